"""The supervisor's ops: every request a peer can make, declared once.

Runs in the supervisor, on its one thread. Each op is registered with
:func:`op`: its name on the wire, its handler, whether the peer must have
attached first, and the :class:`Privilege` it needs. ``Supervisor`` looks the
op up, enforces those two, checks the arena is still intact, and calls the
handler with the :class:`Context` (what the supervisor owns) and the
connection. A handler validates every field it reads (``protocol.get_*``) and
returns ``(reply, fds)``: the reply fields and the descriptors to send with
them, or ``(None, None)`` when the reply comes later (a claim that waits, or
a :class:`Work` handed to ``Context.defer``: a put that needs more than one
slice of the loop, which the supervisor steps between other peers' requests).

A new op is one function here.
"""

from __future__ import annotations

import enum
import fcntl
import logging
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from shmkv import __version__
from shmkv.core.arena import MAX_TOKENS, ArenaView, common_prefix
from shmkv.core.config import Settings
from shmkv.core.errors import ArenaCorruptError, BadRequest, LimitExceeded, PermissionDenied
from shmkv.core.protocol import (
    MAX_PUBLISHERS,
    MAX_U64,
    get_bool,
    get_bytes,
    get_counters,
    get_digest,
    get_digests,
    get_fingerprint,
    get_float,
    get_int,
    get_label,
    get_tokens,
)
from shmkv.core.stats import ArenaGauges, LimitCounters, PersistStats, RemoteStats, SupervisorStats
from shmkv.supervisor.arenafile import ArenaFile
from shmkv.supervisor.claims import GO, Claims, Waiter
from shmkv.supervisor.fdcloser import discard
from shmkv.supervisor.fdcloser import pending as fds_closing
from shmkv.supervisor.listener import Conn
from shmkv.supervisor.put import PutJob
from shmkv.supervisor.store import Store
from shmkv.supervisor.ttl import Expiry
from shmkv.supervisor.worker_counters import Reports

if TYPE_CHECKING:
    from shmkv.supervisor.adopt import Adoption
    from shmkv.supervisor.tiers.disk.tier import Persistence
    from shmkv.supervisor.tiers.redis.tier import Remote

log = logging.getLogger(__name__)

#: records returned (and, of each kind, compared) per ``owners`` request
OWNERS_MAX = 32

Reply = tuple[dict[str, Any] | None, list[int] | None]


class Work(Protocol):
    """A request answered over several turns of the supervisor's loop."""

    def step(self, deadline: float) -> dict[str, Any] | None:
        """Work until ``deadline`` (time.monotonic); the reply once done, else None.

        Raises ShmkvError to answer with an error; the work then holds nothing.
        """

    def abort(self) -> None:
        """Give back what the work holds (its peer is gone, or the supervisor stops)."""


class Privilege(enum.Enum):
    """What a peer must be to use an op, on top of the listener's credential check."""

    #: any peer the listener accepted (our uid, or a member of ``--group``)
    ANY = "any"
    #: our own uid or root: ops that drop, keep or close what other peers rely on
    ADMIN = "admin"

    def permits(self, conn: Conn) -> bool:
        return self is Privilege.ANY or conn.uid in (0, os.geteuid())

    def refusal(self, name: str, conn: Conn) -> str:
        """Why ``conn`` may not use op ``name``, and what to do instead."""
        uid = os.geteuid()
        return (
            f"op {name!r} is for the supervisor's own user (uid {uid}) or root, not uid "
            f"{conn.uid}: a --group member may attach, read and publish, not administer; "
            f"run it as uid {uid}"
        )


