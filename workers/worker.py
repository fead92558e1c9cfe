"""The gunicorn worker class for shmkv: uvicorn's, except that a busy worker stops accepting.

Runs inside each gunicorn worker. A worker has one llama.cpp context, so it
serves one completion at a time; but a uvicorn worker keeps accepting
connections while it computes, and the kernel hands a new connection to any
worker waiting in accept, busy or not. Requests then queue behind a busy
worker while others sit idle. Here a worker accepts only while it is idle:

* it stops listening for new connections while it has a completion in flight (its
  body received, the model at work) and starts again when it is done;
* it also stops from the moment it accepts a connection that has sent bytes until that
  connection's request has arrived (a completion's whole body, or another request's
  headers), for at most :data:`HOLD_SECONDS`: between the accept and the completion's
  start the worker is not busy yet, and two connections arriving together could both go
  to it, the second waiting behind the first's prefill while another worker was idle;
* the listening sockets defer accepts until a connection's first bytes arrive
  (``TCP_DEFER_ACCEPT``), so a client's request is there when its connection is accepted.

New connections wait in the shared listen backlog for the first idle worker instead
(when every worker is busy, the first to finish takes the next). A connection that sends
nothing, or sends slowly, never keeps a worker from accepting others for long: one with no
bytes at its accept (``TCP_DEFER_ACCEPT`` gave up waiting) holds nothing, one whose request
is not in after :data:`HOLD_SECONDS` holds no more, and one that has not sent its request's
headers ``--request-read-timeout`` seconds after it was accepted is closed.

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
from typing import Any

from gunicorn.arbiter import Arbiter
from shmkv_workers import compat
from uvicorn.server import Server
from uvicorn_worker import UvicornWorker

from shmkv.core.config import resolve
from shmkv.core.errors import ConfigError
from shmkv.core.stats import HttpCounters

log = logging.getLogger("shmkv.worker")

#: seconds a worker stays out of the accept pool for a connection whose request has not
#: arrived (a client sends its request at once; only a slow or stalled one waits this long)
HOLD_SECONDS = 0.5
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
        self._no_cycle_logged = False

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
        if has_bytes(conn):  # a request on its way: take no other connection before it
            self._hold(loop, peer(addr))
        made: list[Any] = []

        def protocol() -> Any:
            made.append(factory())
            return made[-1]

        loop.create_task(loop.connect_accepted_socket(protocol, conn))
        loop.call_later(self.read_timeout, self._expire, made, conn)

    def _expire(self, made: list[Any], conn: socket.socket) -> None:
        """``read_timeout`` after the accept: close the connection if no request started."""
        if not made:  # never got its protocol: the connection went away early
            if conn.fileno() >= 0:
                conn.close()
            return
        proto = made[0]
        transport = getattr(proto, "transport", None)
        if transport is None or transport.is_closing():
            return
        if not hasattr(proto, "cycle"):  # not uvicorn's h11/httptools protocol
            if not self._no_cycle_logged:
                self._no_cycle_logged = True
                log.warning("cannot tell idle connections apart: none is timed out")
            return
        if proto.cycle is None:  # uvicorn has not parsed a request's headers on it
            self.counters.idle_closed += 1
            log.debug("closing a connection that sent no request in %.1f s", self.read_timeout)
            transport.close()

    def _hold(self, loop: Any, client: tuple[str, int] | None) -> None:
        self.holding = client
        if self._hold_timer is not None:
            self._hold_timer.cancel()
        self._hold_timer = loop.call_later(HOLD_SECONDS, self._expire_hold)
        self._sync()

    def _expire_hold(self) -> None:
        self.counters.holds_expired += 1
        log.debug("accepting again: no request from %s in %.1f s", self.holding, HOLD_SECONDS)
        self._release()

    def _release(self) -> None:
        if self._hold_timer is not None:
            self._hold_timer.cancel()
            self._hold_timer = None
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
        """A request from ``client`` (its ``scope["client"]``) reached the app: if it is the
        one this worker holds out of the accept pool for, accept again (unless busy)."""
        if self._hold_timer is not None and peer(client) == self.holding:
            self._release()

    def enter(self) -> None:
        """A completion arrived (its body is in): stop accepting until it is done."""
        self.busy += 1
        if self._hold_timer is not None:  # (the held connection's, or one that is as late)
            self._hold_timer.cancel()
            self._hold_timer = None
            self.holding = None
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


def has_bytes(conn: socket.socket) -> bool:
    """Whether a just-accepted connection has sent bytes (its request, coming)."""
    try:
        return bool(conn.recv(1, socket.MSG_PEEK))
    except OSError:  # nothing yet (BlockingIOError), or reset
        return False


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
    that sends its body slowly does not keep the worker from accepting others for longer
    than :data:`HOLD_SECONDS`. Another request is quick: its arrival is all that counts.
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
