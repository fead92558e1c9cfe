"""The supervisor loop's side of the slower tiers: ``--persist`` (write-behind to disk and
the refill of a new arena from it) and ``--remote`` (write-behind to Redis / Valkey and
fetches from it). Runs in the supervisor, on its loop: it opens the tiers, tells the loop
how long it may sleep and which of its descriptors to watch, and runs their slices of
work (``refill.py``, ``tiers/redis/tier.py``) between the loop's other work.
"""

from __future__ import annotations

import logging
import selectors
import time
from collections.abc import Callable
from typing import Any

from shmkv.core.config import Settings
from shmkv.core.errors import ArenaCorruptError
from shmkv.supervisor.arenafile import ArenaFile
from shmkv.supervisor.store import Store
from shmkv.supervisor.tiers.disk.refill import Refill
from shmkv.supervisor.tiers.disk.tier import Persistence
from shmkv.supervisor.tiers.redis.tier import Remote

log = logging.getLogger(__name__)


class TierLoop:
    """``--persist`` and ``--remote`` of one supervisor (each None when off)."""

    def __init__(self, settings: Settings, arena: ArenaFile, chunk_tokens: int) -> None:
        self.settings = settings
        assert arena.ro_fd is not None
        self.persist = (
            Persistence(settings, arena.ro_fd, chunk_tokens) if settings.persist else None
        )
        self.remote = Remote(settings, arena.ro_fd, chunk_tokens) if settings.remote else None
        self.refill: Refill | None = None
        #: an adopted arena: its pins come from the disk once it is open
        self._repin = False

    def attach(
        self,
        store: Store,
        sel: selectors.BaseSelector,
        answer: Callable[[int, int, dict[str, Any]], None],
        indexed: Callable[[list[bytes]], None],
    ) -> None:
        """Write what ``store`` accepts behind, and watch the remote fetcher."""
        if self.persist is not None:
            self.persist.attach(store)
        if self.remote is not None:
            self.remote.attach(store, answer, indexed)
            sel.register(self.remote.fileno(), selectors.EVENT_READ, "remote")

    def begin(self, store: Store, sel: selectors.BaseSelector, adopted: bool) -> None:
        """Serving starts: the arena is refilled from disk (an adopted one with what it
        lacks: its supervisor may have stopped mid-refill) and an adopted one re-pinned."""
        if self.persist is None:
            return
        self._repin = adopted
        self.refill = self.persist.start_refill(store, held=frozenset(store.by_content))
        sel.register(self.refill.fileno(), selectors.EVENT_READ, "refill")

    def tick(self, store: Store) -> None:
        """Once a second."""
        if self._repin and self.persist is not None:
            self._repin = not self.persist.repin(store)

    def timeout(self, now: float, timeout: float) -> float:
        """The loop's ``timeout``, shortened to what the tiers need."""
        if (self.refill is not None and self.refill.busy) or (
            self.remote is not None and self.remote.busy
        ):
            return 0.0
        if self.remote is not None and (due := self.remote.next_deadline()) is not None:
            timeout = min(timeout, max(0.0, due - now))
        return timeout

    def step(
        self,
        ready: set[str],
        sel: selectors.BaseSelector,
        check_arena: Callable[[], None],
    ) -> None:
        """The tiers' slices of work; ``ready``: which of their descriptors were readable."""
        if self.refill is not None and ("refill" in ready or self.refill.busy):
            self._step_refill(sel, check_arena)
        if self.remote is not None:
            self._step_remote("remote" in ready, check_arena)

    def _step_refill(self, sel: selectors.BaseSelector, check_arena: Callable[[], None]) -> None:
        """One slice of the refill from ``--persist`` (``refill.py``)."""
        refill = self.refill
        assert refill is not None
        try:
            check_arena()
            refill.step(time.monotonic() + self.settings.put_slice)
        except ArenaCorruptError:
            return
        except Exception:  # a bug must cost the refill, not the supervisor
            log.exception("internal error refilling the arena; the rest stays on disk")
            refill.abandon()
        if refill.done:
            self._end_refill(sel)

    def _end_refill(self, sel: selectors.BaseSelector) -> None:
        """Stop watching the refill's wake fd (closed later, by ``Persistence.close``:
        unregistered first, or the next socket given its number could not be watched)."""
        refill = self.refill
        self.refill = None
        if refill is not None:
            try:
                sel.unregister(refill.fileno())
            except (KeyError, ValueError):
                pass

    def _step_remote(self, ready: bool, check_arena: Callable[[], None]) -> None:
        """Fetch results in, one slice of putting them, answers due (``tiers/redis/tier.py``)."""
        remote = self.remote
        assert remote is not None
        try:
            if ready or remote.busy:
                check_arena()
                remote.step(time.monotonic() + self.settings.put_slice)
            remote.expire(time.monotonic())
        except ArenaCorruptError:
            return
        except Exception:  # a bug must cost the remote tier's answers, not the supervisor
            log.exception("internal error in the remote tier")
            remote.expire(float("inf"))

    def close(self, sel: selectors.BaseSelector) -> None:
        """Stop both (before the arena closes: their writers read records from it)."""
        if self.persist is not None:
            self._end_refill(sel)
            self.persist.close()
        if self.remote is not None:
            try:
                sel.unregister(self.remote.fileno())
            except (KeyError, ValueError):
                pass
            self.remote.close()
            self.remote = None
