"""Prometheus exposition of the supervisor's ``stats``, built from the schema in ``stats.py``.

Runs wherever metrics are scraped: in a gunicorn worker (``/metrics`` on the API
port, ``workers/metrics.py``) and in a thread of ``shmkv supervise
--metrics-port``. Either way :class:`StatsCollector` asks the supervisor for its
``stats`` over the socket (the supervisor answers on its loop, so the numbers
are one consistent snapshot and no thread touches the store) and turns every
field of :class:`~shmkv.core.stats.SupervisorStats` into a metric family: there is no
second list of names. Names are ``shmkv_`` + the field's ``metric`` name, with
``_total`` for counters; the workers' counters carry ``model`` and ``tenant``
labels (bounded by the supervisor, ``supervisor/worker_counters.py``), failures a ``kind`` label.
When the supervisor does not answer, only ``shmkv_supervisor_up 0`` is exposed.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import fields
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from shmkv.core.config import Settings
from shmkv.core.errors import ShmkvError
from shmkv.core.stats import COUNTER, GAUGE, HISTOGRAM, SupervisorStats, WorkerCounters, metric_name

log = logging.getLogger(__name__)

#: the supervisor's own groups of numbers: every nested schema of ``SupervisorStats``
#: (arena gauges and counters, limits, ``--persist``, ``--remote``, ...) but the workers'
#: sums, which ``_worker_metrics`` exposes per label set
SUPERVISOR_GROUPS: tuple[type, ...] = tuple(
    f.default_factory  # type: ignore[misc]
    for f in fields(SupervisorStats)
    if f.name not in ("reported", "series") and hasattr(f.default_factory, "__dataclass_fields__")
)

PREFIX = "shmkv_"
#: the workers' counters are labelled with these (``stats.Series``)
SERIES_LABELS = ("model", "tenant")


def _supervisor_metrics(st: dict[str, Any]) -> Iterator[Metric]:
    """The supervisor's own numbers: identity, uptime, arena gauges and counters."""
    ident = {f.name: str(st.get(f.name, "")) for f in fields(SupervisorStats)}
    idf = InfoMetricFamily(PREFIX + "supervisor", "the supervisor's identity")
    idf.add_metric([], {k: ident[k] for k in ("name", "version", "pid")})
    yield idf
    for f in fields(SupervisorStats):
        if f.metadata.get("kind") == GAUGE:
            yield GaugeMetricFamily(
                PREFIX + metric_name(f), f.metadata["help"], value=float(st[f.name])
            )
    for group in SUPERVISOR_GROUPS:
        for f in fields(group):
            name, help = PREFIX + metric_name(f), f.metadata["help"]
            value = st.get(f.name, 0)
            if isinstance(value, dict):  # counts by kind (persist_errors, remote_errors)
                fam = CounterMetricFamily(name, help, labels=("kind",))
                for kind, n in sorted(value.items()):
                    fam.add_metric([str(kind)], float(n))
                yield fam
            elif f.metadata["kind"] == COUNTER:
                yield CounterMetricFamily(name, help, value=float(value))
            else:
                yield GaugeMetricFamily(name, help, value=float(value))


def _worker_metrics(series: list[dict[str, Any]]) -> Iterator[Metric]:
    """The workers' reported sums, one sample per label set (and failure kind)."""
    for f in fields(WorkerCounters):
        if not f.metadata.get("reported") or any(
            g.metadata.get("sum_of") == f.name for g in fields(WorkerCounters)
        ):
            continue  # (a histogram's sum is exposed as the histogram's _sum)
        name, help, kind = PREFIX + metric_name(f), f.metadata["help"], f.metadata["kind"]
        if kind == HISTOGRAM:
            bounds = f.metadata["buckets"]
            hist = HistogramMetricFamily(name, help, labels=SERIES_LABELS)
            for s in series:
                counts, total = s["counters"][f.name], 0
                buckets = []
                for bound, n in zip([*map(str, bounds), "+Inf"], counts, strict=True):
                    total += n
                    buckets.append((bound, total))
                labels = [s["model"], s["tenant"]]
                hist.add_metric(labels, buckets, float(s["counters"][f.metadata["sum_of"]]))
            yield hist
        elif "label" in f.metadata:
            fam = CounterMetricFamily(name, help, labels=(*SERIES_LABELS, f.metadata["label"]))
            for s in series:
                for k, n in sorted(s["counters"][f.name].items()):
                    fam.add_metric([s["model"], s["tenant"], k], float(n))
            yield fam
        else:
            fam = CounterMetricFamily(name, help, labels=SERIES_LABELS)
            for s in series:
                fam.add_metric([s["model"], s["tenant"]], float(s["counters"][f.name]))
            yield fam


class StatsCollector(Collector):
    """A prometheus_client collector over the supervisor's ``stats`` reply."""

    def __init__(self, fetch: Callable[[], dict[str, Any]]) -> None:
        self.fetch = fetch

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            PREFIX + "supervisor_up", "whether the supervisor answered this scrape"
        )
        try:
            st = self.fetch()
        except ShmkvError as e:
            log.debug("metrics: no stats from the supervisor: %s", e)
            up.add_metric([], 0.0)
            yield up
            return
        up.add_metric([], 1.0)
        yield up
        yield from _supervisor_metrics(st)
        yield from _worker_metrics(st.get("series", []))


def stats_fetcher(settings: Settings) -> Callable[[], dict[str, Any]]:
    """``Client.stats`` over one connection kept for the scrapes (not a worker's: it does not
    attach), opened again after a supervisor restart; thread-safe."""
    from shmkv.core.client import Client

    client = Client(settings=settings, populate=False, attach=False, backoff=False)
    lock = threading.Lock()

    def fetch() -> dict[str, Any]:
        with lock:
            return client.stats()

    return fetch


def registry_for(settings: Settings) -> CollectorRegistry:
    """A registry holding only the shmkv collector for the supervisor of ``settings``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatsCollector(stats_fetcher(settings)))
    return registry


def serve_metrics(settings: Settings, port: int, host: str) -> Any:
    """Serve ``/metrics`` on ``host:port`` from a daemon thread (``--metrics-port`` of the
    supervisor of ``settings``, asked over its socket); returns the HTTP server
    (``.shutdown()`` stops it)."""
    from shmkv.core.config import resolve

    client = resolve("client", {"name": settings.name, "socket": settings.socket_path})
    server, _thread = start_http_server(port, addr=host, registry=registry_for(client))
    log.info("metrics on http://%s:%d/metrics", host, port)
    return server


__all__ = ["StatsCollector", "registry_for", "serve_metrics"]
