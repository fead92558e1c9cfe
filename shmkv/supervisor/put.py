"""A put in progress: stage and checksum the payload, split it, make room, write, index.

Runs only in the supervisor, on its one thread, against its
:class:`~shmkv.supervisor.store.Store` (the arena's single writer). A put is sliced: each
:meth:`PutJob.step` copies, evicts and writes until a deadline and goes on where it
stopped at the next call, so that the supervisor can serve other peers between
the slices of a put that must evict thousands of records or copy hundreds of MiB.

The payload is first staged in the supervisor's own memory (read from the worker's
memfd, or the tier's buffer, and checked against its XXH3-64), then planned
(``kvformat.plan``): a state that splits is stored as a chunked record whose full
groups are chunks found by key (``chunks.py``: reused, a reference more) or written
anew, and whose other groups are inline in its body; any other stays whole, its
payload in the record as before.

What a put holds of the supervisor's memory is its staged payload and one group's
scratch: each group is gathered from the staged payload straight to where it goes
(the scratch, to find its chunk; a new chunk's or the body's place in the arena),
never into a copy of the whole state. The staging is an anonymous mapping, given back
to the kernel when the put ends (glibc's heap would keep it), and the puts in progress
stage at most :data:`STAGE_BUDGET` bytes at once (:class:`Staging`): a put past it
waits its turn, so a burst of puts from every worker does not multiply the
supervisor's memory by their number.
"""

from __future__ import annotations

import logging
import mmap
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Protocol

import numpy as np
import xxhash

from shmkv.core import kvformat
from shmkv.core.arena import (
    PAGE,
    ArenaWriter,
    ChunkRef,
    Geometry,
    align,
    body_layout,
    chunk_digest,
    chunk_extent,
    pack_body_head,
    record_layout,
    stored_manifest,
)
from shmkv.core.config import format_size
from shmkv.core.errors import (
    ArenaCorruptError,
    ArenaFullError,
    BadRequest,
    ChecksumMismatch,
    LimitExceeded,
)
from shmkv.core.keys import chain_digests, content_digest
from shmkv.core.stats import ArenaCounters
from shmkv.supervisor.allocator import Allocator
from shmkv.supervisor.chunks import Chunk, ChunkKey, Chunks
from shmkv.supervisor.pages import Pages
from shmkv.supervisor.record import Entry
from shmkv.supervisor.tiers.base import Accepted, TierHook

log = logging.getLogger("shmkv.supervisor.store")

#: a put's payload is copied (and checksummed) in pieces of this size, each followed by
#: a look at the put's deadline
COPY_PIECE = 8 << 20

#: new chunks' bytes a put writes between two looks at its deadline (gathered together:
#: each region of the staged payload read once for all of them)
WRITE_BATCH = 64 << 20

#: payload bytes the puts in progress may hold staged at once (a larger payload is staged
#: alone): two or three states of a small model, one of a large one
STAGE_BUDGET = 64 << 20

SHM_FULL = (
    "no memory left for this state in the arena's tmpfs (its directory, --dir, is full): "
    "free space there or enlarge it (Docker: --shm-size), lower --size, or start the "
    "supervisor with --reserve true to claim all of --size at start"
)

MISMATCH = (
    "payload does not match its checksum: the blob was changed or truncated in transit; not stored"
)

CHUNK_MISMATCH = (
    "a group of the payload does not match its chunk's XXH3-128: the blob was changed in "
    "transit or on disk; not stored"
)

FULL = (
    "the arena is full of pinned or in-use entries: unpin some, or restart "
    "`shmkv supervise` with a larger --size (or --index-slots)"
)


