"""One schema for every number shmkv counts or reports.

Each counter and gauge is declared once here, as a dataclass field whose
metadata carries its help text and kind. Everything that shows numbers reads
this module: the supervisor's ``stats`` op, a worker's running totals and the
counters it reports to the supervisor, ``shmkv stats``, ``/health``, and any
exporter. Adding a counter means adding one field here.

Two owners keep counters:

* a worker (:class:`WorkerCounters`) counts what its cache did for its calls;
  the fields marked ``reported`` are also sent to the supervisor (as running
  totals since the worker started, in ``report`` messages), which keeps each
  worker's latest totals and the sums of workers gone (``supervisor/worker_counters.py``), per
  model and tenant label;
* the supervisor (:class:`ArenaCounters`) counts what its arena did.

A field's Prometheus name (``shmkv.core.metrics``) is ``shmkv_`` + its ``metric``
metadata (default: the field name), ``_total`` for counters.

:class:`SupervisorStats` is what the ``stats`` op returns: identity, gauges
read from the arena at that moment, the arena's counters and the workers'
reported sums, flattened into one dict with the field names as keys (the
arena's ``hits`` are leases granted; the workers' own ``hits`` are not
reported, so the names never clash).
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any

COUNTER, GAUGE, INFO, HISTOGRAM = "counter", "gauge", "info", "histogram"

#: upper bounds (seconds) of the restore latency histogram's buckets (+Inf is implied)
RESTORE_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)  # fmt: skip


def counter(help: str, reported: bool = False, metric: str | None = None) -> Any:
    """A monotone count; ``reported``: workers send it to the supervisor, which sums it."""
    meta = {"kind": COUNTER, "help": help, "reported": reported, "metric": metric}
    return field(default=0, metadata=meta)


def seconds(help: str, reported: bool = False, metric: str | None = None) -> Any:
    """A monotone sum of seconds."""
    meta = {"kind": COUNTER, "help": help, "reported": reported, "metric": metric}
    return field(default=0.0, metadata=meta)


def histogram(help: str, buckets: tuple[float, ...], sum_of: str, metric: str) -> Any:
    """Counts of observations per bucket (``len(buckets) + 1``, the last one +Inf, not
    cumulative); ``sum_of``: the ``seconds`` field that sums the observations."""
    meta = {"kind": HISTOGRAM, "help": help, "reported": True, "metric": metric}
    meta.update(buckets=buckets, sum_of=sum_of)
    return field(default_factory=lambda: [0] * (len(buckets) + 1), metadata=meta)


def by_kind(help: str, metric: str) -> Any:
    """Counts by a short kind name (a failure's kind), as a ``kind`` label."""
    meta = {"kind": COUNTER, "help": help, "reported": True, "metric": metric, "label": "kind"}
    return field(default_factory=dict, metadata=meta)


def gauge(help: str, metric: str | None = None) -> Any:
    """A value read at the moment it is reported."""
    return field(default=0, metadata={"kind": GAUGE, "help": help, "metric": metric})


def info(help: str, default: Any = "") -> Any:
    """An identity field (name, pid, version): not a number to aggregate."""
    return field(default=default, metadata={"kind": INFO, "help": help})


def metric_name(f: Any) -> str:
    """The Prometheus name of schema field ``f`` (a ``dataclasses.Field``), without
    ``shmkv_`` and ``_total``."""
    return str(f.metadata.get("metric") or f.name)


def observe(buckets: list[int], bounds: tuple[float, ...], value: float) -> None:
    """Count ``value`` in the first bucket whose bound it does not exceed."""
    for i, bound in enumerate(bounds):
        if value <= bound:
            buckets[i] += 1
            return
    buckets[-1] += 1


def numbers(obj: Any) -> dict[str, Any]:
    """The fields of a schema object as a flat dict (nested schema objects are merged)."""
    out: dict[str, Any] = {}
    for f in fields(obj):
        v = getattr(obj, f.name)
        if hasattr(v, "__dataclass_fields__"):
            out.update(numbers(v))
        elif isinstance(v, dict):
            out[f.name] = dict(v)
        elif isinstance(v, list):
            out[f.name] = list(v)
        else:
            out[f.name] = v
    return out


@dataclass
class CallStats:
    """What the cache did for one ``generate`` call (``SharedPrefixCache.last``)."""

    prompt_tokens: int = gauge("tokens in the prompt")
    tokens_restored: int = gauge("prompt tokens restored from the arena")
    tokens_reused_local: int = gauge("prompt tokens reused from the worker's own context")
    tokens_evaluated: int = gauge("prompt tokens evaluated (prefilled)")
    completion_tokens: int = gauge(
        "tokens generated, an end-of-generation token not counted (as llama-cpp-python's usage)"
    )
    restore_seconds: float = field(
        default=0.0, metadata={"kind": GAUGE, "help": "seconds spent restoring"}
    )
    hit: bool = field(
        default=False, metadata={"kind": GAUGE, "help": "whether a state was restored"}
    )
    coalesce_wait_seconds: float = field(
        default=0.0, metadata={"kind": GAUGE, "help": "seconds waited for another worker's prefill"}
    )
    prefill_threads: int = gauge(
        "most threads one batch of the prompt ran on (CPU budget; 0: no batch or no budget)"
    )
    published: int = gauge("states queued for publishing")
    checkpoint: int = gauge("length of the checkpoint state published mid-prefill (0: none)")
    checkpoint_seconds: float = field(
        default=0.0,
        metadata={
            "kind": GAUGE,
            "help": "seconds the prefill spent copying checkpoint states out of the context",
        },
    )
    remote: str = field(
        default="",
        metadata={"kind": INFO, "help": "what a fetch from --remote said (empty: none asked)"},
    )
    remote_wait_seconds: float = field(
        default=0.0, metadata={"kind": GAUGE, "help": "seconds waited for a fetch from --remote"}
    )
    cpu_wait_seconds: float = field(
        default=0.0,
        metadata={
            "kind": GAUGE,
            "help": "seconds this call's evals waited for cores of the CPU budget (at the "
            "first token: its prefill's waits)",
        },
    )
    prefill_seconds: float = field(
        default=0.0,
        metadata={
            "kind": GAUGE,
            "help": "wall seconds of evaluating the prompt's new tokens (the suffix, or the "
            "whole prompt when cold), summed over its evals, CPU waits included",
        },
    )
    started_at: float = field(
        default=0.0,
        metadata={"kind": INFO, "help": "time.monotonic() when the call began"},
    )
    prefill_end_at: float = field(
        default=0.0,
        metadata={"kind": INFO, "help": "time.monotonic() when its prompt's last eval ended"},
    )
    first_token_at: float = field(
        default=0.0,
        metadata={
            "kind": INFO,
            "help": "time.monotonic() when its first token was sampled (0: not yet)",
        },
    )
    checkpoints: list[int] = field(
        default_factory=list,
        metadata={"kind": INFO, "help": "lengths of every checkpoint state published mid-prefill"},
    )
    error: str | None = field(
        default=None, metadata={"kind": INFO, "help": "the last cache failure, if any"}
    )

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens not evaluated because the context held them already, restored from
        the arena or kept from the worker's own context (OpenAI's
        ``usage.prompt_tokens_details.cached_tokens``). Once the prompt is evaluated.

        Usually ``tokens_restored + tokens_reused_local``; less when a whole prompt was
        cached (llama-cpp-python evaluates its last token again, for the logits) or when
        a restored state was dropped again (a failure that went cold).
        """
        return max(0, self.prompt_tokens - self.tokens_evaluated) if self.tokens_evaluated else 0


@dataclass
class WorkerCounters:
    """A worker's running totals (``SharedPrefixCache.totals``)."""

    calls: int = counter("generate calls (requests)", reported=True, metric="requests")
    hits: int = counter(
        "calls that restored a state from the arena", reported=True, metric="cache_hits"
    )
    misses: int = counter(
        "calls that found nothing usable in the arena", reported=True, metric="cache_misses"
    )
    tokens_restored: int = counter("prompt tokens restored from the arena", reported=True)
    tokens_evaluated: int = counter("prompt tokens evaluated (prefilled)", reported=True)
    tokens_reused_local: int = counter(
        "prompt tokens reused from the worker's own context", reported=True
    )
    restore_failures: int = counter(
        "restores that failed a check (corrupt record, model mismatch)", reported=True
    )
    states_refused: int = counter(
        "cached states llama.cpp's set_data refused (counted as misses too)", reported=True
    )
    publishes: int = counter("states queued for the supervisor", reported=True)
    publish_dropped: int = counter("states not published because the queue was full", reported=True)
    publish_failures: int = counter("states the supervisor did not store", reported=True)
    coalesced_waits: int = counter(
        "times a call waited for another worker's prefill", reported=True
    )
    swa_unusable: int = counter(
        "cached prefixes a sliding-window model could not use (cannot be cut back)",
        reported=True,
        metric="sliding_window_fallbacks",
    )
    checkpoints: int = counter("checkpoint states published mid-prefill", reported=True)
    boundary_checkpoints: int = counter(
        "of those, checkpoints at a chat's message boundaries (the end of its system message, ...)",
        reported=True,
    )
    recurrent_checkpoints: int = counter(
        "of those, a hybrid's checkpoints copied as their recurrent state alone and published "
        "cut from the prompt's state (attention cells shared as chunks)",
        reported=True,
    )
    captures_dropped: int = counter(
        "states not captured because their call was closed late (an abandoned stream) while "
        "the context was in use or had moved on"
    )
    untrusted: int = counter(
        "cached states skipped: published by a uid this worker does not trust",
        reported=True,
        metric="untrusted_states",
    )
    tenant_switches: int = counter(
        "calls that found another tenant's cells in the context, which were wiped (none reused)",
        reported=True,
    )
    remote_asked: int = counter(
        "calls that asked the supervisor to fetch from --remote", reported=True
    )
    remote_restored: int = counter(
        "calls that restored a state the supervisor had just fetched from --remote",
        reported=True,
    )
    restore_seconds: float = seconds("seconds spent restoring states", reported=True)
    restore_latency: list[int] = histogram(
        "seconds per successful restore (lease, checks, set_data)",
        RESTORE_BUCKETS,
        sum_of="restore_seconds",
        metric="restore_duration_seconds",
    )
    cpu_waits: int = counter("evals that waited for a free core of the CPU budget", reported=True)
    cpu_wait_seconds: float = seconds(
        "seconds evals waited for a free core of the CPU budget", reported=True
    )
    cpu_wait_timeouts: int = counter(
        "requests that stopped waiting for the CPU budget (its holders made no progress, or "
        "no core came free within --cpu-wait) and ran on one thread anyway",
        reported=True,
    )
    errors: dict[str, int] = by_kind(
        "cache failures by kind (each cost a cold prefill or a lost publish)",
        metric="cache_failures",
    )