@dataclass
class Context:
    """What handlers work with: built once the arena exists, so the store is always there."""

    settings: Settings
    arena: ArenaFile
    store: Store
    #: a read-only view of the arena, to check records as a worker would
    view: ArenaView
    claims: Claims
    #: the counters workers reported (their totals, and the sums of those gone)
    reported: Reports
    socket_path: Path
    started: float
    conns: dict[int, Conn]
    #: send the replies of waiters whose claims ended
    wake: Callable[[list[tuple[Waiter, str]]], None]
    close: Callable[[Conn, str], None]
    #: raise ArenaCorruptError (and stop the supervisor) if the arena file was truncated
    check_arena: Callable[[], None]
    #: go on with the work of request ``rid`` of ``conn`` in later turns of the loop (the
    #: connection's later requests wait for its reply)
    defer: Callable[[Conn, int, Work], None]
    #: what the supervisor refused to keep a peer within its limits
    limits: LimitCounters
    #: ``--persist`` (None: off)
    persist: Persistence | None = None
    #: releases states idle past --ttl or their pin's TTL (``ttl.py``)
    expiry: Expiry | None = None
    #: ``--remote`` (None: off)
    remote: Remote | None = None
    #: the adoption of the arena a stopped or killed supervisor left, while it checks
    #: records (``adopt.py``; None: none, or done)
    adoption: Adoption | None = None

    def stats(self) -> SupervisorStats:
        store, g = self.store, self.store.geometry
        live = store.live_entries()
        gauges = ArenaGauges(
            entries=len(live),
            pinned=sum(1 for e in live if e.pinned),
            pinned_bytes=store.pinned_bytes,
            bytes_used=store.bytes_used(),
            bytes_free=g.data_size - store.bytes_used(),
            bytes_capacity=g.data_size,
            bytes_resident=store.pages.resident(),
            bytes_free_largest=store.alloc.largest(),
            free_extents=store.alloc.count(),
            adopting=self.adoption.remaining if self.adoption is not None else 0,
            chunks=store.chunks.count,
            chunk_bytes=store.chunks.bytes,
            chunk_bytes_shared=store.chunks.shared_bytes,
            index_used=len(store.owners),
            index_capacity=store.index_capacity,
            chunk_tokens=g.chunk_tokens,
            leases_active=store.leases.active(),
            workers_attached=sum(1 for c in self.conns.values() if c.attached),
            workers_connected=len({c.pid for c in self.conns.values() if c.attached}),
            connections=len(self.conns),
            fds_closing=fds_closing(),
            unread_bytes=sum(c.out_bytes for c in self.conns.values()),
            claims_held=len(self.claims.claims),
            claims_waiting=self.claims.waiting(),
        )
        return SupervisorStats(
            name=self.settings.name,
            pid=os.getpid(),
            version=__version__,
            arena=str(self.arena.path),
            socket=str(self.socket_path),
            uptime=round(time.time() - self.started, 3),
            gauges=gauges,
            counters=store.counters,
            limits=self.limits,
            reported=self.reported.total(series := self.reported.series()),
            series=series,
            persist=self.persist.numbers() if self.persist is not None else PersistStats(),
            remote=self.remote.numbers() if self.remote is not None else RemoteStats(),
        )


Handler = Callable[[Context, Conn, dict[str, Any]], Reply]


@dataclass(frozen=True)
class Op:
    name: str
    handler: Handler
    #: the peer must have sent ``attach`` on this connection first
    attached: bool
    privilege: Privilege


OPS: dict[str, Op] = {}


def op(name: str, *, attached: bool, privilege: Privilege) -> Callable[[Handler], Handler]:
    """Register the decorated function as the handler of op ``name``."""

    def register(fn: Handler) -> Handler:
        OPS[name] = Op(name, fn, attached, privilege)
        return fn

    return register


# ------------------------------------------------------------------ admin and info
@op("ping", attached=False, privilege=Privilege.ANY)
def ping(ctx: Context, conn: Conn, msg: dict[str, Any]) -> Reply:
    return {"version": __version__}, None


@op("attach", attached=False, privilege=Privilege.ANY)
def attach(ctx: Context, conn: Conn, msg: dict[str, Any]) -> Reply:
    """Make this connection a worker's: it gets the arena's read-only descriptor."""
    get_int(msg, "pid", 0, 1 << 31, required=False)
    conn.attached = True
    return (
        {
            "name": ctx.settings.name,
            "path": str(ctx.arena.path),
            "arena_id": ctx.store.geometry.arena_id,
            "version": __version__,
            "supervisor_pid": os.getpid(),
            "remote": ctx.remote is not None,
        },
        [ctx.arena.ro_fd],
    )


@op("stats", attached=False, privilege=Privilege.ANY)
def stats(ctx: Context, conn: Conn, msg: dict[str, Any]) -> Reply:
    return ctx.stats().to_dict(), None


