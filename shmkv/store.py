"""The supervisor's bookkeeping of the arena: records, index owners, LRU, pins, leases.

Runs only in the supervisor, the arena's single writer, on its one thread;
nothing here takes a lock. The bytes are written through
:class:`~shmkv.arena.ArenaWriter`, space comes from
:class:`~shmkv.allocator.Allocator`, leases are kept in
:class:`~shmkv.leases.Leases`. What workers may read concurrently is published
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
"does it fit now" in O(log n). A put is a :class:`PutJob` that makes room and
copies its payload within a deadline and goes on where it stopped at the next
call, so that the supervisor can serve other peers between the slices of a
put that must evict thousands of records or copy hundreds of MiB.

Limits keep one peer from taking what all share: pinned states may take at
most ``max_pinned`` bytes, a connection may hold at most ``max_leases`` leases.
"""

from __future__ import annotations

import hashlib
import heapq
import logging
import math
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from mmap import mmap

import numpy as np
import xxhash

from .allocator import Allocator
from .arena import ArenaWriter, Geometry, Slot, chain_digests, record_layout
from .config import format_size
from .errors import ArenaFullError, BadRequest, ChecksumMismatch, LimitExceeded, NotFound
from .leases import Leases
from .stats import ArenaCounters, LimitCounters

log = logging.getLogger(__name__)

#: a put's payload is copied (and checksummed) in pieces of this size, each followed by
#: a look at the put's deadline
COPY_PIECE = 8 << 20

FULL = (
    "the arena is full of pinned or in-use entries: unpin some, or restart "
    "`shmkv supervise` with a larger --size (or --index-slots)"
)