@dataclass
class HttpCounters:
    """What a gunicorn worker's acceptor did with connections (``/health``)."""

    connections_accepted: int = counter("connections accepted")
    idle_closed: int = counter(
        "connections closed because their first request (headers and body) was not whole "
        "within --request-read-timeout"
    )
    holds_expired: int = counter(
        "connections whose request had not arrived when their accept hold ran out (each kept "
        "its worker from accepting others that long: 0.5 s at most, a request not whole at its "
        "accept only on the worker's credit of 0.1 s)"
    )
    holds_refused: int = counter(
        "connections whose request was not whole at their accept, taken with no hold because "
        "the worker's hold credit was spent (stalled clients)"
    )


#: the worker counters a ``report`` message may carry
REPORTED: tuple[str, ...] = tuple(
    f.name for f in fields(WorkerCounters) if f.metadata.get("reported")
)


#: the ``reported`` fields that hold one number (the others: a histogram, counts by kind)
REPORTED_SCALARS: tuple[str, ...] = tuple(
    f.name
    for f in fields(WorkerCounters)
    if f.metadata.get("reported") and f.default is not MISSING
)


def merge(into: WorkerCounters, other: WorkerCounters | dict[str, Any], sign: int = 1) -> None:
    """Add (``sign`` -1: take away) the reported fields of ``other`` to ``into``."""
    get = other.get if isinstance(other, dict) else lambda k, d=None: getattr(other, k)
    for k in REPORTED:
        v = get(k, None)
        if v is None:
            continue
        mine = getattr(into, k)
        if isinstance(mine, list):
            for i in range(min(len(mine), len(v))):
                mine[i] += sign * v[i]
        elif isinstance(mine, dict):
            for kind, n in v.items():
                mine[kind] = mine.get(kind, 0) + sign * n
                if not mine[kind]:
                    del mine[kind]
        else:
            setattr(into, k, mine + sign * v)


