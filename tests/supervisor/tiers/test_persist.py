"""``--persist``: states written behind to LMDB survive a reboot (the arena in /dev/shm is
gone) and come back, most recently used first, while the supervisor serves; a corrupt
record on disk is skipped; a full disk pauses persistence and costs no request.

Real supervisors, real llama.cpp on the tiny model; a "reboot" is a supervisor stopped,
its /dev/shm arena removed, and a new one started on the same --persist directory.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import lmdb
import numpy as np
import pytest
import xxhash

from shmkv.core import kvformat
from shmkv.core.errors import ArenaCorruptError
from shmkv.core.keys import chain_digests
from shmkv.supervisor.tiers.disk.lmdb_store import DiskRecord
from tests.support.blobs import blob, put_blob, use_blob
from tests.support.kvblobs import kv_state
from tests.support.llama_workers import SYSTEM, completion, run_worker, texts
from tests.support.supervisors import (
    Sup,
    kill9,
    no_internal_errors,
    persisted_all,
    start_supervisor,
    wait_ready,
)
from tests.support.waiting import wait_until


def reboot(tmp_path: Path, sup: Sup, *args: str) -> Sup:
    """Stop ``sup`` once its puts are on disk, remove its arena, start it again."""
    wait_until(lambda: persisted_all(sup), 20, "the write-behind to catch up")
    assert sup.stop() == 0, sup.log()
    sup.arena.unlink(missing_ok=True)  # what a reboot does to /dev/shm
    return start_supervisor(tmp_path, *args, name=sup.name)


def refilled(sup: Sup) -> dict:
    """The stats once the refill is over."""
    return wait_until(lambda: (st := sup.stats())["refilling"] == 0 and st, 30, "the refill")


@contextmanager
def store_locked(disk: Path) -> Iterator[None]:
    """Hold ``disk``'s ``shmkv.lock`` (one supervisor per directory): a supervisor started
    meanwhile serves, but its writer cannot open the store, so its refill waits."""
    fd = os.open(disk / "shmkv.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def break_metadata(disk: Path, root: bytes) -> None:
    """Flip a byte in the stored metadata of the record whose root is ``root`` (its
    checksum then fails), with LMDB itself (the supervisor is stopped)."""
    env = lmdb.open(str(disk), max_dbs=2, map_size=1 << 30)
    meta = env.open_db(b"meta", create=False)
    with env.begin(db=meta, write=True) as txn:
        key, val = next((k, v) for k, v in txn.cursor() if DiskRecord.unpack(k, v).root == root)
        bad = bytearray(val)
        bad[-12] ^= 0xFF  # (a token id)
        txn.put(key, bytes(bad))
    env.close()


def present(sup: Sup, blobs: list) -> list[bool]:
    with sup.client() as c:
        return [c.lookup(b.digests()) is not None for b in blobs]


def test_reboot_refills_the_arena_and_hits_equal_cold(make_supervisor, tmp_path, models):
    disk = tmp_path / "persist"
    args = ("--size", "64M", "--persist", str(disk))
    prompt = SYSTEM + " Question: what survives a reboot?"
    jobs = [completion(prompt), completion(SYSTEM + " Question: and the mats?")]
    cold = run_worker(None, models["seed0"], jobs, mode="cold")
    sup = make_supervisor(*args)
    first = run_worker(sup, models["seed0"], jobs[:1])
    assert texts(first) == texts(cold)[:1]
    again = reboot(tmp_path, sup, *args)
    try:
        st = refilled(again)
        assert st["refilled"] >= 1 and st["refill_skipped"] == 0, st
        assert st["entries"] == st["refilled"]
        got = [run_worker(again, models["seed0"], [job]) for job in jobs]  # fresh processes
        assert [texts(g)[0] for g in got] == texts(cold)
        exact, other = (g["results"][0]["last"] for g in got)
        assert exact["hit"] and exact["tokens_restored"] >= exact["prompt_tokens"] - 1
        assert other["hit"] and other["tokens_restored"] > 500  # the shared system prompt
    finally:
        assert again.stop() == 0
        no_internal_errors(sup, again)


def _flip_on_disk(disk: Path) -> int:
    """Flip 16 bytes in the middle of every payload in ``disk``'s data.mdb, in the file
    itself (as bit rot would); returns how many payloads."""
    env = lmdb.open(str(disk), max_dbs=2, readonly=True, lock=False)
    with env.begin(db=env.open_db(b"blob", create=False)) as txn:
        windows = [bytes(v[len(v) // 2 : len(v) // 2 + 64]) for _, v in txn.cursor()]
    env.close()
    data = bytearray((disk / "data.mdb").read_bytes())
    for w in windows:
        pos = data.find(w)
        assert pos >= 0
        data[pos + 24 : pos + 40] = bytes(b ^ 0xFF for b in data[pos + 24 : pos + 40])
    (disk / "data.mdb").write_bytes(bytes(data))
    return len(windows)


def test_flipped_byte_on_disk_is_skipped_and_output_unchanged(make_supervisor, tmp_path, models):
    disk = tmp_path / "persist"
    args = ("--size", "64M", "--persist", str(disk))
    prompt = SYSTEM + " Question: is the disk intact?"
    cold = run_worker(None, models["seed0"], [completion(prompt)], mode="cold")
    sup = make_supervisor(*args)
    run_worker(sup, models["seed0"], [completion(prompt)])
    wait_until(lambda: persisted_all(sup), 20, "the write-behind")
    assert sup.stop() == 0
    n = _flip_on_disk(disk)
    assert n >= 1
    again = start_supervisor(tmp_path, *args, name=sup.name)
    try:
        st = refilled(again)
        assert st["refill_skipped"] == n and st["refilled"] == 0, st
        assert st["entries"] == 0
        # the corrupt copies were removed from disk, and a new run is cold and correct
        wait_until(lambda: again.stats()["persist_records"] == 0, 10, "corrupt records removed")
        got = run_worker(again, models["seed0"], [completion(prompt)])
        assert texts(got) == texts(cold)
        assert not got["results"][0]["last"]["hit"]
        wait_until(lambda: again.stats()["persisted"] >= 1, 10, "the new state persisted")
    finally:
        assert again.stop() == 0
        no_internal_errors(again)


def test_refill_is_most_recent_first_and_never_evicts(make_supervisor, tmp_path):
    """A smaller arena after the restart takes the most recently used states, then stops."""
    disk = tmp_path / "persist"
    blobs = [blob(i, 1 << 20) for i in range(12)]
    sup = make_supervisor("--size", "64M", "--persist", str(disk))
    with sup.client() as c:
        for b in blobs:
            c.put_bytes(b.root, b.tokens, b"fp", b.data)
        hit = c.lookup(blobs[0].digests())  # blob 0 used last: the most recent of all
        with c.acquire(hit) as lease:
            assert lease.finish()
    again = reboot(tmp_path, sup, "--size", "6M", "--persist", str(disk))
    try:
        st = refilled(again)
        assert 3 <= st["refilled"] < len(blobs) and st["evictions"] == 0, st
        order = [0, *range(11, 0, -1)]  # most recently used first
        with again.client() as c:
            present = [c.lookup(blobs[i].digests()) is not None for i in order]
            assert present == [True] * st["refilled"] + [False] * (len(blobs) - st["refilled"])
            hit = c.lookup(blobs[0].digests())
            with c.acquire(hit) as lease:
                assert bytes(lease.payload) == blobs[0].data and lease.finish()
        assert st["persist_records"] == len(blobs)  # what did not fit stays on disk
    finally:
        assert again.stop() == 0
        no_internal_errors(sup, again)


def test_persist_size_keeps_the_most_recent_and_pins(make_supervisor, tmp_path):
    disk = tmp_path / "persist"
    args = ("--size", "64M", "--persist", str(disk), "--persist-size", "3M")
    blobs = [blob(100 + i, 700_000) for i in range(8)]
    sup = make_supervisor(*args)
    with sup.client() as c:
        c.put_bytes(blobs[0].root, blobs[0].tokens, b"fp", blobs[0].data, pin=True)
        for b in blobs[1:]:
            c.put_bytes(b.root, b.tokens, b"fp", b.data)
    wait_until(lambda: persisted_all(sup), 20, "the write-behind")
    st = sup.stats()
    assert st["persist_bytes"] <= 3 << 20 and st["persist_evictions"] >= 3, st
    again = reboot(tmp_path, sup, *args)
    try:
        st = refilled(again)
        with again.client() as c:
            present = [c.lookup(b.digests()) is not None for b in blobs]
        kept = st["persist_records"]
        # the pinned one and the most recent ones; the oldest unpinned went first
        assert present == [True] + [False] * (8 - kept) + [True] * (kept - 1), (present, st)
        assert st["pinned"] == 1
    finally:
        assert again.stop() == 0
        no_internal_errors(sup, again)


@pytest.mark.small_tmpfs(size="2m", mode="0700")
def test_full_disk_pauses_persistence_and_costs_no_request(make_supervisor, small_tmpfs):
    sup = make_supervisor("--size", "64M", "--persist", str(small_tmpfs / "db"))
    blobs = [blob(200 + i, 300_000) for i in range(24)]
    with sup.client() as c:
        for i, b in enumerate(blobs):  # every put and every read is served
            c.put_bytes(b.root, b.tokens, b"fp", b.data)
            for old in (blobs[0], b):
                hit = c.lookup(old.digests())
                assert hit is not None, i
                with c.acquire(hit) as lease:
                    assert bytes(lease.payload) == old.data and lease.finish()
    st = wait_until(
        lambda: (s := sup.stats())["persist_errors"].get("disk_full") and s, 20, "a full disk"
    )
    assert st["persist_paused"] == 1 or st["persist_dropped"] >= 1, st
    assert st["persisted"] < len(blobs) and st["puts"] == len(blobs)
    # room again: persistence resumes by itself
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_tmpfs)], check=True)
    more = [blob(300 + i, 300_000) for i in range(40)]

    def resumed() -> bool:
        b = more.pop()
        with sup.client() as c:
            c.put_bytes(b.root, b.tokens, b"fp", b.data)
        s = sup.stats()
        return s["persist_paused"] == 0 and s["persisted"] > st["persisted"]

    wait_until(resumed, 30, "persistence to resume", step=0.5)
    assert sup.proc.poll() is None
    no_internal_errors(sup)
    assert "persist: paused (disk_full)" in sup.log() and "persist: resumed" in sup.log()


def test_unusable_directory_costs_no_request(make_supervisor, tmp_path):
    (tmp_path / "file").write_text("not a directory")
    sup = make_supervisor("--size", "16M", "--persist", str(tmp_path / "file" / "db"))
    b = blob(7, 50_000)
    with sup.client() as c:
        c.put_bytes(b.root, b.tokens, b"fp", b.data)
        hit = c.lookup(chain_digests(b.root, b.tokens, c.view.geometry.chunk_tokens))
        with c.acquire(hit) as lease:
            assert np.array_equal(lease.tokens(), b.tokens) and lease.finish()
    st = wait_until(
        lambda: (s := sup.stats())["persist_errors"].get("unwritable") and s, 10, "the error"
    )
    assert st["persist_on"] == 0 and st["persist_paused"] == 1
    assert sup.proc.poll() is None and os.path.exists(sup.arena)
    no_internal_errors(sup)


def test_refill_steps_over_every_outcome_under_live_puts(make_supervisor, tmp_path):
    """A refill meets a record a peer republished meanwhile, one whose metadata fails its
    checksum, one that can never fit the new arena and one over the pin limit: each is a
    step (issue 18: an assertion ended the refill, and its wake fd stayed registered after
    close, so the next connection that reused the number killed the supervisor)."""
    disk = tmp_path / "persist"
    blobs = [blob(400 + i, 64_000) for i in range(48)]
    huge, pinned = blob(500, 20 << 20), blob(501, 6 << 20)
    sup = make_supervisor("--size", "64M", "--persist", str(disk))
    with sup.client() as c:
        c.put_bytes(huge.root, huge.tokens, b"fp", huge.data)
        c.put_bytes(pinned.root, pinned.tokens, b"fp", pinned.data, pin=True)
        for b in blobs:
            c.put_bytes(b.root, b.tokens, b"fp", b.data)
    wait_until(lambda: persisted_all(sup), 20, "the write-behind to catch up")
    assert sup.stop() == 0
    sup.arena.unlink(missing_ok=True)
    break_metadata(disk, blobs[20].root)
    args = ("--size", "16M", "--max-pinned-percent", "25", "--persist", str(disk))
    with store_locked(disk):  # the refill waits: the republish is certainly first
        again = make_supervisor(*args, name=sup.name)
        republished = [blobs[0], blobs[30]]  # the last and a middle one in refill order
        with again.client() as c:
            for b in republished:
                c.put_bytes(b.root, b.tokens, b"fp", b.data)
        assert again.stats()["refilling"] == 1
    try:
        st = refilled(again)
        assert again.proc.poll() is None, again.log()[-3000:]
        # a skipped record each: the corrupt one, the one that can never fit, the pin
        assert st["refill_skipped"] == 3, st
        assert st["refilled"] == len(blobs) - 1 - len(republished), st
        for _ in range(20):  # new connections reuse freed descriptor numbers
            assert again.stats()["pid"] == again.proc.pid
        assert present(again, blobs) == [i != 20 for i in range(len(blobs))]
        assert present(again, [huge, pinned]) == [False, False]
        wait_until(
            lambda: again.stats()["persist_records"] == len(blobs) + 1, 10, "corrupt removed"
        )
    finally:
        assert again.stop() == 0, again.log()[-3000:]
    no_internal_errors(again)


def test_restart_that_adopts_resumes_the_refill(make_supervisor, tmp_path):
    """A supervisor killed before its refill finished leaves its arena; the next one adopts
    it and still refills what is on disk but not in the arena."""
    disk = tmp_path / "persist"
    args = ("--size", "64M", "--persist", str(disk))
    blobs = [blob(600 + i, 64_000) for i in range(40)]
    sup = make_supervisor(*args)
    with sup.client() as c:
        for b in blobs:
            c.put_bytes(b.root, b.tokens, b"fp", b.data)
    wait_until(lambda: persisted_all(sup), 20, "the write-behind to catch up")
    assert sup.stop() == 0
    with store_locked(disk):  # killed before its refill loaded anything
        mid = make_supervisor(*args, name=sup.name)
        with mid.client() as c:
            c.put_bytes(blobs[5].root, blobs[5].tokens, b"fp", blobs[5].data)
        mid.proc.kill()
        mid.proc.wait(10)
    assert mid.arena.exists()
    again = wait_ready(make_supervisor(*args, name=sup.name, wait=False))
    try:
        st = refilled(again)
        # (the one put before the kill was adopted, not refilled)
        assert st["refilled"] == len(blobs) - 1 and st["refill_skipped"] == 0, st
        assert present(again, blobs) == [True] * len(blobs)
    finally:
        assert again.stop() == 0
    no_internal_errors(again)


@pytest.mark.parametrize("keep", ["half", "a few bytes"])
def test_truncated_store_is_moved_aside_and_serves(make_supervisor, tmp_path, keep):
    """A data.mdb shorter than LMDB's meta pages say (a full disk's torn copy, a restore
    cut short) is moved aside and a new one started: no SIGBUS restart loop (issue 18)."""
    disk = tmp_path / "persist"
    args = ("--size", "64M", "--persist", str(disk))
    blobs = [blob(700 + i, 64_000) for i in range(40)]
    sup = make_supervisor(*args)
    with sup.client() as c:
        for b in blobs:
            c.put_bytes(b.root, b.tokens, b"fp", b.data)
    wait_until(lambda: persisted_all(sup), 20, "the write-behind to catch up")
    assert sup.stop() == 0
    data = disk / "data.mdb"
    size = data.stat().st_size
    os.truncate(data, size // 2 if keep == "half" else 7)
    again = start_supervisor(tmp_path, *args, name=sup.name)
    try:
        st = wait_until(
            lambda: (s := again.stats())["persist_on"] == 1 and s, 20, "a new store", step=0.1
        )
        assert st["persist_errors"].get("corrupt") == 1 and st["persist_records"] == 0, st
        aside = list(disk.glob("data.mdb.corrupt-*"))
        assert len(aside) == 1 and aside[0].stat().st_size == (size // 2 if keep == "half" else 7)
        assert present(again, blobs[:1]) == [False]
        with again.client() as c:  # serves, and persists again
            c.put_bytes(blobs[0].root, blobs[0].tokens, b"fp", blobs[0].data)
            assert c.lookup(blobs[0].digests()) is not None
        wait_until(lambda: again.stats()["persisted"] == 1, 10, "the new state persisted")
    finally:
        assert again.stop() == 0, again.log()[-3000:]
    no_internal_errors(again)


# ------------------------------------------------- what the guide promises (issue 22)
@pytest.mark.parametrize("how", ["group-writable", "a symbolic link"])
def test_unsafe_directory_is_counted_and_costs_no_request(make_supervisor, tmp_path, how):
    """A --persist directory others could plant states in is never used: ``unsafe``."""
    disk = tmp_path / "persist"
    if how == "group-writable":
        disk.mkdir(mode=0o700)
        disk.chmod(0o770)
    else:
        (tmp_path / "real").mkdir(mode=0o700)
        disk.symlink_to(tmp_path / "real")
    sup = make_supervisor("--size", "16M", "--persist", str(disk))
    b = blob(801, 50_000)
    with sup.client() as c:
        put_blob(c, b)
        use_blob(c, b)
    st = wait_until(lambda: (s := sup.stats())["persist_errors"].get("unsafe") and s, 10, "unsafe")
    assert st["persist_on"] == 0 and st["persisted"] == 0, st
    assert not list(tmp_path.glob("*/*.mdb")), "the store was opened"
    no_internal_errors(sup)


def test_one_supervisor_per_directory(make_supervisor, tmp_path):
    """A second supervisor on a --persist directory in use (``shmkv.lock``) serves without
    it (``in_use``) and takes the directory over once the first one stops."""
    disk = tmp_path / "persist"
    first = make_supervisor("--size", "16M", "--persist", str(disk))
    wait_until(lambda: first.stats()["persist_on"], 10, "the first store")
    assert (disk / "shmkv.lock").stat().st_mode & 0o777 == 0o600
    second = make_supervisor("--size", "16M", "--persist", str(disk))
    st = wait_until(
        lambda: (s := second.stats())["persist_errors"].get("in_use") and s, 10, "in_use"
    )
    assert st["persist_on"] == 0, st
    b = blob(802, 50_000)
    with second.client() as c:
        put_blob(c, b)
        use_blob(c, b)
    assert first.stop() == 0
    wait_until(lambda: second.stats()["persist_on"], 30, "the second to take the store over")
    with second.client() as c:
        put_blob(c, blob(803, 50_000))
    wait_until(lambda: second.stats()["persisted"] >= 1, 10, "a state persisted")
    no_internal_errors(first, second)


@contextmanager
def writer_blocked(disk: Path) -> Iterator[Callable[[], None]]:
    """Hold LMDB's one writer lock of ``disk`` (a write transaction of our own), so that
    the supervisor's write-behind waits in its next commit and what the arena accepts
    meanwhile stays queued; yields the release (also done on exit)."""
    env = lmdb.open(str(disk), max_dbs=2, map_size=1 << 30)
    txn: lmdb.Transaction | None = env.begin(write=True)

    def release() -> None:
        nonlocal txn
        if txn is not None:
            txn.abort()
            txn = None

    try:
        yield release
    finally:
        release()
        env.close()


def queue_behind(sup: Sup, blobs: list) -> None:
    """Put ``blobs`` while the write-behind waits in the commit of the first one: the
    others are queued."""
    before = sup.stats()["persisted"]
    with sup.client() as c:
        put_blob(c, blobs[0])
        wait_until(lambda: sup.stats()["persist_queue"] == 0, 10, "the writer to take it")
        for b in blobs[1:]:
            put_blob(c, b)
    st = sup.stats()
    assert st["persisted"] == before and st["persist_queue"] == len(blobs) - 1, st


def read_all(sup: Sup, blobs: list) -> list[bool]:
    """Which of ``blobs`` ``sup`` holds; each one held reads back whole."""
    out = []
    with sup.client() as c:
        for b in blobs:
            hit = c.lookup(b.digests())
            if hit is not None:
                with c.acquire(hit) as lease:
                    assert bytes(lease.payload) == b.data and lease.finish()
            out.append(hit is not None)
    return out


def test_a_clean_stop_writes_what_is_still_queued(make_supervisor, tmp_path):
    """SIGTERM while records wait for the disk: the supervisor writes them before it
    exits, and the next one (after a reboot) refills them all."""
    disk = tmp_path / "persist"
    args = ("--size", "64M", "--persist", str(disk))
    blobs = [blob(810 + i, 200_000) for i in range(16)]
    sup = make_supervisor(*args)
    wait_until(lambda: sup.stats()["persist_on"], 10, "the store")
    with writer_blocked(disk):
        queue_behind(sup, blobs)
        sup.proc.send_signal(signal.SIGTERM)
    assert sup.proc.wait(20) == 0, sup.log()[-3000:]
    again = start_supervisor(tmp_path, *args, name=sup.name)
    try:
        st = refilled(again)
        assert st["refilled"] == len(blobs) and st["persist_records"] == len(blobs), st
        assert read_all(again, blobs) == [True] * len(blobs)
    finally:
        assert again.stop() == 0
    no_internal_errors(sup, again)


def test_a_crash_with_a_queue_leaves_what_was_written_intact(make_supervisor, tmp_path):
    """kill -9 while the write-behind commits a queue of records: after a reboot the
    store opens as it is (nothing moved aside, nothing corrupt), every record written
    before is refilled whole, and of the queue at most what was committed."""
    disk = tmp_path / "persist"
    args = ("--size", "64M", "--persist", str(disk))
    written, queued = (
        [blob(830 + i, 200_000) for i in range(8)],
        [blob(840 + i, 1 << 20) for i in range(24)],
    )
    sup = make_supervisor(*args)
    with sup.client() as c:
        for b in written:
            put_blob(c, b)
    wait_until(lambda: persisted_all(sup), 20, "the write-behind to catch up")
    with writer_blocked(disk) as release:
        queue_behind(sup, queued)
        size = (disk / "data.mdb").stat().st_size
        release()  # the writer commits the queue ...
        wait_until(lambda: (disk / "data.mdb").stat().st_size != size, 10, "a write", 0.001)
        kill9(sup)  # ... and dies in the middle of it
    sup.arena.unlink()  # (a reboot)
    again = wait_ready(start_supervisor(tmp_path, *args, name=sup.name, wait=False))
    try:
        st = refilled(again)
        assert not st["persist_errors"] and st["refill_skipped"] == 0, st
        assert not list(disk.glob("data.mdb.corrupt-*"))
        assert read_all(again, written) == [True] * len(written)
        assert (
            st["refilled"] == st["persist_records"] == len(written) + sum(read_all(again, queued))
        )
    finally:
        assert again.stop() == 0
    no_internal_errors(again)


def _stored(disk: Path) -> dict[str, dict[bytes, bytes]]:
    """Each record's ``blob`` value and each chunk in ``disk``'s store, by key (read with
    LMDB itself, once the write-behind is idle or the supervisor stopped)."""
    env = lmdb.open(str(disk), max_dbs=3, readonly=True, lock=False)
    out = {}
    for name in ("blob", "chunk"):
        with env.begin(db=env.open_db(name.encode(), create=False)) as txn:
            out[name] = {bytes(k): bytes(v) for k, v in txn.cursor()}
    env.close()
    return out


def _flip_chunk(disk: Path, group: bytes, at: int, others: list[bytes]) -> None:
    """Flip 16 bytes inside the chunk whose data is ``group``, where its 64 bytes from
    ``at`` are first found in data.mdb (bytes no chunk in ``others`` holds), in the file
    itself."""
    data = bytearray((disk / "data.mdb").read_bytes())
    window = group[at : at + 64]
    assert not any(window in o for o in others if o != group)
    pos = data.find(window)
    assert pos >= 0
    data[pos + 24 : pos + 40] = bytes(b ^ 0xFF for b in data[pos + 24 : pos + 40])
    (disk / "data.mdb").write_bytes(bytes(data))


def test_states_that_share_a_prefix_share_its_chunks_on_disk(make_supervisor, tmp_path):
    """States that share a prefix are chunks in the arena and on disk: each full group of
    64 tokens is stored once, whoever lists it; the disk holds the shared prefix once and
    each state's own part. After a reboot the refill hands each state's chunks to the arena
    as they lie on disk, never assembled: the arena copies each unique chunk once and no
    more bytes, and shares them as before."""
    disk = tmp_path / "persist"
    root = bytes(range(16))
    prefix = np.arange(700, dtype="<i4")
    prompts = [np.concatenate([prefix, np.arange(30, dtype="<i4") + 9000 * i]) for i in (1, 2, 3)]
    datas = [kv_state(t) for t in prompts]
    args = ("--size", "32M", "--persist", str(disk))
    sup = make_supervisor(*args)
    with sup.client() as c:
        for t, d in zip(prompts, datas, strict=True):
            c.put_bytes(root, t, b"fp", d)
    before = sup.stats()
    assert before["chunked_puts"] == 3 and before["chunk_bytes_shared"] > 0
    wait_until(lambda: persisted_all(sup), 20, "the write-behind")
    st, stored = sup.stats(), _stored(disk)
    # 700 shared tokens: 10 full groups of 64 alike; the 11th holds each state's own tokens
    groups = [kvformat.split(d, 64) for d in datas]
    full = [[bytes(g) for g, f in zip(gs, m.group_full, strict=True) if f] for m, gs in groups]
    assert [len(f) for f in full] == [11, 11, 11] and full[0][:10] == full[1][:10] == full[2][:10]
    assert sorted(stored["chunk"].values()) == sorted({g for f in full for g in f})
    assert len(stored["chunk"]) == 13 and len(stored["blob"]) == 3
    assert st["persist_bytes"] == sum(map(len, stored["blob"].values())) + sum(
        map(len, stored["chunk"].values())
    )
    assert st["persist_bytes"] < 0.45 * sum(map(len, datas)), st  # (whole: 3 copies)
    again = reboot(tmp_path, sup, *args)
    try:
        st = refilled(again)
        assert st["refilled"] == 3, st
        # (assembled and split again, it would gather all 33 full groups besides)
        assert st["chunk_bytes_copied"] == sum(map(len, stored["chunk"].values())), st
        for k in ("chunks", "chunk_bytes", "chunk_bytes_shared", "bytes_used"):
            assert st[k] == before[k], k
        with again.client() as c:
            for t, d in zip(prompts, datas, strict=True):
                hit = c.lookup(chain_digests(root, t, 64))
                with c.acquire(hit) as lease:
                    assert lease.record.chunked and bytes(lease.payload) == d and lease.finish()
    finally:
        assert again.stop() == 0
        no_internal_errors(sup, again)


def test_a_damaged_chunk_costs_the_states_that_list_it_a_miss(make_supervisor, tmp_path):
    """A flipped chunk on disk: the refill skips every state that lists it (a miss, never a
    wrong state) and deletes them; the chunks they shared with others stay, the others'
    own go. A state's own chunk damaged costs that state; a shared one costs all."""
    disk, args, sup, root, prompts, datas, _ = _three_on_one_prefix(make_supervisor, tmp_path)
    full = []
    for d in datas:
        m, gs = kvformat.split(d, 64)
        full.append([bytes(g) for g, f in zip(gs, m.group_full, strict=True) if f])
    chunks = [g for f in full for g in f]
    # state 0's own chunk, where its token 699's K row ends and 700's (its own) begins
    _flip_chunk(disk, full[0][10], 60 * 256 - 32, chunks)
    again = start_supervisor(tmp_path, *args, name=sup.name)
    try:
        st = refilled(again)
        assert st["refilled"] == 2 and st["refill_skipped"] == 1, st
        with again.client() as c:  # (state 0's prompt still finds the shared 640 tokens)
            assert [c.lookup(chain_digests(root, t, 64)).chunks for t in prompts] == [10, 11, 11]
        wait_until(lambda: again.stats()["persist_records"] == 2, 10, "the damaged state deleted")
        assert again.stop() == 0
        assert sorted(_stored(disk)["chunk"].values()) == sorted(set(full[1] + full[2]))
        _flip_chunk(disk, full[1][3], 4096, chunks)  # a chunk all three shared
        again.arena.unlink(missing_ok=True)
        again = start_supervisor(tmp_path, *args, name=sup.name)
        st = refilled(again)
        assert st["refilled"] == 0 and st["refill_skipped"] == 2, st
        wait_until(lambda: again.stats()["persist_records"] == 0, 10, "the damaged states deleted")
        assert again.stats()["persist_bytes"] == 0
    finally:
        assert again.stop() == 0
        no_internal_errors(sup, again)


