"""With ``--reserve false`` (the default) the arena holds the memory of what it caches, not
of its whole --size (``pages.py``); ``--reserve true`` allocates all of it at start.

Real supervisors, real clients, real tmpfs: the arena file's allocated bytes
(st_blocks) and the pages a reader maps follow what is stored; a tmpfs too small
for the arena costs rejected puts, never a SIGBUS; and the pages of a record whose
lease was revoked or lost with its connection are never punched (its reader may
still be copying).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from shmkv.core import arena as A
from shmkv.core.errors import ShmkvError
from tests.support.blobs import blob
from tests.support.peer import Raw
from tests.support.supervisors import assert_healthy
from tests.support.waiting import mapped_kib, no_signal_deaths, wait_until

pytestmark = pytest.mark.timeout(120)
MiB = 1 << 20


def allocated(path: Path) -> int:
    return os.stat(path).st_blocks * 512


def mapping_kib(path: Path, field: str = "Rss") -> int:
    """``field`` (kB) of this process's mappings of ``path``, all together."""
    return sum(mapped_kib(str(path), field))


def settled(sup) -> dict:
    """Stats once the supervisor has punched what was freed (resident stops moving)."""
    last = [-1]

    def still() -> bool:
        now = sup.stats()["bytes_resident"]
        same, last[0] = now == last[0], now
        return same

    wait_until(still, 10, "the freed pages' punching")
    return sup.stats()


def test_memory_follows_what_the_arena_holds(make_supervisor) -> None:
    sup = make_supervisor("--size", "256M", "--reserve", "false")
    g = A.Geometry.plan(256 * MiB, 32)
    index = g.data_offset  # header + index: always allocated
    assert allocated(sup.arena) <= index + 64 * 1024, "the data region was allocated at start"
    c = sup.client()  # a worker's view (populate=True, as workers map it)
    c.lookup(blob(0, 4096).digests())  # attach
    assert mapping_kib(sup.arena) * 1024 <= index + 64 * 1024
    assert mapping_kib(sup.arena, "Pss") * 1024 <= index + 64 * 1024

    b = blob(1, 32 * MiB)
    c.put_bytes(b.root, b.tokens, b"fp", b.data)
    grown = allocated(sup.arena) - index
    assert 32 * MiB <= grown <= 32 * MiB + 64 * 1024, grown
    with c.acquire(c.lookup(b.digests())) as lease:
        assert bytes(lease.payload) == b.data
        assert lease.finish() is True
    rss = mapping_kib(sup.arena) * 1024
    assert 32 * MiB <= rss <= index + 33 * MiB, rss
    assert abs(sup.stats()["bytes_resident"] - allocated(sup.arena)) <= 64 * 1024

    assert c.clear() == 1
    st = settled(sup)
    assert allocated(sup.arena) <= index + 64 * 1024, "the cleared record's pages stayed"
    assert st["bytes_resident"] <= index + 64 * 1024
    assert mapping_kib(sup.arena) * 1024 <= index + 64 * 1024

    # evictions: ten 40 MiB states through a 256 MiB arena; memory stays what is held
    for seed in range(10):
        b = blob(10 + seed, 40 * MiB)
        c.put_bytes(b.root, b.tokens, b"fp", b.data)
    st = settled(sup)
    assert st["evictions"] >= 4, st
    assert st["bytes_resident"] <= index + st["bytes_used"] + 64 * 1024, st
    c.close()
    assert_healthy(sup)


def test_a_reserved_arena_is_mapped_after_the_attach_not_during_it(make_supervisor) -> None:
    """A worker's view of a --reserve arena maps its header and index at once and its data
    region from a thread after: mapped whole at once (MAP_POPULATE), an 8 GiB arena held
    the attach for 0.55 s, which every worker re-attaching to a restarted supervisor paid
    before its first hit. Right after the attach most of a 1 GiB data region is not
    mapped yet, a record reads back intact meanwhile, and soon all of it is mapped; a view
    closed at once waits for the mapping to stop (no crash, no hang)."""
    sup = make_supervisor("--size", "1G", "--reserve", "true")
    size = os.stat(sup.arena).st_size
    b = blob(1, 8 * MiB)
    with sup.client(populate=False) as w:
        w.put_bytes(b.root, b.tokens, b"fp", b.data)
    c = sup.client()  # a worker's view
    hit = c.lookup(b.digests())  # (the attach)
    index = c.view.geometry.data_offset
    assert mapping_kib(sup.arena) * 1024 < index + (size - index) // 2
    with c.acquire(hit) as lease:
        assert bytes(lease.payload) == b.data and lease.finish()
    wait_until(lambda: mapping_kib(sup.arena) * 1024 >= size, 30, "the data region mapped")
    c.close()
    for _ in range(3):  # (closed while its thread maps pages)
        other = sup.client()
        assert other.lookup(b.digests()) is not None
        other.close()
    assert_healthy(sup)


