"""Write-behind tiers: what the arena accepts is also copied, off the loop, to slower storage.

Runs in the supervisor. The store calls a tier's hooks on its loop (a record was
accepted, used, pinned or unpinned, or released by ``--ttl``); :class:`WriteBehind`
turns each into an event on a bounded queue and never blocks: an event that does not
fit, or that comes while the tier is paused after a failure, is dropped and counted.
One writer thread per tier takes the events in batches and applies them to its
:class:`Backend` (LMDB on disk in ``tiers/disk/lmdb_store.py``). A failure (a full disk, an
unwritable directory, a corrupt file) pauses the tier for a delay that doubles up to
:data:`MAX_BACKOFF`, is counted by kind and logged once per pause, and never reaches
a worker.

The payload is not copied on the loop: an :class:`Accepted` event carries where the
record is (offset, generation), and the writer thread reads it through its own
read-only mapping (:class:`PayloadSource`). By then the record may have been evicted
and its space reused; the backend checks the XXH3 of what it copied against the
record's, so a record that changed under the copy is skipped (counted as gone),
never stored torn.
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import xxhash

from shmkv.core.arena import ArenaView
from shmkv.core.errors import ArenaCorruptError, TierError

log = logging.getLogger(__name__)

#: events one tier's queue holds; past it events are dropped (the loop never waits)
MAX_EVENTS = 4096
#: events one batch (one transaction) takes at most
MAX_BATCH = 256
#: first and longest pause after a failure, seconds
FIRST_BACKOFF, MAX_BACKOFF = 0.5, 30.0


@dataclass(frozen=True)
class RecordMeta:
    """A record's identity and metadata, as the arena holds it and every tier keeps it."""

    root: bytes
    fingerprint: bytes
    #: token ids, little-endian int32
    tokens: bytes
    #: the uid that published it (the arena's publisher field)
    publisher: int
    pinned: bool
    payload_len: int
    payload_xxh3: int
    #: wall-clock time of the first put
    created: float


@dataclass(frozen=True)
class Accepted(RecordMeta):
    """The arena accepted a record: its identity and metadata, and where its payload is."""

    #: the record's content digest (root, fingerprint, tokens, publisher): its key in a tier
    content: bytes
    offset: int
    gen: int
    #: wall-clock time of the put (a use)
    when: float


def bytes_reader(payload: bytes | bytearray | memoryview) -> Callable[[memoryview, int], None]:
    """A ``Store.begin_put`` reader of a payload a tier holds in memory."""
    src = memoryview(payload)

    def read(view: memoryview, pos: int) -> None:
        view[:] = src[pos : pos + len(view)]

    return read


def merged_errors(*counts: dict[str, int]) -> dict[str, int]:
    """One tier's failures by kind: the sum of its threads' counts."""
    out: dict[str, int] = {}
    for errors in counts:
        for kind, n in errors.items():
            out[kind] = out.get(kind, 0) + n
    return out


@dataclass(frozen=True)
class Used:
    """A worker leased the record (a hit): a use, for the tier's own LRU."""

    content: bytes
    when: float


@dataclass(frozen=True)
class Pinned:
    """The record was pinned or unpinned."""

    content: bytes
    pinned: bool


@dataclass(frozen=True)
class Forget:
    """Remove the tier's copy: it was found corrupt or unusable, or --ttl released it."""

    content: bytes


Event = Accepted | Used | Pinned | Forget


class TierHook(Protocol):
    """What the store tells a tier, on the supervisor's loop; each call must not block."""

    def accepted(self, ev: Accepted) -> None: ...

    def used(self, content: bytes) -> None: ...

    def pinned(self, content: bytes, pinned: bool) -> None: ...

    def expired(self, content: bytes) -> None: ...


class PayloadSource:
    """Reads accepted records' payloads from the arena on a writer thread (read-only)."""

    def __init__(self, ro_fd: int) -> None:
        fd = os.dup(ro_fd)
        try:
            self.view = ArenaView(fd, populate=False)
        finally:
            os.close(fd)

    def payload(self, ev: Accepted) -> bytes | None:
        """A copy of the payload of ``ev``'s record if it is still in place, else None: a
        chunked record's assembled from its chunks (tiers keep whole blobs; a refill or
        fetch is split again when it lands in the arena).

        The record may be evicted, its pages punched and its space reused while we copy:
        so the copy is read with ``pread`` (a hole reads as zeros, never faults: see
        ``pages.py``), and the caller checks it with :func:`same_payload`.
        """
        try:
            self.view.check()
            rec, _ = self.view.peek(ev.offset, ev.gen)
            if rec.payload_len != ev.payload_len or rec.payload_xxh3 != ev.payload_xxh3:
                return None
            return self.view.read_payload(rec)
        except ArenaCorruptError:
            return None

    def chunk(self, where: tuple[int, int, int], digest: bytes) -> bytes | None:
        """A copy of the data of the chunk at ``where`` (offset, generation, length, as
        ``Chunks.where`` says) if its XXH3-128 is ``digest``, else None (freed, reused or
        torn while we read: read it from elsewhere)."""
        try:
            self.view.check()
            data, kept = self.view.read_chunk(*where)
        except ArenaCorruptError:
            return None
        if kept != digest or xxhash.xxh3_128_digest(data) != digest:
            return None
        return data

    def close(self) -> None:
        self.view.close()