@op("ls", attached=False, privilege=Privilege.ANY)
def ls(ctx: Context, conn: Conn, msg: dict[str, Any]) -> Reply:
    limit = get_int(msg, "limit", 1, 100_000, required=False, default=1000)
    now_mono, now = time.monotonic(), time.time()
    live = ctx.store.live_entries()
    if "key_prefix" in msg:  # (``shmkv export KEY``: a key as ``shmkv ls`` shows it)
        prefix = get_bytes(msg, "key_prefix", 1, 16)
        live = [e for e in live if e.key.startswith(prefix)]
    rows = []
    for e in sorted(live, key=lambda e: -e.last_used)[:limit]:
        rows.append(
            {
                "key": e.key.hex(),
                "root": e.root.hex(),
                "tokens": e.n_tokens,
                "bytes": e.payload_len,
                "extent": e.extent,
                "pinned": e.pinned,
                "pin_ttl": ctx.expiry.pinned_ttl(e.gen) if ctx.expiry and e.pinned else None,
                "publisher": e.publisher,
                "offset": e.offset,
                "gen": e.gen,
                "hits": e.hits,
                "leases": e.leases,
                "created": e.created,
                "last_used": now - (now_mono - e.last_used),
            }
        )
        if e.chunks:  # (a chunked record: what its chunks hold, shared ones in full)
            rows[-1].update(chunks=len(e.chunks), chunk_bytes=sum(c.extent for c in e.chunks))
    chunks = ctx.store.chunks
    return {
        "entries": rows,
        "total": len(live),
        # (the data region as a whole: each chunk counted once)
        "bytes_used": ctx.store.bytes_used(),
        "chunk_bytes": chunks.bytes,
        "chunk_bytes_shared": chunks.shared_bytes,
    }, None


#: longest TTL a pin may carry (ten years)
MAX_PIN_TTL = 10 * 365 * 86400.0


def _set_pinned(ctx: Context, msg: dict[str, Any], pinned: bool) -> Reply:
    key = get_digest(msg, "key")
    ttl = get_float(msg, "ttl", 0.001, MAX_PIN_TTL) if pinned and "ttl" in msg else None
    n_tokens = get_int(msg, "n_tokens", 1, MAX_TOKENS, required=False)
    entries = [e for e in ctx.store.by_key(key) if n_tokens in (None, e.n_tokens)]
    for e in entries:
        ctx.store.set_pinned(e, pinned, durable=ttl is None)
        if ctx.expiry is not None:
            ctx.expiry.pin_ttl(e, ttl if pinned else None)
    return {"count": len(entries)}, None


@op("pin", attached=False, privilege=Privilege.ADMIN)
def pin(ctx: Context, conn: Conn, msg: dict[str, Any]) -> Reply:
    """Keep the records of ``key`` (of ``n_tokens`` tokens only, if given) out of eviction
    and ``--ttl``; with ``ttl``, only until they went unused for that many seconds."""
    return _set_pinned(ctx, msg, True)


@op("unpin", attached=False, privilege=Privilege.ADMIN)
def unpin(ctx: Context, conn: Conn, msg: dict[str, Any]) -> Reply:
    return _set_pinned(ctx, msg, False)


@op("clear", attached=False, privilege=Privilege.ADMIN)
def clear(ctx: Context, conn: Conn, msg: dict[str, Any]) -> Reply:
    if ctx.adoption is not None:  # (what it has still to check is dropped, not adopted)
        ctx.adoption.cancel()
    removed = ctx.store.clear()
    log.info("cleared %d entries at the request of pid %d", removed, conn.pid)
    return {"removed": removed}, None


@op("worker_exit", attached=False, privilege=Privilege.ADMIN)
def worker_exit(ctx: Context, conn: Conn, msg: dict[str, Any]) -> Reply:
    """A worker process exited (gunicorn's master says so): drop its connections now.

    Only its parent may say so (or the process itself, of its other connections):
    the parent of each peer is read from /proc when it connects, since by the time
    the master reports the exit it has reaped the pid.
    """
    pid = get_int(msg, "pid", 1, 1 << 31)
    others = [c for c in ctx.conns.values() if c.pid == pid and c is not conn]
    gone = [c for c in others if conn.pid in (c.pid, c.ppid)]
    if others and not gone:
        ctx.store.counters.ops_denied += 1
        raise PermissionDenied(
            f"pid {conn.pid} is not the parent of pid {pid}: only a worker's parent (its "
            f"gunicorn master) may report that it exited"
        )
    released = 0
    for other in gone:
        released += ctx.store.release_owner(other.id)
        ctx.close(other, "worker exited (reported)")
    return {"released": released}, None