def reported_dict(c: WorkerCounters) -> dict[str, Any]:
    """The reported fields of ``c``, as a ``report`` message or the ``stats`` reply
    carries them."""
    out: dict[str, Any] = {}
    for k in REPORTED:
        v = getattr(c, k)
        out[k] = list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v
    return out


@dataclass
class ArenaCounters:
    """What the supervisor's arena did since it started."""

    puts: int = counter("states stored")
    rejected_puts: int = counter("puts refused (no room, bad checksum, bad request)")
    shm_full_puts: int = counter(
        "puts refused because the arena's tmpfs (--dir) had no memory left for their pages "
        "(also in rejected_puts)"
    )
    duplicate_puts: int = counter("puts of a state already stored")
    evictions: int = counter("states evicted to make room")
    expired: int = counter(
        "states released after --ttl seconds unused (or a pinned one after its pin's TTL)"
    )
    hits: int = counter(
        "read leases granted (a worker found a state and leased it)", metric="leases_granted"
    )
    revocations: int = counter("read leases revoked (held too long while space was needed)")
    leases_closed: int = counter("read leases ended by their connection's close, unreleased")
    stale_acquires: int = counter("lease requests for a state no longer stored")
    corrupt_removed: int = counter("stored states found corrupt and removed")
    ops_denied: int = counter(
        "requests refused for lack of privilege (admin ops from a --group member, "
        "worker_exit from a process that is not the worker's parent)"
    )
    bytes_put: int = counter("payload bytes stored", metric="put_bytes")
    chunked_puts: int = counter(
        "states stored as chunks (their full token groups shared with other states)"
    )
    chunk_bytes_copied: int = counter(
        "bytes of full token groups a put copied in the supervisor: gathered from a staged "
        "payload (to be hashed, or into a new chunk) or written as a new chunk from a "
        "tier's group (a group the arena holds already is only compared)"
    )
    foreign_fds: int = counter(
        "descriptors peers passed that were not a put's memfd (closed off the loop)"
    )
    puts_sliced: int = counter(
        "puts whose evictions or copy took several turns of the loop (others served between)"
    )
    adopted: int = counter(
        "states adopted at start from the arena a stopped or killed supervisor left"
    )
    adopt_dropped: int = counter(
        "records of that arena dropped at adoption (damaged, half-written or inconsistent)"
    )
    adopt_checked_bytes: int = counter(
        "bytes hashed to check the adopted arena's records: whole payloads, and each chunk "
        "once however many records name it"
    )
    adopt_on_lease: int = counter(
        "records of that arena checked out of turn, for a lease asked for while the rest "
        "were still being checked (--adopt-wait)"
    )


