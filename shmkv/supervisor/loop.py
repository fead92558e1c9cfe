"""``shmkv supervise``: the process that owns the arena and is its only writer.

One thread, one ``selectors`` loop, kept here: signals, accepting connections,
dispatch of requests (work deferred over several turns: ``deferred.py``). Signal handlers only
queue the signal number (through ``signal.set_wakeup_fd``); the loop dispatches
it. The rest has a module each: the arena file's life in ``arenafile.py``, the
socket and peer credentials in ``listener.py``, each connection's I/O (frames,
descriptors, replies, unread limits, close) in ``connection.py``, the requests in
``ops.py``, the records in ``store.py``, systemd notifications in ``systemd.py``, its
own heap (given back as the tiers free their buffers) in ``memory.py``.

Start-up order: lock the arena's name, adopt the arena a stopped or killed
predecessor left (``adopt.py``) or create one (``arenafile.py``), bind the socket
(``listener.py``), then send READY=1 to systemd.

No peer may stall the loop or hold what all share: a request that needs more
than ``--put-slice`` of work (a put that evicts thousands of records or copies
hundreds of MiB) goes on a slice per turn of the loop, and that connection's
later requests wait for its reply; replies a peer leaves unread are bounded
per connection (``--max-unread``) and in total (``--max-unread-total``).
"""

from __future__ import annotations

import logging
import os
import selectors
import signal
import time
from collections import deque
from typing import Any

from shmkv import __version__
from shmkv.core.arena import ArenaView
from shmkv.core.config import Settings, group_id
from shmkv.core.errors import (
    EXIT_ARENA_LOST,
    EXIT_OK,
    ArenaCorruptError,
    BadRequest,
    PermissionDenied,
    ProtocolError,
    ShmkvError,
)
from shmkv.core.protocol import MAX_U64, decode_body
from shmkv.core.stats import LimitCounters
from shmkv.supervisor import adopt
from shmkv.supervisor.arenafile import ArenaFile, arena_path
from shmkv.supervisor.claims import Claims, Waiter
from shmkv.supervisor.connection import MAX_BACKLOG, MAX_PENDING_FDS, ConnIO
from shmkv.supervisor.deferred import INTERNAL, Deferred
from shmkv.supervisor.listener import Conn, Listener
from shmkv.supervisor.memory import Heap
from shmkv.supervisor.ops import OPS, Context
from shmkv.supervisor.pages import Pages
from shmkv.supervisor.store import Store
from shmkv.supervisor.systemd import Watchdog, sd_notify
from shmkv.supervisor.tiers.loop import TierLoop
from shmkv.supervisor.ttl import Expiry
from shmkv.supervisor.worker_counters import Reports

#: most time given to punching freed pages per turn of the loop (``pages.py``)
PUNCH_SLICE = 0.002

__all__ = [
    "EXIT_ARENA_LOST",
    "EXIT_OK",
    "MAX_BACKLOG",
    "MAX_PENDING_FDS",
    "Supervisor",
    "arena_path",
]

log = logging.getLogger(__name__)


