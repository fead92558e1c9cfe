"""A worker's ledger: every number its cache counts, counted in one place.

Runs inside a worker. The counters are declared in ``shmkv.stats``
(:class:`~shmkv.stats.WorkerCounters`); this is where a worker adds to them.
The ones the supervisor sums over all workers (``stats.REPORTED``) are set
aside by the same call, until the publisher thread sends them in a
``report``, so the worker's own totals and the supervisor's sums cannot drift
apart. Failures are counted by kind and logged once per kind.
"""

from __future__ import annotations

import logging
import threading

from .stats import REPORTED, WorkerCounters

#: the counters a ``report`` carries; tokens_restored travels with each lease's release
_REPORTED = frozenset(REPORTED) - {"tokens_restored"}


class Ledger:
    """One cache's running totals, and the part of them not yet reported."""

    def __init__(self, logger: logging.Logger) -> None:
        self.totals = WorkerCounters()
        self.log = logger
        self._unreported: dict[str, int] = {}
        self._lock = threading.Lock()
        self._warned: set[str] = set()

    def add(self, **counts: float) -> None:
        """Add to the totals, and set aside the deltas the supervisor sums."""
        reported = {}
        for k, v in counts.items():
            setattr(self.totals, k, getattr(self.totals, k) + v)
            if k in _REPORTED:
                reported[k] = int(v)
        if reported:
            with self._lock:
                for k, v in reported.items():
                    self._unreported[k] = self._unreported.get(k, 0) + v

    def fail(self, kind: str, err: BaseException | str) -> None:
        """Count a cache failure and log it once per kind."""
        self.totals.errors[kind] = self.totals.errors.get(kind, 0) + 1
        if kind not in self._warned:
            self._warned.add(kind)
            self.log.warning(
                "shmkv %s (falling back to a cold prefill; logged once): %s", kind, err
            )
        else:
            self.log.debug("shmkv %s: %s", kind, err)

    def unreported(self) -> bool:
        with self._lock:
            return bool(self._unreported)

    def take_unreported(self) -> dict[str, int]:
        """The deltas not yet reported; the caller sends them."""
        with self._lock:
            out, self._unreported = self._unreported, {}
        return out