@dataclass
class LimitCounters:
    """What the supervisor refused so that one peer cannot exhaust what all peers share."""

    pins_refused: int = counter(
        "pins refused: pinned states would exceed --max-pinned-percent of the data region"
    )
    leases_refused: int = counter("read leases refused: the connection held --max-leases")
    claims_refused: int = counter("digests not claimed: the connection held --max-claims")
    unread_dropped: int = counter(
        "connections closed for leaving more than --max-unread (or, all together, "
        "--max-unread-total) bytes of replies unread"
    )
    frames_refused: int = counter(
        "frames refused: undecodable, or beyond the protocol's msgpack limits"
    )


@dataclass
class ArenaGauges:
    """The arena as it is at the moment of the ``stats`` request."""

    entries: int = gauge("states stored", metric="arena_entries")
    pinned: int = gauge("states pinned (never evicted)", metric="arena_pinned_entries")
    pinned_bytes: int = gauge(
        "bytes of the data region held by pinned states", metric="arena_pinned_bytes"
    )
    bytes_used: int = gauge("bytes of the data region in use", metric="arena_used_bytes")
    bytes_free: int = gauge("bytes of the data region not in use", metric="arena_free_bytes")
    bytes_capacity: int = gauge("bytes of the data region", metric="arena_capacity_bytes")
    bytes_resident: int = gauge(
        "bytes of the arena file allocated in its tmpfs, header and index included "
        "(what it costs in memory; all of --size with --reserve)",
        metric="arena_resident_bytes",
    )
    bytes_free_largest: int = gauge(
        "largest free extent, bytes", metric="arena_largest_free_extent_bytes"
    )
    free_extents: int = gauge("free extents (fragmentation)")
    adopting: int = gauge(
        "records of an adopted arena still to check (answered meanwhile: puts wait, a "
        "lease checks its record first)",
        metric="arena_adopting_records",
    )
    chunks: int = gauge("chunks stored (token groups that chunked states share)")
    chunk_bytes: int = gauge(
        "bytes of the data region held by chunks, each counted once (in bytes_used)",
        metric="arena_chunk_bytes",
    )
    chunk_bytes_shared: int = gauge(
        "bytes that sharing chunks saved: what the states would take in copies of them",
        metric="arena_chunk_shared_bytes",
    )
    index_used: int = gauge("index slots in use (chunk prefixes)")
    index_capacity: int = gauge("index slots usable")
    chunk_tokens: int = gauge("tokens per chunk")
    leases_active: int = gauge("read leases held")
    workers_attached: int = gauge(
        "connections that attached to the arena (a worker has two per model: reads and puts)",
        metric="attached_connections",
    )
    workers_connected: int = gauge("processes with a connection attached to the arena")
    connections: int = gauge("open connections")
    fds_closing: int = gauge("descriptors peers passed, waiting for the closer thread")
    unread_bytes: int = gauge("bytes of replies queued for peers that have not read them yet")
    claims_held: int = gauge("prefill claims held")
    claims_waiting: int = gauge("requests waiting for another connection's claimed prefill")


