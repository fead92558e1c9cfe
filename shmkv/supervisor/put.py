"""A put in progress: make room, copy and checksum the payload, index the record.

Runs only in the supervisor, on its one thread, against its
:class:`~shmkv.supervisor.store.Store` (the arena's single writer). A put is sliced: each
:meth:`PutJob.step` evicts and copies until a deadline and goes on where it
stopped at the next call, so that the supervisor can serve other peers between
the slices of a put that must evict thousands of records or copy hundreds of MiB.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

import numpy as np
import xxhash

from shmkv.core.arena import PAGE, ArenaWriter, Geometry, align, record_layout
from shmkv.core.config import format_size
from shmkv.core.errors import ArenaFullError, BadRequest, ChecksumMismatch, LimitExceeded
from shmkv.core.keys import chain_digests, content_digest
from shmkv.core.stats import ArenaCounters
from shmkv.supervisor.allocator import Allocator
from shmkv.supervisor.pages import Pages
from shmkv.supervisor.record import Entry
from shmkv.supervisor.tiers.base import Accepted, TierHook

log = logging.getLogger("shmkv.supervisor.store")

#: a put's payload is copied (and checksummed) in pieces of this size, each followed by
#: a look at the put's deadline
COPY_PIECE = 8 << 20

SHM_FULL = (
    "no memory left for this state in the arena's tmpfs (its directory, --dir, is full): "
    "free space there or enlarge it (Docker: --shm-size), lower --size, or start the "
    "supervisor with --reserve true to claim all of --size at start"
)

FULL = (
    "the arena is full of pinned or in-use entries: unpin some, or restart "
    "`shmkv supervise` with a larger --size (or --index-slots)"
)


class PutStore(Protocol):
    """What a put needs of the store (:class:`~shmkv.supervisor.store.Store`, which
    makes each job and imports this module, never the other way)."""

    geometry: Geometry
    arena: ArenaWriter
    alloc: Allocator
    pages: Pages
    counters: ArenaCounters
    index_capacity: int
    uid: int
    clock: Callable[[], float]

    def duplicate(self, content: bytes, pin: bool) -> Entry | None: ...
    def check_pin(self, extent: int) -> None: ...
    def fits(self, extent: int, digests: list[bytes]) -> bool: ...
    def evict_one(self) -> bool: ...
    def revoke_stale_leases(self) -> bool: ...
    def take_gen(self) -> int: ...
    def insert(self, e: Entry, point: bool = True) -> None: ...
    def tell_tiers(self, ev: Accepted, source: TierHook | None = None) -> None: ...


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
        store: PutStore,
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
        #: bytes from the record's start whose pages exist (``pages.py``)
        self.allocated = 0
        #: where the payload starts, from the record's start
        self.payload_offset = record_layout(len(tokens), len(fingerprint), 0)[2]
        self.hasher = xxhash.xxh3_64()
        self.revoked = False
        self.steps = 0
        self.entry: Entry | None = None
        #: False: refuse (ArenaFullError) rather than evict (a refill never evicts)
        self.may_evict = True
        #: the tier the record was loaded from (a refill from disk, a fetch from Redis): it
        #: is not told of it, every other tier is (a fetched state goes to disk too)
        self.source: TierHook | None = None

    @classmethod
    def start(
        cls,
        store: PutStore,
        root: bytes,
        tokens: np.ndarray,
        fingerprint: bytes,
        payload_len: int,
        payload_xxh3: int,
        read: Callable[[memoryview, int], None],
        pin: bool,
        piece: int,
        publisher: int | None,
    ) -> PutJob:
        """The job of :meth:`Store.begin_put` (which see), or the refusal it raises."""
        g = store.geometry
        publisher = store.uid if publisher is None else publisher
        n_tokens = len(tokens)
        if n_tokens < g.chunk_tokens:
            raise BadRequest(
                f"a blob needs at least chunk_tokens={g.chunk_tokens} tokens, got {n_tokens}"
            )
        tok_bytes = tokens.astype("<i4", copy=False).tobytes()
        content = content_digest(root, fingerprint, tok_bytes, publisher)
        try:
            dup = store.duplicate(content, pin)
        except LimitExceeded:
            store.counters.rejected_puts += 1
            raise
        job = cls(
            store,
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
            store.counters.rejected_puts += 1
            raise ArenaFullError(
                f"a {format_size(payload_len)} blob can never fit in this arena's "
                f"{format_size(g.data_size)} data region: restart `shmkv supervise` "
                f"with a larger --size"
            )
        if pin:
            try:
                store.check_pin(job.extent)
            except LimitExceeded:
                store.counters.rejected_puts += 1
                raise
        job.digests = chain_digests(root, tokens, g.chunk_tokens)
        if len(job.digests) > store.index_capacity:
            store.counters.rejected_puts += 1
            raise ArenaFullError(FULL)
        return job

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
        while not store.fits(self.extent, self.digests):
            if not self.may_evict:
                raise ArenaFullError("no room left without evicting")
            if not store.evict_one():
                if not self.revoked and store.revoke_stale_leases():
                    self.revoked = True
                    continue
                raise ArenaFullError(FULL)
            if time.monotonic() >= deadline:
                return False
        self.offset = store.alloc.alloc(self.extent)
        assert self.offset is not None  # it fits
        self.allocated = 0
        self._allocate(self.payload_offset)  # header, fingerprint, token ids
        return True

    def _allocate(self, upto: int) -> None:
        """Make the record's first ``upto`` bytes exist before they are written (a put
        never writes into a hole: on a full tmpfs that is a SIGBUS); ArenaFullError if
        the tmpfs has no room for them."""
        assert self.offset is not None
        upto = min(self.extent, align(upto, PAGE))
        if upto > self.allocated:
            if not self.store.pages.allocate(self.offset + self.allocated, upto - self.allocated):
                self.store.counters.shm_full_puts += 1
                raise ArenaFullError(SHM_FULL)
            self.allocated = upto

    def _copy(self, deadline: float) -> bool:
        """Copy and checksum the payload, a piece at a time; True once all of it is in."""
        assert self.offset is not None
        while self.copied < self.payload_len:
            view = self.store.arena.payload(
                self.offset, len(self.tokens), len(self.fingerprint), self.payload_len
            )
            part = view[self.copied : self.copied + self.piece]
            try:
                self._allocate(self.payload_offset + self.copied + len(part))
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
        dup = store.duplicate(self.content, self.pin)
        if dup is not None:
            self.abort()
            return dup
        if self.pin:
            store.check_pin(self.extent)  # others may have pinned between our steps
        offset, self.offset = self.offset, None
        return self._record(offset)

    def abort(self) -> None:
        """Give back the space taken (the put is over, done or not)."""
        if self.offset is not None:
            self.store.alloc.release(self.offset, self.extent)
            self.store.pages.freed(self.offset, self.extent)
            self.offset = None

    def _record(self, offset: int) -> Entry:
        """Write the record of a filled and checked payload, then index it."""
        store = self.store
        gen = store.take_gen()
        created = time.time()
        digests, pin = self.digests, self.pin
        store.arena.write_record(
            offset,
            gen,
            digests[-1],
            self.root,
            len(digests),
            self.fingerprint,
            self.tok_bytes,
            self.payload_len,
            self.xxh3,
            created,
            self.publisher,
        )
        e = Entry(
            gen,
            offset,
            self.extent,
            digests[-1],
            self.root,
            len(self.tokens),
            self.payload_len,
            digests,
            self.content,
            created,
            pinned=pin,
            last_used=store.clock(),
            publisher=self.publisher,
        )
        store.insert(e)
        store.counters.puts += 1
        store.counters.bytes_put += self.payload_len
        ev = Accepted(
            root=self.root,
            fingerprint=self.fingerprint,
            tokens=self.tok_bytes,
            publisher=self.publisher,
            pinned=pin,
            payload_len=self.payload_len,
            payload_xxh3=self.xxh3,
            created=created,
            content=self.content,
            offset=offset,
            gen=gen,
            when=created,
        )
        store.tell_tiers(ev, self.source)
        return e
