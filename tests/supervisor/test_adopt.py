"""A restarted supervisor adopts the arena its stopped or killed predecessor left.

Real supervisors SIGKILLed and restarted on the same name: what the old one had
stored is served at once (checked byte for byte, and with llama.cpp against a
cold run); what was damaged or half-written is dropped; a file of another format,
mode or owner is refused; ``--fresh`` and ``shmkv clear`` start empty on purpose.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import random
import shutil
import signal
import struct
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from shmkv import ArenaCorruptError, Client, NotFound, SupervisorUnavailable
from shmkv.core import arena as A
from shmkv.core.keys import chain_digests
from shmkv.supervisor.pages import punch_hole
from tests.support.blobs import CHUNK
from tests.support.cli import assert_one_error_line
from tests.support.llama_workers import SYSTEM, completion, run_worker, texts
from tests.support.supervisors import Sup, kill9, no_internal_errors, restart, try_stats
from tests.support.waiting import wait_until

log = logging.getLogger(__name__)

FP = b"adopt-test-fingerprint"


# ------------------------------------------------------------------ known blobs
def known(seed: int, max_size: int = 300_000) -> tuple[bytes, np.ndarray, bytes]:
    """(root, tokens, payload): a pure function of ``seed``, which the first token
    carries, so that whatever record is found in an arena can be checked."""
    rng = np.random.default_rng(seed)
    n_tok = CHUNK * int(rng.integers(1, 4)) + int(rng.integers(0, CHUNK))
    tokens = rng.integers(0, 30_000, n_tok).astype("<i4")
    tokens[0] = seed
    root = hashlib.blake2b(b"adopt-%d" % seed, digest_size=16).digest()
    return root, tokens, rng.bytes(int(rng.integers(1000, max_size)))


def put_known(c: Client, seed: int, max_size: int = 300_000) -> None:
    root, tokens, data = known(seed, max_size)
    c.put_bytes(root, tokens, FP, data)


def check_records(
    path: Path, max_size: int = 300_000, strict: bool = True
) -> tuple[int, list[str]]:
    """Every record an arena file's index names, against what was put: (count, problems).

    ``strict``: a slot naming no valid record is a problem too (not in an arena a
    killed supervisor left, where adoption drops what such slots name)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        view = A.ArenaView(fd, populate=False)
    finally:
        os.close(fd)
    problems, seen = [], set()
    try:
        for s in view.scan():
            if (s.rec_offset, s.rec_gen) in seen:
                continue
            seen.add((s.rec_offset, s.rec_gen))
            try:
                rec = view.read_record(s.rec_offset, s.rec_gen)
                view.verify_meta(rec)
            except ArenaCorruptError as e:
                if strict:
                    problems.append(f"slot {s.digest.hex()[:12]}: {e}")
                continue
            tokens = view.tokens(rec).copy()
            root, want_tokens, data = known(int(tokens[0]), max_size)
            if (
                rec.root != root
                or not np.array_equal(tokens, want_tokens)
                or bytes(view.fingerprint(rec)) != FP
                or bytes(view.payload(rec)) != data
            ):
                problems.append(f"record {rec.gen} at {rec.offset} (seed {tokens[0]}) differs")
            if s.digest not in chain_digests(root, want_tokens, CHUNK):
                problems.append(f"slot {s.digest.hex()[:12]} names record {rec.gen} wrongly")
    finally:
        view.close()
    return len(seen), problems


def read_back(c: Client, seed: int, max_size: int = 300_000) -> bytes | None:
    """The payload of ``seed``'s blob as a worker reads it (None: a miss)."""
    root, tokens, _ = known(seed, max_size)
    hit = c.lookup(chain_digests(root, tokens, CHUNK))
    if hit is None or hit.chunks != len(tokens) // CHUNK:
        return None
    with c.acquire(hit) as lease:
        data = bytes(lease.payload)
        return data if lease.finish() else None


