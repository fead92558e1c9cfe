"""``--persist`` wired into the supervisor: write-behind, LMDB store, refill, numbers.

Runs in the supervisor. :class:`Persistence` is what ``loop.py`` holds: made at
start (no disk I/O there: the writer thread opens the store), hooked into the store
(every record accepted, used, pinned goes to the write-behind), asked to refill a
new arena once the socket serves, read for ``stats`` and closed at shutdown.
"""

from __future__ import annotations

import logging

from shmkv.core.config import Settings
from shmkv.core.errors import LimitExceeded
from shmkv.core.stats import PersistStats
from shmkv.supervisor.store import Store
from shmkv.supervisor.tiers.base import Forget, PayloadSource, WriteBehind, merged_errors
from shmkv.supervisor.tiers.disk.lmdb_store import LmdbTier
from shmkv.supervisor.tiers.disk.refill import Refill

log = logging.getLogger(__name__)


class Persistence:
    """The write-behind to ``--persist`` and the refill from it."""

    def __init__(self, settings: Settings, ro_fd: int, chunk_tokens: int = 0) -> None:
        size = settings.persist_size or 4 * settings.size
        self.disk = LmdbTier(settings.persist, size, chunk_tokens)
        self.writer = WriteBehind(self.disk, PayloadSource(ro_fd))
        self.stats = PersistStats()
        self.refill: Refill | None = None

    def attach(self, store: Store) -> None:
        """Tell the write-behind of every record ``store`` accepts; start its thread."""
        store.tiers.append(self.writer)
        self.writer.start()

    def start_refill(self, store: Store, held: frozenset[bytes] = frozenset()) -> Refill:
        """Load the disk's records into the arena, in the background, but for ``held``
        (the contents an adopted arena holds already)."""
        self.refill = Refill(
            store,
            self.disk,
            self.writer.opened,
            self.stats,
            forget=lambda content: self.writer.offer(Forget(content)),
            source=self.writer,
            held=held,
        )
        self.refill.start()
        return self.refill

    def repin(self, store: Store) -> bool:
        """Pin the adopted records the disk holds pinned (the arena file keeps no pins, the
        disk does: a restart that adopts must not lose what a reboot's refill keeps).
        False until the store is open (the writer thread opens it); then True, done."""
        if not self.writer.opened.is_set():
            return False
        n = 0
        for content in self.disk.pinned_at_open:
            gen = store.by_content.get(content)
            e = store.entries.get(gen) if gen is not None else None
            if e is None or e.pinned:
                continue
            try:
                store.set_pinned(e, True)
            except LimitExceeded as err:
                log.warning("persist: adopted state %s not pinned again: %s", content.hex(), err)
                continue
            n += 1
        if n:
            log.info("persist: pinned %d adopted state(s) again, as on disk", n)
        return True

    def numbers(self) -> PersistStats:
        """The ``persist_*`` and ``refill*`` numbers as of now."""
        s, w, d = self.stats, self.writer, self.disk
        s.persist_on = int(w.opened.is_set() and d.env is not None)
        s.persist_paused = w.paused
        s.persist_queue = w.queued()
        s.persist_records = len(d.lru)
        s.persist_bytes = d.bytes
        s.persisted = d.written
        s.persisted_bytes = d.written_bytes
        s.persist_dropped = w.dropped
        s.persist_gone = d.gone
        s.persist_evictions = d.evicted
        s.persist_errors = merged_errors(w.errors, d.errors)
        return s

    def close(self) -> None:
        """Stop the refill, write what is queued (a few seconds at most), close the store."""
        if self.refill is not None:
            self.refill.close()
        self.writer.close()
