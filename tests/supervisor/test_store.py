"""The supervisor's Store (allocator, index, LRU, pins, leases) over a real /dev/shm mapping.

A Hypothesis state machine drives one :class:`shmkv.supervisor.store.Store` through puts,
leases, pins, removals and a fake clock, and after every step checks it against
a read-only :class:`shmkv.core.arena.ArenaView` of the same file, as a worker sees it.
"""

from __future__ import annotations

import logging
import math
import os
import struct
from dataclasses import dataclass

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from shmkv.core import arena as A
from shmkv.core.errors import (
    ArenaCorruptError,
    ArenaFullError,
    BadRequest,
    ChecksumMismatch,
    LimitExceeded,
    NotFound,
)
from shmkv.core.keys import chain_digests
from shmkv.supervisor.allocator import Allocator
from shmkv.supervisor.put import PutJob
from shmkv.supervisor.store import Store
from shmkv.supervisor.tiers.base import RecordMeta
from tests.support.arenas import ArenaFile
from tests.support.blobs import payload_for

log = logging.getLogger(__name__)

PAGE = A.PAGE


# ----------------------------------------------------------------------------- helpers
def filler(data: bytes):
    def fill(view: memoryview) -> None:
        view[:] = data

    return fill


def put_bytes(
    store: Store,
    root: bytes,
    tokens: np.ndarray,
    data: bytes,
    fp: bytes = b"fp",
    pin: bool = False,
    checksum: int | None = None,
    publisher: int | None = None,
):
    csum = xxhash.xxh3_64_intdigest(data) if checksum is None else checksum
    return store.put(root, tokens, fp, len(data), csum, filler(data), pin=pin, publisher=publisher)


def reader(data: bytes):
    """A ``Store.begin_put`` reader of ``data``."""

    def read(view: memoryview, pos: int) -> None:
        view[:] = data[pos : pos + len(view)]

    return read


# ------------------------------------------------------------------- state machine
CHUNK = 4
#: the supervisor's uid (what Store.put records by default) and another publisher's
OURS = os.geteuid()
THEIRS = (OURS + 1) & 0xFFFFFFFF
DATA_PAGES = 48
INDEX_SLOTS = 64  # index capacity 32 digests: the index fills up too, not just bytes
ROOTS = [bytes([r]) * A.DIGEST_SIZE for r in range(2)]
# Few base sequences, so prompts share prefixes (and digests) across entries.
BASES = [np.arange(b * 1000, b * 1000 + 24, dtype="<i4") for b in range(3)]
OWNERS = [101, 102, 103]
LEASE_TIMEOUT = 10.0


@dataclass
class Held:
    """A lease the test holds: what it was granted on, and when."""

    lid: int
    owner: int
    gen: int
    granted: float
    payload: bytes


@dataclass
class Known:
    """What the test put: the key material and the bytes it must read back."""

    root: bytes
    tokens: np.ndarray
    payload: bytes
    digests: list[bytes]
    offset: int
    publisher: int


@dataclass
class Pending:
    """A put the test started with ``begin_put`` and steps a slice at a time."""

    job: PutJob
    root: bytes
    tokens: np.ndarray
    payload: bytes
    corrupt: bool
    pin: bool
    publisher: int