def _where(c: Client, root: bytes, tokens: np.ndarray) -> tuple[int, int]:
    hit = c.lookup(chain_digests(root, tokens, CHUNK))
    return hit.slot.rec_offset, hit.slot.rec_gen


def _records(c: Client, seeds: range, max_size: int = 300_000) -> dict[int, A.Record]:
    """The record of each seed's blob, as the arena holds it now."""
    out = {}
    for seed in seeds:
        root, tokens, _ = known(seed, max_size)
        out[seed] = c.view.read_record(*_where(c, root, tokens))
    return out


# ------------------------------------------------------------------------ adopt
def test_kill9_restart_serves_every_entry_at_once(make_supervisor) -> None:
    sup = make_supervisor("--size", "64M")
    with sup.client() as c:
        for seed in range(50):
            put_known(c, seed)
        old_id = c.view.geometry.arena_id
    inode = sup.arena.stat().st_ino
    kill9(sup)
    new = restart(make_supervisor, sup, "--size", "64M")
    assert sup.arena.stat().st_ino == inode  # the same file, adopted
    with new.client() as c:
        st = c.stats()
        assert (st["entries"], st["adopted"], st["adopt_dropped"]) == (50, 50, 0), st
        assert c.view.geometry.arena_id != old_id  # a new supervisor: workers reattach
        for seed in range(50):
            assert read_back(c, seed) == known(seed)[2], seed
        assert c.stats()["hits"] == 50
        put_known(c, 50)  # and it goes on storing
        assert read_back(c, 50) == known(50)[2]
    assert check_records(new.arena) == (51, [])
    assert "adopted 50 entries" in new.log()


#: records enough that checking them takes many turns of the loop (10 ms slices)
MANY = 6000
SMALL = 2000  # (payload bytes at most: the fill stays quick)
ROOMY = ("--size", "64M", "--index-slots", "65536")  # (room for all of them)


def _fill_many(make_supervisor) -> Sup:
    sup = make_supervisor(*ROOMY)
    with sup.client() as c:
        for seed in range(MANY):
            put_known(c, seed, SMALL)
        assert c.stats()["entries"] == MANY
    kill9(sup)
    return sup


def test_a_large_arena_is_answered_while_its_records_are_checked(make_supervisor) -> None:
    """``--adopt-wait 0``: the restarted supervisor answers at once and checks the records
    between requests, newest first. Meanwhile a lease on the oldest record (the last in
    turn) checks it out of turn and is granted; a put waits until every record is checked,
    then is stored; at the end every record is adopted and reads back. Without it the
    first answer comes once all are checked (none left at the first ``stats``), and
    with no lease-time check the oldest record is a miss until its turn."""
    sup = _fill_many(make_supervisor)
    new = restart(make_supervisor, sup, *ROOMY, "--adopt-wait", "0")
    with new.client() as c:
        first = c.stats()
        assert first["adopting"] > 0 and first["entries"] < MANY, (first, new.log())
        assert read_back(c, 0, SMALL) == known(0, SMALL)[2]  # (the oldest: checked now)
        assert c.stats()["adopt_on_lease"] == 1
        put_known(c, MANY, SMALL)  # (answered once the adoption has ended)
        st = c.stats()
        assert (st["adopting"], st["entries"], st["adopted"]) == (0, MANY + 1, MANY), st
        for seed in [*range(0, MANY, 97), MANY]:
            assert read_back(c, seed, SMALL) == known(seed, SMALL)[2], seed
    assert f"adopted {MANY} entries" in new.log()
    assert "answering while" in new.log()
    no_internal_errors(new)