@dataclass
class Entry:
    """The supervisor's bookkeeping for one record."""

    gen: int
    offset: int
    extent: int
    key: bytes
    root: bytes
    n_tokens: int
    payload_len: int
    digests: list[bytes]
    content: bytes
    created: float
    pinned: bool = False
    leases: int = 0
    hits: int = 0
    last_used: float = 0.0
    doomed: bool = False
    #: uid of the peer that put it
    publisher: int = 0


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
    ) -> None:
        self.arena = ArenaWriter(mm, geometry)
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
        #: chunk digest -> {gen: n_tokens} of every live record indexed under it
        self.owners: dict[bytes, dict[int, int]] = {}
        #: (rank, gen) heaps of the digests with several owners (see _best); some stale
        self._heaps: dict[bytes, list[tuple[tuple[int, int, int, int], int]]] = {}
        self.by_content: dict[bytes, int] = {}
        self.leases = Leases()
        self.index_capacity = geometry.index_slots // 2
        self.counters = ArenaCounters()
        #: the supervisor's uid: its records win an index slot (see ``_point``)
        self.uid = os.geteuid()
        self._next_gen = 1

    # ------------------------------------------------------------------- index
    def _rank(self, nch: int, gen: int, n_tokens: int) -> tuple[int, int, int, int]:
        """Order of the owners of chunk prefix ``nch`` for :meth:`_point` (least is best).

        A record's rank never changes while it lives (its publisher and length are
        fixed), so a heap entry stays valid until the record leaves.
        """
        theirs = int(self.entries[gen].publisher != self.uid)  # the supervisor's uid first
        if n_tokens < (nch + 1) * self.geometry.chunk_tokens:  # ends within the next chunk
            return (0, theirs, -n_tokens, gen)  # the longest of those
        return (1, theirs, n_tokens, gen)  # else the shortest

    def _best(self, digest: bytes, nch: int, owners: dict[int, int]) -> int:
        """The owner of ``digest`` its slot should point at, in O(log n) amortized.

        A digest with several owners (a chunk prefix many prompts share, e.g. a system
        prompt's) keeps its owners in a heap by rank; owners removed since are dropped
        when they reach the top.
        """
        if len(owners) == 1:
            return next(iter(owners))
        heap = self._heaps.get(digest)
        if heap is None:
            heap = [(self._rank(nch, g, n), g) for g, n in owners.items()]
            heapq.heapify(heap)
            self._heaps[digest] = heap
        while heap[0][1] not in owners:
            heapq.heappop(heap)
        return heap[0][1]

    def _add_owner(self, digest: bytes, nch: int, gen: int, n_tokens: int) -> None:
        self.owners.setdefault(digest, {})[gen] = n_tokens
        heap = self._heaps.get(digest)
        if heap is not None:
            heapq.heappush(heap, (self._rank(nch, gen, n_tokens), gen))

    def _drop_owner(self, digest: bytes, gen: int) -> None:
        owners = self.owners.get(digest)
        if owners is None:
            return
        owners.pop(gen, None)
        if not owners:
            del self.owners[digest]
        heap = self._heaps.get(digest)
        if heap is not None:
            if len(owners) <= 1:
                del self._heaps[digest]
            elif len(heap) > 2 * len(owners) + 8:  # mostly removed owners: rebuild
                self._heaps[digest] = [t for t in heap if t[1] in owners]
                heapq.heapify(self._heaps[digest])

    def _point(self, digest: bytes, nch: int) -> bool:
        """Point the slot of chunk prefix ``nch`` at the owner a lookup should try first.

        That is the longest of the records whose last full chunk this is (they end
        before the next chunk: a prompt or checkpoint that a prompt matching this
        chunk may match to its very end, which is what a sliding-window model
        needs to restore it whole), else the shortest (cheapest to restore); the
        oldest among equals. Within each, records published by the supervisor's own
        uid come first, as every worker trusts those: another user's record never
        takes their place.
        """
        owners = self.owners.get(digest)
        if not owners:
            self.arena.index_del(digest)
            return True
        e = self.entries[self._best(digest, nch, owners)]
        return self.arena.index_set(Slot(digest, e.offset, e.gen, nch))

    # ---------------------------------------------------------------- eviction
    def _revoke_stale_leases(self) -> bool:
        """Revoke leases older than lease_timeout; True if any was revoked.

        Each holder learns it at its release (``valid: False``); nobody else is affected.
        """
        stale = self.leases.stale(self.clock(), self.lease_timeout)
        if not stale:
            return False
        for grant in stale:
            grant.revoked = True
            self._unlease(grant.gen)
        self.counters.revocations += len(stale)
        log.warning(
            "revoked %d read lease(s) held longer than %.0fs", len(stale), self.lease_timeout
        )
        return True

    def _fits(self, extent: int, digests: list[bytes]) -> bool:
        if self.alloc.largest() < extent:
            return False
        new = sum(1 for d in digests if d not in self.owners)
        return len(self.owners) + new <= self.index_capacity

    def _evict_one(self) -> bool:
        """Evict the least recently used evictable entry; False if there is none."""
        if not self.lru:
            return False
        self.remove(self.entries[next(iter(self.lru))])
        self.counters.evictions += 1
        return True

    def _free(self, e: Entry) -> None:
        self.arena.zap_record(e.offset)
        self.alloc.release(e.offset, e.extent)
        del self.entries[e.gen]

    def remove(self, e: Entry) -> None:
        """Take ``e`` out of the index now; free its space now or at its last release."""
        self.lru.pop(e.gen, None)
        if e.pinned and not e.doomed:
            self.pinned_bytes -= e.extent
        if self.by_content.get(e.content) == e.gen:
            del self.by_content[e.content]
        for k, d in enumerate(e.digests, 1):
            if d in self.owners:
                self._drop_owner(d, e.gen)
                self._point(d, k)
        e.doomed = True
        if e.leases == 0:
            self._free(e)

    # --------------------------------------------------------------------- put
    def _duplicate(self, content: bytes, pin: bool) -> Entry | None:
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

    def _check_pin(self, extent: int) -> None:
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
        g = self.geometry
        publisher = self.uid if publisher is None else publisher
        n_tokens = len(tokens)
        if n_tokens < g.chunk_tokens:
            raise BadRequest(
                f"a blob needs at least chunk_tokens={g.chunk_tokens} tokens, got {n_tokens}"
            )
        tok_bytes = tokens.astype("<i4", copy=False).tobytes()
        content = hashlib.blake2b(
            root + fingerprint + tok_bytes + publisher.to_bytes(4, "little"), digest_size=16
        ).digest()
        try:
            dup = self._duplicate(content, pin)
        except LimitExceeded:
            self.counters.rejected_puts += 1
            raise
        job = PutJob(
            self,
            root,
            tokens,
            tok_bytes,
            fingerprint,
            content,
            payload_len,
            payload_xxh3,
            read,
            pin,
            publisher,
        )
        job.piece = max(1, piece)
        if dup is not None:
            job.entry = dup
            return job
        *_, job.extent = record_layout(n_tokens, len(fingerprint), payload_len)
        if job.extent > g.data_size:
            self.counters.rejected_puts += 1
            raise ArenaFullError(
                f"a {format_size(payload_len)} blob can never fit in this arena's "
                f"{format_size(g.data_size)} data region: restart `shmkv supervise` "
                f"with a larger --size"
            )
        if pin:
            try:
                self._check_pin(job.extent)
            except LimitExceeded:
                self.counters.rejected_puts += 1
                raise
        job.digests = chain_digests(root, tokens, g.chunk_tokens)
        if len(job.digests) > self.index_capacity:
            self.counters.rejected_puts += 1
            raise ArenaFullError(FULL)
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
        entry = job.step(math.inf)
        assert entry is not None  # no deadline: done or raised
        return entry

    def _index(self, job: PutJob, offset: int) -> Entry:
        """Write the record of a filled and checked payload, then index it."""
        gen = self._next_gen
        self._next_gen += 1
        created = time.time()
        digests, pin = job.digests, job.pin
        self.arena.write_record(
            offset,
            gen,
            digests[-1],
            job.root,
            len(digests),
            job.fingerprint,
            job.tok_bytes,
            job.payload_len,
            job.xxh3,
            created,
            job.publisher,
        )
        e = Entry(
            gen,
            offset,
            job.extent,
            digests[-1],
            job.root,
            len(job.tokens),
            job.payload_len,
            digests,
            job.content,
            created,
            pinned=pin,
            last_used=self.clock(),
            publisher=job.publisher,
        )
        self.entries[gen] = e
        self.by_content[job.content] = gen
        for k, d in enumerate(digests, 1):
            self._add_owner(d, k, gen, len(job.tokens))
            if not self._point(d, k):
                log.warning("index probe limit reached; entry %s only partly indexed", d.hex()[:12])
        if pin:
            self.pinned_bytes += e.extent
        else:
            self.lru[gen] = None
        self.counters.puts += 1
        self.counters.bytes_put += job.payload_len
        return e

    # ------------------------------------------------------------------ leases
    def _touch(self, e: Entry) -> None:
        e.last_used = self.clock()
        if e.gen in self.lru:
            self.lru.move_to_end(e.gen)

    def _unlease(self, gen: int) -> None:
        """One lease of record ``gen`` ended: free it if it was doomed and that was the last,
        else make it evictable again (as the most recently used) if that was the last."""
        e = self.entries.get(gen)
        if e is not None:
            e.leases -= 1
            if e.leases == 0:
                if e.doomed:
                    self._free(e)
                elif not e.pinned:
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

    def release(self, lid: int, owner: int) -> bool:
        """End a lease; False if it was revoked meanwhile (the read must be discarded)."""
        grant = self.leases.get(lid)
        if grant is None or grant.owner != owner:
            raise NotFound(f"no lease {lid} held by this connection")
        del self.leases[lid]
        if grant.revoked:
            return False
        self._unlease(grant.gen)
        return True

    def release_owner(self, owner: int) -> int:
        """Drop every lease of ``owner`` (its connection closed); returns how many.

        Only these leases end. A process still reading under one of them (a client that
        dropped this connection after a timeout) knows its connection is gone and
        discards that read itself (``client.Lease.finish``).
        """
        lids = self.leases.of_owner(owner)
        for lid in lids:
            if self.release(lid, owner):
                self.counters.leases_closed += 1
        return len(lids)

    # ----------------------------------------------------------- pins & clear
    def set_pinned(self, e: Entry, pinned: bool) -> None:
        """Pin or unpin ``e``; LimitExceeded if pinning it would pass ``max_pinned``."""
        if e.pinned == pinned or e.doomed:
            return
        if pinned:
            self._check_pin(e.extent)
            self.pinned_bytes += e.extent
            self.lru.pop(e.gen, None)
        else:
            self.pinned_bytes -= e.extent
            if e.leases == 0:
                self.lru[e.gen] = None
        e.pinned = pinned

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