def _edit_store(disk: Path, db: str, edit: Callable[[bytes, bytes], bytes | None]) -> int:
    """Rewrite each value of ``disk``'s ``db`` that ``edit(key, value)`` returns anew for
    (None: left as it is), with LMDB itself, as a writer of the files could (the
    supervisor is stopped); returns how many it rewrote."""
    env = lmdb.open(str(disk), max_dbs=3, map_size=1 << 30)
    n = 0
    with env.begin(db=env.open_db(db.encode(), create=False), write=True) as txn:
        for k, v in [(bytes(k), bytes(v)) for k, v in txn.cursor()]:
            if (new := edit(k, v)) is not None:
                txn.put(k, new)
                n += 1
    env.close()
    return n


def _tokens_of(disk: Path) -> dict[bytes, bytes]:
    """Each stored record's tokens (little-endian int32), by its key."""
    env = lmdb.open(str(disk), max_dbs=3, readonly=True, lock=False)
    with env.begin(db=env.open_db(b"meta", create=False)) as txn:
        out = {bytes(k): DiskRecord.unpack(bytes(k), bytes(v)).tokens for k, v in txn.cursor()}
    env.close()
    return out


def _three_on_one_prefix(make_supervisor, tmp_path: Path):
    """Three chunked states on one 700-token prefix (each with 30 tokens of its own),
    persisted, the supervisor stopped and its arena gone (a reboot). Returns the store's
    directory, the supervisor's arguments, the stopped supervisor, the root, prompts and
    states, and the store key of the first state."""
    disk = tmp_path / "persist"
    root = os.urandom(16)
    prefix = np.arange(700, dtype="<i4")
    prompts = [np.concatenate([prefix, np.arange(30, dtype="<i4") + 9000 * i]) for i in (1, 2, 3)]
    datas = [kv_state(t, salt=root) for t in prompts]
    args = ("--size", "32M", "--persist", str(disk))
    sup = make_supervisor(*args)
    with sup.client() as c:
        for t, d in zip(prompts, datas, strict=True):
            c.put_bytes(root, t, b"fp", d)
    wait_until(lambda: persisted_all(sup), 20, "the write-behind")
    assert sup.stop() == 0
    sup.arena.unlink(missing_ok=True)
    first = next(k for k, t in _tokens_of(disk).items() if t == prompts[0].tobytes())
    return disk, args, sup, root, prompts, datas, first