class StoreMachine(RuleBasedStateMachine):
    """Random operations on a Store; every step re-checks it through a reader's view.

    Puts also run in slices (``begin_put``, then a step at a time, other operations
    in between), as the supervisor runs a put that needs more than one turn.
    """

    def __init__(self) -> None:
        super().__init__()
        self.af: ArenaFile | None = None

    @initialize()
    def setup(self) -> None:
        self.af = ArenaFile(DATA_PAGES, CHUNK, INDEX_SLOTS, lease_timeout=LEASE_TIMEOUT)
        self.store = self.af.store
        self.view = self.af.view
        self.known: dict[int, Known] = {}  # gen -> what was put (live or not)
        self.pinned: set[int] = set()  # gens the test pinned and did not unpin/remove
        self.held: dict[int, Held] = {}  # lease id -> lease
        self.jobs: list[Pending] = []  # sliced puts under way
        self.evicted = 0

    def teardown(self) -> None:
        if self.af is not None:
            self.af.close()

    # ---------------------------------------------------------------- helpers
    def live(self) -> list[int]:
        return sorted(e.gen for e in self.store.live_entries())

    def pick_live(self, i: int):
        live = self.live()
        return self.store.entries[live[i % len(live)]] if live else None

    def protected(self) -> set[int]:
        """Gens that must survive eviction: pinned, or under a lease not revoked."""
        out = set(self.pinned)
        for h in self.held.values():
            if not self.store.leases[h.lid].revoked:
                out.add(h.gen)
        return out

    # ------------------------------------------------------------------ rules
    @rule(
        root=st.sampled_from(range(len(ROOTS))),
        base=st.sampled_from(range(len(BASES))),
        n_tokens=st.integers(CHUNK, 24),
        size=st.integers(1, 6 * PAGE),
        pin=st.sampled_from([False] * 5 + [True]),
    )
    def put_small(self, root: int, base: int, n_tokens: int, size: int, pin: bool) -> None:
        self.do_put(root, base, n_tokens, size, pin, False)

    @rule(
        root=st.sampled_from(range(len(ROOTS))),
        base=st.sampled_from(range(len(BASES))),
        n_tokens=st.integers(CHUNK, 24),
        size=st.one_of(
            st.integers(1, 12 * PAGE),
            st.integers(20 * PAGE, (DATA_PAGES - 1) * PAGE),
            st.integers(DATA_PAGES * PAGE - 200, DATA_PAGES * PAGE + 5000),
        ),
        pin=st.sampled_from([False] * 3 + [True]),
        corrupt=st.sampled_from([False] * 5 + [True]),
        theirs=st.sampled_from([False] * 3 + [True]),
    )
    def put_any(
        self,
        root: int,
        base: int,
        n_tokens: int,
        size: int,
        pin: bool,
        corrupt: bool,
        theirs: bool,
    ) -> None:
        self.do_put(root, base, n_tokens, size, pin, corrupt, THEIRS if theirs else OURS)

    @rule(root=st.sampled_from(range(len(ROOTS))), base=st.sampled_from(range(len(BASES))))
    def put_whole_region(self, root: int, base: int) -> None:
        """A blob whose extent is the whole data region: everything must go, or be revoked."""
        n_tokens = 8
        _, _, pay_off, _ = A.record_layout(n_tokens, 2, 1)
        self.do_put(root, base, n_tokens, self.af.geometry.data_size - pay_off, False, False)

    def do_put(
        self,
        root: int,
        base: int,
        n_tokens: int,
        size: int,
        pin: bool,
        corrupt: bool,
        publisher: int = OURS,
    ) -> None:
        """A put that fits, needs evictions, can never fit, or carries a bad checksum."""
        tokens = BASES[base][:n_tokens].copy()
        r = ROOTS[root]
        data = payload_for(r, tokens, size)
        *_, extent = A.record_layout(n_tokens, 2, size)
        before = set(self.live())
        pinned = set(self.pinned)
        evictions = self.store.counters.evictions
        checksum = (xxhash.xxh3_64_intdigest(data) ^ 1) if corrupt else None
        dup = self.find_dup(r, tokens, publisher)
        over_cap = self.pin_over_cap(dup, extent) if pin else False
        try:
            e = put_bytes(
                self.store, r, tokens, data, pin=pin, checksum=checksum, publisher=publisher
            )
        except LimitExceeded as err:
            assert over_cap and "--max-pinned-percent" in str(err)
            e = None
        except ArenaFullError as err:
            assert dup is None
            if extent > self.af.geometry.data_size:
                assert "--size" in str(err)
            else:
                # refused only when every unpinned survivor is under a live lease
                for g in self.live():
                    ent = self.store.entries[g]
                    assert ent.pinned or ent.leases > 0, (g, ent)
            e = None
        except ChecksumMismatch:
            assert corrupt and dup is None
            e = None
        else:
            assert not over_cap
            assert not corrupt or dup is not None
            if dup is not None:
                assert e.gen == dup  # same key: the stored blob is kept, not replaced
            else:
                assert e.gen not in self.known
                self.known[e.gen] = Known(
                    r, tokens, data, chain_digests(r, tokens, CHUNK), e.offset, publisher
                )
            assert e.publisher == publisher
            if pin:
                self.pinned.add(e.gen)
        after = set(self.live())
        gone = before - after
        # leases revoked during this put no longer protect (their holders learn it at release)
        protected = pinned | self.protected()
        assert not gone & protected, f"evicted protected entries {gone & protected}"
        assert self.store.counters.evictions - evictions == len(gone)
        self.evicted += len(gone)
        if e is not None:
            assert e.gen in after

    def find_dup(self, r: bytes, tokens: np.ndarray, publisher: int) -> int | None:
        """The live entry of the same key and publisher, if any (another publisher's copy
        is no duplicate)."""
        return next(
            (
                g
                for g in self.live()
                if self.known[g].root == r
                and self.known[g].publisher == publisher
                and np.array_equal(self.known[g].tokens, tokens)
            ),
            None,
        )

    def pin_over_cap(self, dup: int | None, extent: int) -> bool:
        """Whether pinning ``dup`` (or a new entry of ``extent`` bytes) passes max_pinned."""
        store = self.store
        if dup is not None:
            e = store.entries[dup]
            return not e.pinned and store.pinned_bytes + e.extent > store.max_pinned
        never_fits = extent > self.af.geometry.data_size
        return not never_fits and store.pinned_bytes + extent > store.max_pinned

    @rule(
        root=st.sampled_from(range(len(ROOTS))),
        base=st.sampled_from(range(len(BASES))),
        n_tokens=st.integers(CHUNK, 24),
        size=st.one_of(
            st.integers(1, 3 * PAGE),
            st.integers(3 * PAGE, 12 * PAGE),
            st.integers(20 * PAGE, (DATA_PAGES - 1) * PAGE),
        ),
        pin=st.sampled_from([False] * 3 + [True]),
        corrupt=st.sampled_from([False] * 5 + [True]),
        theirs=st.sampled_from([False] * 3 + [True]),
    )
    def begin_sliced_put(
        self,
        root: int,
        base: int,
        n_tokens: int,
        size: int,
        pin: bool,
        corrupt: bool,
        theirs: bool,
    ) -> None:
        """Start a put that copies a page per step; it goes on in ``step_put``."""
        if len(self.jobs) >= 2:
            return
        tokens = BASES[base][:n_tokens].copy()
        r = ROOTS[root]
        data = payload_for(r, tokens, size)
        *_, extent = A.record_layout(n_tokens, 2, size)
        checksum = xxhash.xxh3_64_intdigest(data) ^ (1 if corrupt else 0)
        publisher = THEIRS if theirs else OURS
        dup = self.find_dup(r, tokens, publisher)
        over_cap = self.pin_over_cap(dup, extent) if pin else False
        try:
            job = self.store.begin_put(
                r,
                tokens,
                b"fp",
                size,
                checksum,
                reader(data),
                pin=pin,
                piece=PAGE,
                publisher=publisher,
            )
        except LimitExceeded:
            assert over_cap
            return
        assert not over_cap
        if dup is not None:
            assert job.done and job.entry is not None and job.entry.gen == dup
            if pin:
                self.pinned.add(dup)
            return
        self.jobs.append(Pending(job, r, tokens, data, corrupt, pin, publisher))

    @precondition(lambda self: self.jobs)
    @rule(
        i=st.integers(0, 1000),
        steps=st.integers(1, 16),
        abort=st.sampled_from([False] * 9 + [True]),
    )
    def step_put(self, i: int, steps: int, abort: bool) -> None:
        """A few slices (each one eviction or one page copied) of a sliced put, or its
        abort."""
        p = self.jobs[i % len(self.jobs)]
        if abort:
            self.jobs.remove(p)
            p.job.abort()
            assert p.job.offset is None
            return
        before = set(self.live())
        pinned = set(self.pinned)
        evictions = self.store.counters.evictions
        dup = self.find_dup(p.root, p.tokens, p.publisher)
        try:
            for _ in range(steps):
                e = p.job.step(0.0)  # a deadline already past: the least possible work
                if e is not None:
                    break
        except ArenaFullError:
            self.jobs.remove(p)
            for g in self.live():
                ent = self.store.entries[g]
                assert ent.pinned or ent.leases > 0, (g, ent)
            e = None
        except ChecksumMismatch:
            self.jobs.remove(p)
            assert p.corrupt
            e = None
        except LimitExceeded:  # others pinned meanwhile
            self.jobs.remove(p)
            assert p.pin
            e = None
        else:
            if e is not None:
                self.jobs.remove(p)
                assert not p.corrupt or dup is not None
                if dup is not None:  # the same key was put meanwhile: that one is kept
                    assert e.gen == dup
                else:
                    assert e.gen not in self.known
                    self.known[e.gen] = Known(
                        p.root,
                        p.tokens,
                        p.payload,
                        chain_digests(p.root, p.tokens, CHUNK),
                        e.offset,
                        p.publisher,
                    )
                assert e.publisher == p.publisher
                if p.pin:
                    self.pinned.add(e.gen)
        if p not in self.jobs:
            assert p.job.offset is None  # a finished put holds no space of its own
        gone = before - set(self.live())
        # leases revoked during this step no longer protect (as in do_put)
        protected = pinned | self.protected()
        assert not gone & protected, f"evicted protected entries {gone & protected}"
        assert self.store.counters.evictions - evictions == len(gone)
        self.evicted += len(gone)

    @rule(owner=st.sampled_from(OWNERS), i=st.integers(0, 1000))
    def acquire(self, owner: int, i: int) -> None:
        e = self.pick_live(i)
        if e is None:
            return
        lid = self.store.acquire(e.offset, e.gen, owner)
        assert lid not in self.held
        self.held[lid] = Held(lid, owner, e.gen, self.af.now, self.known[e.gen].payload)

    @rule(owner=st.sampled_from(OWNERS), i=st.integers(0, 1000))
    def acquire_stale(self, owner: int, i: int) -> None:
        """A removed generation, or a live one at the wrong offset: NotFound, no lease."""
        leases = dict(self.store.leases)
        dead = sorted(set(self.known) - set(self.live()))
        if dead:
            g = dead[i % len(dead)]
            with pytest.raises(NotFound):
                self.store.acquire(self.known[g].offset, g, owner)
        e = self.pick_live(i)
        if e is not None:
            with pytest.raises(NotFound):
                self.store.acquire(e.offset + PAGE, e.gen, owner)
        assert self.store.leases == leases

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 1000))
    def release(self, i: int) -> None:
        lid = sorted(self.held)[i % len(self.held)]
        h = self.held.pop(lid)
        other = next(o for o in OWNERS if o != h.owner)
        with pytest.raises(NotFound):  # only its holder can release a lease
            self.store.release(lid, other)
        revoked = self.store.leases[lid].revoked
        if not revoked:  # the bytes read under a live lease are the ones put
            e = self.store.entries[h.gen]
            assert self.read_payload(e) == h.payload
        assert self.store.release(lid, h.owner) is (not revoked)
        with pytest.raises(NotFound):
            self.store.release(lid, h.owner)

    @rule(owner=st.sampled_from(OWNERS))
    def release_owner(self, owner: int) -> None:
        mine = [lid for lid, h in self.held.items() if h.owner == owner]
        assert self.store.release_owner(owner) == len(mine)
        for lid in mine:
            del self.held[lid]
        assert not any(ls.owner == owner for ls in self.store.leases.values())

    @rule(i=st.integers(0, 1000), pinned=st.booleans())
    def pin(self, i: int, pinned: bool) -> None:
        e = self.pick_live(i)
        if e is None:
            return
        over_cap = pinned and self.pin_over_cap(e.gen, e.extent)
        try:
            self.store.set_pinned(e, pinned)
        except LimitExceeded as err:
            assert over_cap and "--max-pinned-percent" in str(err)
            assert not e.pinned
            return
        assert not over_cap
        assert e.pinned is pinned
        assert (e.gen in self.store.lru) is (not pinned and e.leases == 0)
        (self.pinned.add if pinned else self.pinned.discard)(e.gen)

    @rule(i=st.integers(0, 1000))
    def remove(self, i: int) -> None:
        e = self.pick_live(i)
        if e is None:
            return
        self.store.remove(e)
        self.pinned.discard(e.gen)
        assert e.gen not in self.live()
        # freed now, or at its last release
        leased = any(
            h.gen == e.gen and not self.store.leases[h.lid].revoked for h in self.held.values()
        )
        assert (e.gen in self.store.entries) is leased

    @rule()
    def clear(self) -> None:
        n = len(self.live())
        assert self.store.clear() == n
        assert self.live() == []
        self.pinned.clear()

    @rule(dt=st.sampled_from([2.0, LEASE_TIMEOUT + 1]))
    def tick(self, dt: float) -> None:
        self.af.now += dt

    # ------------------------------------------------------------- invariants
    def read_payload(self, e) -> bytes:
        *_, pay_off, _ = A.record_layout(e.n_tokens, 2, e.payload_len)
        start = e.offset + pay_off
        return bytes(self.af.mm[start : start + e.payload_len])

    @invariant()
    def extents_tile_the_data_region(self) -> None:
        if self.af is None:
            return
        g = self.af.geometry
        free = self.store.alloc.extents()
        used = [(e.offset, e.extent) for e in self.store.entries.values()]
        used += [(p.job.offset, p.job.extent) for p in self.jobs if p.job.offset is not None]
        assert sum(n for _, n in free) == self.store.alloc.free_bytes
        assert self.store.alloc.free_bytes + sum(n for _, n in used) == g.data_size
        spans = sorted([(o, n, "free") for o, n in free] + [(o, n, "used") for o, n in used])
        pos = g.data_offset
        for off, n, _kind in spans:
            assert off == pos, f"gap or overlap at {off} (expected {pos}): {spans}"
            assert n > 0 and n % PAGE == 0
            pos = off + n
        assert pos == g.data_offset + g.data_size
        for (o1, n1), (o2, _) in zip(free, free[1:], strict=False):
            assert o1 + n1 < o2, "adjacent free extents were not coalesced"
        alloc = self.store.alloc
        assert alloc.count() == len(free)
        assert alloc.largest() == max((n for _, n in free), default=0)

    @invariant()
    def pinned_and_leased_entries_survive(self) -> None:
        if self.af is None:
            return
        live = set(self.live())
        assert self.pinned <= live, f"pinned entries gone: {self.pinned - live}"
        for gen in self.pinned:
            assert self.store.entries[gen].pinned and gen not in self.store.lru
        for h in self.held.values():
            ls = self.store.leases[h.lid]
            if ls.revoked:
                # revocation is per lease: only a lease held past the timeout (its holder
                # learns it at release, which the release rule checks)
                assert self.af.now - h.granted > LEASE_TIMEOUT
            else:
                e = self.store.entries.get(h.gen)
                assert e is not None, f"leased entry {h.gen} was freed"
                assert self.read_payload(e) == h.payload
        counts: dict[int, int] = {}
        for ls in self.store.leases.values():
            if not ls.revoked:
                counts[ls.gen] = counts.get(ls.gen, 0) + 1
        for e in self.store.entries.values():
            assert e.leases == counts.get(e.gen, 0)
            if e.doomed:
                assert e.leases > 0, "a doomed entry without leases was not freed"
        # the LRU holds exactly the evictable entries: live, unpinned, unleased
        entries = self.store.entries
        assert set(self.store.lru) == {
            g for g in live if not entries[g].pinned and entries[g].leases == 0
        }
        pinned_bytes = sum(entries[g].extent for g in live if entries[g].pinned)
        assert self.store.pinned_bytes == pinned_bytes <= self.store.max_pinned

    @invariant()
    def index_matches_live_entries(self) -> None:
        if self.af is None:
            return
        view, store = self.view, self.store
        live = [store.entries[g] for g in self.live()]
        want: dict[bytes, int] = {}  # digest -> chunk count
        for e in live:
            k = self.known[e.gen]
            assert e.digests == k.digests
            for n, d in enumerate(k.digests, 1):
                want[d] = n
        # every live digest, and nothing else, is in the index
        slots = view.scan()
        assert sorted(s.digest for s in slots) == sorted(want)
        assert len(store.owners) == len(want) <= store.index_capacity
        for s in slots:
            assert s.n_chunks == want[s.digest]
            owner = store.entries.get(s.rec_gen)
            assert owner is not None and not owner.doomed and owner.offset == s.rec_offset
            assert s.digest in owner.digests
            # the slot points at the longest live record ending within the next chunk,
            # else at the shortest (the oldest among equals), the supervisor's uid's
            # records first in either case, found by a scan here
            n_of = {e.gen: e.n_tokens for e in live if s.digest in e.digests}
            ours = {e.gen for e in live if e.gen in n_of and e.publisher == store.uid}
            ending = [g for g, n in n_of.items() if n < (s.n_chunks + 1) * CHUNK]
            if ending:
                best = max(ending, key=lambda g: (g in ours, n_of[g], -g))
            else:
                best = min(n_of, key=lambda g: (g not in ours, n_of[g], g))
            assert s.rec_gen == best, (s, n_of, ours)
        # a reader finds every live entry's full prefix and a record that validates
        for e in live:
            k = self.known[e.gen]
            found = view.find_longest(k.digests)
            assert found is not None and found[0] == len(k.digests)
            for n, d in enumerate(k.digests, 1):
                slot = view.probe(d)
                assert slot is not None and slot.n_chunks == n
                rec = view.read_record(slot.rec_offset, slot.rec_gen)
                view.verify_meta(rec)
                assert view.verify_payload(rec)
                assert rec.root == k.root
                assert rec.n_chunks >= n
                assert np.array_equal(view.tokens(rec)[: n * CHUNK], k.tokens[: n * CHUNK])
                assert bytes(view.fingerprint(rec)) == b"fp"
            rec = view.read_record(e.offset, e.gen)
            view.verify_meta(rec)
            assert bytes(view.payload(rec)) == k.payload
            assert rec.publisher == k.publisher == e.publisher
            assert rec.key == k.digests[-1] and rec.n_tokens == len(k.tokens)
        # removed entries are not findable, and their records no longer validate
        for gen in set(self.known) - {e.gen for e in live}:
            k = self.known[gen]
            for d in k.digests:
                if d not in want:
                    assert view.probe(d) is None
            if gen not in store.entries:  # freed (a doomed entry stays valid for its reader)
                with pytest.raises(ArenaCorruptError):
                    view.read_record(k.offset, gen)


StoreMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestStoreMachine = StoreMachine.TestCase
TestStoreMachine = pytest.mark.timeout(120)(TestStoreMachine)


# ---------------------------------------------------------- allocator state machine
class ListAllocator:
    """The reference: best fit by a linear scan of extents kept in address order (the
    allocator's first version, quadratic under eviction), with the same tie rule."""

    def __init__(self, start: int, size: int) -> None:
        self.ext: list[list[int]] = [[start, size]]

    def alloc(self, n: int) -> int | None:
        fits = [e for e in self.ext if e[1] >= n]
        if not fits:
            return None
        best = min(fits, key=lambda e: (e[1], e[0]))
        off = best[0]
        best[0] += n
        best[1] -= n
        if not best[1]:
            self.ext.remove(best)
        return off

    def release(self, off: int, n: int) -> None:
        self.ext.append([off, n])
        self.ext.sort()
        merged: list[list[int]] = []
        for o, ln in self.ext:
            if merged and merged[-1][0] + merged[-1][1] == o:
                merged[-1][1] += ln
            else:
                merged.append([o, ln])
        self.ext = merged


class AllocatorMachine(RuleBasedStateMachine):
    """Allocator against ListAllocator: the same offsets, extents and largest extent."""

    def __init__(self) -> None:
        super().__init__()
        self.a = Allocator(PAGE, 64 * PAGE)
        self.ref = ListAllocator(PAGE, 64 * PAGE)
        self.used: list[tuple[int, int]] = []

    @rule(pages=st.integers(1, 24))
    def alloc(self, pages: int) -> None:
        got = self.a.alloc(pages * PAGE)
        assert got == self.ref.alloc(pages * PAGE)
        if got is not None:
            self.used.append((got, pages * PAGE))

    @precondition(lambda self: self.used)
    @rule(i=st.integers(0, 1000))
    def release(self, i: int) -> None:
        off, n = self.used.pop(i % len(self.used))
        self.a.release(off, n)
        self.ref.release(off, n)

    @precondition(lambda self: self.used)
    @rule(i=st.integers(0, 1000), span=st.sampled_from([(0, 0), (-PAGE, PAGE), (0, PAGE)]))
    def double_free(self, i: int, span: tuple[int, int]) -> None:
        """Releasing free space, or a span that overlaps it, raises and changes nothing."""
        free = self.a.extents()
        if not free:
            return
        off, n = free[i % len(free)]
        before = (free, self.a.free_bytes)
        with pytest.raises(ValueError):
            self.a.release(off + span[0], n + span[1])
        assert (self.a.extents(), self.a.free_bytes) == before

    @invariant()
    def same_as_reference(self) -> None:
        ext = self.a.extents()
        assert ext == [tuple(e) for e in self.ref.ext]
        assert self.a.count() == len(ext)
        assert self.a.largest() == max((n for _, n in ext), default=0)
        assert self.a.free_bytes == sum(n for _, n in ext)
        assert self.a.free_bytes + sum(n for _, n in self.used) == 64 * PAGE


AllocatorMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=80, deadline=None
)
TestAllocatorMachine = AllocatorMachine.TestCase


# ----------------------------------------------------------------------- unit tests
def test_allocator_coalesces_neighbours_in_any_order() -> None:
    a = Allocator(PAGE, 10 * PAGE)
    offs = [a.alloc(PAGE) for _ in range(10)]
    assert offs == [PAGE * (i + 1) for i in range(10)]
    assert a.alloc(PAGE) is None and a.free_bytes == 0 and a.largest() == 0
    for i in (1, 3, 5, 7):  # isolated holes do not merge
        a.release(offs[i], PAGE)
    assert len(a.extents()) == 4 and a.largest() == PAGE
    a.release(offs[2], PAGE)  # merges with both neighbours
    assert a.extents()[0] == (offs[1], 3 * PAGE)
    a.release(offs[4], PAGE)  # joins [1..3] and [5]
    assert a.extents() == [(offs[1], 5 * PAGE), (offs[7], PAGE)]
    for i in (0, 6, 8, 9):
        a.release(offs[i], PAGE)
    assert a.extents() == [(PAGE, 10 * PAGE)] and a.free_bytes == 10 * PAGE


def test_allocator_best_fit_reuses_the_tightest_hole() -> None:
    a = Allocator(0, 20 * PAGE)
    x = a.alloc(3 * PAGE)
    y = a.alloc(PAGE)
    z = a.alloc(PAGE)
    a.alloc(PAGE)
    a.release(x, 3 * PAGE)
    a.release(z, PAGE)
    assert a.alloc(PAGE) == z  # the 1-page hole, not the 3-page one
    assert a.alloc(2 * PAGE) == x
    assert y is not None