def same_payload(copy: bytes | memoryview, ev: Accepted) -> bool:
    """Whether ``copy`` holds exactly the payload ``ev`` describes."""
    return len(copy) == ev.payload_len and xxhash.xxh3_64_intdigest(copy) == ev.payload_xxh3


class Backend(Protocol):
    """Where a tier keeps records; every method runs on the tier's writer thread."""

    #: a short name for logs
    name: str

    def open(self) -> None:
        """Get ready (open files, connect); raise TierError on failure (retried later)."""

    def apply(self, batch: list[Event], source: PayloadSource) -> None:
        """Apply ``batch`` at once; raise TierError if nothing of it may be assumed done."""

    def close(self) -> None:
        """Release what open() took; never raises."""


class WriteBehind:
    """A bounded event queue and the writer thread that applies it to a backend."""

    def __init__(
        self,
        backend: Backend,
        source: PayloadSource,
        max_events: int = MAX_EVENTS,
    ) -> None:
        self.backend = backend
        self.source = source
        self._q: queue.Queue[Event] = queue.Queue(max_events)
        self._stop = threading.Event()
        #: set once the backend opened (a refill waits for it)
        self.opened = threading.Event()
        #: False while paused after a failure: events are dropped, not queued
        self._accepting = True
        #: 1 from a failure until the next success
        self.paused = 0
        #: records (and pin changes) not queued: the queue was full or the tier paused
        self.dropped = 0
        #: failures by kind (TierError.kind)
        self.errors: dict[str, int] = {}
        self._backoff = FIRST_BACKOFF
        self._flush_deadline = 0.0
        self._thread = threading.Thread(target=self._run, name=f"shmkv-{backend.name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    # ------------------------------------------------------- the loop's side
    def offer(self, ev: Event) -> None:
        """Queue ``ev`` for the writer thread; never blocks (drops and counts instead)."""
        if self._accepting:
            try:
                self._q.put_nowait(ev)
                return
            except queue.Full:
                pass
        if not isinstance(ev, Used):  # (a lost use only makes the tier's LRU coarser)
            self.dropped += 1

    def accepted(self, ev: Accepted) -> None:
        """Hook: the store accepted a record (its payload is read later, by offset)."""
        self.offer(ev)

    def used(self, content: bytes) -> None:
        """Hook: a worker leased the record."""
        self.offer(Used(content, time.time()))

    def pinned(self, content: bytes, pinned: bool) -> None:
        """Hook: the record was pinned or unpinned."""
        self.offer(Pinned(content, pinned))

    def expired(self, content: bytes) -> None:
        """Hook: ``--ttl`` released the record (nobody used it): the tier forgets its copy
        too, or the next refill would bring back what nobody uses. (A backend may keep
        it: the remote tier lets a record live its own TTL.)"""
        self.offer(Forget(content))

    def queued(self) -> int:
        return self._q.qsize()

    def close(self, flush: float = 5.0) -> None:
        """Apply what is queued (for at most ``flush`` seconds), stop the thread, close."""
        self._flush_deadline = time.monotonic() + flush
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(flush + 1.0)
        if self._thread.is_alive():
            log.warning("%s writer still busy at shutdown; leaving it behind", self.backend.name)
            return
        self.backend.close()
        try:
            self.source.close()
        except BufferError:  # pragma: no cover (the thread is gone: no view is exported)
            pass

    # ------------------------------------------------------ the writer thread
    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.opened.is_set():
                if self._attempt(self.backend.open):
                    self.opened.set()
                continue
            batch = self._take(timeout=0.5)
            if batch:
                self._apply(batch)
        if self.opened.is_set():  # stopping: what is queued, while it goes well
            while time.monotonic() < self._flush_deadline and (batch := self._take(0.0)):
                if not self._apply(batch):
                    break

    def _apply(self, batch: list[Event]) -> bool:
        return self._attempt(functools.partial(self.backend.apply, batch, self.source), batch)

    def _take(self, timeout: float) -> list[Event]:
        try:
            first = self._q.get(timeout=timeout) if timeout > 0 else self._q.get_nowait()
        except queue.Empty:
            return []
        batch = [first]
        while len(batch) < MAX_BATCH:
            try:
                batch.append(self._q.get_nowait())
            except queue.Empty:
                break
        return batch

    def _attempt(self, fn: Callable[[], None], batch: list[Event] | None = None) -> bool:
        """Run ``fn``; on failure count it, log it once per pause and wait (backoff)."""
        try:
            fn()
        except TierError as e:
            self._failed(e.kind, str(e), batch)
            return False
        except Exception as e:  # a bug must cost persistence, never the supervisor
            log.exception("%s: internal error", self.backend.name)
            self._failed("internal", f"internal error: {e}", batch)
            return False
        if self.paused:
            log.info("%s: resumed", self.backend.name)
        self.paused = 0
        self._backoff = FIRST_BACKOFF
        return True

    def _failed(self, kind: str, message: str, batch: list[Event] | None) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1
        if batch:
            self.dropped += sum(1 for ev in batch if not isinstance(ev, Used))
        if not self.paused:
            log.warning("%s: paused (%s): %s", self.backend.name, kind, message)
        self.paused = 1
        self._accepting = False
        self._stop.wait(self._backoff)
        self._backoff = min(self._backoff * 2, MAX_BACKOFF)
        self._accepting = True
