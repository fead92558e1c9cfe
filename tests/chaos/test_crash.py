"""Chaos: workers and supervisors killed at the worst moments, writes through a
worker's mapping, and corrupted records.

Every process here is real (multiprocessing 'spawn' children or subprocesses),
every kill is SIGKILL, and every wait is bounded.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from shmkv import ArenaCorruptError, Client, SupervisorUnavailable
from shmkv.core.keys import chain_digests
from tests.support import MiB
from tests.support.blobs import CHUNK, blob
from tests.support.supervisors import no_internal_errors, try_stats
from tests.support.waiting import wait_until

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------- helpers
def put(client: Client, seed: int, size: int) -> tuple[bytes, np.ndarray, bytes]:
    root, tokens, data = blob(seed, size)
    client.put_bytes(root, tokens, b"fp", data)
    return root, tokens, data


def key_of(root: bytes, tokens: np.ndarray) -> str:
    return chain_digests(root, tokens, CHUNK)[-1].hex()


def sup_fds(sup) -> int:
    return len(os.listdir(f"/proc/{sup.proc.pid}/fd"))


def idle_fds(client: Client, sup) -> int:
    """The supervisor's open descriptors, not counting ``client``'s own connection."""
    wait_until(lambda: client.stats()["connections"] == 1, what="other connections to close")
    return sup_fds(sup) - 1


def assert_consistent(client: Client) -> dict:
    """Stats agree with the listing and every indexed record is intact."""
    st, ls = client.stats(), client.ls(limit=100_000)
    assert st["leases_active"] == 0, st
    assert st["entries"] == ls["total"] == len(ls["entries"]), (st, ls)
    assert st["bytes_used"] == sum(e["extent"] for e in ls["entries"]), (st, ls)
    assert st["bytes_used"] <= st["bytes_capacity"]
    assert all(e["leases"] == 0 for e in ls["entries"])
    view = client.view
    slots = view.scan()
    assert len(slots) == st["index_used"]
    assert len({s.rec_gen for s in slots}) == st["entries"]  # no two blobs here share a prefix
    for slot in slots:
        rec = view.read_record(slot.rec_offset, slot.rec_gen)
        view.verify_meta(rec)
        assert view.verify_payload(rec)
    return st


def assert_round_trip(client: Client, seed: int, size: int = MiB) -> None:
    """A put by ``client`` can be found, leased and read back byte for byte."""
    root, tokens, data = put(client, seed, size)
    hit = client.lookup(chain_digests(root, tokens, CHUNK))
    assert hit is not None and hit.chunks == len(tokens) // CHUNK
    with client.acquire(hit) as lease:
        assert bytes(lease.payload) == data
        assert np.array_equal(lease.tokens(), tokens)
        assert lease.finish()


# -------------------------------------------------------------- child processes
def hold_lease_main(name: str, sock: str, root: bytes, tokens: np.ndarray, ready: Any) -> None:
    """Lease the record of (root, tokens), touch its bytes, then sleep holding the lease."""
    client = Client(name=name, socket_path=sock, timeout=10)
    hit = client.lookup(chain_digests(root, tokens, CHUNK))
    assert hit is not None
    lease = client.acquire(hit)
    assert lease.view.verify_payload(lease.record)
    ready.set()
    time.sleep(120)  # killed long before this


def read_loop_main(name: str, sock: str, seeds: list[int], size: int, ready: Any) -> None:
    """Read and verify the blobs of ``seeds`` forever (until killed)."""
    client = Client(name=name, socket_path=sock, timeout=10)
    blobs = [blob(s, size) for s in seeds]
    ready.set()
    while True:
        for root, tokens, data in blobs:
            hit = client.lookup(chain_digests(root, tokens, CHUNK))
            if hit is None:
                continue
            with client.acquire(hit) as lease:
                if bytes(lease.payload) != data:
                    raise AssertionError("wrong bytes")
                lease.finish()


def put_loop_main(name: str, sock: str, seed: int, done: Any, ready: Any) -> None:
    """Put distinct 2-8 MiB blobs as fast as possible (until killed)."""
    client = Client(name=name, socket_path=sock, timeout=10)
    client.ensure()
    rnd = random.Random(seed)
    ready.set()
    i = 0
    while True:
        size = rnd.randint(2 * MiB, 8 * MiB)
        root, tokens, data = blob(seed * 100_000 + i, size)
        client.put_bytes(root, tokens, b"fp", data)
        i += 1
        done.value += 1  # (one writer at a time; no lock a kill -9 could leave held)


def spawn(target: Callable[..., None], *args: Any) -> tuple[mp.Process, Any]:
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    p = ctx.Process(target=target, args=(*args, ready), daemon=True)
    p.start()
    if not ready.wait(30):
        p.kill()
        p.join(5)
        raise AssertionError(f"{target.__name__} did not get ready (exit code {p.exitcode})")
    return p, ready


def kill9(p: mp.Process) -> None:
    os.kill(p.pid, signal.SIGKILL)
    p.join(10)
    assert p.exitcode == -signal.SIGKILL, p.exitcode


# ------------------------------------------------------------------ dead readers
@pytest.mark.timeout(60)
def test_reader_killed_mid_read_releases_lease_and_entry_becomes_evictable(make_supervisor):
    sup = make_supervisor("--size", "16M")
    with sup.client() as c:
        base_fds = idle_fds(c, sup)
        root, tokens, data = put(c, 1, 4 * MiB)
        key = key_of(root, tokens)
        reader, _ = spawn(hold_lease_main, sup.name, sup.socket, root, tokens)
        try:
            st = c.stats()
            assert st["leases_active"] == 1 and st["hits"] == 1
            # while leased, eviction pressure passes it by and evicts the others
            for seed in range(100, 106):
                put(c, seed, 4 * MiB)
            ls = c.ls()
            assert key in [e["key"] for e in ls["entries"] if e["leases"] == 1]
            assert c.stats()["evictions"] >= 3
        finally:
            kill9(reader)

        wait_until(lambda: c.stats()["leases_active"] == 0, what="the dead reader's lease")
        assert c.lookup(chain_digests(root, tokens, CHUNK)) is not None
        # now least recently used and unleased: the next puts evict it
        for seed in range(200, 204):
            put(c, seed, 4 * MiB)
        assert key not in [e["key"] for e in c.ls()["entries"]]
        assert c.lookup(chain_digests(root, tokens, CHUNK)) is None
        assert_consistent(c)
        assert c.clear() > 0
        st = c.stats()
        assert st["bytes_used"] == 0 and st["entries"] == 0 and st["index_used"] == 0
        assert idle_fds(c, sup) == base_fds
        assert_round_trip(c, 7)
    assert sup.proc.poll() is None
    no_internal_errors(sup)


@pytest.mark.timeout(60)
def test_reader_killed_holding_lease_on_cleared_entry_frees_its_space(make_supervisor):
    sup = make_supervisor("--size", "16M")
    with sup.client() as c:
        root, tokens, data = put(c, 2, 3 * MiB)
        extent = c.ls()["entries"][0]["extent"]
        reader, _ = spawn(hold_lease_main, sup.name, sup.socket, root, tokens)
        try:
            assert c.clear() == 1
            st = c.stats()
            # out of the index, but its bytes are still leased: not reusable yet
            assert st["entries"] == 0 and st["bytes_used"] == extent and st["leases_active"] == 1
            assert c.lookup(chain_digests(root, tokens, CHUNK)) is None
        finally:
            kill9(reader)
        wait_until(lambda: c.stats()["bytes_used"] == 0, what="the cleared entry's space")
        assert c.stats()["leases_active"] == 0
        assert_round_trip(c, 8)
    assert sup.proc.poll() is None
    no_internal_errors(sup)


@pytest.mark.stress
@pytest.mark.timeout(120)
def test_readers_killed_at_random_points_leak_nothing(make_supervisor):
    sup = make_supervisor("--size", "32M")
    rnd = random.Random(3)
    seeds = list(range(10, 16))
    with sup.client() as c:
        base_fds = idle_fds(c, sup)
        for s in seeds:
            put(c, s, 2 * MiB)
        for _ in range(6):
            readers = [
                spawn(read_loop_main, sup.name, sup.socket, seeds, 2 * MiB)[0] for _ in range(3)
            ]
            time.sleep(rnd.uniform(0.05, 0.5))
            for p in readers:
                kill9(p)
            wait_until(lambda: c.stats()["leases_active"] == 0, what="leases of dead readers")
        st = assert_consistent(c)
        assert st["hits"] > 0 and st["entries"] == len(seeds)
        assert idle_fds(c, sup) == base_fds
        log.info(
            "killed 18 readers mid-loop after %d leases: no lease or descriptor leaked", st["hits"]
        )
        assert c.clear() == len(seeds)
        assert c.stats()["bytes_used"] == 0
    assert sup.proc.poll() is None
    no_internal_errors(sup)


# ------------------------------------------------------------------ dead writers
@pytest.mark.stress
@pytest.mark.timeout(180)
def test_writer_killed_mid_put_leaves_arena_consistent(make_supervisor):
    sup = make_supervisor("--size", "64M")
    rnd = random.Random(4)
    ctx = mp.get_context("spawn")
    # lock=False: the writer is killed at random points, also while it would hold the lock,
    # which then stays taken and hangs this test's reads
    done = ctx.Value("q", 0, lock=False)
    rounds = 8
    with sup.client() as c:
        base_fds = idle_fds(c, sup)
        for r in range(rounds):
            before = done.value
            writer, _ = spawn(put_loop_main, sup.name, sup.socket, r + 1, done)
            # the first rounds kill it almost at once, later ones after several puts
            time.sleep(rnd.uniform(0.0, 0.02) if r < 2 else rnd.uniform(0.05, 0.8))
            kill9(writer)
            wait_until(lambda: c.stats()["connections"] == 1, what="the writer's connection")
            st = assert_consistent(c)
            log.info(
                "writer round %d: killed after %d completed puts; %d entries, %d bytes",
                r,
                done.value - before,
                st["entries"],
                st["bytes_used"],
            )
        st = assert_consistent(c)
        # a put the supervisor finished but whose reply the writer never read is stored too
        assert done.value <= st["puts"] <= done.value + rounds, (done.value, st)
        assert st["rejected_puts"] == 0
        assert st["evictions"] > 0
        assert idle_fds(c, sup) == base_fds
        log.info(
            "killed %d writers mid-put: %d puts done, %d stored, %d evictions",
            rounds,
            done.value,
            st["puts"],
            st["evictions"],
        )
    with sup.client() as fresh:
        assert_round_trip(fresh, 9, 4 * MiB)
        assert_consistent(fresh)
    assert sup.proc.poll() is None
    no_internal_errors(sup)


# ------------------------------------------------- writes through a worker's map
def test_python_level_write_into_worker_mapping_raises(supervisor):
    with supervisor.client() as c:
        root, tokens, data = put(c, 5, MiB)
        view = c.view
        before = bytes(view.mm[:])
        hit = c.lookup(chain_digests(root, tokens, CHUNK))
        with c.acquire(hit) as lease:
            with pytest.raises(TypeError):
                view.mm[0:4] = b"EVIL"
            with pytest.raises(TypeError):
                view.mm.write(b"EVIL")
            with pytest.raises(TypeError):
                memoryview(view.mm)[lease.record.payload_off] = 0
            with pytest.raises(TypeError):
                lease.payload[0] = 0
            arr = np.frombuffer(view.mm, dtype=np.uint8)
            with pytest.raises(ValueError):
                arr[lease.record.payload_off] = 0
            with pytest.raises(ValueError):
                arr.flags.writeable = True
            tok = lease.tokens()
            with pytest.raises(ValueError):
                tok[0] = 1
            del arr, tok
            assert lease.finish()
        assert bytes(view.mm[:]) == before
        assert_round_trip(c, 6)


_SEGV_WRITER = textwrap.dedent("""
    import ctypes, sys
    from shmkv import Client
    c = Client(name=sys.argv[1], socket_path=sys.argv[2])
    addr = c.view.base_address + int(sys.argv[3])
    print("writing", flush=True)
    ctypes.memmove(addr, b"\\xaa" * 64, 64)
    print("survived", flush=True)