@dataclass
class PersistStats:
    """What the write-behind to disk (``--persist``) and the refill from it did.

    The ``persist_*`` counters are kept by the writer thread, the ``refill*`` ones by
    the supervisor's loop; each field has one writer, and the ``stats`` op reads them.
    """

    persist_on: int = gauge("1 if --persist is set and its store is open")
    persist_paused: int = gauge(
        "1 while persistence is paused after a failure (full disk, unwritable directory, "
        "corrupt file); it is retried with a growing delay"
    )
    persist_queue: int = gauge("accepted records waiting for the writer thread")
    persist_records: int = gauge("records stored on disk")
    persist_bytes: int = gauge("bytes stored on disk (records and chunks, each chunk once)")
    persisted: int = counter("records written to disk")
    persisted_bytes: int = counter("payload bytes written to disk")
    persist_dropped: int = counter(
        "records not written to disk: the writer's queue was full or persistence was paused"
    )
    persist_gone: int = counter(
        "records evicted from the arena (or reused) before the writer could copy them"
    )
    persist_evictions: int = counter("records removed from disk by --persist-size (LRU)")
    persist_errors: dict[str, int] = field(
        default_factory=dict,
        metadata={"kind": COUNTER, "help": "persistence failures by kind", "reported": False},
    )
    refilling: int = gauge("1 while the arena is being refilled from disk")
    refilled: int = counter("records loaded from disk into the arena after a start")
    refilled_bytes: int = counter("payload bytes loaded from disk into the arena")
    refill_skipped: int = counter(
        "records on disk not loaded: corrupt (checksum, metadata), invalid, or refused"
    )
    # (durations measured once per start: gauges, not sums)
    refill_seconds: float = gauge(
        "seconds from the start of the refill to its end", metric="refill_duration_seconds"
    )
    refill_first_seconds: float = gauge(
        "seconds from the start of the refill until the first record was in the arena",
        metric="refill_first_record_seconds",
    )


