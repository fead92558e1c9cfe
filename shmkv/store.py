"""The supervisor's side of the arena: allocator, index owners, LRU, pins, leases.

Runs only in the supervisor, the arena's single writer, on its one thread;
nothing here takes a lock. The bytes are written through
:class:`~shmkv.arena.ArenaWriter`. What workers may read concurrently is published
in an order that keeps their reads safe:

* a record is written in full (payload, checksum verified, then token ids,
  fingerprint, header) before any index slot points at it;
* index slots change under a per-slot seqlock (odd while being written);
* space is reused only once no lease covers it. A lease is granted by
  ``acquire`` (on a socket round trip) and ends with ``release`` or when the
  worker's connection closes, which the kernel does for a killed worker too
  (Plasma's rule). A lease held longer than ``lease_timeout`` may be revoked
  when space is needed: the header's revoke epoch is bumped *before* the space
  is written, and a reader compares the epoch after its copy, so a revoked
  read is discarded instead of used (Mooncake's rule). Leases ended by a
  closed connection bump the epoch too: the process behind it may be alive
  (it dropped the connection after a timeout) and still reading.

Eviction is least-recently-used over unpinned, unleased entries, where a use is
a put or a lease (a hit by any worker).
"""

from __future__ import annotations

import bisect
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import xxhash

from . import arena as A
from .config import format_size
from .errors import ArenaFullError, BadRequest, ChecksumMismatch, NotFound

log = logging.getLogger(__name__)


class Allocator:
    """Best-fit allocator over [start, start+size) with address-ordered coalescing."""

    def __init__(self, start: int, size: int) -> None:
        self.start, self.size = start, size
        self._starts: list[int] = [start]
        self._len: dict[int, int] = {start: size}
        self.free_bytes = size

    def alloc(self, n: int) -> int | None:
        best, best_len = None, None
        for off in self._starts:
            ln = self._len[off]
            if ln >= n and (best_len is None or ln < best_len):
                best, best_len = off, ln
                if ln == n:
                    break
        if best is None or best_len is None:
            return None
        i = bisect.bisect_left(self._starts, best)
        del self._starts[i]
        del self._len[best]
        if best_len > n:
            self._starts.insert(i, best + n)
            self._len[best + n] = best_len - n
        self.free_bytes -= n
        return best

    def release(self, off: int, n: int) -> None:
        if not (self.start <= off and off + n <= self.start + self.size) or n <= 0:
            raise ValueError(f"release of [{off}, {off + n}) outside the heap")
        i = bisect.bisect_left(self._starts, off)
        if i < len(self._starts) and self._starts[i] < off + n:
            raise ValueError(f"double free of [{off}, {off + n})")
        if i > 0:
            prev = self._starts[i - 1]
            if prev + self._len[prev] > off:
                raise ValueError(f"double free of [{off}, {off + n})")
        self.free_bytes += n
        # merge with the next extent
        if i < len(self._starts) and self._starts[i] == off + n:
            n += self._len.pop(self._starts[i])
            del self._starts[i]
        # merge with the previous extent
        if i > 0 and self._starts[i - 1] + self._len[self._starts[i - 1]] == off:
            self._len[self._starts[i - 1]] += n
            return
        self._starts.insert(i, off)
        self._len[off] = n

    def largest(self) -> int:
        return max(self._len.values(), default=0)

    def extents(self) -> list[tuple[int, int]]:
        return [(o, self._len[o]) for o in self._starts]


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


@dataclass
class Lease:
    gen: int
    owner: int
    granted: float
    revoked: bool = False


@dataclass
class Counters:
    puts: int = 0
    rejected_puts: int = 0
    duplicate_puts: int = 0
    evictions: int = 0
    hits: int = 0
    misses: int = 0
    tokens_restored: int = 0
    tokens_evaluated: int = 0
    restore_failures: int = 0
    revocations: int = 0
    stale_acquires: int = 0
    corrupt_removed: int = 0
    bytes_put: int = 0
    extra: dict[str, int] = field(default_factory=dict)