class PutJob:
    """One put in progress: room made, payload copied and checked, record indexed.

    Made by :meth:`Store.begin_put`. Each :meth:`step` works until its deadline
    and returns the stored :class:`Entry` once done (None: call again). What a
    step did stays done: evictions and copied bytes are not redone. Between
    steps the store serves others; a put that finished meanwhile with the same
    content makes this one a duplicate. :meth:`abort` gives back its space.
    """

    def __init__(
        self,
        store: Store,
        root: bytes,
        tokens: np.ndarray,
        tok_bytes: bytes,
        fingerprint: bytes,
        content: bytes,
        payload_len: int,
        xxh3: int,
        read: Callable[[memoryview, int], None],
        pin: bool,
        publisher: int,
    ) -> None:
        self.store = store
        self.root, self.tokens, self.tok_bytes = root, tokens, tok_bytes
        self.fingerprint, self.content, self.payload_len = fingerprint, content, payload_len
        self.xxh3, self.read, self.pin = xxh3, read, pin
        #: uid of the peer that put it (the kernel's word: see ops.put)
        self.publisher = publisher
        self.piece = COPY_PIECE
        self.extent = 0
        self.digests: list[bytes] = []
        #: the space taken, once room was made; None before (and after abort)
        self.offset: int | None = None
        self.copied = 0
        self.hasher = xxhash.xxh3_64()
        self.revoked = False
        self.steps = 0
        self.entry: Entry | None = None

    @property
    def done(self) -> bool:
        return self.entry is not None

    def step(self, deadline: float) -> Entry | None:
        """Work until ``deadline`` (time.monotonic); the entry when done, else None.

        Raises ArenaFullError (nothing left to evict), ChecksumMismatch, or what
        ``read`` raises; the job then holds nothing.
        """
        if self.entry is not None:
            return self.entry
        self.steps += 1
        if self.steps == 2:
            self.store.counters.puts_sliced += 1
        try:
            if self.offset is None and not self._make_room(deadline):
                return None
            if not self._copy(deadline):
                return None
            self.entry = self._finish()
            return self.entry
        except BaseException:
            self.store.counters.rejected_puts += 1
            self.abort()
            raise

    def _make_room(self, deadline: float) -> bool:
        """Evict until the extent fits and the index has room, then take the space."""
        store = self.store
        while not store._fits(self.extent, self.digests):
            if not store._evict_one():
                if not self.revoked and store._revoke_stale_leases():
                    self.revoked = True
                    continue
                raise ArenaFullError(FULL)
            if time.monotonic() >= deadline:
                return False
        self.offset = store.alloc.alloc(self.extent)
        assert self.offset is not None  # it fits
        return True

    def _copy(self, deadline: float) -> bool:
        """Copy and checksum the payload, a piece at a time; True once all of it is in."""
        assert self.offset is not None
        while self.copied < self.payload_len:
            view = self.store.arena.payload(
                self.offset, len(self.tokens), len(self.fingerprint), self.payload_len
            )
            part = view[self.copied : self.copied + self.piece]
            try:
                self.read(part, self.copied)
                self.hasher.update(part)
                self.copied += len(part)
            finally:
                part.release()
                view.release()
            if self.copied < self.payload_len and time.monotonic() >= deadline:
                return False
        if self.hasher.intdigest() != self.xxh3:
            raise ChecksumMismatch(
                "payload does not match its checksum: the blob was "
                "changed or truncated in transit; not stored"
            )
        return True

    def _finish(self) -> Entry:
        store = self.store
        assert self.offset is not None
        # another put of the same content may have finished between our steps
        if self.content in store.by_content:
            dup = store._duplicate(self.content, self.pin)
            if dup is not None:
                self.abort()
                return dup
        if self.pin:
            store._check_pin(self.extent)  # others may have pinned between our steps
        offset, self.offset = self.offset, None
        return store._index(self, offset)

    def abort(self) -> None:
        """Give back the space taken (the put is over, done or not)."""
        if self.offset is not None:
            self.store.alloc.release(self.offset, self.extent)
            self.offset = None
