"""The CPU budget's board as other processes see it: who waits in line for cores."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from shmkv.llama.cpu import budget as cpubudget
from shmkv.llama.cpu import ofd
from shmkv.llama.cpu import queue as cpuqueue
from tests.support.waiting import wait_until

SHM = "/dev/shm"


def board(name: str) -> list[tuple[float, int, int, int, float, float, int, int]]:
    """Every record of budget ``name``'s board, live or not, read from the file:
    (since, tokens left, cores wanted, state, stamp, expected seconds, pid, pid namespace)."""
    raw = Path(cpubudget.budget_path(SHM, name)).read_bytes()
    size = cpuqueue.SLOTS * cpuqueue.REC.size
    recs = raw[cpuqueue.BOARD_OFFSET : cpuqueue.BOARD_OFFSET + size].ljust(size, b"\0")
    return list(cpuqueue.REC.iter_unpack(recs))


def waiting_on_board(name: str) -> int:
    """Records in line on the budget's board, live or not."""
    return sum(rec[3] == cpuqueue.WAITING for rec in board(name))


def wait_until_in_line(name: str, n: int, timeout: float = 60) -> None:
    """Until at least ``n`` evals wait in line for cores of budget ``name`` (a decode step
    that found no core free posts itself too)."""
    wait_until(lambda: waiting_on_board(name) >= n, timeout, f"{n} evals in line for cores")


class HeldCore:
    """Core ``slot`` of budget ``name`` (whose file exists) held by a lock with no record
    on the board: waiters see the core taken, and neither a run they could find stalled
    (an eval's record that runs past STALL_UNKNOWN_SECONDS stops their wait, which a
    loaded machine can take to start the processes a test lines up) nor anyone in line.
    :meth:`release` gives it back; waiters find it at their next poll."""

    def __init__(self, name: str, slot: int = 0) -> None:
        self.slot = slot
        self.fd = os.open(cpubudget.budget_path(SHM, name), os.O_RDWR | os.O_CLOEXEC)
        assert ofd.lock(self.fd, fcntl.F_WRLCK, slot), f"core {slot} is taken already"

    def release(self) -> None:
        if self.fd >= 0:
            ofd.lock(self.fd, fcntl.F_UNLCK, self.slot)
            os.close(self.fd)
            self.fd = -1