def test_a_supervisor_killed_while_adopting_leaves_every_record_to_the_next(
    make_supervisor,
) -> None:
    """Killed while it checks records (the first round, at a random point) or once it
    has checked them all and rebuilds the index (the other rounds: at the first answer
    that none is left to check), the next supervisor adopts every record all the same: the
    index is rebuilt in place, so no record stops being named (emptied first, the index
    lost what had not been pointed again when the kill came)."""
    sup = _fill_many(make_supervisor)
    rng = random.Random(7)
    for left in (rng.randrange(1, MANY // 2), 0, 0):
        sup = restart(make_supervisor, sup, *ROOMY, "--adopt-wait", "0")
        with sup.client() as c:
            wait_until(lambda: c.stats()["adopting"] <= left, 60, "the adoption", step=0.0005)  # noqa: B023
        kill9(sup)
    new = restart(make_supervisor, sup, *ROOMY)
    with new.client() as c:
        st = wait_until(lambda: (s := c.stats())["adopting"] == 0 and s, 60, "the adoption")
        assert (st["entries"], st["adopt_dropped"]) == (MANY, 0), st
        for seed in range(0, MANY, 13):
            assert read_back(c, seed, SMALL) == known(seed, SMALL)[2], seed


def test_clear_while_adopting_drops_what_is_still_to_check(make_supervisor) -> None:
    """``shmkv clear`` during an adoption removes what was adopted and checks nothing
    more: the arena stays empty, and takes puts again."""
    sup = _fill_many(make_supervisor)
    new = restart(make_supervisor, sup, *ROOMY, "--adopt-wait", "0")
    with new.client() as c:
        assert c.stats()["adopting"] > 0
        c.clear()
        st = c.stats()
        assert (st["adopting"], st["entries"]) == (0, 0), st
        put_known(c, MANY, SMALL)
        assert read_back(c, MANY, SMALL) == known(MANY, SMALL)[2]
        assert read_back(c, 0, SMALL) is None and c.stats()["entries"] == 1
    no_internal_errors(new)


def test_clean_stop_with_keep_is_adopted_and_fresh_starts_empty(make_supervisor) -> None:
    sup = make_supervisor("--size", "16M", "--keep")
    with sup.client() as c:
        for seed in range(5):
            put_known(c, seed)
    assert sup.stop() == 0
    again = restart(make_supervisor, sup, "--size", "16M", "--keep")
    with again.client() as c:
        assert c.stats()["entries"] == 5
        assert read_back(c, 3) == known(3)[2]
    assert again.stop() == 0
    fresh = restart(make_supervisor, sup, "--size", "16M", "--fresh")
    with fresh.client() as c:
        assert c.stats()["entries"] == 0
        assert read_back(c, 3) is None
    assert "adopting" not in fresh.log()


def test_other_geometry_starts_empty(make_supervisor) -> None:
    sup = make_supervisor("--size", "16M")
    with sup.client() as c:
        put_known(c, 1)
    kill9(sup)
    new = restart(make_supervisor, sup, "--size", "32M")
    with new.client() as c:
        assert c.stats()["entries"] == 0 and c.view.geometry.arena_size == 32 << 20
    assert "starting empty" in new.log()


@pytest.mark.parametrize(
    "damage,says",
    [
        ("a flipped geometry byte", "damaged header"),
        ("bad magic", "bad magic"),
        ("cut to 100 bytes", "too short to be an arena"),
        ("cut to half", "damaged header"),
    ],
)
def test_a_damaged_file_is_replaced_by_an_empty_arena(make_supervisor, damage, says) -> None:
    sup = make_supervisor("--size", "16M")
    with sup.client() as c:
        put_known(c, 1)
    kill9(sup)
    inode = sup.arena.stat().st_ino
    if damage.startswith("cut"):
        os.truncate(sup.arena, 100 if "100" in damage else (16 << 20) // 2)
    else:
        _flip(sup.arena, 0 if damage == "bad magic" else 40)
    new = restart(make_supervisor, sup, "--size", "16M")
    assert sup.arena.stat().st_ino != inode  # (a new file)
    with new.client() as c:
        assert c.stats()["entries"] == 0 and c.stats()["adopted"] == 0
        assert read_back(c, 1) is None
        put_known(c, 2)
        assert read_back(c, 2) == known(2)[2]
    assert says in new.log() and "starting empty" in new.log(), new.log()


# --------------------------------------------------------- kill -9 during puts
PUTS_TRIALS = 16


@pytest.mark.timeout(300)
def test_kill9_during_puts_never_adopts_a_half_written_record(make_supervisor) -> None:
    """Three writers put (and so evict) without pause into a small arena; the supervisor is
    SIGKILLed at random moments and restarted each time. Every record each adopted
    arena names must be byte for byte what was put; most trials adopt many."""
    rnd = random.Random(11)
    size = 1_500_000
    args = ("--size", "8M", "--put-slice", "0.001")
    box = [make_supervisor(*args)]
    stop, paused = threading.Event(), threading.Event()
    idle = [threading.Event() for _ in range(3)]
    puts = [0]

    def writer(i: int) -> None:
        c = box[0].client(timeout=2.0)
        seed = 1000 + i
        while not stop.is_set():
            if paused.is_set():
                idle[i].set()
                time.sleep(0.005)
                continue
            idle[i].clear()
            c._backoff = 0.0
            try:
                put_known(c, seed, size)
                puts[0] += 1
            except SupervisorUnavailable:
                time.sleep(0.005)
            except Exception:  # (a refusal while the arena is full of the others' puts)
                time.sleep(0.001)
            seed += 3
        c.close()

    threads = [threading.Thread(target=writer, args=(i,), daemon=True) for i in range(3)]
    adopted, dropped, problems = [], [], []
    for t in threads:
        t.start()
    try:
        for trial in range(PUTS_TRIALS):
            n0 = puts[0]
            wait_until(lambda n0=n0: puts[0] > n0 + 3, 30, "the writers to put")
            time.sleep(rnd.uniform(0.0, 0.03))
            sup = box[0]
            kill9(sup)
            paused.set()
            wait_until(lambda: all(e.is_set() for e in idle), 30, "the writers to pause")
            _, bad = check_records(sup.arena, size, strict=False)  # what may be adopted
            problems += [f"trial {trial} (left): {p}" for p in bad]
            sup = box[0] = restart(make_supervisor, sup, *args)
            with sup.client(attach=False) as c:
                st = c.stats()
            adopted.append(st["adopted"])
            dropped.append(st["adopt_dropped"])
            n_after, bad = check_records(sup.arena, size)
            problems += [f"trial {trial}: {p}" for p in bad]
            if n_after != st["entries"]:
                problems.append(f"trial {trial}: {n_after} records indexed, {st['entries']} kept")
            paused.clear()
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not problems, problems
    log.info(
        "kill -9 during puts: adopted %s records, dropped %s, %d puts", adopted, dropped, puts[0]
    )
    assert sum(1 for a in adopted if a > 0) >= PUTS_TRIALS // 2, adopted


# ---------------------------------------------------------------------- damage
def _flip(path: Path, pos: int, n: int = 4) -> None:
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(n)
        f.seek(pos)
        f.write(bytes(x ^ 0x5A for x in b))


def test_flipped_bytes_drop_only_the_damaged_records(make_supervisor) -> None:
    sup = make_supervisor("--size", "32M")
    with sup.client() as c:
        for seed in range(12):
            put_known(c, seed)
        recs = _records(c, range(12))
        g = c.view.geometry
        slots = {i: c.view.read_slot(i)[1] for i in range(g.index_slots)}
    kill9(sup)
    damaged = {
        0: recs[0].payload_off + recs[0].payload_len - 3,  # the payload's last bytes
        1: recs[1].payload_off,  # its first
        2: recs[2].tokens_off + 8,  # token ids
        3: recs[3].fp_off + 2,  # fingerprint
        4: recs[4].offset + 8,  # header: generation
        5: recs[5].offset + 60,  # header: token count
    }
    for pos in damaged.values():
        _flip(sup.arena, pos)
    # every slot naming record 6 caught mid-write (odd seqlock word): nothing names it
    for i, s in slots.items():
        if s is not None and s.rec_offset == recs[6].offset:
            off = g.index_offset + i * A.SLOT_SIZE
            with open(sup.arena, "r+b") as f:
                f.seek(off)
                (seq,) = struct.unpack("<I", f.read(4))
                f.seek(off)
                f.write(struct.pack("<I", seq | 1))
    new = restart(make_supervisor, sup, "--size", "32M")
    with new.client() as c:
        st = c.stats()
        assert st["entries"] == 12 - len(damaged) - 1, st
        assert st["adopt_dropped"] == len(damaged), st
        for seed in range(12):
            want = None if seed in damaged or seed == 6 else known(seed)[2]
            assert read_back(c, seed) == want, seed
    assert check_records(new.arena) == (12 - len(damaged) - 1, [])
    assert "caught mid-write" in new.log()


def test_a_torn_slot_inside_a_probe_run_is_taken_out_of_it(make_supervisor) -> None:
    """A slot caught mid-write in the middle of a probe run (a later slot of the run was
    displaced past it): adoption removes it from the run before it answers, so every
    digest past it is found again, during the adoption and after it (a reader takes a
    torn slot for an empty one, which ends the run: left there, the records named past
    it are misses for good, since the index is rebuilt in place)."""
    args = ("--size", "32M", "--index-slots", "256")
    sup = make_supervisor(*args)
    with sup.client() as c:
        for seed in range(40):
            put_known(c, seed, 20_000)
        g = c.view.geometry
        slots = {i: c.view.read_slot(i)[1] for i in range(g.index_slots)}
        n = g.index_slots
    run = [
        i
        for i, sl in slots.items()
        if sl is not None
        and (nxt := slots[(i + 1) % n]) is not None
        and A.slot_home(nxt.digest, n) != (i + 1) % n
    ]
    assert run, "no probe run with a displaced slot"
    torn = slots[run[0]]
    assert torn is not None
    kill9(sup)
    off = g.index_offset + run[0] * A.SLOT_SIZE
    with open(sup.arena, "r+b") as f:
        f.seek(off)
        (seq,) = struct.unpack("<I", f.read(4))
        f.seek(off)
        f.write(struct.pack("<I", seq | 1))
    behind = [sl.digest for sl in slots.values() if sl is not None and sl != torn]
    new = restart(make_supervisor, sup, *args, "--adopt-wait", "0")
    with new.client() as c:
        missing = [d for d in behind if c.view.probe(d) is None]  # (during the adoption)
        assert not missing, f"{len(missing)} digest(s) lost behind the torn slot"
        wait_until(lambda: c.stats()["adopting"] == 0, 30, "the adoption")
        assert [d for d in behind if c.view.probe(d) is None] == []
        lost = {seed for seed in range(40) if read_back(c, seed, 20_000) is None}
        st = c.stats()
    assert len(lost) <= 1 and st["entries"] >= 39, (lost, st)  # (only the torn slot's)
    assert "caught mid-write" in new.log()


def test_a_record_with_a_hole_is_dropped_and_the_rest_adopted(make_supervisor) -> None:
    """A slot of a damaged arena may name pages that no longer exist; adoption reads no
    hole (a fault there allocates it, or SIGBUSes on a full tmpfs): such a record is
    dropped, whether the hole is inside its payload or is its last page."""
    sup = make_supervisor("--size", "32M")
    with sup.client() as c:
        for seed in range(10):
            put_known(c, seed, max_size=200_000)
        recs = _records(c, range(10), 200_000)
    kill9(sup)
    page = mmap.PAGESIZE
    mid = recs[3].payload_off + recs[3].payload_len // 2
    *_, extent = A.record_layout(recs[7].n_tokens, recs[7].fp_len, recs[7].body_len)
    holes = {3: mid - mid % page, 7: recs[7].offset + extent - page}
    fd = os.open(sup.arena, os.O_RDWR)
    try:
        for off in holes.values():
            punch_hole(fd, off, page)
    finally:
        os.close(fd)
    new = restart(make_supervisor, sup, "--size", "32M")
    with new.client() as c:
        st = c.stats()
        assert (st["entries"], st["adopt_dropped"]) == (10 - len(holes), len(holes)), st
        for seed in range(10):
            assert read_back(c, seed, 200_000) == (
                None if seed in holes else known(seed, 200_000)[2]
            )


def test_adoption_walks_the_pages_once_not_once_per_record(make_supervisor, tmp_path) -> None:
    """Looking for holes costs the arena's pages once: lseek(SEEK_HOLE) from a record's
    offset walks every page up to the next hole, so asking once per record grew with
    records times arena size (317 s to adopt 100,000 records of 8 GiB, 6.1 s now).
    Counted under strace: the SEEK_DATA/SEEK_HOLE calls follow the runs of pages, not
    the records (here one run: 300 records put back to back)."""
    strace = shutil.which("strace")
    if strace is None:
        pytest.skip("needs strace (.ci/run installs it)")
    sup = make_supervisor("--size", "64M")
    with sup.client() as c:
        for seed in range(300):
            put_known(c, seed, max_size=20_000)
    kill9(sup)
    trace = tmp_path / "adopt.trace"
    python = [strace, "-f", "-qq", "-e", "trace=lseek", "-o", str(trace), sys.executable]
    # (--adopt-wait 60: the whole adoption before the first answer, however slow the
    # traced process runs; what is counted is the walk, not when answers begin)
    new = make_supervisor(
        "--size", "64M", "--adopt-wait", "60", name=sup.name, wait=False, python=python
    )
    wait_until(lambda: "supervising" in new.log(), 60, "the traced supervisor")
    assert "adopted 300 entries" in new.log()
    with new.client(attach=False, populate=False) as c:
        os.kill(c.stats()["pid"], signal.SIGTERM)  # (strace would not pass a SIGTERM on)
    assert new.proc.wait(30) == 0
    seeks = [ln for ln in trace.read_text().splitlines() if "SEEK_HOLE" in ln or "SEEK_DATA" in ln]
    assert 0 < len(seeks) <= 8, seeks[:20]


def _rewrite_record(path: Path, rec: A.Record, seed: int, gen: int, created: float) -> None:
    """Rewrite record ``rec`` (of ``seed``'s blob) with another generation and creation
    time, consistently: its header with a valid metadata checksum, and every index slot
    that names it, as a writer of the file (the supervisor's uid) could."""
    _, tokens, _ = known(seed)
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
        g = A.Geometry.unpack(mm, len(mm))
        A.ArenaWriter(mm, g).write_record(
            rec.offset,
            gen,
            rec.key,
            rec.root,
            rec.n_chunks,
            FP,
            tokens.tobytes(),
            rec.payload_len,
            rec.payload_xxh3,
            created,
            rec.publisher,
        )
        for i in range(g.index_slots):
            off = g.index_offset + i * A.SLOT_SIZE
            used, roff, rgen = struct.unpack_from("<4xI16xQQ", mm, off)
            if used and (roff, rgen) == (rec.offset, rec.gen):
                struct.pack_into("<Q", mm, off + 32, gen)  # (the slot's record generation)


def test_out_of_range_generation_or_time_is_not_adopted(make_supervisor) -> None:
    """An adopted generation of 2**64-1 made every later put fail (struct.error, "internal
    supervisor error"): adoption must drop a record whose numbers cannot be used again."""
    sup = make_supervisor("--size", "32M")
    recs: dict[int, A.Record] = {}
    with sup.client() as c:
        for seed in range(6):
            put_known(c, seed)
            recs[seed] = c.view.read_record(*_where(c, *known(seed)[:2]))
    kill9(sup)
    crafted = {
        0: ((1 << 64) - 1, recs[0].created),  # the largest u64
        1: (1 << 63, recs[1].created),  # past what a supervisor can count up from
        2: (recs[2].gen, float("nan")),
        3: (recs[3].gen, float("inf")),
    }
    for seed, (gen, created) in crafted.items():
        _rewrite_record(sup.arena, recs[seed], seed, gen, created)
    new = restart(make_supervisor, sup, "--size", "32M")
    with new.client() as c:
        st = c.stats()
        assert (st["entries"], st["adopt_dropped"]) == (2, len(crafted)), st
        for seed in range(6):
            assert read_back(c, seed) == (None if seed in crafted else known(seed)[2]), seed
        for seed in range(10, 13):  # later puts work, and their generations count on
            put_known(c, seed)
            assert read_back(c, seed) == known(seed)[2], seed
        assert c.stats()["puts"] >= 3
    assert check_records(new.arena) == (5, [])


# ------------------------------------------------------------------- refusals
def test_another_format_version_is_refused_never_adopted(make_supervisor, tmp_path) -> None:
    sup = make_supervisor("--size", "16M")
    with sup.client() as c:
        put_known(c, 1)
    kill9(sup)
    _flip(sup.arena, 8, 1)  # the format version (magic is bytes 0-7)
    before = sup.arena.read_bytes()
    refused = make_supervisor("--size", "16M", name=sup.name, wait=False)
    assert refused.proc.wait(30) == 9
    line = assert_one_error_line(_as_result(refused), "format", "--fresh", "shmkv clear")
    assert str(sup.arena) in line
    assert sup.arena.read_bytes() == before  # neither adopted nor removed
    fresh = restart(make_supervisor, sup, "--size", "16M", "--fresh")
    with fresh.client() as c:
        assert c.stats()["entries"] == 0


def test_a_file_others_could_write_is_refused(make_supervisor, tmp_path) -> None:
    sup = make_supervisor("--size", "16M")
    with sup.client() as c:
        put_known(c, 1)
    kill9(sup)
    os.chmod(sup.arena, 0o660)
    refused = make_supervisor("--size", "16M", name=sup.name, wait=False)
    assert refused.proc.wait(30) == 8
    assert_one_error_line(_as_result(refused), "0660", "--fresh", "shmkv clear")
    assert sup.arena.exists()
    os.chmod(sup.arena, 0o600)
    again = restart(make_supervisor, sup, "--size", "16M")
    with again.client() as c:
        assert c.stats()["entries"] == 1


def test_another_owners_file_is_refused(make_supervisor, tmp_path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to give the file away")
    sup = make_supervisor("--size", "16M")
    kill9(sup)
    os.chown(sup.arena, 65534, -1)
    try:
        refused = make_supervisor("--size", "16M", name=sup.name, wait=False)
        assert refused.proc.wait(30) == 8
        assert_one_error_line(_as_result(refused), "owned by uid 65534")
    finally:
        sup.arena.unlink()


class _Res:
    def __init__(self, sup: Sup) -> None:
        self.returncode = sup.proc.returncode
        self.stdout = ""
        self.stderr = sup.log()


def _as_result(sup: Sup) -> _Res:
    """A stopped supervisor's exit code and output, as assert_one_error_line takes them."""
    return _Res(sup)


# ---------------------------------------------------------------- shmkv clear
def test_clear_removes_a_stopped_supervisors_arena(make_supervisor) -> None:
    sup = make_supervisor("--size", "16M")
    with sup.client() as c:
        put_known(c, 1)
    res = sup.cli("clear")  # a running supervisor: its entries go, as always
    assert "removed 1 entries" in res.stdout
    with sup.client() as c:
        put_known(c, 2)
    kill9(sup)
    res = sup.cli("clear")
    assert res.returncode == 0 and str(sup.arena) in res.stdout, res
    assert not sup.arena.exists() and not Path(str(sup.arena) + ".lock").exists()
    new = restart(make_supervisor, sup, "--size", "16M")
    with new.client() as c:
        assert c.stats()["entries"] == 0
    # a supervisor that holds the name but does not answer: refused, nothing removed
    os.kill(new.proc.pid, signal.SIGSTOP)
    try:
        res = new.cli("clear", "--timeout", "1", check=False)
    finally:
        os.kill(new.proc.pid, signal.SIGCONT)
    assert_one_error_line(res, f"pid {new.proc.pid}", "stop it")
    assert res.returncode == 3 and new.arena.exists()


# ------------------------------------------------------- old readers, new arena
def test_old_lease_and_old_generations_never_read_a_reused_extent(make_supervisor) -> None:
    """A worker leased a record of the killed supervisor and is still reading it when the
    adopted arena reuses its space: its lease is void (the read is discarded), and
    records stored from now on never reuse an old generation, so no (offset, gen) a
    worker saw before the restart names a new record."""
    args = ("--size", "8M", "--put-slice", "0.001")
    sup = make_supervisor(*args)
    reader = sup.client(timeout=2.0)
    try:
        for seed in range(3):
            put_known(reader, seed, 2_000_000)
        root, tokens, data = known(0, 2_000_000)
        hit = reader.lookup(chain_digests(root, tokens, CHUNK))
        lease = reader.acquire(hit)
        old_gens = {s.rec_gen for s in reader.view.scan()}
        r2, t2, _ = known(2, 2_000_000)
        last = reader.view.read_record(*_where(reader, r2, t2))
        assert last.gen == max(old_gens)
        kill9(sup)
        # the newest record is damaged, so dropped: its generation was the highest
        _flip(sup.arena, last.payload_off + 100)
        new = restart(make_supervisor, sup, *args)
        with new.client() as c:
            assert c.stats()["adopted"] == 2
            for seed in range(10, 30):  # evicts record 0 and reuses its space
                put_known(c, seed, 2_000_000)
                if c.stats()["evictions"] >= 2:
                    break
            assert read_back(c, 0, 2_000_000) is None
            new_gens = [
                c.view.read_record(s.rec_offset, s.rec_gen).gen
                for s in c.view.scan()
                if c.view.tokens(c.view.read_record(s.rec_offset, s.rec_gen))[0] >= 10
            ]
            assert new_gens and min(new_gens) > max(old_gens)
        assert bytes(lease.payload) != data  # its extent now holds another record
        assert lease.finish() is False  # ... and the reader learns its read is void
        with pytest.raises(NotFound):  # the old (offset, gen) names nothing now
            wait_until(lambda: try_stats(reader), 15, "the reader to reconnect")
            reader.acquire(hit)
    finally:
        reader.close()


# ----------------------------------------------------------------- with llama
def test_llama_restores_after_kill9_and_restart_equal_to_cold(make_supervisor, models) -> None:
    """Prompts cached before a kill -9 are restored by a new worker after the restart, with
    no prefill of the cached part, and give a cold run's greedy tokens."""
    prompts = [SYSTEM + f" Question {i}: which cat sits on which mat?" for i in range(3)]
    jobs = [completion(p, max_tokens=12) for p in prompts]
    cold = run_worker(None, models["seed0"], jobs, mode="cold")
    sup = make_supervisor("--size", "64M")
    first = run_worker(sup, models["seed0"], jobs)
    assert texts(first) == texts(cold)
    kill9(sup)
    new = restart(make_supervisor, sup, "--size", "64M")
    again = run_worker(new, models["seed0"], jobs)
    assert texts(again) == texts(cold)
    for r in again["results"]:
        last = r["last"]
        assert last["hit"] and last["tokens_evaluated"] <= 1, last
        assert last["tokens_restored"] >= last["prompt_tokens"] - 1, last
    assert new.stats_json()["adopted"] >= 3