""")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["header", "index", "payload"])
def test_raw_write_into_worker_mapping_segfaults_and_changes_nothing(supervisor, where):
    with supervisor.client() as c:
        root, tokens, data = put(c, 11, MiB)
        hit = c.lookup(chain_digests(root, tokens, CHUNK))
        view = c.view
        with c.acquire(hit) as lease:
            offset = {
                "header": 0,
                "index": view.geometry.index_offset,
                "payload": lease.record.payload_off,
            }[where]
            assert lease.finish()
        before = bytes(view.mm[:])
        proc = subprocess.run(
            [sys.executable, "-c", _SEGV_WRITER, supervisor.name, supervisor.socket, str(offset)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert proc.returncode == -signal.SIGSEGV, (proc.returncode, proc.stdout, proc.stderr)
        assert "writing" in proc.stdout and "survived" not in proc.stdout
        assert bytes(view.mm[:]) == before
        with c.acquire(c.lookup(chain_digests(root, tokens, CHUNK))) as lease:
            assert bytes(lease.payload) == data
            assert lease.finish()
        st = c.stats()
        assert st["leases_active"] == 0 and st["entries"] == 1
    assert supervisor.proc.poll() is None
    no_internal_errors(supervisor)


def test_mprotect_worker_mapping_writable_fails_with_eacces(supervisor):
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.mprotect.restype = ctypes.c_int
    with supervisor.client() as c:
        put(c, 12, MiB)
        view = c.view
        assert view.base_address % mmap.PAGESIZE == 0
        before = bytes(view.mm[:])
        for length in (mmap.PAGESIZE, view.file_size):
            ctypes.set_errno(0)
            rc = libc.mprotect(view.base_address, length, mmap.PROT_READ | mmap.PROT_WRITE)
            assert rc == -1 and ctypes.get_errno() == errno.EACCES, (rc, ctypes.get_errno())
        assert bytes(view.mm[:]) == before


# --------------------------------------------------------------- dead supervisor
@pytest.mark.timeout(60)
def test_supervisor_killed_client_fails_fast_then_reconnects(make_supervisor, tmp_path):
    sup = make_supervisor("--size", "16M")
    c = sup.client(timeout=2.0)
    try:
        root, tokens, data = put(c, 13, 2 * MiB)
        old_id = c.view.geometry.arena_id
        lease = c.acquire(c.lookup(chain_digests(root, tokens, CHUNK)))

        sup.proc.kill()
        assert sup.proc.wait(10) == -signal.SIGKILL
        t0 = time.monotonic()
        with pytest.raises(SupervisorUnavailable):
            c.stats()
        assert time.monotonic() - t0 < 2.0
        t0 = time.monotonic()
        with pytest.raises(SupervisorUnavailable):  # during the back-off: no connect at all
            c.put_bytes(root, tokens, b"fp", data)
        assert time.monotonic() - t0 < 0.5
        # a lease of a connection that is gone is void, even though its bytes are still
        # readable: the reader cannot tell a dead supervisor from one that closed this
        # connection and reused the space (a cold prefill, never a wrong read)
        assert bytes(lease.payload) == data
        assert lease.finish() is False

        new = make_supervisor("--size", "16M", "--fresh", name=sup.name)  # not adopted
        assert new.socket == sup.socket
        st = wait_until(lambda: try_stats(c), timeout=15, what="the client to reconnect")
        assert st["pid"] == new.proc.pid and st["entries"] == 0
        assert c.view.geometry.arena_id != old_id
        assert c.lookup(chain_digests(root, tokens, CHUNK)) is None  # a fresh arena
        assert_round_trip(c, 14)
    finally:
        c.close()
    assert new.stop() == 0
    no_internal_errors(new)


@pytest.mark.timeout(60)
def test_lease_of_a_dropped_connection_fails_finish_once_its_space_is_reused(make_supervisor):
    """Reproducer: a request timing out drops the connection, the supervisor ends that
    connection's leases and reuses their space, yet the reader still holding one of them
    (another thread, or simply later code) was told its read was intact."""
    sup = make_supervisor("--size", "16M")
    with sup.client(timeout=1.0) as c, sup.client() as other:
        root, tokens, data = put(other, 19, 4 * MiB)
        lease = c.acquire(c.lookup(chain_digests(root, tokens, CHUNK)))
        assert bytes(lease.payload) == data
        os.kill(sup.proc.pid, signal.SIGSTOP)
        try:
            with pytest.raises(SupervisorUnavailable):
                c.stats()  # times out: the client drops the connection the lease lives on
        finally:
            os.kill(sup.proc.pid, signal.SIGCONT)
        wait_until(lambda: other.stats()["leases_active"] == 0, what="the dropped lease")
        other.clear()
        for seed in range(300, 304):  # overwrite the whole data region
            put(other, seed, 4 * MiB)
        assert bytes(lease.payload) != data  # the lease's mapping is still readable...
        assert lease.finish() is False  # ...but its bytes were reused: the read is void
        wait_until(lambda: try_stats(c), timeout=15, what="the client to reconnect")
        assert_round_trip(c, 20)
    assert sup.proc.poll() is None
    no_internal_errors(sup)


@pytest.mark.timeout(60)
def test_frozen_supervisor_costs_a_client_its_timeout_not_a_hang(make_supervisor):
    sup = make_supervisor("--size", "16M")
    c = sup.client(timeout=1.0)
    try:
        put(c, 15, MiB)
        os.kill(sup.proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(SupervisorUnavailable):
                c.stats()
            elapsed = time.monotonic() - t0
            assert 0.9 <= elapsed < 15, elapsed  # (its 1 s timeout, not a hang; slack for load)
        finally:
            os.kill(sup.proc.pid, signal.SIGCONT)
        st = wait_until(lambda: try_stats(c), timeout=15, what="the client to reconnect")
        assert st["entries"] == 1
        assert_round_trip(c, 16)
    finally:
        c.close()
    assert sup.proc.poll() is None
    no_internal_errors(sup)


# --------------------------------------------------------------- corrupt records
@pytest.fixture
def arena_rw(supervisor):
    """The supervisor's arena file opened O_RDWR by the test: the only way to corrupt it."""
    fd = os.open(supervisor.arena, os.O_RDWR)
    yield fd
    os.close(fd)


