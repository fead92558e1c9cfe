"""Chaos, part 2: the supervisor SIGKILLed in put, evict, clear and start-up.

Client threads hammer one supervisor with puts into a small arena (puts evict constantly),
leased reads and clears, and the supervisor is killed in the operation the test picks, or
while it starts up (a half-made arena file or socket); it is restarted on the same name and
socket each time and must take the leftovers over. The file ends with reproducers of the
bugs these kills found. What every chaos file checks after each trial is in harness.py.
"""

from __future__ import annotations

import collections
import logging
import os
import random
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from shmkv import ArenaFullError, Client, NotFound, SupervisorUnavailable
from tests.chaos.harness import (
    SUMMARY,
    SUPERVISOR_TRIALS,
    TOTALS,
    Refs,
    Worker,
    check_arena,
    check_outputs,
    shm_files,
    socket_litter,
    trials,
)
from tests.support import SHM
from tests.support.blobs import Blob, blob
from tests.support.supervisors import start_supervisor, wait_ready
from tests.support.waiting import wait_until

log = logging.getLogger(__name__)

pytestmark = [pytest.mark.stress, pytest.mark.usefixtures("chaos_summary")]

BLOB_MIN, BLOB_MAX = 64 << 10, 3 << 20
CHUNK2 = 16


def hammer_blob(seed: int) -> Blob:
    """A blob of 4 to 64 chunks of CHUNK2 tokens and BLOB_MIN to BLOB_MAX bytes (log-uniform),
    all a function of ``seed``."""
    rnd = random.Random(seed)
    return blob(
        seed, int(BLOB_MIN * (BLOB_MAX / BLOB_MIN) ** rnd.random()), CHUNK2 * rnd.randint(4, 64)
    )


class Hammer:
    """Threads hammering one supervisor: a writer (puts, sometimes a clear) and a reader
    (lookups and leased reads of recent blobs, every byte verified)."""

    def __init__(self, sup, data_size: int) -> None:
        self.sup, self.data_size = sup, data_size
        self.run = threading.Event()
        self.quit = False
        self.idle = {"writer": threading.Event(), "reader": threading.Event()}
        self.op = {"writer": "idle", "reader": "idle"}
        self.entered = {op: threading.Event() for op in ("put", "put+evict", "clear", "acquire")}
        self.filled = 0
        self.recent: collections.deque[int] = collections.deque(maxlen=6)
        self.counts: collections.Counter[str] = collections.Counter()
        self.unexpected: list[str] = []
        self.wrong: list[str] = []
        self.threads = [
            threading.Thread(target=self._loop, args=(role,), daemon=True)
            for role in ("writer", "reader")
        ]
        for t in self.threads:
            t.start()

    def pause(self) -> None:
        self.run.clear()
        for e in self.idle.values():
            assert e.wait(30), "a hammer thread did not pause"

    def resume(self) -> None:
        for e in self.idle.values():
            e.clear()
        self.filled = 0  # a fresh arena
        self.counts["puts since resume"] = 0
        self.run.set()

    def stop(self) -> None:
        self.quit = True
        self.run.set()
        for t in self.threads:
            t.join(30)

    def _loop(self, role: str) -> None:
        client = self.sup.client(timeout=3.0)
        rnd = random.Random(role)
        seed = 0 if role == "writer" else None
        while not self.quit:
            if not self.run.is_set():
                self.op[role] = "idle"
                self.idle[role].set()
                self.run.wait()
                continue
            try:
                if role == "writer":
                    seed = (seed or 0) + 1
                    self._write(client, rnd, seed)
                else:
                    self._read(client, rnd)
            except (SupervisorUnavailable, NotFound, ArenaFullError) as e:
                self.counts[f"{role} {type(e).__name__}"] += 1
                if isinstance(e, SupervisorUnavailable):
                    time.sleep(0.01)
            except Exception as e:  # anything else is a failure of the client under chaos
                self.unexpected.append(f"{role}: {e!r}")
            finally:
                self.op[role] = "idle"
        client.close()

    def _enter(self, role: str, op: str) -> None:
        self.op[role] = op
        if op in self.entered:
            self.entered[op].set()

    def _write(self, client: Client, rnd: random.Random, seed: int) -> None:
        if rnd.random() < 0.05:
            self._enter("writer", "clear")
            client.clear()
            self.filled = 0
            self.counts["clears"] += 1
            return
        root, tokens, data = hammer_blob(seed)
        extent = len(data) + 4 * len(tokens) + 8192
        self._enter("writer", "put+evict" if self.filled + extent > self.data_size else "put")
        client.put_bytes(root, tokens, b"chaos-fp", data)
        self.filled += extent
        self.recent.append(seed)
        self.counts["puts"] += 1
        self.counts["puts since resume"] += 1

    def _read(self, client: Client, rnd: random.Random) -> None:
        if not self.recent:
            time.sleep(0.002)
            return
        seed = rnd.choice(list(self.recent))
        root, tokens, data = b = hammer_blob(seed)
        self._enter("reader", "lookup")
        hit = client.lookup(b.digests(CHUNK2))
        if hit is None:
            self.counts["read misses"] += 1
            time.sleep(0.001)  # leave the GIL to the writer and the test
            return
        self._enter("reader", "acquire")
        with client.acquire(hit) as lease:
            self._enter("reader", "read")
            same = bytes(lease.payload) == data and np.array_equal(lease.tokens(), tokens)
            self._enter("reader", "release")
            if lease.finish(len(tokens)):
                self.counts["reads verified"] += 1
                if not same:
                    self.wrong.append(f"blob {seed}: wrong bytes under a valid lease")
            else:
                self.counts["reads void"] += 1


