"""A worker's ledger: every number its cache counts, counted in one place.

Runs inside a worker. The counters are declared in ``shmkv.core.stats``
(:class:`~shmkv.core.stats.WorkerCounters`); this is where a worker adds to them.
The ones the supervisor sums over all workers (``stats.REPORTED``) are sent,
as running totals under this ledger's reporter id, by the publisher thread
(:meth:`report`), so the worker's own totals and the supervisor's sums cannot
drift apart, and a lost or repeated report changes nothing (see
``shmkv/supervisor/worker_counters.py``). Failures are counted by kind and logged once per kind.
"""

from __future__ import annotations

import copy
import logging
import os
import re
import secrets
import threading
from dataclasses import fields
from typing import Any

from shmkv.core.protocol import LABEL_RE, MAX_KINDS
from shmkv.core.stats import REPORTED, WorkerCounters, merge, observe, reported_dict

#: observed values (a ``seconds`` field) -> the histogram field that buckets them
_HISTOGRAMS = {
    f.metadata["sum_of"]: (f.name, f.metadata["buckets"])
    for f in fields(WorkerCounters)
    if "sum_of" in f.metadata
}


def label(text: str) -> str:
    """``text`` as a label value the supervisor accepts (``protocol.LABEL_RE``)."""
    out = re.sub(r"[^A-Za-z0-9 ._:@+-]", "_", text)[:64].lstrip(" ._:@+-")
    return out


class Ledger:
    """One cache's running totals, and whether the supervisor has the latest."""

    def __init__(self, logger: logging.Logger) -> None:
        self.totals = WorkerCounters()
        self.log = logger
        #: model alias and tenant the totals are reported under (``cache.labels``)
        self.labels = ("", "")
        self._dirty = False
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        self._pid = os.getpid()
        self._reporter = secrets.randbits(63)
        #: what the totals held when this process forked from the one that counted them
        self._base = WorkerCounters()

    def add(self, **counts: float) -> None:
        """Add to the totals (a ``seconds`` field with a histogram is also observed)."""
        with self._lock:
            for k, v in counts.items():
                setattr(self.totals, k, getattr(self.totals, k) + v)
                if k in _HISTOGRAMS:
                    name, bounds = _HISTOGRAMS[k]
                    observe(getattr(self.totals, name), bounds, float(v))
                if k in REPORTED:
                    self._dirty = True

    def fail(self, kind: str, err: BaseException | str) -> None:
        """Count a cache failure and log it once per kind."""
        with self._lock:
            self.totals.errors[kind] = self.totals.errors.get(kind, 0) + 1
            self._dirty = True
        if kind not in self._warned:
            self._warned.add(kind)
            self.log.warning(
                "shmkv %s (falling back to a cold prefill; logged once): %s", kind, err
            )
        else:
            self.log.debug("shmkv %s: %s", kind, err)

    def unreported(self) -> bool:
        return self._dirty

    def report(self, force: bool = False) -> dict[str, Any] | None:
        """The fields of a ``report`` message (reporter id, labels, totals), or None if the
        supervisor already has them (``force``: send them anyway, e.g. to a new
        supervisor). A forked child reports under a new id only what it counted itself."""
        with self._lock:
            if not (self._dirty or force):
                return None
            if os.getpid() != self._pid:  # a forked child: its parent reports the rest
                self._pid, self._reporter = os.getpid(), secrets.randbits(63)
                self._base = copy.deepcopy(self.totals)
            mine = copy.deepcopy(self.totals)
            self._dirty = False
        merge(mine, self._base, -1)
        counters = reported_dict(mine)
        kinds: dict[str, int] = {}
        for kind, n in counters["errors"].items():
            key = kind if LABEL_RE.match(kind) and len(kinds) < MAX_KINDS - 1 else "other"
            kinds[key] = kinds.get(key, 0) + n
        counters["errors"] = kinds
        model, tenant = self.labels
        return {"reporter": self._reporter, "model": label(model), "tenant": label(tenant),
                "counters": counters}  # fmt: skip

    def unsent(self) -> None:
        """The last :meth:`report` did not reach the supervisor: send again."""
        self._dirty = True