def test_allocator_double_free_and_out_of_heap_raise() -> None:
    a = Allocator(PAGE, 8 * PAGE)
    x = a.alloc(2 * PAGE)
    a.alloc(2 * PAGE)
    a.release(x, 2 * PAGE)
    with pytest.raises(ValueError, match="double free"):
        a.release(x, 2 * PAGE)
    with pytest.raises(ValueError, match="double free"):
        a.release(x + PAGE, PAGE)  # inside a free extent
    with pytest.raises(ValueError, match="double free"):
        a.release(x + PAGE, 2 * PAGE)  # straddles free and used
    with pytest.raises(ValueError, match="outside"):
        a.release(0, PAGE)
    with pytest.raises(ValueError, match="outside"):
        a.release(8 * PAGE, 2 * PAGE)
    with pytest.raises(ValueError, match="outside"):
        a.release(x, 0)
    assert a.free_bytes == 6 * PAGE


@pytest.fixture
def small_arena():
    af = ArenaFile(data_pages=16, chunk_tokens=4, index_slots=64)
    yield af
    af.close()


def test_blob_bigger_than_the_data_region_names_size(small_arena: ArenaFile) -> None:
    store = small_arena.store
    data = b"x" * (small_arena.geometry.data_size + 1)
    with pytest.raises(ArenaFullError, match="--size") as exc:
        put_bytes(store, ROOTS[0], BASES[0][:8].copy(), data)
    assert "can never fit" in str(exc.value)
    assert store.counters.rejected_puts == 1 and store.bytes_used() == 0


def test_full_of_pinned_entries_is_refused_and_names_the_fix(small_arena: ArenaFile) -> None:
    store = small_arena.store
    store.max_pinned = small_arena.geometry.data_size  # --max-pinned-percent 100
    for b in range(3):
        put_bytes(store, ROOTS[0], BASES[b][:8].copy(), b"p" * (4 * PAGE), pin=True)
    with pytest.raises(ArenaFullError, match="unpin") as exc:
        put_bytes(store, ROOTS[1], BASES[0][:8].copy(), b"q" * (6 * PAGE))
    assert "--size" in str(exc.value)
    assert store.counters.evictions == 0 and len(store.live_entries()) == 3