def llama_check(sup, refs: Refs, tmp_path: Path, tag: str, wrong: list[str]) -> int:
    """A fresh llama worker's requests on this supervisor equal cold runs; returns how many."""
    w = Worker(tmp_path, tag)
    try:
        w.go(sup, seed=hash(tag) & 0xFFFF, requests=4)
        assert w.proc.wait(120) == 0, w.stderr()
        w._reader.join(10)
        n = check_outputs(w, refs, wrong)
        assert n == 4
        return n
    finally:
        w.discard()


SUP_TARGETS = ["put+evict", "clear", "put", "acquire", "put+evict", "random", "clear", "start"]
SUP_START = ["start:arena", "start:socket", "start:random"]


@pytest.mark.timeout(600)
def test_supervisor_killed_in_put_evict_and_clear(models, chaos_refs, tmp_path, reserve_mode):
    t_start = time.monotonic()
    rnd = random.Random(2)
    # a few blobs: puts evict; --fresh: each restart takes the leftovers over and starts
    # empty (test_adopt.py kills during puts and adopts)
    args = ("--size", "8M", "--chunk-tokens", str(CHUNK2), "--fresh")
    sup = start_supervisor(tmp_path, *args)
    sup.model = models["seed0"]
    name, sock = sup.name, sup.socket
    procs = [sup.proc]
    kills: collections.Counter[str] = collections.Counter()
    problems: list[str] = []
    wrong: list[str] = []
    llama_outputs = takeovers = socket_takeovers = n_kills = 0
    restart_s: list[float] = []
    hammer = None
    try:
        with sup.client() as c0:
            data_size = c0.view.geometry.data_size
        hammer = Hammer(sup, data_size)
        hammer.resume()
        t = 0
        n_trials = trials(SUPERVISOR_TRIALS, reserve_mode, len(SUP_TARGETS))
        while n_kills < n_trials:
            target = SUP_TARGETS[t % len(SUP_TARGETS)]
            # the hammer's clients reconnect by themselves (after their back-off)
            wait_until(lambda: hammer.counts["puts since resume"] > 0, 15, "the hammer to put")
            if target in ("random", "start"):
                time.sleep(rnd.uniform(0.0, 0.3))
            else:
                ev = hammer.entered[target]
                ev.clear()
                if not ev.wait(15):
                    problems.append(f"trial {t}: the hammer never entered {target}")
                # (a clear of a small arena is over in well under a millisecond: a later
                # kill finds the writer past it, and the run then killed in no clear at all)
                time.sleep(rnd.uniform(0.0, 0.0002 if target == "clear" else 0.0015))
            old_inode = os.stat(SHM / f"shmkv-{name}").st_ino
            sup.proc.kill()
            in_flight = {hammer.op["writer"], hammer.op["reader"]} - {"idle"}
            assert sup.proc.wait(10) == -signal.SIGKILL
            label = "/".join(sorted(in_flight)) or "nothing in flight"
            for op in in_flight or ["nothing in flight"]:
                kills[op] += 1  # a kill with a put and a read in flight counts for both
            n_kills += 1
            hammer.pause()
            if target == "start":
                # the next one dies while it starts up: half made arena file or socket
                label = SUP_START[(t // len(SUP_TARGETS)) % len(SUP_START)]
                s2 = start_supervisor(tmp_path, *args, name=name, wait=False)
                procs.append(s2.proc)
                want = {
                    "start:arena": SHM / f"shmkv-{name}.{s2.proc.pid}.tmp",
                    "start:socket": Path(sock).with_name(f".{Path(sock).name}.{s2.proc.pid}"),
                }.get(label)
                if want is None:
                    time.sleep(rnd.uniform(0.05, 0.4))
                else:
                    deadline = time.monotonic() + 20
                    while (
                        not want.exists() and s2.proc.poll() is None and time.monotonic() < deadline
                    ):
                        pass
                s2.proc.kill()
                s2.proc.wait(10)
                if want is not None and not want.exists():
                    label += " (missed)"
                kills[label] += 1
                n_kills += 1
            left = shm_files(name)
            stray = {f for f in left if f not in (f"shmkv-{name}", f"shmkv-{name}.lock")}
            log.debug("trial %d: killed in %s; left %s", t, label, sorted(left))
            # restart on the same name and socket: it must take the leftovers over
            t_restart = time.monotonic()
            sup = wait_ready(start_supervisor(tmp_path, *args, name=name, wait=False))
            restart_s.append(time.monotonic() - t_restart)
            sup.model = models["seed0"]
            procs.append(sup.proc)
            files = shm_files(name)
            if files != {f"shmkv-{name}", f"shmkv-{name}.lock"}:
                problems.append(
                    f"trial {t} ({label}): after restart {sorted(files)} "
                    f"(left by the kill: {sorted(stray)})"
                )
            if socket_litter(sock) != {Path(sock).name}:
                problems.append(f"trial {t} ({label}): socket dir holds {socket_litter(sock)}")
            if os.stat(SHM / f"shmkv-{name}").st_ino != old_inode:
                takeovers += 1
            if "taking over stale socket" in sup.log():
                socket_takeovers += 1
            with sup.client() as c:
                st = c.stats()
                if (st["entries"], st["bytes_used"], st["leases_active"], st["puts"]) != (
                    0,
                    0,
                    0,
                    0,
                ) or st["pid"] != sup.proc.pid:
                    problems.append(f"trial {t} ({label}): restarted supervisor not clean: {st}")
            if t % 20 == 19:
                llama_outputs += llama_check(sup, chaos_refs, tmp_path, f"sup{t}", wrong)
            hammer.resume()
            t += 1
        # last round: the hammer reconnects and works on the last supervisor
        wait_until(lambda: hammer.counts["puts since resume"] > 0, 15, "the hammer to reconnect")
        time.sleep(0.3)
        hammer.stop()
        with sup.client() as c:
            found, st = check_arena(c)
            problems += [f"final: {p}" for p in found]
        llama_outputs += llama_check(sup, chaos_refs, tmp_path, "sup-final", wrong)
        assert sup.stop() == 0, sup.log()[-3000:]
    finally:
        if hammer is not None:
            hammer.stop()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    left = shm_files(name) | socket_litter(sock)
    for p in SHM.glob(f"shmkv-{name}*"):
        p.unlink()
    wall = time.monotonic() - t_start
    counts = {k: v for k, v in hammer.counts.items() if k != "puts since resume"}
    log.info(
        "supervisor kills: %d trials; client requests in flight at the kills (a kill may "
        "count twice, put+evict = a put into a full arena): %s; %d stale arenas and %d "
        "stale sockets taken over by the next supervisor",
        n_kills,
        dict(kills),
        takeovers,
        socket_takeovers,
    )
    log.info(
        "supervisor kills: a restart took %.2f s on average (%.2f s at most)",
        sum(restart_s) / max(1, len(restart_s)),
        max(restart_s, default=0.0),
    )
    log.info(
        "supervisor kills: client ops %s; %d unexpected client errors, %d wrong reads, "
        "%d llama outputs compared with cold (%d wrong); %d problems; %.1f s",
        counts,
        len(hammer.unexpected),
        len(hammer.wrong),
        llama_outputs,
        len(wrong),
        len(problems),
        wall,
    )
    TOTALS.update(
        kills=n_kills,
        outputs=llama_outputs,
        reads=counts.get("reads verified", 0),
        wrong=len(hammer.wrong) + len(wrong),
        leaks=len(problems),
    )
    evict = kills["put+evict"]
    SUMMARY[f"supervisor kills (--reserve {reserve_mode})"] = (
        f"{n_kills} trials (put {kills['put'] + evict}, evicting {evict}, clear "
        f"{kills['clear']}, lease ops {kills['acquire'] + kills['read'] + kills['release']}, "
        f"start-up {sum(v for k, v in kills.items() if k.startswith('start'))}), "
        f"{counts.get('reads verified', 0)} verified reads, {llama_outputs} llama outputs, "
        f"{len(hammer.wrong) + len(wrong)} wrong, {len(problems)} leaks/problems, {wall:.0f} s"
    )
    assert not hammer.unexpected, hammer.unexpected[:5]
    assert not hammer.wrong and not wrong, (hammer.wrong + wrong)[:5]
    assert not problems, problems[:10]
    assert not left, f"left behind after a clean stop: {left}"
    assert counts.get("reads verified", 0) > 0 and counts.get("clears", 0) > 0
    assert kills["put"] and evict and kills["clear"], dict(kills)  # the kills the name says


# ------------------------------------------- reproducers of bugs this harness found
@pytest.mark.timeout(120)
def test_supervisor_killed_while_creating_its_arena_leaves_no_temp_arena(tmp_path):
    """A kill between creating ``shmkv-NAME.PID.tmp`` (fallocated to the full --size) and
    renaming it into place left the file for good: the next supervisor never removed it.
    (``--reserve true``: the window is the fallocate of all of --size; ``false`` allocates
    the header and index only, a window too brief to catch. ``--fresh``: an attempt that
    missed it leaves an arena the next would adopt, creating none.)"""
    name = f"t{os.urandom(5).hex()}"
    args = ("--size", "64M", "--reserve", "true", "--fresh")
    for i in range(10):
        sock = {"SHMKV_SOCKET": str(tmp_path / f"try{i}.sock")}  # (a killed one's may stay)
        sup = start_supervisor(tmp_path, *args, name=name, env_extra=sock, wait=False)
        tmp = SHM / f"shmkv-{name}.{sup.proc.pid}.tmp"
        deadline = time.monotonic() + 20
        while (
            not tmp.exists()
            and not os.path.exists(sup.socket)  # (it is up: the window was missed)
            and sup.proc.poll() is None
            and time.monotonic() < deadline
        ):
            pass
        sup.proc.kill()
        sup.proc.wait(10)
        if tmp.exists():
            break
    assert tmp.exists(), "never caught the supervisor while it created its arena"
    new = wait_ready(start_supervisor(tmp_path, "--size", "64M", name=name, wait=False))
    try:
        assert shm_files(name) == {f"shmkv-{name}", f"shmkv-{name}.lock"}
    finally:
        assert new.stop() == 0
    assert not shm_files(name) and not socket_litter(new.socket)


@pytest.mark.timeout(60)
def test_temporary_socket_of_a_killed_supervisor_is_removed_at_start(make_supervisor):
    """A kill between binding ``.NAME.sock.PID`` and renaming it into place left it behind."""
    sup = make_supervisor("--size", "8M")
    assert sup.stop() == 0
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that no longer runs, as a killed supervisor's
    litter = Path(sup.socket).with_name(f".{Path(sup.socket).name}.{gone.pid}")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(litter))
    new = make_supervisor("--size", "8M", name=sup.name)
    assert not litter.exists()
    assert new.stop() == 0
    assert not socket_litter(sup.socket)


@pytest.mark.timeout(60)
@pytest.mark.small_tmpfs(size="48m")
def test_supervisor_restarts_after_a_kill_when_its_arena_fills_most_of_the_tmpfs(
    tmp_path, small_tmpfs
):
    """The stale arena of a killed supervisor counted against the new one's space check: with
    --size over half the tmpfs (Docker's 64 MB /dev/shm, say) it never restarted. (With
    --reserve: an arena allocated as records are stored takes what it holds only.)"""
    mnt = small_tmpfs
    procs = []
    try:
        env = {"SHMKV_DIR": str(mnt)}
        sup = start_supervisor(tmp_path, "--reserve", "true", "--size", "32M", env_extra=env)
        procs.append(sup.proc)
        sup.proc.kill()
        sup.proc.wait(10)
        assert (mnt / f"shmkv-{sup.name}").exists()
        new = start_supervisor(
            tmp_path, "--reserve", "true", "--size", "32M", name=sup.name, env_extra=env, wait=False
        )
        procs.append(new.proc)
        wait_ready(new)
        with new.client() as c:
            root, tokens, data = b = blob(1, 200_000)
            c.put_bytes(root, tokens, b"fp", data)
            assert c.lookup(b.digests()) is not None
        assert new.stop() == 0
        assert not list(mnt.iterdir())
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