class Store:
    """Single-writer state of one arena mapping (writable, supervisor only)."""

    def __init__(self, mm, geometry: A.Geometry, lease_timeout: float = 30.0,
                 clock: Callable[[], float] = time.monotonic,
                 intact: Callable[[Entry], bool] | None = None) -> None:
        self.arena = A.ArenaWriter(mm, geometry)
        #: re-checks a stored record (header, metadata and payload checksums); a put of
        #: the same content replaces a copy that fails it
        self.intact = intact
        self.g = geometry
        self.lease_timeout = lease_timeout
        self.clock = clock
        self.alloc = Allocator(geometry.data_offset, geometry.data_size)
        self.entries: dict[int, Entry] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.owners: dict[bytes, dict[int, int]] = {}
        self.by_content: dict[bytes, int] = {}
        self.leases: dict[int, Lease] = {}
        self.index_capacity = geometry.index_slots // 2
        self.counters = Counters()
        self._next_gen = 1
        self._next_lease = 1
        self._epoch = 0

    # ------------------------------------------------------------------ header
    def _bump_epoch(self) -> None:
        self._epoch += 1
        self.arena.set_epoch(self._epoch)

    # ------------------------------------------------------------------- index
    def _point(self, digest: bytes, nch: int) -> bool:
        """Point the slot of chunk prefix ``nch`` at the owner a lookup should try first.

        That is the longest of the records whose last full chunk this is (they end
        before the next chunk: a prompt or checkpoint that a prompt matching this
        chunk may match to its very end, which is what a sliding-window model
        needs to restore it whole), else the shortest (cheapest to restore).
        """
        owners = self.owners.get(digest)
        if not owners:
            self.arena.index_del(digest)
            return True
        limit = (nch + 1) * self.g.chunk_tokens
        ending = [g for g, n in owners.items() if n < limit]
        if ending:
            gen = max(ending, key=lambda g: (owners[g], -g))
        else:
            gen = min(owners, key=lambda g: (owners[g], g))
        e = self.entries[gen]
        return self.arena.index_set(A.Slot(digest, e.offset, e.gen, nch))

    # ---------------------------------------------------------------- eviction
    def _evictable(self) -> Iterable[Entry]:
        for gen in self.lru:
            e = self.entries[gen]
            if e.leases == 0:
                yield e

    def _revoke_stale_leases(self) -> bool:
        """Revoke leases older than lease_timeout; True if any was revoked."""
        now = self.clock()
        stale = [lid for lid, ls in self.leases.items()
                 if not ls.revoked and now - ls.granted > self.lease_timeout]
        if not stale:
            return False
        self._bump_epoch()  # before any revoked space can be written
        for lid in stale:
            ls = self.leases[lid]
            ls.revoked = True
            e = self.entries.get(ls.gen)
            if e is not None:
                e.leases -= 1
                if e.doomed and e.leases == 0:
                    self._free(e)
        self.counters.revocations += len(stale)
        log.warning("revoked %d read lease(s) held longer than %.0fs", len(stale),
                    self.lease_timeout)
        return True

    def _make_room(self, extent: int, digests: list[bytes]) -> bool:
        """Evict LRU entries until ``extent`` bytes fit and the index has room."""
        revoked = False
        while True:
            new = sum(1 for d in digests if d not in self.owners)
            if (len(self.owners) + new <= self.index_capacity
                    and self.alloc.largest() >= extent):
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
    def put(self, root: bytes, tokens: np.ndarray, fingerprint: bytes, payload_len: int,
            payload_xxh3: int, fill: Callable[[memoryview], None], pin: bool = False) -> Entry:
        """Store one blob; ``fill`` writes exactly ``payload_len`` bytes into the view."""
        g = self.g
        n_tokens = len(tokens)
        if n_tokens < g.chunk_tokens:
            raise BadRequest(f"a blob needs at least chunk_tokens={g.chunk_tokens} tokens, "
                             f"got {n_tokens}")
        tok_bytes = tokens.astype("<i4", copy=False).tobytes()
        content = hashlib.blake2b(root + fingerprint + tok_bytes, digest_size=16).digest()
        dup = self.by_content.get(content)
        if dup is not None and self.intact is not None and not self.intact(self.entries[dup]):
            # a worker that found the old copy corrupt publishes a good one: take it
            log.warning("replacing corrupt record %d with a new copy", dup)
            self.remove(self.entries[dup])
            self.counters.corrupt_removed += 1
            dup = None
        if dup is not None:
            e = self.entries[dup]
            self._touch(e)
            if pin:
                self.set_pinned(e, True)
            self.counters.duplicate_puts += 1
            return e
        *_, extent = A.record_layout(n_tokens, len(fingerprint), payload_len)
        if extent > g.data_size:
            self.counters.rejected_puts += 1
            raise ArenaFullError(
                f"a {format_size(payload_len)} blob can never fit in this arena's "
                f"{format_size(g.data_size)} data region: restart `shmkv supervise` "
                f"with a larger --size")
        digests = A.chain_digests(root, tokens, g.chunk_tokens)
        if len(digests) > self.index_capacity or not self._make_room(extent, digests):
            self.counters.rejected_puts += 1
            raise ArenaFullError(
                "the arena is full of pinned or in-use entries: unpin some, or restart "
                "`shmkv supervise` with a larger --size (or --index-slots)")
        offset = self.alloc.alloc(extent)
        assert offset is not None
        gen = self._next_gen
        try:
            view = self.arena.payload(offset, n_tokens, len(fingerprint), payload_len)
            try:
                fill(view)
                ok = xxhash.xxh3_64_intdigest(view) == payload_xxh3
            finally:
                view.release()
            if not ok:
                raise ChecksumMismatch("payload does not match its checksum: the blob was "
                                       "changed or truncated in transit; not stored")
        except BaseException:
            self.counters.rejected_puts += 1
            self.alloc.release(offset, extent)
            raise
        self._next_gen += 1
        now = self.clock()
        created = time.time()
        self.arena.write_record(offset, gen, digests[-1], root, len(digests), fingerprint,
                                tok_bytes, payload_len, payload_xxh3, created)
        e = Entry(gen, offset, extent, digests[-1], root, n_tokens, payload_len, digests,
                  content, created, pinned=pin, last_used=now)
        self.entries[gen] = e
        self.by_content[content] = gen
        for k, d in enumerate(digests, 1):
            self.owners.setdefault(d, {})[gen] = n_tokens
            if not self._point(d, k):
                log.warning("index probe limit reached; entry %s only partly indexed",
                            d.hex()[:12])
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

    def acquire(self, offset: int, gen: int, owner: int) -> int:
        """Grant a read lease on the live record (offset, gen); returns the lease id."""
        e = self.entries.get(gen)
        if e is None or e.doomed or e.offset != offset:
            self.counters.stale_acquires += 1
            raise NotFound(f"record {gen} at {offset} is no longer in the arena")
        lid = self._next_lease
        self._next_lease += 1
        self.leases[lid] = Lease(gen, owner, self.clock())
        e.leases += 1
        e.hits += 1
        self.counters.hits += 1
        self._touch(e)
        return lid

    def release(self, lid: int, owner: int) -> bool:
        """End a lease; False if it was revoked meanwhile (the read must be discarded)."""
        ls = self.leases.get(lid)
        if ls is None or ls.owner != owner:
            raise NotFound(f"no lease {lid} held by this connection")
        del self.leases[lid]
        if ls.revoked:
            return False
        e = self.entries.get(ls.gen)
        if e is not None:
            e.leases -= 1
            if e.doomed and e.leases == 0:
                self._free(e)
        return True

    def release_owner(self, owner: int) -> int:
        """Drop every lease of ``owner`` (its connection closed); returns how many."""
        lids = [lid for lid, ls in self.leases.items() if ls.owner == owner]
        if any(not self.leases[lid].revoked for lid in lids):
            # The owner's process may still be reading (another thread, or a client that
            # dropped this connection after a timeout): like a revocation, bump the epoch
            # before the space can be reused, so that read fails its finish() check.
            self._bump_epoch()
        for lid in lids:
            self.release(lid, owner)
        return len(lids)

    @property
    def epoch(self) -> int:
        return self._epoch

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

    # ------------------------------------------------------------------- stats
    def bytes_used(self) -> int:
        return self.g.data_size - self.alloc.free_bytes

    def live_entries(self) -> list[Entry]:
        return [e for e in self.entries.values() if not e.doomed]