@dataclass
class RemoteStats:
    """What the write-behind to Redis / Valkey (``--remote``) and fetches from it did.

    The writer's and fetcher's numbers are kept on their threads, the ``remote_fetch_*``
    answers on the supervisor's loop; each field has one writer.
    """

    remote_on: int = gauge("1 if --remote is set and its server answered")
    remote_paused: int = gauge(
        "1 while the remote tier is paused after a failure (down, slow, full); it is "
        "retried with a growing delay"
    )
    remote_queue: int = gauge("accepted records waiting for the remote writer thread")
    remote_written: int = counter("records written to the remote tier")
    remote_written_bytes: int = counter("payload bytes written to the remote tier")
    remote_stored_bytes: int = counter("bytes sent for those payloads (after --remote-compress)")
    remote_present: int = counter("accepted records the remote tier held already (not sent)")
    remote_dropped: int = counter(
        "records not written remotely: the writer's queue was full or the tier was paused"
    )
    remote_gone: int = counter(
        "records evicted from the arena (or reused) before the remote writer could copy them"
    )
    remote_errors: dict[str, int] = field(
        default_factory=dict,
        metadata={"kind": COUNTER, "help": "remote tier failures by kind", "reported": False},
    )
    remote_fetches: int = counter("fetch requests from workers")
    remote_fetched: int = counter("records fetched from the remote tier into the arena")
    remote_fetched_bytes: int = counter("payload bytes fetched into the arena")
    remote_fetch_none: int = counter("fetch requests the remote tier had no longer prefix for")
    remote_fetch_joined: int = counter(
        "fetch requests answered with a record another request was fetching (or had just "
        "fetched): read from the remote tier once"
    )
    remote_fetch_not_worth: int = counter(
        "fetch requests answered 'prefill instead': the fetch would take longer"
    )
    remote_fetch_late: int = counter(
        "fetch requests answered at their deadline (the fetch, if any, went on)"
    )
    remote_fetch_down: int = counter("fetch requests answered at once: the tier was down")
    remote_fetch_busy: int = counter("fetch requests refused: too many outstanding")
    remote_fetch_corrupt: int = counter("fetched records rejected by a check (checksum, fields)")
    remote_fetch_refused: int = counter("fetched records the arena refused (too short, no room)")
    remote_untrusted: int = counter(
        "accepted records not written remotely: their publisher is neither the supervisor's "
        "uid nor in its --trust-publishers"
    )
    remote_fetch_untrusted: int = counter(
        "fetch requests whose remote record has a publisher the supervisor does not trust"
    )
    remote_fetch_unverified: int = counter(
        "fetch requests whose remote record's MAC verifies under no --remote-key-file key"
    )
    remote_fetch_too_big: int = counter(
        "fetch requests whose remote record can never fit this arena (refused unread)"
    )
    remote_refused_skipped: int = counter(
        "remote records skipped unread: refused (too big, untrusted, unverified, corrupt) "
        "less than a minute ago"
    )
    remote_bad_keys: int = counter(
        "remote keys of the wrong type (not written by shmkv): a miss, or replaced"
    )
    remote_corrupt: int = counter("remote records found corrupt and deleted")
    remote_pulled_bytes: int = counter("bytes read from the remote tier's pieces and chunks")
    remote_pull_seconds: float = seconds(
        "seconds spent reading pieces and chunks from the remote tier"
    )
    remote_chunks_sent: int = counter(
        "chunks (shared token groups of a state) sent to the remote tier: it lacked them"
    )
    remote_chunks_present: int = counter(
        "chunks the remote tier held already (another record or node sent them): not sent"
    )
    remote_chunks_local: int = counter(
        "chunks of fetched records copied from this arena, not read from the remote tier"
    )
    remote_chunks_pulled: int = counter("chunks of fetched records read from the remote tier")
    remote_bandwidth: int = gauge(
        "measured fetch bandwidth, bytes/s (moving average)",
        metric="remote_bandwidth_bytes_per_second",
    )


@dataclass
class Series:
    """The workers' reported sums for one label set (model alias, tenant)."""

    model: str = info("model alias the workers serve (or the GGUF file's stem)")
    tenant: str = info("the workers' namespace (empty: none)")
    counters: WorkerCounters = field(default_factory=WorkerCounters)


@dataclass
class SupervisorStats:
    """The reply of the ``stats`` op, flattened by :meth:`to_dict`."""

    name: str = info("arena name")
    pid: int = info("supervisor pid", 0)
    version: str = info("shmkv version of the supervisor")
    arena: str = info("arena file path")
    socket: str = info("socket path")
    uptime: float = gauge("seconds since the supervisor started", metric="uptime_seconds")
    gauges: ArenaGauges = field(default_factory=ArenaGauges)
    counters: ArenaCounters = field(default_factory=ArenaCounters)
    limits: LimitCounters = field(default_factory=LimitCounters)
    persist: PersistStats = field(default_factory=PersistStats)
    remote: RemoteStats = field(default_factory=RemoteStats)
    #: sums of what workers reported, over all label sets; only ``REPORTED`` fields count
    reported: WorkerCounters = field(default_factory=WorkerCounters)
    #: the same sums per label set
    series: list[Series] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """The wire form of the ``stats`` reply: one flat dict, field names as keys (the
        workers' sums flat only where their names are free and they hold one number, e.g.
        ``misses``; all of them under ``workers``), and ``series``: per label set."""
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in ("reported", "series"):
                continue
            if hasattr(v, "__dataclass_fields__"):
                out.update(numbers(v))
            else:
                out[f.name] = v
        for k in REPORTED_SCALARS:
            out.setdefault(k, getattr(self.reported, k))
        out["workers"] = reported_dict(self.reported)
        out["series"] = [
            {"model": s.model, "tenant": s.tenant, "counters": reported_dict(s.counters)}
            for s in self.series
        ]
        return out