def test_stale_lease_is_revoked_and_only_it(small_arena: ArenaFile) -> None:
    af = small_arena
    store = af.store
    e = put_bytes(store, ROOTS[0], BASES[0][:8].copy(), b"a" * (10 * PAGE))
    lid = store.acquire(e.offset, e.gen, owner=7)
    with pytest.raises(ArenaFullError):  # leased and young: not evicted
        put_bytes(store, ROOTS[0], BASES[1][:8].copy(), b"b" * (10 * PAGE))
    assert e.gen in store.entries
    af.now += 31.0  # default lease_timeout in ArenaFile is 10 s
    e0 = put_bytes(store, ROOTS[1], BASES[2][:8].copy(), b"c" * 100)
    young = store.acquire(e0.offset, e0.gen, owner=8)
    e2 = put_bytes(store, ROOTS[0], BASES[1][:8].copy(), b"b" * (10 * PAGE))
    assert store.counters.revocations == 1
    assert e.gen not in store.entries and e2.gen in store.entries
    assert store.release(lid, 7) is False  # the read under it must be discarded
    assert store.release(young, 8) is True  # and nobody else's


def test_chain_digests_properties() -> None:
    root = bytes(range(16))
    toks = np.arange(50, dtype=np.int32)
    ds = chain_digests(root, toks, 8)
    assert len(ds) == 6 and all(len(d) == A.DIGEST_SIZE for d in ds)
    assert len(set(ds)) == 6
    # prefix-closed: a prefix of whole chunks has the same leading digests
    for k in range(7):
        assert chain_digests(root, toks[: k * 8], 8) == ds[:k]
    # the trailing partial chunk does not count; lists and arrays agree
    assert chain_digests(root, list(range(55)), 8) == ds
    assert chain_digests(root, toks[:7], 8) == []
    # deterministic, and each digest covers its whole prefix: a change in chunk 3
    # changes digests 3.. and nothing before
    other = toks.copy()
    other[2 * 8 + 5] += 1
    ds2 = chain_digests(root, other, 8)
    assert ds2[:2] == ds[:2] and all(a != b for a, b in zip(ds2[2:], ds[2:], strict=True))
    # the root (salt/model key) separates every digest
    ds3 = chain_digests(bytes(16), toks, 8)
    assert not set(ds3) & set(ds)
    # the chunk length matters too
    assert chain_digests(root, toks, 4)[1] != ds[0]
    # negative ids stay distinct from positive ones
    assert chain_digests(root, [-1] * 8, 8) != chain_digests(root, [1] * 8, 8)


@pytest.fixture
def header_bytes() -> tuple[bytearray, int]:
    g = A.Geometry.plan(4 << 20, 64)
    buf = bytearray(A.HEADER_SIZE)
    head = g.pack()
    buf[: len(head)] = head
    A._U64.pack_into(buf, A._HDR_CSUM_OFF, A.header_checksum(head))
    return buf, g.arena_size


def test_geometry_round_trips(header_bytes) -> None:
    buf, size = header_bytes
    g = A.Geometry.unpack(bytes(buf), size)
    assert g.arena_size == size and g.chunk_tokens == 64
    assert g.data_offset + g.data_size <= size and g.data_offset % PAGE == 0


def test_geometry_unpack_rejects_every_flipped_header_byte(header_bytes) -> None:
    buf, size = header_bytes
    for i in range(A._HDR_CSUM_OFF + 8):  # every immutable byte and the checksum itself
        bad = bytearray(buf)
        bad[i] ^= 0x5A
        with pytest.raises(ArenaCorruptError):
            A.Geometry.unpack(bytes(bad), size)


def _resign(buf: bytearray) -> bytes:
    A._U64.pack_into(buf, A._HDR_CSUM_OFF, A.header_checksum(bytes(buf[: A._HDR_CSUM_OFF])))
    return bytes(buf)


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("magic", b"NOTSHMKV", "magic"),
        ("version", A.FORMAT_VERSION + 1, "format"),
        ("index_slots", 1000, "inconsistent"),  # not a power of two
        ("data_size", 1 << 40, "inconsistent"),  # beyond the file
        ("chunk_tokens", 0, "inconsistent"),
        ("header_size", 8192, "inconsistent"),
    ],
)
def test_geometry_unpack_rejects_bad_fields_even_with_a_valid_checksum(
    header_bytes, field: str, value, match: str
) -> None:
    buf, size = header_bytes
    names = [
        "magic",
        "version",
        "header_size",
        "arena_size",
        "index_offset",
        "index_slots",
        "data_offset",
        "data_size",
        "chunk_tokens",
        "slot_size",
        "pid",
        "arena_id",
        "created",
    ]
    vals = list(A._HDR.unpack_from(buf))
    vals[names.index(field)] = value
    bad = bytearray(buf)
    A._HDR.pack_into(bad, 0, *vals)
    with pytest.raises(ArenaCorruptError, match=match):
        A.Geometry.unpack(_resign(bad), size)


def test_geometry_unpack_rejects_short_files(header_bytes) -> None:
    buf, size = header_bytes
    with pytest.raises(ArenaCorruptError):
        A.Geometry.unpack(bytes(buf), A.HEADER_SIZE - 1)
    with pytest.raises(ArenaCorruptError, match="inconsistent"):
        A.Geometry.unpack(bytes(buf), size - PAGE)  # file truncated below arena_size