# ----------------------------------------------------------------------- reads
@op("acquire", attached=True, privilege=Privilege.ANY)
def acquire(ctx: Context, conn: Conn, msg: dict[str, Any]) -> Reply:
    g = ctx.store.geometry
    offset = get_int(msg, "offset", g.data_offset, g.data_offset + g.data_size)
    gen = get_int(msg, "gen", 1)
    if ctx.adoption is not None:  # (a record the adoption has still to check: check it now)
        ctx.adoption.now(offset, gen)
    lease = ctx.store.acquire(offset, gen, conn.id)
    return {"lease": lease}, None


@op("release", attached=True, privilege=Privilege.ANY)
def release(ctx: Context, conn: Conn, msg: dict[str, Any]) -> Reply:
    lease = get_int(msg, "lease", 1)
    restored = get_int(msg, "tokens_restored", 0, MAX_TOKENS, required=False, default=0)
    valid = ctx.store.release(lease, conn.id)
    if valid and restored:  # (a worker's cache reports its totals instead: it sends none)
        ctx.reported.add(tokens_restored=restored)
    return {"valid": valid}, None


@op("suspect", attached=True, privilege=Privilege.ANY)
def suspect(ctx: Context, conn: Conn, msg: dict[str, Any]) -> Reply:
    """A worker found a record corrupt: check it ourselves; remove it if it is.

    A corrupt record would otherwise cost a miss on every lookup until evicted, and
    stop workers from publishing a good copy over it.
    """
    g = ctx.store.geometry
    offset = get_int(msg, "offset", g.data_offset, g.data_offset + g.data_size)
    gen = get_int(msg, "gen", 1)
    e = ctx.store.entries.get(gen)
    if e is None or e.doomed or e.offset != offset:
        return {"removed": False}, None
    intact = ctx.view.intact(e.offset, e.gen)
    if not intact:
        ctx.store.remove(e)
        ctx.store.counters.corrupt_removed += 1
        log.warning(
            "removed corrupt record %d at offset %d (reported by pid %d)", gen, offset, conn.pid
        )
    return {"removed": not intact}, None


@op("owners", attached=True, privilege=Privilege.ANY)
def owners(ctx: Context, conn: Conn, msg: dict[str, Any]) -> Reply:
    """The records indexed under chunk prefix ``digest``, and how far ``tokens`` match each.

    The index points a chunk prefix at one record. A worker of a sliding-window
    model can restore a record only whole, so when that one does not fit its
    prompt it asks for the others: every record that ends within the next chunk
    (the only ones a prompt can match to their end) and the most recent longer
    ones (how far the prompt goes along with them is where a checkpoint helps).
    ``publishers`` (optional, u32 uids) keeps the records of those publishers only, so
    that nobody else's records can crowd a worker's own out of the reply. Reads token
    ids only; the worker checks everything again under its lease.
    """
    store = ctx.store
    digest = get_digest(msg, "digest")
    tokens = np.frombuffer(get_tokens(msg), dtype="<i4")
    publishers: set[int] | None = None
    if "publishers" in msg:
        raw = get_bytes(msg, "publishers", 4, 4 * MAX_PUBLISHERS, multiple=4)
        publishers = {int(u) for u in np.frombuffer(raw, dtype="<u4")}
    gens = store.owners.get(digest) or {}
    live = [
        e
        for e in map(store.entries.get, gens)
        if e is not None and not e.doomed and (publishers is None or e.publisher in publishers)
    ]
    if not live:
        return {"owners": []}, None
    # the digest is chunk prefix k of every record that owns it
    end = (live[0].digests.index(digest) + 2) * store.geometry.chunk_tokens
    ending = [e.gen for e in live if e.n_tokens < end]
    longer = sorted((e.gen for e in live if e.n_tokens >= end), reverse=True)
    out = []
    for gen in ending[:OWNERS_MAX] + longer[:OWNERS_MAX]:
        e = store.entries[gen]
        try:
            cached = ctx.view.tokens(ctx.view.read_record(e.offset, gen))
        except (ArenaCorruptError, ValueError):
            continue
        out.append((common_prefix(cached, tokens), e.n_tokens, e.offset, gen))
    out.sort(reverse=True)
    return {"owners": [[off, gen, n, c] for c, n, off, gen in out[:OWNERS_MAX]]}, None