def _flip(value: bytes, back: int) -> bytes:
    """``value`` with one bit flipped ``back`` bytes before its end."""
    bad = bytearray(value)
    bad[-back] ^= 0x01
    return bytes(bad)


def _read_back(sup: Sup, root: bytes, prompts: list, datas: list, chunk: int = 64) -> list[bool]:
    """For each state: found whole, and its payload what was put and intact by its XXH3-64."""
    out = []
    with sup.client() as c:
        for t, d in zip(prompts, datas, strict=True):
            hit = c.lookup(chain_digests(root, t, chunk))
            if hit is None or hit.chunks != len(t) // chunk:
                out.append(False)
                continue
            with c.acquire(hit) as lease:
                got = bytes(lease.payload)
                same = xxhash.xxh3_64_intdigest(got) == lease.record.payload_xxh3
                out.append(lease.finish() and got == d and same)
    return out


def test_a_flipped_bit_outside_the_chunks_costs_that_state_a_miss(make_supervisor, tmp_path):
    """A chunked state's value on disk (its layout and the groups that are not full) is
    sealed by a checksum, which with each chunk's key (its XXH3-128) covers every byte: the
    refill hands the chunks to the arena without hashing the whole blob, and one bit
    flipped in a group that is not full still costs that state a miss (skipped, deleted),
    never a wrong state; the others come back intact."""
    disk, args, sup, root, prompts, datas, first = _three_on_one_prefix(make_supervisor, tmp_path)
    # (40 bytes from the end: the V rows of the last layer at the state's last tokens)
    assert _edit_store(disk, "blob", lambda k, v: _flip(v, 40) if k == first else None) == 1
    again = start_supervisor(tmp_path, *args, name=sup.name)
    try:
        st = refilled(again)
        assert st["refilled"] == 2 and st["refill_skipped"] == 1, st
        assert _read_back(again, root, prompts, datas) == [False, True, True]
        wait_until(lambda: again.stats()["persist_records"] == 2, 10, "the damaged state deleted")
    finally:
        assert again.stop() == 0
        no_internal_errors(again)