def flip(fd: int, offset: int) -> Callable[[], None]:
    """XOR one byte of the arena file; returns the function that flips it back."""
    (b,) = os.pread(fd, 1, offset)
    os.pwrite(fd, bytes([b ^ 0x5A]), offset)
    return lambda: os.pwrite(fd, bytes([b]), offset)


def test_corrupted_payload_is_detected_by_verify_payload(supervisor, arena_rw):
    with supervisor.client() as c:
        root, tokens, data = put(c, 17, MiB)
        hit = c.lookup(chain_digests(root, tokens, CHUNK))
        view = c.view
        with c.acquire(hit) as lease:
            rec = lease.record
            assert view.verify_payload(rec)
            for pos in (0, len(data) // 2, len(data) - 1):
                undo = flip(arena_rw, rec.payload_off + pos)
                assert not view.verify_payload(rec)  # the mapping is shared: seen at once
                view.verify_meta(rec)  # metadata untouched
                undo()
                assert view.verify_payload(rec)
            assert lease.finish()


def test_corrupted_tokens_or_metadata_are_detected_by_verify_meta(supervisor, arena_rw):
    with supervisor.client() as c:
        root, tokens, data = put(c, 18, MiB)
        hit = c.lookup(chain_digests(root, tokens, CHUNK))
        view = c.view
        with c.acquire(hit) as lease:
            rec = lease.record
            assert lease.finish()
        targets = {
            "token": rec.tokens_off + 4 * 70,
            "fingerprint": rec.fp_off,
            "key": rec.offset + 16,
            "root": rec.offset + 32,
            "payload checksum": rec.offset + 80,
            "created": rec.offset + 100,
        }
        for what, off in targets.items():
            undo = flip(arena_rw, off)
            try:
                with pytest.raises(ArenaCorruptError):
                    view.verify_meta(view.read_record(rec.offset, rec.gen))
                # acquire validates too, and gives its lease back when the record is bad
                with pytest.raises(ArenaCorruptError):
                    c.acquire(hit)
                assert c.stats()["leases_active"] == 0, what
            finally:
                undo()
        # header fields read_record checks itself: magic, generation, lengths
        for what, off in {
            "magic": rec.offset,
            "generation": rec.offset + 8,
            "token count": rec.offset + 48,
        }.items():
            undo = flip(arena_rw, off)
            try:
                with pytest.raises(ArenaCorruptError):
                    c.acquire(hit)
                assert c.stats()["leases_active"] == 0, what
            finally:
                undo()
        with c.acquire(hit) as lease:
            view.verify_meta(lease.record)
            assert bytes(lease.payload) == data
            assert lease.finish()
