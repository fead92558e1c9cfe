"""The workers' reported counters, kept by the supervisor so that they only go up.

Runs in the supervisor, on its one thread. A worker's cache reports its running
totals (``stats.REPORTED``) under a reporter id of its own, not deltas: the
supervisor keeps each live reporter's latest totals, and when its connection
closes, adds them to the sums of reporters gone. So

* a worker that dies (or restarts) leaves its counts in the sums; what it had
  not reported yet is all that is lost;
* a report lost on the way costs nothing: the next one carries it;
* after a supervisor restart each live worker reports its totals again (its
  publisher re-reports every few seconds), so the sums of the live workers do
  not go backwards (those of workers gone before the restart are lost: a counter
  reset, as Prometheus sees any restart);
* a reporter that reconnects (same pid, same id) takes its totals back out of
  the sums of those gone, so nothing is counted twice; totals never decrease
  (a lower value than before is ignored).

Everything is per label set (model alias, tenant), at most ``MAX_SERIES`` of
them (more fall into ``other``), at most ``MAX_REPORTERS`` per connection.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from shmkv.core.errors import BadRequest
from shmkv.core.stats import REPORTED, Series, WorkerCounters, merge

#: label sets kept apart; the rest are summed under ("other", "other")
MAX_SERIES = 64
#: reporter ids one connection may use (a worker has one per model it serves)
MAX_REPORTERS = 16
#: reporters whose connection closed, remembered so that a reconnect is not counted twice
MAX_GONE = 1024
#: failure kinds kept apart per label set; the rest are counted as "other"
MAX_KINDS = 64
OTHER = ("other", "other")

Labels = tuple[str, str]


@dataclass
class Reporter:
    labels: Labels
    totals: WorkerCounters = field(default_factory=WorkerCounters)


class Reports:
    """Live reporters' totals plus the sums of those gone, per label set."""

    def __init__(self) -> None:
        #: per label set: reporters gone, and counts given without a reporter (a release's
        #: ``tokens_restored``)
        self.gone_sums: dict[Labels, WorkerCounters] = {}
        #: connection id -> reporter id -> its latest totals
        self.live: dict[int, dict[int, Reporter]] = {}
        #: (pid, reporter id) of reporters whose connection closed -> what they added
        self.gone: OrderedDict[tuple[int, int], Reporter] = OrderedDict()
        self._pids: dict[int, int] = {}

    def _labels(self, labels: Labels) -> Labels:
        if labels in self.gone_sums or any(
            r.labels == labels for reps in self.live.values() for r in reps.values()
        ):
            return labels
        known = set(self.gone_sums) | {
            r.labels for reps in self.live.values() for r in reps.values()
        }
        return labels if len(known) < MAX_SERIES else OTHER

    def report(
        self, conn: int, pid: int, reporter: int, labels: Labels, counters: dict[str, Any]
    ) -> None:
        """Reporter ``reporter`` of connection ``conn`` (process ``pid``) has these totals."""
        reps = self.live.setdefault(conn, {})
        self._pids[conn] = pid
        rep = reps.get(reporter)
        if rep is None:
            if len(reps) >= MAX_REPORTERS:
                raise BadRequest(f"more than {MAX_REPORTERS} reporters on one connection")
            # back after a reconnect (same process, id and labels; id 0 is a connection's
            # own): out of the sums of those gone, so that it is not counted twice
            rep = self.gone.pop((pid, reporter), None) if reporter else None
            if rep is not None and rep.labels == self._labels(labels):
                merge(self.gone_sums[rep.labels], rep.totals, -1)
            else:
                rep = Reporter(self._labels(labels))
            reps[reporter] = rep
        _raise_to(rep.totals, counters)

    def add(self, **counts: int) -> None:
        """Counts given once, without a reporter (they only add up)."""
        merge(self.gone_sums.setdefault(("", ""), WorkerCounters()), counts)

    def closed(self, conn: int) -> None:
        """Connection ``conn`` closed: its reporters' totals join the sums of those gone."""
        pid = self._pids.pop(conn, 0)
        for rid, rep in self.live.pop(conn, {}).items():
            sums = self.gone_sums.setdefault(rep.labels, WorkerCounters())
            merge(sums, rep.totals)
            _cap_kinds(sums.errors)
            if not rid:
                continue
            self.gone[(pid, rid)] = rep
            self.gone.move_to_end((pid, rid))
            while len(self.gone) > MAX_GONE:
                self.gone.popitem(last=False)

    def series(self) -> list[Series]:
        """The sums per label set (a copy)."""
        out: dict[Labels, WorkerCounters] = {k: copy.deepcopy(v) for k, v in self.gone_sums.items()}
        for reps in self.live.values():
            for rep in reps.values():
                merge(out.setdefault(rep.labels, WorkerCounters()), rep.totals)
        return [Series(m, t, c) for (m, t), c in sorted(out.items())]

    def total(self, series: list[Series]) -> WorkerCounters:
        total = WorkerCounters()
        for s in series:
            merge(total, s.counters)
        return total


def _raise_to(totals: WorkerCounters, counters: dict[str, Any]) -> None:
    """Set each reported field of ``totals`` to the reported value where that is higher."""
    for k, v in counters.items():
        if k not in REPORTED:
            continue
        mine = getattr(totals, k)
        if isinstance(mine, list):
            for i in range(min(len(mine), len(v))):
                mine[i] = max(mine[i], v[i])
        elif isinstance(mine, dict):
            for kind, n in v.items():
                if kind not in mine and len(mine) >= MAX_KINDS:
                    kind = "other"
                mine[kind] = max(mine.get(kind, 0), n)
        else:
            setattr(totals, k, max(mine, v))


def _cap_kinds(counts: dict[str, int]) -> None:
    """Keep at most ``MAX_KINDS`` kinds: the smallest of the rest go into ``other``."""
    if len(counts) <= MAX_KINDS:
        return
    extra = sorted((k for k in counts if k != "other"), key=lambda k: counts[k])
    for k in extra[: len(counts) - MAX_KINDS + 1]:
        counts["other"] = counts.get("other", 0) + counts.pop(k)
