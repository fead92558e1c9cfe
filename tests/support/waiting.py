"""Waiting for a condition, and what processes hold or died of."""

from __future__ import annotations

import collections
import os
import subprocess
import time
from collections.abc import Callable
from typing import Any

from tests.support import SHM


def mapped_kib(path: str, field: str = "Rss") -> list[int]:
    """``field`` (kB) of each of this process's mappings of ``path``, from /proc/self/smaps."""
    out: list[int] = []
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
                inside = line.rstrip().endswith(path)
                if inside:
                    out.append(0)
            elif inside and line.startswith(field + ":"):
                out[-1] += int(head[1])
    return out


def resident_kib_at(address: int) -> int:
    """Resident kB of this process's mapping that holds ``address``, from /proc/self/smaps."""
    inside, rss = False, None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith("Rss:"):
                rss = int(head[1])
    assert rss is not None, f"no mapping holds {address:#x}"
    return rss


def wait_until(
    pred: Callable[[], Any], timeout: float = 10.0, what: str = "condition", step: float = 0.01
) -> Any:
    """Poll ``pred`` until it returns something truthy and return that; after ``timeout``
    seconds raise AssertionError naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(step)


def fd_count(pid: int) -> int:
    """How many descriptors process ``pid`` holds open."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def shm_fds(pid: int, prefix: str = "shmkv-") -> list[str]:
    """The files in /dev/shm named ``prefix``... that process ``pid`` holds descriptors of,
    one entry per descriptor; an unlinked file's ends in " (deleted)"."""
    shm, out = f"{SHM}/{prefix}", []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith(shm):
            out.append(target)
    return out


def deleted_arena_fds(pid: int) -> collections.Counter[str]:
    """How many descriptors process ``pid`` holds of each unlinked arena file (``shmkv-*``
    anywhere, /dev/shm or a test's tmpfs) and each put memfd: memory that none of those
    files' names account for any more, pinned until the descriptors close."""
    held: collections.Counter[str] = collections.Counter()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        name = os.path.basename(target)
        if target.endswith(" (deleted)") and name.startswith(("shmkv-", "memfd:shmkv-")):
            held[target] += 1
    return held


def no_signal_deaths(*procs: subprocess.Popen | subprocess.CompletedProcess) -> None:
    """None of ``procs`` died of a signal (SIGBUS, SIGSEGV, ...)."""
    for p in procs:
        rc = p.returncode
        assert rc is not None and rc >= 0, f"pid {getattr(p, 'pid', '?')} died of signal {-rc}"


def cpu_seconds(pid: int) -> float:
    """CPU time process ``pid`` (all its threads) has used, user and system: unlike wall
    time, what a piece of work costs in it does not grow when the machine is loaded."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