def test_states_stored_before_the_seal_are_refilled_and_hashed_whole(make_supervisor, tmp_path):
    """A store written before chunked values were sealed (no magic, no checksum) still
    refills: its states are hashed whole as before, so the intact ones come back equal and
    one with a bit flipped where no chunk's key covers it is skipped."""
    disk, args, sup, root, prompts, datas, first = _three_on_one_prefix(make_supervisor, tmp_path)

    def unseal(k: bytes, v: bytes) -> bytes:
        assert v[:4] == b"SKC2"
        old = v[4:-8]  # (the value as it was written before)
        return _flip(old, 40) if k == first else old

    assert _edit_store(disk, "blob", unseal) == 3
    again = start_supervisor(tmp_path, *args, name=sup.name)
    try:
        st = refilled(again)
        assert st["refilled"] == 2 and st["refill_skipped"] == 1, st
        assert _read_back(again, root, prompts, datas) == [False, True, True]
    finally:
        assert again.stop() == 0
        no_internal_errors(again)


@pytest.mark.parametrize("chunk", [64, 32])
def test_a_sealed_state_whose_blob_checksum_is_wrong_is_a_miss_at_restore(
    make_supervisor, tmp_path, chunk
):
    """What the seal trades: a sealed state's refill does not hash the whole blob, so a
    stored XXH3-64 that disagrees with intact groups (metadata rewritten by a writer of the
    files, under a valid metadata checksum) is taken into the arena, and the restore's
    check of the assembled blob finds it: a miss there, never a wrong state. Under another
    ``--chunk-tokens`` the state is assembled and split again, and hashed whole: skipped."""
    disk, args, sup, root, prompts, datas, first = _three_on_one_prefix(make_supervisor, tmp_path)

    def wrong_xxh3(k: bytes, v: bytes) -> bytes | None:
        rec = DiskRecord.unpack(k, v)
        return replace(rec, payload_xxh3=rec.payload_xxh3 ^ 1).pack() if k == first else None

    assert _edit_store(disk, "meta", wrong_xxh3) == 1
    again = start_supervisor(tmp_path, *args, "--chunk-tokens", str(chunk), name=sup.name)
    try:
        st = refilled(again)
        assert (st["refilled"], st["refill_skipped"]) == ((3, 0) if chunk == 64 else (2, 1)), st
        assert _read_back(again, root, prompts, datas, chunk) == [False, True, True]
        if chunk == 64:
            with again.client() as c:  # (what a worker's restore reads: ArenaView.assembled)
                hit = c.lookup(chain_digests(root, prompts[0], chunk))
                with c.acquire(hit) as lease:
                    with pytest.raises(ArenaCorruptError), lease.view.assembled(lease.record):
                        pass
                    lease.finish()
    finally:
        assert again.stop() == 0
        no_internal_errors(again)
