"""The supervisor's bookkeeping of the arena: records, index owners, LRU, pins, leases.

Runs only in the supervisor, the arena's single writer, on its one thread;
nothing here takes a lock. The bytes are written through
:class:`~shmkv.core.arena.ArenaWriter`, space comes from
:class:`~shmkv.supervisor.allocator.Allocator`, leases are kept in
:class:`~shmkv.supervisor.leases.Leases`. What workers may read concurrently is published
in an order that keeps their reads safe:

* a record is written in full (payload, checksum verified, then token ids,
  fingerprint, header) before any index slot points at it;
* index slots change under a per-slot seqlock (odd while being written);
* space is reused only once no lease covers it. A lease is granted by
  ``acquire`` (on a socket round trip) and ends with ``release`` or when the
  worker's connection closes, which the kernel does for a killed worker too
  (Plasma's rule). A lease held longer than ``lease_timeout`` may be revoked
  when space is needed; the reader learns it from its own ``release``, which
  answers ``valid: False``, and discards what it read (Mooncake's rule). A
  closed connection ends that connection's leases only; a reader that is still
  copying after losing its connection treats every lease of that connection as
  void by itself (``client.Lease``). Each verdict is per lease: no close and no
  revocation voids anyone else's read.

Eviction is least-recently-used over unpinned, unleased entries, where a use is
a put or a lease (a hit by any worker): ``lru`` holds exactly the entries that
may be evicted (a leased entry leaves it and comes back, most recent, at its
last release), so each eviction takes the first one, and the allocator answers
"does it fit now" in O(log n). A put is a :class:`~shmkv.supervisor.put.PutJob` that
makes room and copies its payload within a deadline and goes on where it stopped
at the next call, so that the supervisor can serve other peers between the
slices of a put that must evict thousands of records or copy hundreds of MiB.
Which record each index slot names is kept by :class:`~shmkv.supervisor.chunk_owners.IndexOwners`.

Pages of the data region exist only while a record needs them (``pages.py``):
a put allocates before it writes, a freed extent is punched later, and never
one that a revoked or disconnected lease holder may still be reading.

Limits keep one peer from taking what all share: pinned states may take at
most ``max_pinned`` bytes, a connection may hold at most ``max_leases`` leases.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from mmap import mmap

import numpy as np

from shmkv.core import kvformat
from shmkv.core.arena import ArenaWriter, Geometry
from shmkv.core.config import format_size
from shmkv.core.errors import LimitExceeded, NotFound
from shmkv.core.stats import ArenaCounters, LimitCounters
from shmkv.supervisor.allocator import Allocator
from shmkv.supervisor.chunk_owners import IndexOwners
from shmkv.supervisor.chunks import Chunks
from shmkv.supervisor.leases import Leases
from shmkv.supervisor.pages import Pages
from shmkv.supervisor.put import COPY_PIECE, PutJob, Staging
from shmkv.supervisor.record import Entry
from shmkv.supervisor.tiers.base import Accepted, RecordMeta, TierHook, bytes_reader

log = logging.getLogger(__name__)


def _no_reader(view: memoryview, pos: int) -> None:
    """The reader of a grouped payload's put, never called (its groups are read instead)."""
    raise AssertionError("a grouped payload is not read")


