"""The gunicorn worker class for shmkv: uvicorn's, except that a busy worker stops accepting.

Runs inside each gunicorn worker. A worker has one llama.cpp context, so it
serves one completion at a time; but a uvicorn worker keeps accepting
connections while it computes, and the kernel hands a new connection to any
worker waiting in accept, busy or not. Requests then queue behind a busy
worker while others sit idle. Here a worker accepts only while it is idle:

* it stops listening for new connections while it has a completion in flight (its
  body received, the model at work) and starts again when it is done;
* it also stops from the moment it accepts a connection whose request is whole in the
  kernel's buffer (headers and the body they announce: a peek at the accept) until that
  request has reached the app, for at most :data:`HOLD_SECONDS` (in practice a
  millisecond): between the accept and the completion's start the worker is not busy yet,
  and two connections arriving together could both go to it, the second waiting behind the
  first's prefill while another worker was idle;
* a connection whose request is not whole at its accept (its body a moment behind its
  headers, or a client that stalls) holds the worker's accepts only on credit: at most
  :data:`HOLD_CREDIT_SECONDS` at once and :data:`HOLD_CREDIT_RATE` of its time, so bytes a
  client has not sent never keep a worker out of the pool for long, however many such
  connections one opens;
* the listening sockets defer accepts until a connection's first bytes arrive
  (``TCP_DEFER_ACCEPT``), so a client's request is there when its connection is accepted.

New connections wait in the shared listen backlog for the first idle worker instead
(when every worker is busy, the first to finish takes the next). A connection that sends
nothing, or sends slowly, never keeps a worker from accepting others for long: one with no
bytes at its accept (``TCP_DEFER_ACCEPT`` gave up waiting) holds nothing, one whose request
is not whole holds on credit, and one whose first request (headers and body) is not whole
``--request-read-timeout`` seconds after it was accepted is closed.

Connections already accepted still reach their worker. So that a keep-alive client's next
completion is not sent on a connection to a worker busy with another client's, a worker of
a deployment with more than one answers every completion with ``Connection: close``: each
completion comes on a new connection, which the idle workers' accepts spread.

The listening sockets are asyncio internals, read through ``compat.py`` (which names the
versions it was read from); without them every worker accepts as plain uvicorn does.
:class:`ShmkvWorker` overrides ``UvicornWorker._serve`` (``compat.check`` verifies it).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
import time
from typing import Any

from gunicorn.arbiter import Arbiter
from shmkv_workers import compat
from uvicorn.server import Server
from uvicorn_worker import UvicornWorker

from shmkv.core.config import resolve
from shmkv.core.errors import ConfigError
from shmkv.core.stats import HttpCounters

log = logging.getLogger("shmkv.worker")

#: seconds a worker stays out of the accept pool, at most, for a connection it accepted
#: whose request has not reached the app (a whole one gets there in a millisecond)
HOLD_SECONDS = 0.5
#: a worker's credit of seconds out of the pool for connections whose request is not whole
#: at their accept (its body a moment behind its headers, or a client that stalls): at most
#: this much at once, growing back at :data:`HOLD_CREDIT_RATE` seconds a second, so that
#: stalled clients, however many, keep each worker out for at most 5 % of its time
HOLD_CREDIT_SECONDS = 0.1
HOLD_CREDIT_RATE = 0.05
#: a credit below this holds nothing
MIN_HOLD_SECONDS = 0.002
#: bytes of a new connection's first request peeked at to tell whether it is whole (a body
#: longer than this counts as not whole: it holds on credit)
PEEK_BYTES = 65536
#: ``TCP_DEFER_ACCEPT`` of the listening sockets: seconds the kernel waits for a new
#: connection's first bytes before handing it to accept without them
DEFER_ACCEPT_SECONDS = 1


def peer(addr: Any) -> tuple[str, int] | None:
    """A connection's peer as ASGI's ``scope["client"]`` names it (None: not TCP)."""
    if isinstance(addr, (tuple, list)) and len(addr) >= 2:
        return (str(addr[0]), int(addr[1]))
    return None


def _fileno(sock: Any) -> int:
    """A listening socket's descriptor, -1 once closed: gunicorn's socket wrapper drops its
    socket when a graceful stop closes it, and then raises AttributeError for ``fileno``."""
    try:
        return int(sock.fileno())
    except (AttributeError, OSError):
        return -1


class IdleAcceptor:
    """Accepts connections while this worker is idle, one per readiness event.

    asyncio's own accept loop takes up to `backlog` queued connections at once, so
    it is replaced on the listening sockets by a reader that takes one at a time
    and is switched off while this worker has a request in flight, or a connection
    whose request has not arrived yet (:meth:`arrived`).
    """

    def __init__(self) -> None:
        self.busy = 0
        self.listening: list[tuple[Any, Any, Any]] = []  # (loop, socket, protocol factory)
        self.active = False
        #: seconds a connection may take to send its first request's headers
        self.read_timeout = 10.0
        #: the peer of the accepted connection whose request this worker waits for, if any
        self.holding: tuple[str, int] | None = None
        self.counters = HttpCounters()
        self._on = False
        self._timer: asyncio.TimerHandle | None = None  # backing off after a failed accept
        self._hold_timer: asyncio.TimerHandle | None = None
        #: when the hold under way began, if it is charged to the credit (else None)
        self._held_since: float | None = None
        self._credit_left = HOLD_CREDIT_SECONDS
        self._credit_at = time.monotonic()
        #: peers of accepted TCP connections whose first request is not whole yet, and when
        #: they were accepted (each leaves at its request, its close or its read timeout)
        self.pending: dict[tuple[str, int], float] = {}

    def attach(self, servers: list[Any], read_timeout: float) -> None:
        """Take over accepting from uvicorn's asyncio servers (best effort)."""
        self.read_timeout = read_timeout
        try:
            self.listening = compat.listening_sockets(servers)
        except ConfigError as e:  # an event loop without these internals: accept as usual
            log.warning("cannot take over accepting: %s", e)
            return
        try:
            for loop, sock, _ in self.listening:
                loop.remove_reader(_fileno(sock))
            self.active = True
            self._sync()
        except Exception:  # (the loop refused the takeover): accept as usual
            log.warning("cannot take over accepting; every worker accepts", exc_info=True)
            self.listening = []
            return
        for _, sock, _ in self.listening:
            defer_accept(sock)

    def accepting(self) -> bool:
        """Whether this worker takes new connections now."""
        idle = self.busy == 0 and self._hold_timer is None and self._timer is None
        return self.active and idle

    def _sync(self) -> None:
        """Listen or not, as :meth:`accepting` says."""
        want = self.accepting()
        if want == self._on:
            return
        try:
            self._listen(want)
        except (OSError, ValueError, RuntimeError) as e:  # loop or socket going away
            log.debug("not switching accept %s: %s", "on" if want else "off", e)

    def _listen(self, on: bool) -> None:
        for loop, sock, factory in self.listening:
            if (fd := _fileno(sock)) < 0:  # closed by a graceful stop
                self.active = False
                continue
            if on:
                loop.add_reader(fd, self._accept, loop, sock, factory)
            else:
                loop.remove_reader(fd)
        self._on = on

    def _accept(self, loop: Any, sock: Any, factory: Any) -> None:
        try:
            conn, addr = sock.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return
        except OSError as e:  # EMFILE and friends: back off a little, keep serving
            log.warning("accept failed: %s", e)
            self._pause(loop, 1.0)
            return
        self.counters.connections_accepted += 1
        conn.setblocking(False)
        client = peer(addr)
        if client is not None:
            self.pending[client] = time.monotonic()
        sent = request_sent(conn)
        if sent == WHOLE:  # a request the app will see at once: take no other before it
            self._hold(loop, client, HOLD_SECONDS, charged=False)
        elif sent == PART and (credit := self._credit(time.monotonic())) >= MIN_HOLD_SECONDS:
            self._hold(loop, client, credit, charged=True)  # (its body on the way, or stalled)
        elif sent == PART:
            self.counters.holds_refused += 1
        made: list[Any] = []

        def protocol() -> Any:
            proto = factory()
            lost = proto.connection_lost

            def connection_lost(exc: Exception | None) -> None:
                self.gone(client)
                lost(exc)

            proto.connection_lost = connection_lost
            made.append(proto)
            return proto

        loop.create_task(loop.connect_accepted_socket(protocol, conn))
        loop.call_later(self.read_timeout, self._expire, made, conn, client)

    def _expire(self, made: list[Any], conn: socket.socket, client: tuple[str, int] | None) -> None:
        """``read_timeout`` after the accept: close the connection if its first request is
        not whole (headers and body) by now."""
        if not made:  # never got its protocol: the connection went away early
            self.gone(client)
            if conn.fileno() >= 0:
                conn.close()
            return
        proto = made[0]
        transport = getattr(proto, "transport", None)
        if transport is None or transport.is_closing():
            return
        if client is not None:
            if self.pending.pop(client, None) is None:
                return  # its request arrived whole
        elif not hasattr(proto, "cycle") or proto.cycle is not None:
            return  # (not TCP: only a connection without headers is known idle)
        self.counters.idle_closed += 1
        log.debug("closing a connection whose request is not in after %.1f s", self.read_timeout)
        transport.close()

    def _credit(self, now: float) -> float:
        """Seconds this worker may stay out of the pool for requests not yet whole now."""
        grown = (now - self._credit_at) * HOLD_CREDIT_RATE
        self._credit_left = min(HOLD_CREDIT_SECONDS, self._credit_left + grown)
        self._credit_at = now
        return self._credit_left

    def _hold(
        self, loop: Any, client: tuple[str, int] | None, seconds: float, charged: bool
    ) -> None:
        self.holding = client
        if self._hold_timer is not None:
            self._hold_timer.cancel()
        self._hold_timer = loop.call_later(min(seconds, HOLD_SECONDS), self._expire_hold)
        self._held_since = time.monotonic() if charged else None
        self._sync()

    def _expire_hold(self) -> None:
        self.counters.holds_expired += 1
        log.debug("accepting again: no request from %s in time", self.holding)
        self._release()

    def _release(self) -> None:
        if self._hold_timer is not None:
            self._hold_timer.cancel()
            self._hold_timer = None
            if self._held_since is not None:  # what a request not yet whole held, charged
                now = time.monotonic()
                self._credit(now)
                self._credit_left = max(0.0, self._credit_left - (now - self._held_since))
                self._held_since = None
        self.holding = None
        self._sync()

    def _pause(self, loop: Any, seconds: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = loop.call_later(seconds, self._resume)
        self._sync()

    def _resume(self) -> None:
        self._timer = None
        self._sync()

    def arrived(self, client: Any) -> None:
        """A request from ``client`` (its ``scope["client"]``) reached the app whole (a
        completion's body in, another request's headers): if it is the one this worker holds
        out of the accept pool for, accept again (unless busy)."""
        client = peer(client)
        if client is not None:
            self.pending.pop(client, None)
        if self._hold_timer is not None and client == self.holding:
            self._release()

    def gone(self, client: tuple[str, int] | None) -> None:
        """The connection from ``client`` closed (uvicorn refused its request, or the client
        left): it holds nothing any more."""
        if client is None:
            return
        self.pending.pop(client, None)
        if self._hold_timer is not None and client == self.holding:
            self._release()

    def enter(self) -> None:
        """A completion arrived (its body is in): stop accepting until it is done."""
        self.busy += 1
        if self._hold_timer is not None:  # (the held connection's, or one that is as late)
            self._release()
        else:
            self._sync()

    def leave(self) -> None:
        self.busy -= 1
        self._sync()

    def stop(self) -> None:
        """Shutting down: stop accepting for good."""
        if self.active:
            for timer in (self._timer, self._hold_timer):
                if timer is not None:
                    timer.cancel()
            self._timer = self._hold_timer = None
            self.active = False
            self._sync()


#: what :func:`request_sent` tells of a just-accepted connection
NOTHING, PART, WHOLE = "nothing", "part", "whole"


def request_sent(conn: socket.socket) -> str:
    """How much of its first request a just-accepted connection has sent, from a peek at
    what the kernel holds for it (nothing is read): :data:`NOTHING`, :data:`PART` (its
    headers or body not all in yet: on the way, or a client that stalls), or :data:`WHOLE`
    (headers and the body they announce; or headers uvicorn will refuse at once)."""
    try:
        data = conn.recv(PEEK_BYTES, socket.MSG_PEEK)
    except OSError:  # nothing yet (BlockingIOError), or reset
        return NOTHING
    if not data:
        return NOTHING
    end = data.find(b"\r\n\r\n")
    if end < 0:
        return PART
    length, chunked = 0, False
    for line in data[:end].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            try:
                length = int(value.strip())
            except ValueError:  # refused by uvicorn at once (400)
                return WHOLE
        elif name == b"transfer-encoding":
            chunked = b"chunked" in value.lower()
    body = data[end + 4 :]
    if chunked:
        return WHOLE if body.endswith(b"0\r\n\r\n") else PART
    return WHOLE if len(body) >= length else PART


def defer_accept(sock: Any) -> None:
    """Have the kernel queue a TCP connection for accept once its first bytes arrived."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT, DEFER_ACCEPT_SECONDS)
    except (OSError, AttributeError) as e:  # (not Linux): a connection may come before it
        log.debug("no TCP_DEFER_ACCEPT: %s", e)


ACCEPTOR = IdleAcceptor()


class BusyGate:
    """ASGI middleware: tells :data:`ACCEPTOR` when this worker's requests arrive and end.

    A completion (a POST) is in flight from the moment its whole body has arrived: a client
    that sends its body slowly keeps the worker from accepting others only on the worker's
    credit (:data:`HOLD_CREDIT_SECONDS`). Another request is quick: its arrival is all that
    counts.
    With ``close_completions``, every completion's response closes its connection.
    """

    def __init__(self, app: Any, close_completions: bool = False) -> None:
        self.app = app
        self.close_completions = close_completions

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope.get("method") != "POST":
            ACCEPTOR.arrived(scope.get("client"))  # health checks, model lists: quick
            await self.app(scope, receive, send)
            return
        entered = False

        async def receive_counted() -> dict:
            nonlocal entered
            message = await receive()
            body_pending = message["type"] == "http.request" and message.get("more_body")
            if not entered and not body_pending:
                entered = True
                ACCEPTOR.arrived(scope.get("client"))
                ACCEPTOR.enter()
            return message

        async def send_closing(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k != b"connection"]
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        try:
            await self.app(scope, receive_counted, send_closing if self.close_completions else send)
        finally:
            if entered:
                ACCEPTOR.leave()
            else:  # (refused before its body was read)
                ACCEPTOR.arrived(scope.get("client"))


class ShmkvWorker(UvicornWorker):
    """uvicorn's gunicorn worker on the asyncio loop, accepting only while idle."""

    CONFIG_KWARGS: dict[str, Any] = {"loop": "asyncio", "http": "auto"}

    async def _serve(self) -> None:
        self.config.app = self.wsgi
        server = Server(config=self.config)
        self._install_sigquit_handler()
        serving = asyncio.ensure_future(server.serve(sockets=self.sockets))
        while not server.started and not serving.done():
            await asyncio.sleep(0.01)
        ACCEPTOR.attach(getattr(server, "servers", []), resolve("serve").request_read_timeout)
        try:
            await serving
        finally:
            ACCEPTOR.stop()
        if not server.started:
            sys.exit(Arbiter.WORKER_BOOT_ERROR)