class Supervisor:
    """The loop: signals, accepting connections, dispatch of requests to ``ops``, deferred
    work; each connection's I/O is :class:`ConnIO`'s (``connection.py``)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        gid = group_id(settings.group)
        self.arena = ArenaFile(settings, gid)
        self.listener = Listener(settings, gid)
        self.sel = selectors.DefaultSelector()
        self.limits = LimitCounters()
        self.io = ConnIO(
            settings,
            self.sel,
            self.limits,
            handle=self._handle_frame,
            closed=self._closed,
            counters=lambda: self.ctx.store.counters,
        )
        self.conns: dict[int, Conn] = self.io.conns
        self.claims = Claims(
            ttl=settings.claim_timeout, max_per_owner=settings.max_claims, limits=self.limits
        )
        #: requests worked on over several turns (``deferred.py``)
        self.work = Deferred(self.io, self._check_arena, settings.put_slice)
        self.started = time.time()
        self._ctx: Context | None = None
        #: ``--persist``: the write-behind to disk, and the refill of a new arena from it
        #: ``--persist`` and ``--remote`` (``tiers/loop.py``; None until start)
        self.tiers: TierLoop | None = None
        #: the arena was left by a supervisor before us and adopted (``adopt.py``): the refill
        #: loads only what it lacks
        self.adopted = False
        self._signals: deque[int] = deque()
        self._stop = False
        self._wake_r = self._wake_w = -1
        self._old_wakeup: int | None = None
        #: our own heap, given back as the tiers free their buffers (``memory.py``)
        self.heap = Heap()

    @property
    def ctx(self) -> Context:
        """What the ops work with; exists once :meth:`start` returned."""
        if self._ctx is None:
            raise RuntimeError("Supervisor.start() has not run")
        return self._ctx

    # ------------------------------------------------------------------ set-up
    def start(self) -> None:
        """Lock the name, create the arena, bind the socket; raises ShmkvError on failure."""
        self.heap.tune()  # (before the tiers' threads: each takes a heap of its own)
        self.arena.lock()
        try:
            geometry = None if self.settings.fresh else adopt.open_leftover(self.arena)
            adopted = self.adopted = geometry is not None
            if geometry is None:
                geometry = self.arena.create()
            assert self.arena.mm is not None
            # to re-check records (an adoption's, between requests: its pages are mapped as
            # they are read, not all before the first answer)
            view = ArenaView(self.arena.ro_fd, populate=False)
            pages = Pages(self.arena.rw_fd, self.settings.reserve)
            store = Store(
                self.arena.mm,
                geometry,
                lease_timeout=self.settings.lease_timeout,
                intact=lambda e: view.intact(e.offset, e.gen),
                max_pinned=geometry.data_size * self.settings.max_pinned_percent // 100,
                max_leases=self.settings.max_leases,
                limits=self.limits,
                pages=pages,
            )
            adoption = None
            if adopted:  # (checks records for --adopt-wait, then between requests)
                adoption = adopt.Adoption(store, view)
                if adoption.step(time.monotonic() + self.settings.adopt_wait):
                    adoption = None
            tiers = self.tiers = TierLoop(self.settings, self.arena, geometry.chunk_tokens)
            self._ctx = Context(
                settings=self.settings,
                arena=self.arena,
                store=store,
                view=view,
                claims=self.claims,
                reported=Reports(),
                socket_path=self.listener.path,
                started=self.started,
                conns=self.conns,
                wake=self._wake,
                close=self.io.close,
                check_arena=self._check_arena,
                defer=self.work.defer,
                limits=self.limits,
                persist=tiers.persist,
                expiry=Expiry(store, self.settings.ttl),
                remote=tiers.remote,
                adoption=adoption,
            )
            tiers.attach(
                store,
                self.sel,
                self._answer,
                lambda digests: self._wake(self.claims.indexed(digests)),
            )
            self.sel.register(self.listener.bind(), selectors.EVENT_READ, None)
        except BaseException:
            self.cleanup(remove=True)
            raise

    def _install_signals(self) -> None:
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._old_wakeup = signal.set_wakeup_fd(self._wake_w)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda signum, _frame: self._signals.append(signum))
        self.sel.register(self._wake_r, selectors.EVENT_READ, "signal")

    # -------------------------------------------------------------------- loop
    def serve_forever(self) -> int:
        """Serve until SIGTERM/SIGINT or a lost arena; returns the exit code."""
        self._install_signals()
        sd_notify(f"READY=1\nSTATUS=serving arena {self.settings.name}\nMAINPID={os.getpid()}")
        log.info(
            "shmkv %s supervising %r on %s (pid %d)",
            __version__,
            self.settings.name,
            self.listener.path,
            os.getpid(),
        )
        tiers = self.tiers
        assert tiers is not None
        if self.ctx.adoption is None:
            tiers.begin(self.ctx.store, self.sel, self.adopted)
        else:
            log.info(
                "answering while %d adopted record(s) are still checked (puts wait)",
                self.ctx.adoption.remaining,
            )
        watchdog = Watchdog()
        next_check = time.monotonic() + 1.0
        try:
            while not self._stop:
                adopting = self.ctx.adoption is not None
                if time.monotonic() >= next_check:
                    next_check = time.monotonic() + 1.0
                    if not self.arena.intact():
                        break
                    assert self.ctx.expiry is not None
                    if not adopting:
                        self.ctx.expiry.tick()  # (bounded work: see ttl.py)
                        tiers.tick(self.ctx.store)
                    self.heap.tick()
                now = time.monotonic()
                timeout = watchdog.tick(now)
                due = self.claims.next_deadline()
                if due is not None:
                    if due <= now:
                        self._wake(self.claims.expire(now))
                        due = self.claims.next_deadline()
                    if due is not None:
                        left = max(0.0, due - now)
                        timeout = left if timeout is None else min(timeout, left)
                timeout = 1.0 if timeout is None else min(timeout, 1.0)
                # (pages to punch: pages.py; records to check: adopt.py)
                busy = self.work or self.ctx.store.pages.busy or adopting
                timeout = 0.0 if busy else tiers.timeout(now, timeout)
                ready: set[str] = set()
                for key, events in self.sel.select(timeout):
                    if key.data is None:
                        self._accept()
                    elif key.data == "signal":
                        self._drain_signals()
                    elif key.data in ("refill", "remote"):
                        ready.add(key.data)
                    else:
                        conn: Conn = key.data
                        if events & selectors.EVENT_READ and not conn.closing:
                            self.io.on_readable(conn)
                        if events & selectors.EVENT_WRITE and not conn.closing:
                            self.io.flush(conn)
                if self.work and not self._stop:
                    self.work.step()  # (while adopting: puts that wait, or give up waiting)
                if adopting and not self._stop:
                    self._adopt_step()
                    continue
                if self.ctx.store.pages.busy and not self._stop and not self.arena.lost:
                    self.ctx.store.pages.step(time.monotonic() + PUNCH_SLICE)
                if not self._stop:
                    tiers.step(ready, self.sel, self._check_arena)
        finally:
            sd_notify("STOPPING=1")
            self.cleanup(remove=not self.settings.keep)
        return EXIT_ARENA_LOST if self.arena.lost else EXIT_OK

    def _adopt_step(self) -> None:
        """One slice of the adoption (``adopt.Adoption``); once it is done the tiers begin
        and the puts that waited go on."""
        adoption = self.ctx.adoption
        assert adoption is not None and self.tiers is not None
        try:
            self._check_arena()
            done = adoption.step(time.monotonic() + self.settings.put_slice)
        except ArenaCorruptError:
            return
        if done:
            self.ctx.adoption = None
            self.tiers.begin(self.ctx.store, self.sel, self.adopted)

    def _check_arena(self) -> None:
        """Raise (and stop) if the arena file was truncated: writing to it would SIGBUS."""
        if self.arena.lost or not self.arena.intact():
            self._stop = True
            raise ArenaCorruptError("the arena file was truncated; the supervisor restarts")

    def _drain_signals(self) -> None:
        try:
            while os.read(self._wake_r, 64):
                pass
        except BlockingIOError:
            pass
        while self._signals:
            sig = self._signals.popleft()
            if sig in (signal.SIGTERM, signal.SIGINT):
                log.info("received %s: shutting down", signal.Signals(sig).name)
                self._stop = True
            elif sig == signal.SIGHUP:
                log.info("stats: %s", self.ctx.stats().to_dict())

    def stop(self) -> None:
        self._stop = True

    # ------------------------------------------------------------ connections
    def _accept(self) -> None:
        conn = self.listener.accept(len(self.conns))
        if conn is None:
            return
        self.io.add(conn)
        log.debug("connection %d from pid %d", conn.id, conn.pid)

    def _closed(self, conn: Conn, reason: str) -> None:
        """What a connection held beyond its I/O, once :meth:`ConnIO.close` closed it."""
        self.work.abort(conn.id)
        # releasing may free a doomed record, which writes to the arena
        intact = not self.arena.lost and self.arena.intact()
        released = self.ctx.store.release_owner(conn.id) if intact else 0
        self.ctx.reported.closed(conn.id)
        self._wake(self.claims.drop_owner(conn.id))
        if self.tiers is not None and self.tiers.remote is not None:
            self.tiers.remote.drop_conn(conn.id)
        log.debug(
            "connection %d (pid %d) closed%s; released %d lease(s)",
            conn.id,
            conn.pid,
            f": {reason}" if reason else "",
            released,
        )

    def _handle_frame(self, conn: Conn, body: bytes) -> None:
        rid = 0
        try:
            try:
                msg = decode_body(body)
            except ProtocolError:
                self.limits.frames_refused += 1
                raise
            rid = msg.get("id", 0)
            if not isinstance(rid, int) or isinstance(rid, bool) or not 0 <= rid <= MAX_U64:
                rid = 0
                raise BadRequest("field 'id' must be an int in [0, 2**64)")
            name = msg.get("op")
            op = OPS.get(name) if isinstance(name, str) else None
            if op is None:
                raise BadRequest(f"unknown op {name!r:.40}")
            if op.attached and not conn.attached:
                raise BadRequest(f"op {name!r} before attach")
            if not op.privilege.permits(conn):
                self.ctx.store.counters.ops_denied += 1
                raise PermissionDenied(op.privilege.refusal(op.name, conn))
            self._check_arena()
            reply, fds = op.handler(self.ctx, conn, msg)
            if reply is None:  # answered later (a claim waiting, or deferred work)
                return
        except ShmkvError as e:
            self.io.reply_error(conn, rid, e)
            return
        except Exception:  # a bug must cost this request, not the supervisor
            log.exception("internal error handling a request from pid %d", conn.pid)
            self.io.reply_error(conn, rid, ShmkvError(INTERNAL))
            return
        self.io.reply(conn, rid, reply, fds)

    # ------------------------------------------------------------------ replies
    def _answer(self, conn_id: int, rid: int, reply: dict[str, Any]) -> None:
        """Reply to request ``rid`` of connection ``conn_id``, if it is still open."""
        conn = self.conns.get(conn_id)
        if conn is not None and not conn.closing:
            self.io.reply(conn, rid, reply)
            if not conn.closing:
                self.io.flush(conn)

    def _wake(self, woken: list[tuple[Waiter, str]]) -> None:
        """Answer the claims that were waiting and have now ended."""
        for waiter, status in woken:
            self._answer(waiter.owner, waiter.rid, {"status": status})

    # ----------------------------------------------------------------- cleanup
    def cleanup(self, remove: bool = True) -> None:
        """Close every connection, the socket and the arena; ``remove`` unlinks their files."""
        for conn in list(self.conns.values()):
            self.io.close(conn, "supervisor stopping")
        if self.listener.sock is not None:
            try:
                self.sel.unregister(self.listener.sock)
            except (KeyError, ValueError):
                pass
            self.listener.close(remove)
        if self.tiers is not None:
            self.tiers.close(self.sel)  # (before the arena: their writers read records from it)
        if self._ctx is not None:
            self._ctx.view.close()
        self.arena.close(remove)
        if self._wake_r >= 0:
            signal.set_wakeup_fd(self._old_wakeup if self._old_wakeup is not None else -1)
            try:  # (unregistered before closed, as every fd the loop watches)
                self.sel.unregister(self._wake_r)
            except (KeyError, ValueError):
                pass
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_r = self._wake_w = -1
