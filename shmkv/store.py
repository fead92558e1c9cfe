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
a put or a lease (a hit by any worker).
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from mmap import mmap

import numpy as np
import xxhash

from .allocator import Allocator
from .arena import ArenaWriter, Geometry, Slot, chain_digests, record_layout
from .config import format_size
from .errors import ArenaFullError, BadRequest, ChecksumMismatch, NotFound
from .leases import Leases
from .stats import ArenaCounters

log = logging.getLogger(__name__)


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
        self.lru: OrderedDict[int, None] = OrderedDict()
        #: chunk digest -> {gen: n_tokens} of every live record indexed under it
        self.owners: dict[bytes, dict[int, int]] = {}
        self.by_content: dict[bytes, int] = {}
        self.leases = Leases()
        self.index_capacity = geometry.index_slots // 2
        self.counters = ArenaCounters()
        #: the supervisor's uid: its records win an index slot (see ``_point``)
        self.uid = os.geteuid()
        self._next_gen = 1

    # ------------------------------------------------------------------- index
    def _point(self, digest: bytes, nch: int) -> bool:
        """Point the slot of chunk prefix ``nch`` at the owner a lookup should try first.

        That is the longest of the records whose last full chunk this is (they end
        before the next chunk: a prompt or checkpoint that a prompt matching this
        chunk may match to its very end, which is what a sliding-window model
        needs to restore it whole), else the shortest (cheapest to restore).
        Records published by the supervisor's own uid come first, as every worker
        trusts those: another user's record never takes their place.
        """
        owners = self.owners.get(digest)
        if not owners:
            self.arena.index_del(digest)
            return True
        limit = (nch + 1) * self.geometry.chunk_tokens
        ending = [g for g, n in owners.items() if n < limit]
        ours = {g for g in owners if self.entries[g].publisher == self.uid}
        if ending:
            gen = max(ending, key=lambda g: (g in ours, owners[g], -g))
        else:
            gen = min(owners, key=lambda g: (g not in ours, owners[g], g))
        e = self.entries[gen]
        return self.arena.index_set(Slot(digest, e.offset, e.gen, nch))

    # ---------------------------------------------------------------- eviction
    def _evictable(self) -> Iterable[Entry]:
        for gen in self.lru:
            e = self.entries[gen]
            if e.leases == 0:
                yield e

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

    def _make_room(self, extent: int, digests: list[bytes]) -> bool:
        """Evict LRU entries until ``extent`` bytes fit and the index has room."""
        revoked = False
        while True:
            new = sum(1 for d in digests if d not in self.owners)
            if len(self.owners) + new <= self.index_capacity and self.alloc.largest() >= extent:
                return True
            victim = next(iter(self._evictable()), None)
            if victim is None:
                if not revoked and self._revoke_stale_leases():
                    revoked = True
                    continue
                return False
            self.remove(victim)
            self.counters.evictions += 1

    def _free(self, e: Entry) -> None:
        self.arena.zap_record(e.offset)
        self.alloc.release(e.offset, e.extent)
        del self.entries[e.gen]

    def remove(self, e: Entry) -> None:
        """Take ``e`` out of the index now; free its space now or at its last release."""
        self.lru.pop(e.gen, None)
        if self.by_content.get(e.content) == e.gen:
            del self.by_content[e.content]
        for k, d in enumerate(e.digests, 1):
            owners = self.owners.get(d)
            if owners is not None:
                owners.pop(e.gen, None)
                if not owners:
                    del self.owners[d]
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
        self._touch(e)
        if pin:
            self.set_pinned(e, True)
        self.counters.duplicate_puts += 1
        return e

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
        """Store one blob; ``fill`` writes exactly ``payload_len`` bytes into the view.

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
        dup = self._duplicate(content, pin)
        if dup is not None:
            return dup
        *_, extent = record_layout(n_tokens, len(fingerprint), payload_len)
        if extent > g.data_size:
            self.counters.rejected_puts += 1
            raise ArenaFullError(
                f"a {format_size(payload_len)} blob can never fit in this arena's "
                f"{format_size(g.data_size)} data region: restart `shmkv supervise` "
                f"with a larger --size"
            )
        digests = chain_digests(root, tokens, g.chunk_tokens)
        if len(digests) > self.index_capacity or not self._make_room(extent, digests):
            self.counters.rejected_puts += 1
            raise ArenaFullError(
                "the arena is full of pinned or in-use entries: unpin some, or restart "
                "`shmkv supervise` with a larger --size (or --index-slots)"
            )
        offset = self.alloc.alloc(extent)
        assert offset is not None  # _make_room made room
        try:
            view = self.arena.payload(offset, n_tokens, len(fingerprint), payload_len)
            try:
                fill(view)
                ok = xxhash.xxh3_64_intdigest(view) == payload_xxh3
            finally:
                view.release()
            if not ok:
                raise ChecksumMismatch(
                    "payload does not match its checksum: the blob was "
                    "changed or truncated in transit; not stored"
                )
        except BaseException:
            self.counters.rejected_puts += 1
            self.alloc.release(offset, extent)
            raise
        gen = self._next_gen
        self._next_gen += 1
        created = time.time()
        self.arena.write_record(
            offset,
            gen,
            digests[-1],
            root,
            len(digests),
            fingerprint,
            tok_bytes,
            payload_len,
            payload_xxh3,
            created,
            publisher,
        )
        e = Entry(
            gen,
            offset,
            extent,
            digests[-1],
            root,
            n_tokens,
            payload_len,
            digests,
            content,
            created,
            pinned=pin,
            last_used=self.clock(),
            publisher=publisher,
        )
        self.entries[gen] = e
        self.by_content[content] = gen
        for k, d in enumerate(digests, 1):
            self.owners.setdefault(d, {})[gen] = n_tokens
            if not self._point(d, k):
                log.warning("index probe limit reached; entry %s only partly indexed", d.hex()[:12])
        if not pin:
            self.lru[gen] = None
        self.counters.puts += 1
        self.counters.bytes_put += payload_len
        return e

    # ------------------------------------------------------------------ leases
    def _touch(self, e: Entry) -> None:
        e.last_used = self.clock()
        if e.gen in self.lru:
            self.lru.move_to_end(e.gen)

    def _unlease(self, gen: int) -> None:
        """One lease of record ``gen`` ended: free it if it was doomed and that was the last."""
        e = self.entries.get(gen)
        if e is not None:
            e.leases -= 1
            if e.doomed and e.leases == 0:
                self._free(e)

    def acquire(self, offset: int, gen: int, owner: int) -> int:
        """Grant a read lease on the live record (offset, gen); returns the lease id."""
        e = self.entries.get(gen)
        if e is None or e.doomed or e.offset != offset:
            self.counters.stale_acquires += 1
            raise NotFound(f"record {gen} at {offset} is no longer in the arena")
        lid = self.leases.grant(gen, owner, self.clock())
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
        if e.pinned == pinned or e.doomed:
            return
        e.pinned = pinned
        if pinned:
            self.lru.pop(e.gen, None)
        else:
            self.lru[e.gen] = None

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