@op("report", attached=True, privilege=Privilege.ANY)
def report(ctx: Context, conn: Conn, msg: dict[str, Any]) -> Reply:
    """A worker's running totals (``counters``) for one of its caches (``reporter``, an id
    of the worker's choosing), labelled with the ``model`` alias and ``tenant`` it serves.

    Totals, not deltas: see ``worker_counters.py`` for why the sums then never go backwards.
    """
    counters = get_counters(msg)
    reporter = get_int(msg, "reporter", 0, MAX_U64, required=False, default=0)
    labels = (get_label(msg, "model"), get_label(msg, "tenant"))
    ctx.reported.report(conn.id, conn.pid, reporter, labels, counters)
    return {}, None


# ---------------------------------------------------------------------- writes
def _read_memfd(fd: int) -> Callable[[memoryview, int], None]:
    """A ``Store.begin_put`` reader that copies payload bytes from the worker's memfd."""

    def read(view: memoryview, pos: int) -> None:
        done = 0
        while done < len(view):
            try:
                n = os.preadv(fd, [view[done:]], pos + done)
            except OSError as e:  # e.g. a write-only descriptor of a memfd
                raise BadRequest(
                    f"cannot read the put descriptor: {e.strerror}; send a readable memfd"
                ) from None
            if n <= 0:
                raise BadRequest("memfd shrank while being read")
            done += n

    return read


#: seconds a put waits for an adoption to end before it is refused (within a client's
#: default --timeout of 5 s, so that its connection is not dropped as dead)
ADOPTING_PUT_WAIT = 2.0


class PutWork:
    """A put and its memfd: begun (``start``) at its first step, then made room for,
    copied and indexed a slice at a time. While an adoption still checks records
    (``Store.adopting``) it waits to begin."""

    def __init__(self, ctx: Context, fd: int, start: Callable[[], PutJob]) -> None:
        self.ctx, self.fd, self.start = ctx, fd, start
        self.job: PutJob | None = None
        self.since = time.monotonic()

    def step(self, deadline: float) -> dict[str, Any] | None:
        try:
            self.ctx.check_arena()
            if self.job is None:
                if self.ctx.store.adopting:
                    if time.monotonic() - self.since < ADOPTING_PUT_WAIT:
                        return None
                    self.ctx.store.counters.rejected_puts += 1
                    raise LimitExceeded(
                        f"not stored: the supervisor is still checking the arena it adopted "
                        f"after {ADOPTING_PUT_WAIT:g} s (`shmkv stats`: adopting); puts are "
                        f"taken again once it has"
                    )
                self.job = self.start()
            e = self.job.step(deadline)
        except BaseException:
            self.abort()
            raise
        if e is None:
            return None
        self._close_fd()
        self.ctx.wake(self.ctx.claims.indexed(e.digests))
        return {"gen": e.gen, "key": e.key, "n_tokens": e.n_tokens}

    def abort(self) -> None:
        if self.job is not None:
            self.job.abort()
        self._close_fd()

    def _close_fd(self) -> None:
        if self.fd >= 0:
            discard(self.fd)  # (a close never runs on the loop: see fdcloser.py)
            self.fd = -1


def _run(ctx: Context, conn: Conn, msg: dict[str, Any], work: Work) -> Reply:
    """Answer now if ``work`` fits in one slice of the loop; else go on with it later."""
    reply = work.step(time.monotonic() + ctx.settings.put_slice)
    if reply is not None:
        return reply, None
    ctx.defer(conn, msg.get("id", 0), work)
    return None, None


def _pin_refusal(conn: Conn) -> str:
    """Why ``conn`` may not put a state pinned: pinning is an admin op on every path (a pin
    outlives --ttl and takes a share of --max-pinned-percent the owner's pins then lack)."""
    uid = os.geteuid()
    return (
        f"a put with pin is for the supervisor's own user (uid {uid}) or root, not uid "
        f"{conn.uid}: a --group member may publish, not pin; put it without pin, and let "
        f"uid {uid} pin it (`shmkv pin KEY`)"
    )