class Staging:
    """The payloads the puts in progress hold staged in the supervisor's memory: at most
    ``budget`` bytes of them at once (a larger one alone), taken in the order the puts
    first asked. Jobs are held weakly: one dropped without :meth:`PutJob.abort` (its
    owner gone) gives its share back when it is collected, never holding the rest up."""

    def __init__(self, budget: int = STAGE_BUDGET) -> None:
        self.budget = budget
        self._holders: weakref.WeakSet[PutJob] = weakref.WeakSet()
        self._line: list[weakref.ref[PutJob]] = []

    @property
    def held(self) -> int:
        """Payload bytes staged now."""
        return sum(j.payload_len for j in self._holders)

    def take(self, job: PutJob, wait: bool = True) -> bool:
        """True: ``job`` may stage its payload now (it holds its share until :meth:`give`).
        False: it is in line; ask again at its next step. ``wait`` False: take it now."""
        self._line = [r for r in self._line if r() is not None]
        first = next((r() for r in self._line), None)
        if wait and first is not None and first is not job:
            if all(r() is not job for r in self._line):
                self._line.append(weakref.ref(job))
            return False
        if wait and len(self._holders) and self.held + job.payload_len > self.budget:
            if first is None:
                self._line.append(weakref.ref(job))
            return False
        self._line = [r for r in self._line if r() is not job]
        self._holders.add(job)
        return True

    def give(self, job: PutJob) -> None:
        """``job`` holds nothing staged, nor a place in line, any more."""
        self._holders.discard(job)
        self._line = [r for r in self._line if r() not in (None, job)]


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
    chunks: Chunks
    staging: Staging

    def duplicate(self, content: bytes, pin: bool) -> Entry | None: ...
    def check_pin(self, extent: int) -> None: ...
    def index_room(self, digests: list[bytes]) -> bool: ...
    def evict_one(self) -> bool: ...
    def revoke_stale_leases(self) -> bool: ...
    def take_gen(self) -> int: ...
    def insert(self, e: Entry, point: bool = True) -> None: ...
    def tell_tiers(self, ev: Accepted, source: TierHook | None = None) -> None: ...