class Store:
    """Single-writer state of one arena mapping (writable, supervisor only)."""

    def __init__(
        self,
        mm: mmap,
        geometry: Geometry,
        lease_timeout: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        intact: Callable[[Entry], bool] | None = None,
        max_pinned: int | None = None,
        max_leases: int = 256,
        limits: LimitCounters | None = None,
        pages: Pages | None = None,
    ) -> None:
        self.arena = ArenaWriter(mm, geometry)
        #: the data region's pages: allocated before a write, punched after a free
        #: (default: a reserved arena, all allocated)
        self.pages = Pages(-1, reserve=True) if pages is None else pages
        #: re-checks a stored record (header, metadata and payload checksums); a put of
        #: the same content replaces a copy that fails it
        self.intact = intact
        self.geometry = geometry
        self.lease_timeout = lease_timeout
        self.clock = clock
        self.alloc = Allocator(geometry.data_offset, geometry.data_size)
        self.entries: dict[int, Entry] = {}
        #: the evictable entries (live, unpinned, unleased), least recently used first
        self.lru: OrderedDict[int, None] = OrderedDict()
        #: most bytes pinned entries may take (default: half the data region)
        self.max_pinned = geometry.data_size // 2 if max_pinned is None else max_pinned
        self.pinned_bytes = 0
        #: most leases one owner (connection) may hold
        self.max_leases = max_leases
        self.limits = LimitCounters() if limits is None else limits
        self.by_content: dict[bytes, int] = {}
        self.leases = Leases()
        self.index_capacity = geometry.index_slots // 2
        self.counters = ArenaCounters()
        #: the supervisor's uid: its records win an index slot (see ``IndexOwners.point``)
        self.uid = os.geteuid()
        self._next_gen = 1
        #: write-behind tiers told of every record accepted, used, pinned (``tiers/base.py``)
        self.tiers: list[TierHook] = []
        #: chunk digests' owners and the slot each points at
        self.index = IndexOwners(self.arena, self.entries, geometry.chunk_tokens, self.uid)
        #: chunk digest -> {gen: n_tokens} of every live record indexed under it
        self.owners = self.index.owners
        #: the chunks chunked records share, reference-counted (``chunks.py``)
        self.chunks = Chunks(self.arena, self.alloc, self.pages)
        #: the payloads puts in progress hold staged, bounded (``put.py``)
        self.staging = Staging()
        #: an adoption checks records still (``adopt.Adoption``): nothing may allocate, so
        #: no put begins, and the bytes a record still to check claims stay as they were
        self.adopting = False

    # ---------------------------------------------------------------- eviction
    def revoke_stale_leases(self) -> bool:
        """Revoke leases older than lease_timeout; True if any was revoked.

        Each holder learns it at its release (``valid: False``); nobody else is affected.
        """
        stale = self.leases.stale(self.clock(), self.lease_timeout)
        if not stale:
            return False
        for grant in stale:
            grant.revoked = True
            self._unlease(grant.gen, reader_may_remain=True)
        self.counters.revocations += len(stale)
        log.warning(
            "revoked %d read lease(s) held longer than %.0fs", len(stale), self.lease_timeout
        )
        return True

    def index_room(self, digests: list[bytes]) -> bool:
        """Do the index slots these chunk digests need fit now, without evicting?"""
        new = sum(1 for d in digests if d not in self.owners)
        return len(self.owners) + new <= self.index_capacity

    def evict_one(self) -> bool:
        """Evict the least recently used evictable entry; False if there is none."""
        if not self.lru:
            return False
        self.remove(self.entries[next(iter(self.lru))])
        self.counters.evictions += 1
        return True

    def make_oldest(self, e: Entry) -> None:
        """Make ``e``, if evictable, the first to be evicted (a refill loads the newest
        record first)."""
        if e.gen in self.lru:
            self.lru.move_to_end(e.gen, last=False)

    def _free(self, e: Entry) -> None:
        self.arena.zap_record(e.offset)
        self.alloc.release(e.offset, e.extent)
        self.pages.freed(e.offset, e.extent, e.stale_readers)
        for c in e.chunks:  # (a chunk is freed with its last reference)
            self.chunks.unref(c, e.stale_readers)
        del self.entries[e.gen]

    def remove(self, e: Entry) -> None:
        """Take ``e`` out of the index now; free its space now or at its last release."""
        self.lru.pop(e.gen, None)
        if e.pinned and not e.doomed:
            self.pinned_bytes -= e.footprint
        if self.by_content.get(e.content) == e.gen:
            del self.by_content[e.content]
        for k, d in enumerate(e.digests, 1):
            if d in self.owners:
                self.index.drop(d, e.gen)
                self.index.point(d, k)
        e.doomed = True
        if e.leases == 0:
            self._free(e)

    # ------------------------------------------------------------------ records
    def take_gen(self) -> int:
        """The generation of a new record (each is handed out once, in increasing order)."""
        gen = self._next_gen
        self._next_gen += 1
        return gen

    def gens_from(self, gen: int) -> None:
        """Hand out generations from ``gen`` on (an adoption: above every old record's)."""
        self._next_gen = gen

    def insert(self, e: Entry, point: bool = True) -> None:
        """Index a record written in full at ``e.offset`` (space taken from ``alloc``).

        ``point``: point its chunk digests' index slots now (``IndexOwners.point``); an
        adoption inserts every record first and points the index once all are in
        (``adopt.Adoption``).
        """
        self.entries[e.gen] = e
        self.by_content[e.content] = e.gen
        for k, d in enumerate(e.digests, 1):
            self.index.add(d, k, e.gen, e.n_tokens)
            if point and not self.index.point(d, k):
                log.warning("index probe limit reached; entry %s only partly indexed", d.hex()[:12])
        if e.pinned:
            self.pinned_bytes += e.footprint
        else:
            self.lru[e.gen] = None

    def tell_tiers(self, ev: Accepted, source: TierHook | None = None) -> None:
        """Tell every tier but ``source`` (where the record came from) of ``ev``."""
        for tier in self.tiers:
            if tier is not source:
                tier.accepted(ev)

    # --------------------------------------------------------------------- put
    def duplicate(self, content: bytes, pin: bool) -> Entry | None:
        """The live, intact record of the same content (touched), if there is one."""
        dup = self.by_content.get(content)
        if dup is None:
            return None
        e = self.entries[dup]
        if self.intact is not None and not self.intact(e):
            # a worker that found the old copy corrupt publishes a good one: take it
            log.warning("replacing corrupt record %d with a new copy", dup)
            self.remove(e)
            self.counters.corrupt_removed += 1
            return None
        if pin:
            self.set_pinned(e, True)
        self._touch(e)
        self.counters.duplicate_puts += 1
        return e

    def check_pin(self, extent: int) -> None:
        """Raise LimitExceeded if pinning ``extent`` more bytes would pass ``max_pinned``."""
        if self.pinned_bytes + extent > self.max_pinned:
            self.limits.pins_refused += 1
            raise LimitExceeded(
                f"pinning {format_size(extent)} more would take pinned states past "
                f"{format_size(self.max_pinned)} of the {format_size(self.geometry.data_size)} "
                f"data region: unpin some, or raise --max-pinned-percent"
            )

    def begin_put(
        self,
        root: bytes,
        tokens: np.ndarray,
        fingerprint: bytes,
        payload_len: int,
        payload_xxh3: int,
        read: Callable[[memoryview, int], None],
        pin: bool = False,
        piece: int = COPY_PIECE,
        publisher: int | None = None,
    ) -> PutJob:
        """Start storing one blob; :meth:`PutJob.step` does the work.

        ``read(view, pos)`` writes payload bytes [pos, pos + len(view)) into ``view``;
        it is called with pieces of at most ``piece`` bytes. Refusals that need no
        work (too few tokens, a blob that can never fit, a pin past the limit) raise
        here; a duplicate gives a job that is already done.

        ``publisher`` is the uid of the peer that put it (default: ours). A put of the
        same root, fingerprint and tokens as a stored record is a duplicate only if the
        same uid published that record: another user's copy (maybe garbage with a valid
        checksum) never keeps this one out; both are stored, and workers restore the one
        they trust.
        """
        if self.adopting:  # (the loop holds every put back until then: a bug otherwise)
            raise RuntimeError("a put began while the arena was still being adopted")
        return PutJob.start(
            self, root, tokens, fingerprint, payload_len, payload_xxh3, read, pin, piece, publisher
        )

    def put_record(
        self,
        meta: RecordMeta,
        payload: bytes | bytearray | kvformat.Grouped,
        source: TierHook | None,
        may_evict: bool = True,
    ) -> PutJob:
        """Start putting a record that the tier ``source`` holds (a refill from disk, a
        fetch from Redis): :meth:`begin_put` of ``meta`` (its publisher's uid, never ours
        instead; pinned if it was) and ``payload``; ``source`` is not told of it, every
        other tier is. ``may_evict`` False: refuse (ArenaFullError) rather than evict.
        ``payload`` is the tier's, in our memory: staged where it is (checked, not
        copied), so the caller must not change it until the job is over.

        A :class:`~shmkv.core.kvformat.Grouped` payload (a tier's chunked record: its
        manifest and each group's data) is never assembled: its whole blob's XXH3-64 is
        checked a piece at a time, each full group's XXH3-128 (against the digest the tier
        knows, if any) and bytes decide whether the arena holds its chunk already, and only
        the groups it does not hold are copied, straight from their buffers."""
        read = _no_reader if isinstance(payload, kvformat.Grouped) else bytes_reader(payload)
        job = self.begin_put(
            meta.root,
            np.frombuffer(meta.tokens, dtype="<i4"),
            meta.fingerprint,
            meta.payload_len,
            meta.payload_xxh3,
            read,
            pin=meta.pinned,
            publisher=meta.publisher,
        )
        job.may_evict, job.source = may_evict, source
        if not job.done:
            if isinstance(payload, kvformat.Grouped):
                job.grouped = payload
            else:
                job.given = payload
        return job

    def put(
        self,
        root: bytes,
        tokens: np.ndarray,
        fingerprint: bytes,
        payload_len: int,
        payload_xxh3: int,
        fill: Callable[[memoryview], None],
        pin: bool = False,
        publisher: int | None = None,
    ) -> Entry:
        """Store one blob at once; ``fill`` writes exactly ``payload_len`` bytes into the view.

        ``publisher``: as for :meth:`begin_put`.
        """
        job = self.begin_put(
            root,
            tokens,
            fingerprint,
            payload_len,
            payload_xxh3,
            lambda view, _pos: fill(view),
            pin,
            piece=max(1, payload_len),
            publisher=publisher,
        )
        job.may_wait = False  # (no later step to wait for)
        entry = job.step(math.inf)
        assert entry is not None  # no deadline: done or raised
        return entry

    # ------------------------------------------------------------------ leases
    def _touch(self, e: Entry) -> None:
        e.last_used = self.clock()
        if e.gen in self.lru:
            self.lru.move_to_end(e.gen)
        for tier in self.tiers:
            tier.used(e.content)

    def _unlease(self, gen: int, reader_may_remain: bool = False) -> None:
        """One lease of record ``gen`` ended (``reader_may_remain``: while its holder may
        still be reading, ``pages.py``): free it if it was doomed and that was the last,
        else make it evictable again (as the most recently used) if that was the last."""
        e = self.entries.get(gen)
        if e is not None:
            e.stale_readers |= reader_may_remain
            e.leases -= 1
            if e.leases == 0:
                if e.doomed:
                    self._free(e)
                    return
                e.last_used = self.clock()  # in use until now (what --ttl measures from)
                if not e.pinned:
                    self.lru[gen] = None

    def acquire(self, offset: int, gen: int, owner: int) -> int:
        """Grant a read lease on the live record (offset, gen); returns the lease id."""
        e = self.entries.get(gen)
        if e is None or e.doomed or e.offset != offset:
            self.counters.stale_acquires += 1
            raise NotFound(f"record {gen} at {offset} is no longer in the arena")
        if self.leases.held_by(owner) >= self.max_leases:
            self.limits.leases_refused += 1
            raise LimitExceeded(
                f"this connection already holds {self.max_leases} read leases: release "
                f"them (Lease.finish), or raise the supervisor's --max-leases"
            )
        lid = self.leases.grant(gen, owner, self.clock())
        self.lru.pop(gen, None)  # leased: not evictable until its last release
        e.leases += 1
        e.hits += 1
        self.counters.hits += 1
        self._touch(e)
        return lid

    def release(self, lid: int, owner: int, reader_may_remain: bool = False) -> bool:
        """End a lease; False if it was revoked meanwhile (the read must be discarded)."""
        grant = self.leases.get(lid)
        if grant is None or grant.owner != owner:
            raise NotFound(f"no lease {lid} held by this connection")
        del self.leases[lid]
        if grant.revoked:
            return False
        self._unlease(grant.gen, reader_may_remain)
        return True

    def release_owner(self, owner: int) -> int:
        """Drop every lease of ``owner`` (its connection closed); returns how many.

        Only these leases end. A process still reading under one of them (a client that
        dropped this connection after a timeout) knows its connection is gone and
        discards that read itself (``client.Lease.finish``).
        """
        lids = self.leases.of_owner(owner)
        for lid in lids:
            if self.release(lid, owner, reader_may_remain=True):
                self.counters.leases_closed += 1
        return len(lids)

    # ----------------------------------------------------------- pins & clear
    def set_pinned(self, e: Entry, pinned: bool, durable: bool = True) -> None:
        """Pin or unpin ``e``; LimitExceeded if pinning it would pass ``max_pinned``.

        ``durable``: the pin outlives a restart, so the tiers keep it (``--persist``
        refills the state pinned). A pin with a TTL of its own (``ttl.py``) is not: kept
        on disk, it would come back after a reboot as a pin without its TTL, for ever.
        """
        if e.doomed:
            return
        if e.pinned != pinned:
            if pinned:
                self.check_pin(e.footprint)
                self.pinned_bytes += e.footprint
                self.lru.pop(e.gen, None)
            else:
                self.pinned_bytes -= e.footprint
                if e.leases == 0:
                    self.lru[e.gen] = None
            e.pinned = pinned
        for tier in self.tiers:  # (also when only durability changed: a TTL came or went)
            tier.pinned(e.content, pinned and durable)

    def by_key(self, key: bytes) -> list[Entry]:
        return [e for e in self.entries.values() if e.key == key and not e.doomed]

    def clear(self) -> int:
        live = [e for e in self.entries.values() if not e.doomed]
        for e in live:
            self.remove(e)
        return len(live)

    # ------------------------------------------------------------------ gauges
    def bytes_used(self) -> int:
        return self.geometry.data_size - self.alloc.free_bytes

    def live_entries(self) -> list[Entry]:
        return [e for e in self.entries.values() if not e.doomed]
