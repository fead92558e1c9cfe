"""One schema for every number shmkv counts or reports.

Each counter and gauge is declared once here, as a dataclass field whose
metadata carries its help text and kind. Everything that shows numbers reads
this module: the supervisor's ``stats`` op, a worker's running totals and the
counters it reports to the supervisor, ``shmkv stats``, ``/health``, and any
exporter. Adding a counter means adding one field here.

Two owners keep counters:

* a worker (:class:`WorkerCounters`) counts what its cache did for its calls;
  the fields marked ``reported`` are also sent to the supervisor (as deltas,
  in ``report`` messages), which sums them over all workers;
* the supervisor (:class:`ArenaCounters`) counts what its arena did.

:class:`SupervisorStats` is what the ``stats`` op returns: identity, gauges
read from the arena at that moment, the arena's counters and the workers'
reported sums, flattened into one dict with the field names as keys (the
arena's ``hits`` are leases granted; the workers' own ``hits`` are not
reported, so the names never clash).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

COUNTER, GAUGE, INFO = "counter", "gauge", "info"


def counter(help: str, reported: bool = False) -> Any:
    """A monotone count; ``reported``: workers send it to the supervisor, which sums it."""
    return field(default=0, metadata={"kind": COUNTER, "help": help, "reported": reported})


def seconds(help: str) -> Any:
    """A monotone sum of seconds."""
    return field(default=0.0, metadata={"kind": COUNTER, "help": help, "reported": False})


def gauge(help: str) -> Any:
    """A value read at the moment it is reported."""
    return field(default=0, metadata={"kind": GAUGE, "help": help})


def info(help: str, default: Any = "") -> Any:
    """An identity field (name, pid, version): not a number to aggregate."""
    return field(default=default, metadata={"kind": INFO, "help": help})


def help_of(cls: type, name: str) -> str:
    """The help text of field ``name`` of schema class ``cls``."""
    for f in fields(cls):
        if f.name == name:
            return str(f.metadata["help"])
    raise KeyError(name)


def numbers(obj: Any) -> dict[str, Any]:
    """The fields of a schema object as a flat dict (nested schema objects are merged)."""
    out: dict[str, Any] = {}
    for f in fields(obj):
        v = getattr(obj, f.name)
        if hasattr(v, "__dataclass_fields__"):
            out.update(numbers(v))
        elif isinstance(v, dict):
            out[f.name] = dict(v)
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
    restore_seconds: float = field(
        default=0.0, metadata={"kind": GAUGE, "help": "seconds spent restoring"}
    )
    hit: bool = field(
        default=False, metadata={"kind": GAUGE, "help": "whether a state was restored"}
    )
    coalesce_wait_seconds: float = field(
        default=0.0, metadata={"kind": GAUGE, "help": "seconds waited for another worker's prefill"}
    )
    published: int = gauge("states queued for publishing")
    checkpoint: int = gauge("length of the checkpoint state published mid-prefill (0: none)")
    checkpoints: list[int] = field(
        default_factory=list,
        metadata={"kind": INFO, "help": "lengths of every checkpoint state published mid-prefill"},
    )
    error: str | None = field(
        default=None, metadata={"kind": INFO, "help": "the last cache failure, if any"}
    )


@dataclass
class WorkerCounters:
    """A worker's running totals (``SharedPrefixCache.totals``)."""

    calls: int = counter("generate calls")
    hits: int = counter("calls that restored a state from the arena")
    misses: int = counter("calls that found nothing usable in the arena", reported=True)
    tokens_restored: int = counter("prompt tokens restored from the arena", reported=True)
    tokens_evaluated: int = counter("prompt tokens evaluated (prefilled)", reported=True)
    restore_failures: int = counter(
        "restores that failed a check (corrupt record, model mismatch)", reported=True
    )
    states_refused: int = counter(
        "cached states llama.cpp's set_data refused (counted as misses too)", reported=True
    )
    publishes: int = counter("states queued for the supervisor")
    publish_dropped: int = counter("states not published because the queue was full")
    publish_failures: int = counter("states the supervisor did not store")
    coalesced_waits: int = counter("times a call waited for another worker's prefill")
    swa_unusable: int = counter(
        "cached prefixes a sliding-window model could not use (cannot be cut back)"
    )
    checkpoints: int = counter("checkpoint states published mid-prefill")
    boundary_checkpoints: int = counter(
        "of those, checkpoints at a chat's message boundaries (the end of its system message, ...)"
    )
    captures_dropped: int = counter(
        "states not captured because their call was closed late (an abandoned stream) while "
        "the context was in use or had moved on"
    )
    untrusted: int = counter(
        "cached states skipped: published by a uid this worker does not trust", reported=True
    )
    restore_seconds: float = seconds("seconds spent restoring states")
    errors: dict[str, int] = field(
        default_factory=dict,
        metadata={"kind": COUNTER, "help": "cache failures by kind", "reported": False},
    )