class PutJob:
    """One put in progress: payload staged and checked, split, room made, written, indexed.

    Made by :meth:`Store.begin_put`. Each :meth:`step` works until its deadline
    and returns the stored :class:`Entry` once done (None: call again). What a
    step did stays done: copied bytes, evictions and written chunks are not redone.
    Between steps the store serves others; a put that finished meanwhile with the
    same content makes this one a duplicate. :meth:`abort` gives back its space and
    the chunk references it holds.
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
        #: the record's extent (a whole blob's until the split says otherwise)
        self.extent = 0
        self.digests: list[bytes] = []
        #: the payload, staged in our memory (None before the first step and after the end)
        self.staged: mmap.mmap | bytes | bytearray | None = None
        #: a payload in our memory already (a tier's record: ``Store.put_record``): staged
        #: where it is, not copied (None once staged)
        self.given: bytes | bytearray | None = None
        #: a payload in our memory as its groups (a tier's chunked record:
        #: ``Store.put_record``): checked and written group by group from where they are,
        #: never staged whole (None once the put is over)
        self.grouped: kvformat.Grouped | None = None
        #: the grouped payload's pieces in blob order, being hashed (between steps)
        self._pieces: Iterator[memoryview] | None = None
        #: False: stage at once, past the budget (a put done in one call: ``Store.put``)
        self.may_wait = True
        #: payload bytes staged (and hashed) so far
        self.copied = 0
        self.hasher = xxhash.xxh3_64()
        #: the plan was made (``layout`` None: the record is whole)
        self.planned = False
        self.layout: kvformat.Manifest | None = None
        self.manifest = b""
        self.stored_manifest = b""
        #: for each group, in blob order, the chunk it is stored in (None: inline) and its
        #: inline offset in the body
        self.refs: list[Chunk | None] = []
        self.inline_offs: list[int] = []
        #: the body's length (a whole record's: its payload's)
        self.body_len = payload_len
        #: the chunks this put writes (offset -1 until their space is taken) and the group
        #: each is gathered from
        self.new: list[Chunk] = []
        self.new_groups: list[int] = []
        #: chunks found already stored: a reference held on each, per use
        self.held: list[Chunk] = []
        #: new chunks written so far
        self.written = 0
        #: the record's space, once taken; None before (and after abort)
        self.offset: int | None = None
        #: body bytes written (a whole record's payload)
        self.body_written = 0
        #: bytes from the record's start whose pages exist (``pages.py``)
        self.allocated = 0
        #: where the body (a whole record's payload) starts, from the record's start
        self.payload_offset = record_layout(len(tokens), len(fingerprint), 0)[2]
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
            if not self._stage(deadline):
                return None
            if not self.planned:
                self._plan()
            if not self._make_room(deadline):
                return None
            if not self._write(deadline):
                return None
            self.entry = self._finish()
            return self.entry
        except BaseException:
            self.store.counters.rejected_puts += 1
            self.abort()
            raise

    # ------------------------------------------------------------------ stage
    def _stage(self, deadline: float) -> bool:
        """Copy and checksum the payload into our memory, a piece at a time; True once
        all of it is in and its checksum matched."""
        if self.planned:
            return True
        if self.grouped is not None:
            return self._check_grouped(deadline)
        if self.given is not None:  # (its checksum at once: XXH3 of 16 MiB is ~0.3 ms)
            given, self.given = self.given, None
            if len(given) != self.payload_len or xxhash.xxh3_64_intdigest(given) != self.xxh3:
                raise ChecksumMismatch(MISMATCH)
            self.staged, self.copied = given, self.payload_len
            return True
        if self.staged is None:
            if not self.store.staging.take(self, self.may_wait):
                return False  # (in line behind other puts' payloads)
            # (private: anonymous memory of ours, not shmem)
            self.staged = mmap.mmap(-1, self.payload_len, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        view = memoryview(self.staged)
        try:
            while self.copied < self.payload_len:
                part = view[self.copied : self.copied + self.piece]
                try:
                    self.read(part, self.copied)
                    self.hasher.update(part)
                    self.copied += len(part)
                finally:
                    part.release()
                if self.copied < self.payload_len and time.monotonic() >= deadline:
                    return False
        finally:
            view.release()
        if self.hasher.intdigest() != self.xxh3:
            raise ChecksumMismatch(MISMATCH)
        return True

    def _check_grouped(self, deadline: float) -> bool:
        """Hash a grouped payload's blob (XXH3-64) in blob order, a piece at a time and
        never assembled (``kvformat.blob_pieces``); True once all of it is hashed and its
        checksum matched. ChecksumMismatch if a length or the checksum disagrees.

        A covered payload (``Grouped.covered``: its tier checked what no digest covers)
        is not hashed here: its lengths are checked, each full group's digest by the plan,
        and the blob's XXH3-64 only if it is assembled after all (:meth:`_assemble_grouped`)."""
        assert self.grouped is not None
        if self._pieces is None:
            if self.grouped.manifest.blob_len != self.payload_len:
                raise ChecksumMismatch(MISMATCH)
            if self.grouped.covered:
                try:
                    kvformat.check_groups(self.grouped.manifest, self.grouped.groups)
                except ArenaCorruptError:
                    raise ChecksumMismatch(MISMATCH) from None
                return True
            self._pieces = kvformat.blob_pieces(self.grouped.manifest, self.grouped.groups)
        try:
            for piece in self._pieces:
                self.hasher.update(piece)
                self.copied += len(piece)
                if self.copied < self.payload_len and time.monotonic() >= deadline:
                    return False
        except ArenaCorruptError:  # (a group of the wrong length)
            raise ChecksumMismatch(MISMATCH) from None
        self._pieces = None
        if self.copied != self.payload_len or self.hasher.intdigest() != self.xxh3:
            raise ChecksumMismatch(MISMATCH)
        return True

    def _assemble_grouped(self) -> None:
        """Stage a grouped payload whole after all (checked already): it stays whole, or
        was split at another chunk size than this arena's (a store written under another
        ``--chunk-tokens``), and is planned afresh."""
        assert self.grouped is not None
        staged = bytearray(self.payload_len)
        kvformat.assemble(self.grouped.manifest, self.grouped.groups, memoryview(staged))
        # (a covered one was not hashed whole, and its digests are not what the plan checks)
        if self.grouped.covered and xxhash.xxh3_64_intdigest(staged) != self.xxh3:
            raise ChecksumMismatch(MISMATCH)
        self.staged, self.grouped = staged, None

    def _group(self, i: int, scratch: np.ndarray) -> memoryview:
        """Group ``i``'s data: a grouped payload's own buffer, else gathered from the staged
        payload into ``scratch``."""
        if self.grouped is not None:
            return memoryview(self.grouped.groups[i]).cast("B")
        assert self.layout is not None and self.staged is not None
        data = scratch[: self.layout.group_sizes[i]].data
        kvformat.gather(self.layout, self.staged, i, data)
        self.store.counters.chunk_bytes_copied += len(data)
        return data

    def _copy_groups(self, dests: list[tuple[int, memoryview]]) -> None:
        """Write each ``(group, dest)``'s data into ``dest`` (a new chunk's place, or the
        body's): from a grouped payload's own buffers, or gathered from the staged payload
        region by region (``kvformat.gather_into``: each region read once for all)."""
        assert self.layout is not None
        if self.grouped is not None:
            for i, dest in dests:
                dest[:] = memoryview(self.grouped.groups[i]).cast("B")
        else:
            assert self.staged is not None
            kvformat.gather_into(self.layout, self.staged, dests)

    # ------------------------------------------------------------------- plan
    def _plan(self) -> None:
        """Plan the staged payload's split and find each full group's chunk; size the record."""
        store, g = self.store, self.store.geometry
        self.planned = True
        grouped = self.grouped
        if grouped is not None and (
            grouped.manifest.chunk_tokens != g.chunk_tokens or not any(grouped.manifest.group_full)
        ):
            self._assemble_grouped()
            grouped = None
        if grouped is not None:
            layout: kvformat.Manifest | None = grouped.manifest
        else:
            assert self.staged is not None
            layout = kvformat.plan(self.staged, g.chunk_tokens)
        if layout is None or not any(layout.group_full):
            return  # whole: the payload is the body
        self.layout = layout
        known = grouped.digests if grouped is not None else None
        scratch = np.empty(0 if grouped else max(layout.group_sizes), dtype=np.uint8)
        planned: dict[ChunkKey, Chunk] = {}
        inline: list[int] = []
        full_groups = [i for i, full in enumerate(layout.group_full) if full]
        if grouped is not None:
            digests = [chunk_digest(self._group(i, scratch)) for i in full_groups]
        else:  # (region by region: see kvformat.group_digests)
            assert self.staged is not None
            digests = kvformat.group_digests(layout, self.staged, full_groups)
            store.counters.chunk_bytes_copied += sum(layout.group_sizes[i] for i in full_groups)
        hashed = dict(zip(full_groups, digests, strict=True))
        for i, (size, full, sig) in enumerate(
            zip(layout.group_sizes, layout.group_full, layout.group_sigs, strict=True)
        ):
            if not full:
                self.refs.append(None)
                inline.append(size)
                continue
            digest = hashed[i]
            if known is not None and known[i] is not None and known[i] != digest:
                raise ChecksumMismatch(CHUNK_MISMATCH)
            key = (self.publisher, bytes(sig), digest)
            c = planned.get(key)
            if c is None:
                if store.chunks.where(key) is not None:  # (one stored under it: compare)
                    c = store.chunks.find(key, self._group(i, scratch))
                if c is None:
                    c = Chunk(key, -1, 0, size, chunk_extent(size))
                    self.new.append(c)
                    self.new_groups.append(i)
                planned[key] = c
            if c.offset >= 0 and c not in self.new:  # stored already: hold it from now on
                store.chunks.ref(c)
                self.held.append(c)
            self.refs.append(c)
            inline.append(0)
        self.manifest = layout.pack()
        self.stored_manifest = stored_manifest(self.manifest)
        _, _, self.inline_offs, self.body_len = body_layout(len(self.stored_manifest), inline)
        *_, self.extent = record_layout(len(self.tokens), len(self.fingerprint), self.body_len)
        if self.extent + sum(c.extent for c in self.new) > g.data_size:
            raise ArenaFullError(
                f"a {format_size(self.payload_len)} state can never fit in this arena's "
                f"{format_size(g.data_size)} data region: restart `shmkv supervise` "
                f"with a larger --size"
            )
        if self.pin:
            store.check_pin(self._footprint())

    def _footprint(self) -> int:
        """The record's extent and its chunks' (what pinning it holds)."""
        return self.extent + sum(c.extent for c in self.refs if c is not None)

    # -------------------------------------------------------------- make room
    def _make_room(self, deadline: float) -> bool:
        """Evict until the record's extent, each new chunk's and the index's slots fit;
        take each space as soon as it fits. True once all are taken."""
        store = self.store
        while True:
            todo = next((c for c in self.new if c.offset < 0), None)
            if self.offset is None:
                size = self.extent
            elif todo is not None:
                size = todo.extent
            else:
                return True
            off = store.alloc.alloc(size) if store.index_room(self.digests) else None
            if off is not None:
                if self.offset is None:
                    self.offset, self.allocated = off, 0
                    self._allocate(self.payload_offset)  # header, fingerprint, token ids
                else:
                    assert todo is not None
                    todo.offset, todo.gen = off, store.take_gen()
                continue
            if not self.may_evict:
                raise ArenaFullError("no room left without evicting")
            if not store.evict_one():
                if not self.revoked and store.revoke_stale_leases():
                    self.revoked = True
                    continue
                raise ArenaFullError(FULL)
            if time.monotonic() >= deadline:
                return False

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

    # ------------------------------------------------------------------ write
    def _write(self, deadline: float) -> bool:
        """Write the new chunks, then the body, a piece at a time; True once all is in."""
        store = self.store
        assert self.offset is not None
        assert self.staged is not None or self.grouped is not None
        while self.written < len(self.new):
            # a batch of new chunks (about WRITE_BATCH bytes) written together, then
            # their headers
            batch: list[tuple[Chunk, int]] = []
            size = 0
            for c, i in zip(self.new[self.written :], self.new_groups[self.written :], strict=True):
                if batch and size + c.length > WRITE_BATCH:
                    break
                batch.append((c, i))
                size += c.length
            for c, _ in batch:
                if not store.pages.allocate(c.offset, c.extent):
                    store.counters.shm_full_puts += 1
                    raise ArenaFullError(SHM_FULL)
            dests = [(i, store.arena.chunk_data(c.offset, c.length)) for c, i in batch]
            try:
                self._copy_groups(dests)
            finally:
                for _, dest in dests:
                    dest.release()
            for c, _ in batch:
                store.counters.chunk_bytes_copied += c.length
                store.arena.write_chunk_header(c.offset, c.gen, c.length, c.key[2], self.publisher)
            self.written += len(batch)
            if time.monotonic() >= deadline:
                return False
        view = store.arena.payload(
            self.offset, len(self.tokens), len(self.fingerprint), self.body_len
        )
        try:
            if self.layout is not None:
                self._write_body(view)
                return True
            assert self.staged is not None
            src = memoryview(self.staged)
            try:
                while self.body_written < self.body_len:
                    end = min(self.body_len, self.body_written + self.piece)
                    self._allocate(self.payload_offset + end)
                    view[self.body_written : end] = src[self.body_written : end]
                    self.body_written = end
                    if self.body_written < self.body_len and time.monotonic() >= deadline:
                        return False
            finally:
                src.release()
        finally:
            view.release()
        return True

    def _write_body(self, view: memoryview) -> None:
        """A chunked record's body (manifest, references, inline groups: a partial group's
        few rows each), in one go."""
        assert self.layout is not None
        self._allocate(self.payload_offset + self.body_len)
        refs = [
            ChunkRef(off, 0, size) if c is None else ChunkRef(c.offset, c.gen, c.length)
            for c, size, off in zip(
                self.refs, self.layout.group_sizes, self.inline_offs, strict=True
            )
        ]
        head = pack_body_head(self.manifest, self.stored_manifest, refs)
        view[: len(head)] = head
        self._copy_groups(
            [
                (i, view[off : off + size])
                for i, (c, size, off) in enumerate(
                    zip(self.refs, self.layout.group_sizes, self.inline_offs, strict=True)
                )
                if c is None
            ]
        )
        self.body_written = self.body_len

    # ----------------------------------------------------------------- finish
    def _finish(self) -> Entry:
        store = self.store
        assert self.offset is not None
        # another put of the same content may have finished between our steps
        dup = store.duplicate(self.content, self.pin)
        if dup is not None:
            self.abort()
            return dup
        if self.pin:
            store.check_pin(self._footprint())  # others may have pinned between our steps
        offset, self.offset = self.offset, None
        return self._record(offset)

    def abort(self) -> None:
        """Give back the space taken and the references held (the put is over, done or not)."""
        store = self.store
        if self.offset is not None:
            store.alloc.release(self.offset, self.extent)
            store.pages.freed(self.offset, self.extent)
            self.offset = None
        for c in self.new:
            if c.offset >= 0:
                store.alloc.release(c.offset, c.extent)
                store.pages.freed(c.offset, c.extent)
                c.offset = -1
        for c in self.held:
            store.chunks.unref(c)
        self._drop_plan()

    def _drop_plan(self) -> None:
        """Forget the plan; give the staged payload back to the kernel and its share of
        :data:`STAGE_BUDGET` to the puts in line."""
        self.new, self.new_groups, self.held, self.refs = [], [], [], []
        self.layout = None
        self.grouped, self._pieces = None, None
        staged, self.staged, self.given = self.staged, None, None
        if isinstance(staged, mmap.mmap):
            try:
                staged.close()
            except BufferError:  # (a view still out: the mapping goes with its last one)
                pass
        self.store.staging.give(self)

    def _record(self, offset: int) -> Entry:
        """Write the record of a filled and checked payload, then index it."""
        store = self.store
        gen = store.take_gen()
        created = time.time()
        digests, pin = self.digests, self.pin
        chunked = self.layout is not None
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
            body_len=self.body_len if chunked else None,
        )
        for c in self.new:  # written in full: findable, and referenced below
            store.chunks.add(c)
        held = set(map(id, self.held))
        chunks = [c for c in self.refs if c is not None]
        for c in chunks:
            if id(c) not in held:  # (a reused chunk's reference is held already)
                store.chunks.ref(c)
        self.new, self.held = [], []
        self._drop_plan()
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
            chunks=chunks,
        )
        store.insert(e)
        store.counters.puts += 1
        store.counters.bytes_put += self.payload_len
        if chunked:
            store.counters.chunked_puts += 1
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