@op("put", attached=True, privilege=Privilege.ANY)
def put(ctx: Context, conn: Conn, msg: dict[str, Any]) -> Reply:
    """Store a blob the worker sent as a memfd (SCM_RIGHTS), never as bytes."""
    root = get_digest(msg, "root")
    tokens = np.frombuffer(get_tokens(msg), dtype="<i4")
    fingerprint = get_fingerprint(msg)
    # no upper bound here: Store.put refuses a blob that can never fit with an
    # ArenaFullError naming --size (the memfd size check below bounds the read)
    payload_len = get_int(msg, "payload_len", 1)
    checksum = get_int(msg, "checksum", 0, MAX_U64)
    pinned = get_bool(msg, "pin")
    fd = conn.take_fd()
    if fd is None:
        raise BadRequest("put without a memfd: send the payload fd with SCM_RIGHTS")
    work = None
    try:
        if pinned and not Privilege.ADMIN.permits(conn):
            ctx.store.counters.ops_denied += 1
            raise PermissionDenied(_pin_refusal(conn))
        # F_GET_SEALS first: only shmem files (memfd) answer it, and it asks no file
        # system, where an fstat of a file on a hung FUSE mount would wait for its daemon
        try:
            fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:
            ctx.store.counters.foreign_fds += 1
            raise BadRequest("the put descriptor is not a memfd") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            ctx.store.counters.foreign_fds += 1
            raise BadRequest("the put descriptor is not a regular file (send a memfd)")
        if st.st_size < payload_len:
            raise BadRequest(f"memfd holds {st.st_size} bytes, put says {payload_len}")
        ctx.check_arena()

        def start() -> PutJob:
            return ctx.store.begin_put(
                root,
                tokens,
                fingerprint,
                payload_len,
                checksum,
                _read_memfd(fd),
                pin=pinned,
                publisher=conn.uid & 0xFFFFFFFF,  # (the kernel's word, never the message's)
            )

        work = PutWork(ctx, fd, start)
    finally:
        if work is None:
            discard(fd)  # (a close never runs on the loop: see fdcloser.py)
    return _run(ctx, conn, msg, work)


# ---------------------------------------------------------------------- remote
#: fastest prefill a worker may claim, tokens/s
MAX_PREFILL_TPS = 1e9


@op("fetch", attached=True, privilege=Privilege.ANY)
def fetch(ctx: Context, conn: Conn, msg: dict[str, Any]) -> Reply:
    """Does ``--remote`` hold a longer prefix of ``tokens`` than the ``have`` tokens the
    worker found here? If fetching it beats prefilling it (``prefill_tps``: the worker's
    measured speed, 0 if unknown), it is fetched into the arena and the reply says
    "fetched"; else "none", "not_worth", "down", "busy", or "timeout" at ``wait``
    seconds (capped by ``--remote-wait``). The Redis I/O is on the fetcher thread; the
    loop answers when it is done or at the deadline (``tiers/redis/tier.py``). ``cut``
    (optional, false): the worker's model can cut a state back, so a record that shares
    only a part of the prompt (and goes on past it) is fetched too.
    """
    root = get_digest(msg, "root")
    tokens = np.frombuffer(get_tokens(msg), dtype="<i4")
    have = get_int(msg, "have", 0, len(tokens))
    wait = get_float(msg, "wait", 0.0, 600.0)
    tps = get_float(msg, "prefill_tps", 0.0, MAX_PREFILL_TPS) if "prefill_tps" in msg else 0.0
    cut = get_bool(msg, "cut")
    if ctx.remote is None:
        return {"status": "off"}, None
    if ctx.store.adopting:  # (nothing is put into the arena until its adoption ends)
        return {"status": "busy"}, None
    rid = msg.get("id", 0)
    reply = ctx.remote.request(conn.id, rid, root, tokens.copy(), have, wait, tps, cut)
    return reply, None


# ---------------------------------------------------------------------- claims
@op("claim", attached=True, privilege=Privilege.ANY)
def claim(ctx: Context, conn: Conn, msg: dict[str, Any]) -> Reply:
    """Claim digests this worker will prefill, or wait for the worker that already does."""
    digests = get_digests(msg, "digests")
    wait = get_float(msg, "wait", 0.0, 600.0)
    status, _ = ctx.claims.claim(conn.id, msg.get("id", 0), digests, time.monotonic(), wait)
    if status == GO:
        return {"status": GO}, None
    return None, None


@op("unclaim", attached=True, privilege=Privilege.ANY)
def unclaim(ctx: Context, conn: Conn, msg: dict[str, Any]) -> Reply:
    ctx.wake(ctx.claims.unclaim(conn.id, get_digests(msg, "digests")))
    return {}, None