@dataclass
class HttpCounters:
    """What a gunicorn worker's acceptor did with connections (``/health``)."""

    connections_accepted: int = counter("connections accepted")
    idle_closed: int = counter(
        "connections closed because they sent no request headers within --request-read-timeout"
    )


#: the worker counters a ``report`` message may carry
REPORTED: tuple[str, ...] = tuple(
    f.name for f in fields(WorkerCounters) if f.metadata.get("reported")
)


def add_reported(sums: WorkerCounters, counters: dict[str, int]) -> None:
    """Add one ``report`` message's (validated) counters to the supervisor's sums."""
    for k, v in counters.items():
        if k not in REPORTED:
            raise KeyError(k)
        setattr(sums, k, getattr(sums, k) + v)


@dataclass
class ArenaCounters:
    """What the supervisor's arena did since it started."""

    puts: int = counter("states stored")
    rejected_puts: int = counter("puts refused (no room, bad checksum, bad request)")
    duplicate_puts: int = counter("puts of a state already stored")
    evictions: int = counter("states evicted to make room")
    expired: int = counter(
        "states released after --ttl seconds unused (or a pinned one after its pin's TTL)"
    )
    hits: int = counter("read leases granted (a worker found a state and leased it)")
    revocations: int = counter("read leases revoked (held too long while space was needed)")
    leases_closed: int = counter("read leases ended by their connection's close, unreleased")
    stale_acquires: int = counter("lease requests for a state no longer stored")
    corrupt_removed: int = counter("stored states found corrupt and removed")
    ops_denied: int = counter(
        "requests refused for lack of privilege (admin ops from a --group member, "
        "worker_exit from a process that is not the worker's parent)"
    )
    bytes_put: int = counter("payload bytes stored")
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

    entries: int = gauge("states stored")
    pinned: int = gauge("states pinned (never evicted)")
    pinned_bytes: int = gauge("bytes of the data region held by pinned states")
    bytes_used: int = gauge("bytes of the data region in use")
    bytes_capacity: int = gauge("bytes of the data region")
    bytes_free_largest: int = gauge("largest free extent, bytes")
    free_extents: int = gauge("free extents (fragmentation)")
    index_used: int = gauge("index slots in use (chunk prefixes)")
    index_capacity: int = gauge("index slots usable")
    chunk_tokens: int = gauge("tokens per chunk")
    leases_active: int = gauge("read leases held")
    workers_attached: int = gauge("connections that attached to the arena")
    connections: int = gauge("open connections")
    fds_closing: int = gauge("descriptors peers passed, waiting for the closer thread")
    unread_bytes: int = gauge("bytes of replies queued for peers that have not read them yet")
    claims_held: int = gauge("prefill claims held")


@dataclass
class SupervisorStats:
    """The reply of the ``stats`` op, flattened by :func:`numbers`."""

    name: str = info("arena name")
    pid: int = info("supervisor pid", 0)
    version: str = info("shmkv version of the supervisor")
    arena: str = info("arena file path")
    socket: str = info("socket path")
    uptime: float = gauge("seconds since the supervisor started")
    gauges: ArenaGauges = field(default_factory=ArenaGauges)
    counters: ArenaCounters = field(default_factory=ArenaCounters)
    limits: LimitCounters = field(default_factory=LimitCounters)
    #: sums of what workers reported; only the ``REPORTED`` fields are kept
    reported: WorkerCounters = field(default_factory=WorkerCounters)

    def to_dict(self) -> dict[str, Any]:
        """One flat dict, field names as keys (the wire form of the ``stats`` reply)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "reported":
                out.update({k: getattr(v, k) for k in REPORTED})
            elif hasattr(v, "__dataclass_fields__"):
                out.update(numbers(v))
            else:
                out[f.name] = v
        return out
