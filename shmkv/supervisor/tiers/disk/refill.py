"""Refill a new arena from ``--persist`` while the supervisor already serves.

Runs in the supervisor: a reader thread loads records from the LMDB store (pinned
first, then most recently used first), a whole one into a private copy and a chunked one
as its groups where they lie in LMDB's map (every page read on the thread), so that disk
reads and page faults never happen on the loop, and hands them over through a queue of
:data:`AHEAD` records; the loop takes each through the same
:class:`~shmkv.supervisor.put.PutJob` as a worker's put (bounds, checksum of the payload,
fingerprint and token fields), a ``--put-slice`` at a time between other peers'
requests. A chunked record is never assembled: the put compares each full group with the
chunk the arena may hold already and copies only the groups it lacks, straight from the
map (``Store.put_record`` with a ``kvformat.Grouped``). A record that fails a check is
skipped, counted and removed from disk. A refill never evicts: it stops once the arena
is full, and each record it loads goes to the cold end of the arena's LRU (older than
those loaded before it). What is not loaded yet is a miss, as for any prefix nobody
published.

Every record is one step, whatever becomes of it: loaded, skipped (a check failed, it
can never fit, a pin past the limit), gone from disk meanwhile, or already in the
arena (a worker republished it since the start, or an adopted arena held it: those
the arena held when the refill started are not even read from disk).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable

from shmkv.core.arena import DIGEST_SIZE
from shmkv.core.errors import ArenaFullError, ChecksumMismatch, ShmkvError, TierError
from shmkv.core.stats import PersistStats
from shmkv.supervisor.put import PutJob
from shmkv.supervisor.store import Store
from shmkv.supervisor.tiers.base import TierHook
from shmkv.supervisor.tiers.disk.lmdb_store import ChunkedLoad, DiskRecord, LmdbTier

log = logging.getLogger(__name__)

#: records loaded ahead of the loop (their payloads are held in memory)
AHEAD = 2
_DONE = object()


class Refill:
    """The refill: a reader thread, and :meth:`step` for the supervisor's loop."""

    def __init__(
        self,
        store: Store,
        disk: LmdbTier,
        opened: threading.Event,
        stats: PersistStats,
        forget: Callable[[bytes], None],
        source: TierHook | None = None,
        held: frozenset[bytes] = frozenset(),
    ) -> None:
        self.store, self.disk, self.opened, self.stats = store, disk, opened, stats
        #: the records the arena held at the start (adopted): not read from disk
        self.held = held
        #: the disk's write-behind: not told of what it loads (the other tiers are)
        self.source = source
        #: tell the write-behind to remove a record found corrupt
        self.forget = forget
        self._q: queue.Queue[object] = queue.Queue(AHEAD)
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._stop = threading.Event()
        self._job: PutJob | None = None
        #: the chunked record the job reads from LMDB's map (closed when the job is over)
        self._load: ChunkedLoad | None = None
        self._content = b""
        self.done = False
        self._t0 = 0.0
        self._thread = threading.Thread(target=self._read, name="shmkv-refill", daemon=True)

    def start(self) -> None:
        self._t0 = time.monotonic()
        self.stats.refilling = 1
        self._thread.start()

    def fileno(self) -> int:
        """Readable when records are ready: the loop registers it in its selector."""
        return self._wake_r

    # ------------------------------------------------------- the reader thread
    def _read(self) -> None:
        item: object
        while not self.opened.wait(0.5):
            if self._stop.is_set():
                return
        for content in self.disk.order:
            if self._stop.is_set():
                return
            if content in self.held:
                continue
            try:
                item = (content, self.disk.load(content))
            except TierError as e:
                item = (content, e)
            except Exception as e:  # (LMDB closed under us at shutdown, or a bug)
                if not self._stop.is_set():
                    log.exception("refill: cannot read %s", content.hex()[:12])
                item = (content, TierError(str(e), "io"))
            if not self._put(item):
                _close_item(item)
                return
        self._put(_DONE)

    def _put(self, item: object) -> bool:
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=0.2)
            except queue.Full:
                continue
            try:
                os.write(self._wake_w, b"\0")
            except BlockingIOError:
                pass
            return True
        return False

    # ---------------------------------------------------------------- the loop
    @property
    def busy(self) -> bool:
        """A put is half done, or a record is waiting: step again without waiting."""
        return not self.done and (self._job is not None or not self._q.empty())

    def step(self, deadline: float) -> None:
        """Load records until ``deadline`` (time.monotonic) or until none is ready."""
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        while not self.done and time.monotonic() < deadline:
            if self._job is None:
                if not self._next():
                    return
                if self._job is None:  # that record was a step of its own
                    continue
            try:
                entry = self._job.step(deadline)
            except ArenaFullError:
                log.info("refill: the arena is full; the rest stays on disk")
                self._end_job()
                self._finish()
                return
            except ShmkvError as e:
                self._skip(self._content, e)
                self._end_job()
                continue
            if entry is None:
                return
            self.store.make_oldest(entry)  # older than every record loaded before
            self.stats.refilled += 1
            self.stats.refilled_bytes += entry.payload_len
            if self.stats.refilled == 1:
                self.stats.refill_first_seconds = time.monotonic() - self._t0
            self._end_job()

    def _end_job(self) -> None:
        """The job is over: close the chunked record it read."""
        self._job = None
        load, self._load = self._load, None
        if load is not None:
            load.close()

    def _next(self) -> bool:
        """Take the next loaded record: start its put (``_job``), or skip it, or find it
        gone from disk or already in the arena (``_job`` stays None). False if none is
        ready."""
        try:
            item = self._q.get_nowait()
        except queue.Empty:
            return False
        if item is _DONE:
            self._finish()
            return False
        content: bytes
        got: tuple[DiskRecord, bytes | ChunkedLoad] | TierError | None
        content, got = item  # type: ignore[misc]
        if got is None:  # evicted from disk meanwhile
            return True
        if isinstance(got, TierError):
            self._skip(content, got)
            return True
        rec, payload = got
        try:
            job = self._begin(rec, payload)
        except ShmkvError as e:  # (one that can never fit, or a pin past the limit)
            self._skip(content, e)
            _close_item(item)
            return True
        if job.done:  # (done at once: a worker published it again meanwhile)
            _close_item(item)
        else:
            self._job, self._content = job, content
            self._load = payload if isinstance(payload, ChunkedLoad) else None
        return True

    def _begin(self, rec: DiskRecord, payload: bytes | ChunkedLoad) -> PutJob:
        if len(rec.root) != DIGEST_SIZE:
            raise TierError("bad root", "corrupt")
        data = payload.grouped if isinstance(payload, ChunkedLoad) else payload
        return self.store.put_record(rec, data, self.source, may_evict=False)

    def _skip(self, content: bytes, e: ShmkvError) -> None:
        self.stats.refill_skipped += 1
        log.warning("refill: skipped state %s: %s", content.hex()[:12], e)
        if isinstance(e, ChecksumMismatch) or (isinstance(e, TierError) and e.kind == "corrupt"):
            self.forget(content)

    def _finish(self) -> None:
        if self.done:
            return
        self.done = True
        self.stats.refilling = 0
        self.stats.refill_seconds = time.monotonic() - self._t0
        self._stop.set()
        log.info(
            "refill: %d states (%d bytes) in %.2f s, %d skipped",
            self.stats.refilled,
            self.stats.refilled_bytes,
            self.stats.refill_seconds,
            self.stats.refill_skipped,
        )

    def abandon(self) -> None:
        """End the refill now (after an internal error), without waiting for the reader
        thread: it stops by itself; :meth:`close` joins it and closes the wake fd."""
        self._stop.set()
        if self._job is not None:
            self._job.abort()
        self._end_job()
        self.done = True
        self.stats.refilling = 0

    def close(self) -> None:
        """Stop the reader thread (the supervisor stops); never raises, may run twice.
        The loop unregisters :meth:`fileno` first: a closed number is soon reused."""
        self.abandon()
        if self._thread.is_alive():
            self._thread.join(5.0)
        while True:  # (the records loaded and not taken: their views of the map)
            try:
                _close_item(self._q.get_nowait())
            except queue.Empty:
                break
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = -1


def _close_item(item: object) -> None:
    """Close the chunked record a queued item holds, if it holds one."""
    if isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], tuple):
        payload = item[1][1]
        if isinstance(payload, ChunkedLoad):
            payload.close()
