"""Hands captured states and counter reports to the supervisor, off the token path.

Runs inside a worker: one background thread per cache (restarted after a
fork), fed by a small queue. It owns the cache's writer connection (its own
socket, so a slow put never holds up a lease on the reader) and the count of
items still in flight (what ``flush`` waits for), and sends the counters the
cache's ledger set aside for the supervisor. A hybrid's checkpoints come with the
state they are cut from (``kvformat.hybrid_layout``): each is written here, off the token
path, from that state's attention cells and the checkpoint's own recurrent state, and put
before it. A full queue drops a state rather
than block generation. Every ``REPORT_EVERY`` seconds it sends the counters
again even if nothing changed, so that a restarted supervisor has every live
worker's totals back within seconds.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from shmkv.core import kvformat
from shmkv.core.client import Blob, Client
from shmkv.core.config import Settings
from shmkv.core.errors import ShmkvError
from shmkv.llama.counters import Ledger

log = logging.getLogger(__name__)

#: seconds between two reports of unchanged counters (a restarted supervisor learns them)
REPORT_EVERY = 5.0

#: called on the publisher thread when a put failed: (error, the digests it claimed)
OnFailure = Callable[[BaseException, list[bytes] | None], None]

#: a hybrid's checkpoint held until the state it is cut from is published: its length,
#: and its recurrent state as ``kvstate.copy_recurrent`` copied it
Checkpoint = tuple[int, bytes]


def _write_cut(
    cut: kvformat.HybridCut, blob: memoryview, recurrent: bytes, addr: int, size: int
) -> None:
    """``Client.prepare``'s fill for a hybrid checkpoint: ``cut`` written at ``addr``."""
    with memoryview((ctypes.c_uint8 * size).from_address(addr)).cast("B") as out:
        cut.write(blob, recurrent, out)


class Publisher:
    """The background thread that puts blobs and reports counters for one cache."""

    def __init__(
        self,
        settings: Settings,
        fingerprint: bytes,
        ledger: Ledger,
        on_failure: OnFailure,
        max_pending: int = 2,
    ) -> None:
        self.writer = Client(settings=settings, populate=False)
        self.fingerprint, self.on_failure = fingerprint, on_failure
        self.ledger = ledger
        self._queue: queue.Queue[tuple[Any, ...] | None] = queue.Queue(maxsize=max_pending)
        self._pending = 0
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._thread_pid = -1
        self._reported_at = 0.0
        #: seconds ``submit`` waits for room in a full queue (0: drop the state, as a
        #: serving worker must not hold a request up; ``shmkv warm`` waits instead)
        self.wait_for_room = 0.0
        #: called on the publisher thread when a checkpoint could not be cut from its state
        #: (the cache then captures checkpoints whole)
        self.on_cut_refused: Callable[[], None] = lambda: None

    def submit(
        self,
        root: bytes,
        tokens: np.ndarray,
        blob: Blob,
        pin: bool = False,
        claimed: list[bytes] | None = None,
        cuts: list[Checkpoint] | None = None,
    ) -> bool:
        """Queue ``blob`` (the state of ``tokens``, keyed from ``root``) for the supervisor;
        False (and the blob closed) if the queue is full (after ``wait_for_room``).
        ``claimed``: digests to unclaim if the put fails; ``cuts``: a hybrid's checkpoints
        of shorter prefixes of ``tokens``, cut from ``blob`` and put first."""
        self._start()
        try:
            with self._cv:
                self._pending += 1
            item = ("put", root, tokens, blob, pin, claimed, cuts or [])
            if self.wait_for_room > 0:
                self._queue.put(item, timeout=self.wait_for_room)
            else:
                self._queue.put_nowait(item)
        except queue.Full:
            with self._cv:
                self._pending -= 1
            blob.close()
            return False
        return True

    def on_its_thread(self) -> bool:
        """Whether the caller runs on this publisher's thread."""
        return self._thread is threading.current_thread()

    def report_soon(self) -> None:
        """Send the ledger's counters from the thread (a queued publish sends them too)."""
        if not self.ledger.unreported():
            return
        with self._cv:
            self._pending += 1
        self._start()
        try:
            self._queue.put_nowait(("report",))
        except queue.Full:
            with self._cv:
                self._pending -= 1

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until queued publishes and counters reached the supervisor."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        self._send_report()
        return True

    def close(self) -> None:
        """Flush (briefly), stop the thread, close the writer connection."""
        self.flush(timeout=5.0)
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=2.0)
        self.writer.close()

    def _start(self) -> None:
        if self._thread is not None and self._thread.is_alive() and self._thread_pid == os.getpid():
            return
        self._thread_pid = os.getpid()
        self._thread = threading.Thread(target=self._run, name="shmkv-publish", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=REPORT_EVERY)
            except queue.Empty:
                self._send_report(force=time.monotonic() - self._reported_at >= REPORT_EVERY)
                continue
            if item is None:
                return
            try:
                if item[0] == "put":
                    self._put(*item[1:])
            finally:
                self._send_report()
                with self._cv:
                    self._pending -= 1
                    self._cv.notify_all()

    def _put(
        self,
        root: bytes,
        tokens: np.ndarray,
        blob: Blob,
        pin: bool,
        claimed: list[bytes] | None,
        cuts: list[Checkpoint],
    ) -> None:
        try:
            if cuts:
                self._put_cuts(root, tokens, blob, cuts)
            self.writer.put_blob(root, tokens, self.fingerprint, blob, pin=pin)
        except Exception as e:  # ShmkvError or a bug: never let the thread die
            self.on_failure(e, claimed)
        finally:
            blob.close()

    def _put_cuts(
        self, root: bytes, tokens: np.ndarray, blob: Blob, cuts: list[Checkpoint]
    ) -> None:
        """Put each hybrid checkpoint of ``tokens[:n]``: ``blob``'s first ``n`` attention
        cells and its own recurrent state (``blob`` read once, then one copy into a memfd
        per checkpoint; the supervisor finds the full chunks it shares with ``blob``
        already stored, or stores them once)."""
        with blob.view() as whole:
            layout = kvformat.hybrid_layout(whole)
            for n, recurrent in cuts:
                cut = None if layout is None else layout.cut(n, recurrent)
                if cut is None:
                    self.on_cut_refused()
                    continue
                part = self.writer.prepare(
                    cut.size, functools.partial(_write_cut, cut, whole, recurrent)
                )
                try:
                    self.writer.put_blob(root, tokens[:n], self.fingerprint, part)
                except Exception as e:  # (the state it is cut from is put all the same)
                    self.on_failure(e, None)
                finally:
                    part.close()

    def _send_report(self, force: bool = False) -> None:
        fields = self.ledger.report(force)
        if fields:
            try:
                self.writer.send_report(fields)
                self._reported_at = time.monotonic()
            except ShmkvError:
                self.ledger.unsent()