def test_read_record_rejects_bad_offsets_and_generations(small_arena: ArenaFile) -> None:
    af = small_arena
    e = put_bytes(af.store, ROOTS[0], BASES[0][:8].copy(), b"z" * 100)
    view, g = af.view, af.geometry
    rec = view.read_record(e.offset, e.gen)
    view.verify_meta(rec)
    assert view.verify_payload(rec) and bytes(view.payload(rec)) == b"z" * 100
    for off in (0, g.data_offset - PAGE, e.offset + 8, g.data_offset + g.data_size):
        with pytest.raises(ArenaCorruptError):
            view.read_record(off, e.gen)
    with pytest.raises(ArenaCorruptError, match="generation"):
        view.read_record(e.offset, e.gen + 1)
    # a flipped token id is caught by the metadata checksum, a flipped payload byte too
    tok = rec.tokens_off
    old = af.mm[tok]
    af.mm[tok] = old ^ 1
    with pytest.raises(ArenaCorruptError, match="metadata"):
        view.verify_meta(rec)
    af.mm[tok] = old
    struct.pack_into("<B", af.mm, rec.payload_off, ord("y"))
    assert not view.verify_payload(rec)


def test_put_with_too_few_tokens_is_a_bad_request(small_arena: ArenaFile) -> None:
    with pytest.raises(BadRequest, match="chunk_tokens"):
        put_bytes(small_arena.store, ROOTS[0], BASES[0][:3].copy(), b"x" * 10)
    assert small_arena.store.bytes_used() == 0 and small_arena.view.scan() == []


def test_index_prefers_the_longest_record_ending_in_a_chunk_and_owners_tell_each_match(supervisor):
    """A chunk prefix points at the longest record whose last full chunk it is (a
    sliding-window model can restore only whole records), else at the shortest; the
    ``owners`` op lists the records behind a chunk prefix and how far a prompt matches each."""
    from shmkv.core.keys import chain_digests

    root, fp = b"r" * 16, b"fp"
    rng = np.random.default_rng(5)
    with supervisor.client() as c:
        view = c.ensure()
        chunk = view.geometry.chunk_tokens
        base = rng.integers(0, 30000, 3 * chunk + 40, dtype=np.int32)
        short, mid, long = base[: 3 * chunk + 5], base[: 3 * chunk + 30], base
        longer = np.concatenate([base, rng.integers(0, 30000, chunk, dtype=np.int32)])
        for toks in (longer, short, long, mid):
            c.put_bytes(root, toks, fp, bytes(64))
        digests = chain_digests(root, base, chunk)
        k, slot = view.find_longest(digests)
        assert k == 3
        # `short`, `mid` and `long` all end inside chunk 4: the longest of them
        assert view.read_record(slot.rec_offset, slot.rec_gen).n_tokens == len(long)
        # chunk 2: no record ends inside chunk 3, so the shortest owner
        slot2 = view.probe(digests[1])
        assert view.read_record(slot2.rec_offset, slot2.rec_gen).n_tokens == len(short)
        prompt = np.concatenate([base[: 3 * chunk + 20], [-1, -2]]).astype(np.int32)
        rows = c.owners(digests[2], prompt)  # all four own chunk 3; sorted by tokens matched
        assert sorted(n for _, _, n, _ in rows) == sorted(map(len, (short, mid, long, longer)))
        assert [m for *_, m in rows] == [3 * chunk + 20] * 3 + [3 * chunk + 5]
        off, gen, n, _ = rows[-1]
        assert view.read_record(off, gen).n_tokens == n == len(short)
        assert c.owners(b"\0" * 16, prompt) == []  # nothing indexed there
        for bad in ({"digest": b"x" * 15}, {"tokens": b"abc"}, {"digest": "not bytes"}):
            msg = {"op": "owners", "digest": digests[2], "tokens": prompt.tobytes(), **bad}
            with pytest.raises(BadRequest):
                c.request(msg)
    assert supervisor.proc.poll() is None


def test_a_duplicate_put_replaces_a_corrupt_copy(supervisor):
    """The same tokens put again: kept once if intact, replaced if its payload rotted."""
    root, fp = b"q" * 16, b"fp"
    toks = np.arange(200, dtype=np.int32)
    data = np.random.default_rng(2).bytes(50_000)
    with supervisor.client() as c:
        first = c.put_bytes(root, toks, fp, data)
        assert c.put_bytes(root, toks, fp, data)["gen"] == first["gen"]  # a duplicate
        view = c.ensure()
        rec = view.read_record(*next((s.rec_offset, s.rec_gen) for s in view.scan()))
        with open(supervisor.arena, "r+b") as f:  # a stray writer flips payload bytes
            f.seek(rec.payload_off + 100)
            f.write(b"\xff" * 8)
        again = c.put_bytes(root, toks, fp, data)
        assert again["gen"] != first["gen"]
        st = c.stats()
        assert st["corrupt_removed"] == 1 and st["entries"] == 1
        view = c.ensure()
        slot = next(iter(view.scan()))
        assert view.verify_payload(view.read_record(slot.rec_offset, slot.rec_gen))


def test_a_sliced_put_evicts_and_copies_a_little_per_step(small_arena: ArenaFile) -> None:
    """With its deadline past, each step of a put does one eviction or copies one piece,
    and what it did stays done."""
    store = small_arena.store
    for b in range(3):
        for n in (4, 8):
            put_bytes(store, ROOTS[b % 2], BASES[b][:n].copy(), b"s" * (PAGE + 100))
    assert len(store.live_entries()) == 6 and store.alloc.largest() < 10 * PAGE
    data = payload_for(ROOTS[1], BASES[2][:12].copy(), 10 * PAGE)
    job = store.begin_put(
        ROOTS[1],
        BASES[2][:12].copy(),
        b"fp",
        len(data),
        xxhash.xxh3_64_intdigest(data),
        reader(data),
        piece=PAGE,
    )
    evictions, copied, steps = [], [], 0
    while (e := job.step(0.0)) is None:
        steps += 1
        evictions.append(store.counters.evictions)
        copied.append(job.copied)
    # one eviction a step until it fits, then one page a step
    assert all(b - a <= 1 for a, b in zip([0, *evictions], evictions, strict=False))
    assert all(b - a <= PAGE for a, b in zip([0, *copied], copied, strict=False))
    assert steps >= 10 and store.counters.puts_sliced == 1
    assert e.payload_len == len(data) and job.offset is None
    rec = small_arena.view.read_record(e.offset, e.gen)
    assert bytes(small_arena.view.payload(rec)) == data


