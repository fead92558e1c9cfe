"""States that share a prefix share its bytes in the arena: chunked records.

A put of a sequence state that ``kvformat.split`` cuts into token groups stores each full
group as a chunk found by (publisher, layout, XXH3-128 of its bytes), reference-counted;
these tests hold the store to it on states made in llama.cpp's format
(``tests/support/kvblobs.py``), in this process (``tests/support/arenas.py``) and
through a real supervisor.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import xxhash

from shmkv.core import arena as A
from shmkv.core.keys import chain_digests
from shmkv.supervisor.record import Entry
from shmkv.supervisor.store import Store
from tests.support.arenas import ArenaFile
from tests.support.blobs import each_record
from tests.support.kvblobs import kv_state
from tests.support.supervisors import kill9, restart
from tests.support.waiting import resident_kib_at, wait_until

CHUNK = 64
ROOT = bytes(range(16))
OURS = os.geteuid()
THEIRS = (OURS + 1) & 0xFFFFFFFF
#: a ~1,000-token system prompt, then each conversation's own question
PREFIX = np.arange(1000, dtype="<i4") + 7


def question(i: int, n: int = 40) -> np.ndarray:
    return np.concatenate([PREFIX, np.arange(n, dtype="<i4") + 50_000 + 100 * i])


def put_state(store: Store, tokens: np.ndarray, publisher: int | None = None) -> Entry:
    data = kv_state(tokens)
    return store.put(
        ROOT,
        tokens,
        b"fp",
        len(data),
        xxhash.xxh3_64_intdigest(data),
        lambda view: view.__setitem__(slice(None), data),
        publisher=publisher,
    )


def blob_of(view: A.ArenaView, e: Entry) -> bytes:
    rec = view.read_record(e.offset, e.gen)
    view.verify_meta(rec)
    return bytes(view.blob(rec))


@pytest.fixture
def arena():
    af = ArenaFile(data_pages=2048, chunk_tokens=CHUNK, index_slots=4096)  # 8 MiB
    yield af
    af.close()


def test_twelve_states_on_one_prefix_hold_it_once(arena: ArenaFile) -> None:
    store, view = arena.store, arena.view
    first = put_state(store, question(0))
    assert first.chunks, "a state in llama.cpp's format is stored as chunks"
    one = store.bytes_used()
    entries = [first] + [put_state(store, question(i)) for i in range(1, 12)]
    whole = sum(A.record_layout(e.n_tokens, 2, e.payload_len)[3] for e in entries)
    used = store.bytes_used()
    # 15 full groups of the prefix once; each state adds its group that holds the
    # question's start, its inline tail and its token ids
    assert used / one < 2.0 and whole / one > 11.0, (used, one, whole)
    assert store.chunks.count == 15 + 12
    assert store.chunks.shared_bytes == 11 * 15 * (CHUNK * 2 * 2 * 256)
    for i, e in enumerate(entries):
        assert blob_of(view, e) == kv_state(question(i))
    assert all(view.intact(e.offset, e.gen) for e in entries)


def test_restores_in_a_row_reuse_the_assembly_and_an_idle_worker_keeps_no_copy(
    arena: ArenaFile,
) -> None:
    """A chunked restore assembles the blob into the view's buffer for set_data. Its pages
    stay while restores follow one another (faulting a 512 MiB state's back in cost 153 ms
    of a 390 ms restore, each time) and go back once none used it for ASSEMBLY_IDLE_S: an
    idle worker keeps no copy of the last state it restored (10-14 MiB per worker on
    Gemma 3 270M, 512 MiB at an 8B model's 4,096 tokens)."""
    store, view = arena.store, arena.view
    e = put_state(store, question(1))
    rec = view.read_record(e.offset, e.gen)
    for _ in range(2):  # (the buffer is reused, and refilled)
        with view.assembled(rec) as blob:
            assert bytes(blob) == kv_state(question(1))
            assert resident_kib_at(blob.ctypes.data) * 1024 >= len(blob)
        assert resident_kib_at(blob.ctypes.data) * 1024 >= len(blob), "re-faulted each time"
    wait_until(lambda: resident_kib_at(blob.ctypes.data) == 0, 10, "the idle buffer's release")
    with view.assembled(rec) as blob:  # (and it fills again after)
        assert bytes(blob) == kv_state(question(1))


def test_evicting_one_of_two_frees_only_what_it_alone_held(arena: ArenaFile) -> None:
    store, view = arena.store, arena.view
    a, b = put_state(store, question(1)), put_state(store, question(2))
    shared = {id(c) for c in a.chunks} & {id(c) for c in b.chunks}
    assert len(shared) == 15
    own = sum(c.extent for c in a.chunks if id(c) not in shared)
    free = store.alloc.free_bytes
    store.remove(a)
    assert store.alloc.free_bytes - free == a.extent + own
    assert all(c.refs == 1 for c in b.chunks) and store.chunks.shared_bytes == 0
    assert blob_of(view, b) == kv_state(question(2))
    # a leased record holds its chunks until its last lease ends
    lid = store.acquire(b.offset, b.gen, owner=5)
    assert store.clear() == 1
    assert store.chunks.count == len(b.chunks) and blob_of(view, b) == kv_state(question(2))
    assert store.release(lid, 5)
    assert store.bytes_used() == 0 and store.chunks.count == 0 and store.chunks.bytes == 0
    assert store.alloc.count() == 1  # every extent back, coalesced


def test_clear_frees_every_chunk(arena: ArenaFile) -> None:
    store = arena.store
    for i in range(5):
        put_state(store, question(i))
    assert store.chunks.count > 0
    assert store.clear() == 5
    assert store.bytes_used() == 0 and store.chunks.count == 0 and not store.chunks.by_key


def test_another_publisher_never_shares_a_chunk(arena: ArenaFile) -> None:
    """The same state put by two uids: two sets of chunks, never one (a hostile uid cannot
    put bytes into another uid's records by publishing them first)."""
    store, view = arena.store, arena.view
    theirs = put_state(store, question(1), publisher=THEIRS)
    ours = put_state(store, question(1), publisher=OURS)
    assert not {id(c) for c in theirs.chunks} & {id(c) for c in ours.chunks}
    assert store.chunks.shared_bytes == 0
    assert all(c.key[0] == THEIRS for c in theirs.chunks)
    assert all(c.key[0] == OURS for c in ours.chunks)
    assert blob_of(view, ours) == kv_state(question(1))
    # and a same-uid put of a prefix shares with its own uid's only
    again = put_state(store, question(2), publisher=OURS)
    assert {id(c) for c in again.chunks} & {id(c) for c in ours.chunks}
    assert not {id(c) for c in again.chunks} & {id(c) for c in theirs.chunks}


def test_equal_hashes_with_other_bytes_are_not_shared(arena: ArenaFile) -> None:
    """A chunk is shared only when its bytes are equal, not when its key is: a stored chunk
    whose bytes changed (damage) is never named by a new record."""
    store, view = arena.store, arena.view
    a = put_state(store, question(1))
    c = a.chunks[3]
    arena.mm[c.offset + A.CHUNK_HEADER_SIZE + 10] ^= 0xFF
    assert not view.verify_payload(view.read_record(a.offset, a.gen))
    b = put_state(store, question(2))
    assert c not in b.chunks and a.chunks[2] in b.chunks
    assert blob_of(view, b) == kv_state(question(2))


def test_a_corrupt_chunk_fails_the_whole_blob_check(arena: ArenaFile) -> None:
    store, view = arena.store, arena.view
    a, b = put_state(store, question(1)), put_state(store, question(2))
    arena.mm[a.chunks[0].offset + A.CHUNK_HEADER_SIZE + 77] ^= 0x01
    for e in (a, b):
        rec = view.read_record(e.offset, e.gen)
        assert xxhash.xxh3_64_intdigest(view.blob(rec)) != rec.payload_xxh3
        assert not view.intact(e.offset, e.gen)
    # a reference to a chunk whose header is gone (freed) fails at the header
    arena.mm[a.chunks[5].offset : a.chunks[5].offset + 4] = b"\0\0\0\0"
    with pytest.raises(A.ArenaCorruptError, match="no chunk"):
        view.blob(view.read_record(b.offset, b.gen))


def test_a_sliced_chunked_put_writes_a_chunk_per_step_and_abort_gives_all_back(
    arena: ArenaFile,
) -> None:
    store = arena.store
    a = put_state(store, question(1))
    used, chunks, refs = store.bytes_used(), store.chunks.count, [c.refs for c in a.chunks]
    tokens = question(2)
    data = kv_state(tokens)

    def read(view: memoryview, pos: int) -> None:
        view[:] = data[pos : pos + len(view)]

    job = store.begin_put(
        ROOT, tokens, b"fp", len(data), xxhash.xxh3_64_intdigest(data), read, piece=1 << 16
    )
    while job.written == 0:
        assert job.step(0.0) is None
    assert job.written == 1 and len(job.new) == 1  # (the question's group; the rest reused)
    assert [c.refs for c in a.chunks[:15]] == [r + 1 for r in refs[:15]]  # held by the put
    job.abort()
    assert store.bytes_used() == used and store.chunks.count == chunks
    assert [c.refs for c in a.chunks] == refs
    job = store.begin_put(ROOT, tokens, b"fp", len(data), xxhash.xxh3_64_intdigest(data), read)
    e = job.step(math.inf)
    assert e is not None and blob_of(arena.view, e) == data


# ----------------------------------------------------------- a real supervisor
def put_all(sup, n: int) -> list[bytes]:
    datas = []
    with sup.client() as c:
        for i in range(n):
            tokens = question(i)
            datas.append(kv_state(tokens))
            c.put_bytes(ROOT, tokens, b"fp", datas[-1])
    return datas


def read_all(sup, n: int, datas: list[bytes]) -> None:
    with sup.client() as c:
        for i in range(n):
            hit = c.lookup(chain_digests(ROOT, question(i), CHUNK))
            assert hit is not None and hit.chunks == len(question(i)) // CHUNK
            with c.acquire(hit) as lease:
                assert lease.record.chunked and bytes(lease.payload) == datas[i]
                assert lease.finish()


@pytest.mark.parametrize("reserve", ["true", "false"])
def test_a_supervisor_stores_chunks_reads_them_and_counts_them_once(
    make_supervisor, reserve
) -> None:
    sup = make_supervisor("--size", "32M", "--reserve", reserve)
    datas = put_all(sup, 6)
    read_all(sup, 6, datas)
    st = sup.stats_json()
    assert st["chunks"] == 15 + 6 and st["chunked_puts"] == 6
    assert st["chunk_bytes_shared"] == 5 * 15 * CHUNK * 1024
    assert st["chunk_bytes"] < st["bytes_used"] < st["chunk_bytes"] + 6 * 64 * 1024
    rows = sup.cli("ls", "--json").stdout
    assert '"chunks": 16' in rows
    assert "in shared chunks (each once)" in sup.cli("ls").stdout
    # every payload reader sees whole blobs: the tests' scan, like export and the tiers
    got = each_record(sup.arena, lambda v, off, gen: v.read_payload(v.peek(off, gen)[0]))
    assert sorted(got) == sorted(datas)
    resident = st["bytes_resident"]
    sup.cli("clear")
    st = sup.stats_json()
    assert st["bytes_used"] == 0 and st["chunks"] == 0 and st["chunk_bytes"] == 0
    if reserve == "false":  # every chunk's pages punched
        wait_until(lambda: sup.stats_json()["bytes_resident"] < resident - 900 * 1024)


def test_adopt_after_kill_keeps_chunked_records_and_their_counts(make_supervisor) -> None:
    sup = make_supervisor("--size", "32M")
    datas = put_all(sup, 6)
    before = sup.stats_json()
    kill9(sup)
    again = restart(make_supervisor, sup, "--size", "32M")
    st = again.stats_json()
    assert st["adopted"] == 6 and st["adopt_dropped"] == 0
    for k in ("entries", "chunks", "chunk_bytes", "chunk_bytes_shared", "bytes_used"):
        assert st[k] == before[k], k
    # each chunk's data hashed once, not once per record that names it (whole: 6 payloads)
    assert st["adopt_checked_bytes"] == st["chunks"] * CHUNK * 1024, st
    read_all(again, 6, datas)
    assert again.cli("clear").returncode == 0
    st = again.stats_json()
    assert st["bytes_used"] == 0 and st["chunks"] == 0 and st["chunk_bytes_shared"] == 0


def test_adopt_drops_a_record_whose_chunk_is_damaged_and_frees_what_only_it_held(
    make_supervisor,
) -> None:
    sup = make_supervisor("--size", "32M")
    put_all(sup, 6)
    before = sup.stats_json()

    def named(view, off, gen):
        rec, _ = view.peek(off, gen)
        return [i for i in view.peek_chunks(rec)[2] if i is not None]

    per_record = each_record(sup.arena, named)
    counts: dict[int, int] = {}
    for infos in per_record:
        for i in infos:
            counts[i.offset] = counts.get(i.offset, 0) + 1
    own = next(i for i in per_record[0] if counts[i.offset] == 1)  # its question's group
    kill9(sup)
    with open(sup.arena, "r+b") as f:
        f.seek(own.data_off + 5)
        b = f.read(1)
        f.seek(own.data_off + 5)
        f.write(bytes([b[0] ^ 1]))
    again = restart(make_supervisor, sup, "--size", "32M")
    st = again.stats_json()
    assert st["adopted"] == 5 and st["adopt_dropped"] == 1
    assert st["chunks"] == before["chunks"] - 1
    assert st["chunk_bytes_shared"] == before["chunk_bytes_shared"] - 15 * CHUNK * 1024
    with again.client() as c:
        found = [c.lookup(chain_digests(ROOT, question(i), CHUNK)) for i in range(6)]
    assert sum(h is not None and h.chunks == len(question(0)) // CHUNK for h in found) == 5
    assert again.cli("clear").returncode == 0
    st = again.stats_json()
    assert st["bytes_used"] == 0 and st["chunks"] == 0


def test_adopt_leaves_a_damaged_inline_row_to_the_restore_that_finds_it(make_supervisor) -> None:
    """Adoption hashes each chunk once, not each record's whole state: a flipped byte in a
    chunked record's inline rows (its own last tokens) is adopted, and the restore that
    reads it checks the state's XXH3-64 and refuses it (a miss, never a wrong state)."""
    sup = make_supervisor("--size", "32M")
    datas = put_all(sup, 3)

    def inline_at(view, off, gen):
        rec, _ = view.peek(off, gen)
        refs = view.peek_chunks(rec)[1]
        return rec.key, [rec.payload_off + r.offset for r in refs if r.inline and r.length]

    spots = dict(each_record(sup.arena, inline_at))
    damaged = chain_digests(ROOT, question(0), CHUNK)[-1]
    assert spots[damaged], "a question's tail is inline"
    kill9(sup)
    with open(sup.arena, "r+b") as f:
        f.seek(spots[damaged][0] + 3)
        b = f.read(1)
        f.seek(spots[damaged][0] + 3)
        f.write(bytes([b[0] ^ 1]))
    again = restart(make_supervisor, sup, "--size", "32M")
    assert again.stats_json()["adopted"] == 3
    with again.client() as c:
        for i in range(3):
            hit = c.lookup(chain_digests(ROOT, question(i), CHUNK))
            with c.acquire(hit) as lease:
                if i == 0:
                    with pytest.raises(A.ArenaCorruptError):
                        with lease.view.assembled(lease.record):
                            pass
                else:
                    with lease.view.assembled(lease.record) as blob:
                        assert bytes(blob) == datas[i]


def test_a_damaged_chunk_is_replaced_for_later_puts(arena: ArenaFile) -> None:
    """A put that finds its group's chunk damaged writes a good one, and later puts share
    that one, not the damaged copy (that only the records naming it keep)."""
    store, view = arena.store, arena.view
    a = put_state(store, question(1))
    bad = a.chunks[3]
    arena.mm[bad.offset + A.CHUNK_HEADER_SIZE + 10] ^= 0xFF
    b = put_state(store, question(2))
    c = put_state(store, question(3))
    assert b.chunks[3] is c.chunks[3] and b.chunks[3] is not bad
    assert blob_of(view, c) == kv_state(question(3))