def test_reserve_allocates_the_whole_arena_at_start(make_supervisor) -> None:
    sup = make_supervisor("--size", "64M", "--reserve", "true")
    assert allocated(sup.arena) >= 64 * MiB
    with sup.client() as c:
        b = blob(1, 8 * MiB)
        c.put_bytes(b.root, b.tokens, b"fp", b.data)
        assert c.clear() == 1
    settled(sup)  # (what a --reserve false arena punches is gone by then)
    assert allocated(sup.arena) >= 64 * MiB, "a --reserve arena gave pages back"


def test_a_full_tmpfs_rejects_puts_and_kills_nobody(small_tmpfs: Path, make_supervisor) -> None:
    """A 256 MiB arena in a 64 MiB tmpfs: it starts (with a warning naming --size and
    --reserve); puts past the tmpfs are rejected and counted; nobody gets SIGBUS; what is
    stored still reads back intact; and a clear gives the room back."""
    sup = make_supervisor(
        "--size", "256M", "--reserve", "false", env_extra={"SHMKV_DIR": str(small_tmpfs)}
    )
    log = sup.log()
    assert "--size" in log and "--reserve" in log, log
    c = sup.client()
    stored, refused = [], 0
    for seed in range(8):  # 8 x 12 MiB > 64 MiB
        b = blob(seed, 12 * MiB)
        try:
            c.put_bytes(b.root, b.tokens, b"fp", b.data)
            stored.append(b)
        except ShmkvError as e:
            assert "tmpfs" in str(e), e
            refused += 1
    assert refused >= 3 and len(stored) >= 3, (refused, len(stored))
    st = sup.stats()
    assert st["shm_full_puts"] == refused and st["rejected_puts"] >= refused, st
    assert st["entries"] == len(stored), "a refused put left a record"
    for b in stored:  # what is stored reads back as put (no SIGBUS in this reader either)
        with c.acquire(c.lookup(b.digests())) as lease:
            assert bytes(lease.payload) == b.data
            assert lease.finish() is True
    for b in (blob(100 + i, 12 * MiB) for i in range(3)):  # refused again, still no harm
        with pytest.raises(ShmkvError):
            c.put_bytes(b.root, b.tokens, b"fp", b.data)
    assert c.clear() == len(stored)
    settled(sup)
    b = blob(200, 12 * MiB)
    c.put_bytes(b.root, b.tokens, b"fp", b.data)  # the room came back
    assert c.lookup(b.digests()) is not None
    c.close()
    assert sup.proc.poll() is None
    assert_healthy(sup)
    assert sup.stop() == 0
    no_signal_deaths(sup.proc)


def _holes(path: Path, offset: int, length: int) -> bool:
    """Whether [offset, offset + length) of the file has a hole."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.lseek(fd, offset, os.SEEK_HOLE) < offset + length
    finally:
        os.close(fd)


def test_a_revoked_or_lost_lease_keeps_its_pages(make_supervisor) -> None:
    """The holder of a revoked lease (or of one its connection lost) may still be reading:
    its record's pages stay allocated after the record is freed, even once other records
    used and freed the same space, so that reading them never faults on a hole."""
    sup = make_supervisor("--size", "16M", "--lease-timeout", "0.5", "--reserve", "false")
    c = sup.client()
    b1 = blob(1, 6 * MiB)
    c.put_bytes(b1.root, b1.tokens, b"fp", b1.data)
    stale = c.acquire(c.lookup(b1.digests()))
    # a peer leases a second record and hangs up without releasing it
    b2 = blob(2, 3 * MiB)
    c.put_bytes(b2.root, b2.tokens, b"fp", b2.data)
    slot = c.lookup(b2.digests()).slot
    r = Raw(sup.socket)
    r.attach()
    assert r.call({"op": "acquire", "offset": slot.rec_offset, "gen": slot.rec_gen})["ok"]
    r.close()
    wait_until(lambda: sup.stats()["leases_closed"] == 1, what="the peer's lease's end")
    time.sleep(0.7)  # the first lease is now older than --lease-timeout
    b = blob(3, 12 * MiB)  # needs the stale lease's record: it is revoked and evicted
    c.put_bytes(b.root, b.tokens, b"fp", b.data)
    assert sup.stats()["revocations"] == 1
    assert c.clear() >= 1  # every record freed: their pages are punched, but not these
    settled(sup)
    _, _, _, ext1 = A.record_layout(len(b1.tokens), 2, len(b1.data))
    _, _, _, ext2 = A.record_layout(len(b2.tokens), 2, len(b2.data))
    assert not _holes(sup.arena, stale.record.offset, ext1), "a revoked lease's pages punched"
    assert not _holes(sup.arena, slot.rec_offset, ext2), "a lost lease's pages punched"
    data = bytes(stale.payload)  # no fault on a hole: old or reused bytes
    assert len(data) == len(b1.data)
    assert stale.finish() is False
    c.close()
    assert_healthy(sup)