def test_a_sliced_put_whose_content_was_put_meanwhile_is_a_duplicate(
    small_arena: ArenaFile,
) -> None:
    store = small_arena.store
    tokens = BASES[0][:8].copy()
    data = b"x" * (4 * PAGE)
    csum = xxhash.xxh3_64_intdigest(data)
    job = store.begin_put(ROOTS[0], tokens, b"fp", len(data), csum, reader(data), piece=PAGE)
    while job.offset is None:  # staged in the supervisor's memory, a page a step
        assert job.step(0.0) is None
    assert job.body_written == PAGE  # took its space, one page in
    first = put_bytes(store, ROOTS[0], tokens, data)  # the same content, in one go
    got = job.step(math.inf)
    assert got is first and store.counters.duplicate_puts == 1 and store.counters.puts == 1
    assert job.offset is None and store.bytes_used() == first.extent  # its space is back


def test_a_sliced_put_aborted_gives_its_space_back(small_arena: ArenaFile) -> None:
    store = small_arena.store
    data = b"y" * (6 * PAGE)
    csum = xxhash.xxh3_64_intdigest(data)
    job = store.begin_put(
        ROOTS[0], BASES[1][:8].copy(), b"fp", len(data), csum, reader(data), piece=PAGE
    )
    while job.offset is None:  # staged in the supervisor's memory, a page a step
        assert job.step(0.0) is None
    assert store.bytes_used() > 0
    job.abort()
    assert store.bytes_used() == 0 and store.alloc.count() == 1


def test_puts_stage_within_the_budget_in_the_order_they_asked(small_arena: ArenaFile) -> None:
    """The puts in progress hold at most the staging budget of payload bytes (a larger one
    alone); one past it waits its turn, and a smaller one asking later waits behind it
    rather than starve it. A put done, aborted or dropped gives its share back."""
    store = small_arena.store
    store.staging.budget = 6 * PAGE

    def begin(i: int, pages: int) -> PutJob:
        tokens = BASES[i % 3][: 8 + 4 * (i // 3)].copy()
        data = payload_for(ROOTS[0], tokens, pages * PAGE)
        return store.begin_put(
            ROOTS[0],
            tokens,
            b"fp",
            len(data),
            xxhash.xxh3_64_intdigest(data),
            reader(data),
            piece=PAGE,
        )

    a, b, c = begin(0, 3), begin(1, 4), begin(2, 2)
    assert a.step(0.0) is None and a.copied == PAGE  # staging: 3 pages of 6
    assert b.step(0.0) is None and b.staged is None  # 3 + 4 > 6: in line
    assert c.step(0.0) is None and c.staged is None  # 3 + 2 fits, but b asked first
    assert store.staging.held == 3 * PAGE
    assert a.step(math.inf) is not None and store.staging.held == 0
    assert c.step(0.0) is None and c.staged is None  # still behind b
    assert b.step(0.0) is None and b.copied == PAGE
    assert c.step(0.0) is None and c.copied == PAGE  # 4 + 2 fits
    assert store.staging.held == 6 * PAGE
    c.abort()
    assert store.staging.held == 4 * PAGE
    del c
    d = begin(3, 2)
    assert d.step(0.0) is None and d.copied == PAGE
    del d  # dropped half done, by an owner that went away without aborting it
    assert store.staging.held == 4 * PAGE
    e = b.step(math.inf)
    assert e is not None and store.staging.held == 0
    assert bytes(small_arena.view.payload(small_arena.view.read_record(e.offset, e.gen)))


def test_a_tiers_record_is_checked_and_staged_where_it_is(small_arena: ArenaFile) -> None:
    """A record from a tier (fetched from Redis, refilled from disk) is in the supervisor's
    memory already: ``put_record`` checks it and stages it where it is (no second copy of
    its payload, no share of the staging budget, no place in its line: it is not held up
    behind workers' puts waiting there); a damaged one is refused and nothing is stored."""
    store = small_arena.store
    store.staging.budget = 3 * PAGE

    def meta(tokens: np.ndarray, data: bytes) -> RecordMeta:
        return RecordMeta(
            ROOTS[0], b"fp", tokens.tobytes(), store.uid, False, len(data),
            xxhash.xxh3_64_intdigest(data), 0.0,
        )  # fmt: skip

    held = payload_for(ROOTS[0], BASES[0][:8].copy(), 3 * PAGE)
    worker = store.begin_put(
        ROOTS[0], BASES[0][:8].copy(), b"fp", len(held), xxhash.xxh3_64_intdigest(held),
        reader(held), piece=PAGE,
    )  # fmt: skip
    assert worker.step(0.0) is None and store.staging.held == 3 * PAGE  # the whole budget
    waiting = store.begin_put(
        ROOTS[0], BASES[1][:8].copy(), b"fp", len(held), xxhash.xxh3_64_intdigest(held),
        reader(held), piece=PAGE,
    )  # fmt: skip
    assert waiting.step(0.0) is None and waiting.staged is None  # in line

    tokens = BASES[2][:8].copy()
    payload = bytearray(payload_for(ROOTS[0], tokens, 4 * PAGE))
    job = store.put_record(meta(tokens, bytes(payload)), payload, None)
    e = job.step(math.inf)
    assert e is not None and store.staging.held == 3 * PAGE
    assert bytes(small_arena.view.payload(small_arena.view.read_record(e.offset, e.gen))) == payload

    used = store.bytes_used()
    tokens = BASES[2][:12].copy()
    damaged = bytearray(payload_for(ROOTS[0], tokens, 2 * PAGE))
    m = meta(tokens, bytes(damaged))
    damaged[PAGE] ^= 1
    with pytest.raises(ChecksumMismatch):
        store.put_record(m, damaged, None).step(math.inf)
    assert store.bytes_used() == used
    assert worker.step(math.inf) is not None and waiting.step(math.inf) is not None
