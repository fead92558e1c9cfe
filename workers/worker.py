"""The gunicorn worker class for shmkv: uvicorn's, except that a busy worker stops accepting.

Runs inside each gunicorn worker. A worker has one llama.cpp context, so it
serves one completion at a time; but a uvicorn worker keeps accepting
connections while it computes, and the kernel hands a new connection to any
worker waiting in accept, busy or not. Requests then queue behind a busy
worker while others sit idle. Here a worker stops listening for new
connections while it has a request in flight (its body received, the model
at work) and starts again when it is done: new connections wait in the
shared listen backlog for the first idle worker instead. Connections already
accepted (keep-alive) still reach their worker.

A connection that has sent no request yet (idle, or slow to send its headers or
body) never stops a worker from accepting others; one that has not sent its
request's headers ``--request-read-timeout`` seconds after it was accepted is
closed.

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


def _fileno(sock: Any) -> int:
    """A listening socket's descriptor, -1 once closed: gunicorn's socket wrapper drops its
    socket when a graceful stop closes it, and then raises AttributeError for ``fileno``."""
    try:
        return int(sock.fileno())
    except (AttributeError, OSError):
        return -1


class IdleAcceptor:
    """Accepts connections while no request is in flight, one per readiness event.

    asyncio's own accept loop takes up to `backlog` queued connections at once, so
    it is replaced on the listening sockets by a reader that takes one at a time
    and is switched off while this worker has a request in flight.
    """

    def __init__(self) -> None:
        self.busy = 0
        self.listening: list[tuple[Any, Any, Any]] = []  # (loop, socket, protocol factory)
        self.active = False
        #: seconds a connection may take to send its first request's headers
        self.read_timeout = 10.0
        self.counters = HttpCounters()
        self._timer: asyncio.TimerHandle | None = None
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
            self._listen(self.busy == 0)
        except Exception:  # (the loop refused the takeover): accept as usual
            log.warning("cannot take over accepting; every worker accepts", exc_info=True)
            self.listening = []

    def _listen(self, on: bool) -> None:
        for loop, sock, factory in self.listening:
            if (fd := _fileno(sock)) < 0:  # closed by a graceful stop
                self.active = False
                continue
            if on:
                loop.add_reader(fd, self._accept, loop, sock, factory)
            else:
                loop.remove_reader(fd)

    def _accept(self, loop: Any, sock: Any, factory: Any) -> None:
        try:
            conn, _ = sock.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return
        except OSError as e:  # EMFILE and friends: back off a little, keep serving
            log.warning("accept failed: %s", e)
            self._pause(1.0)
            return
        self.counters.connections_accepted += 1
        conn.setblocking(False)
        made: list[Any] = []

        def protocol() -> Any:
            made.append(factory())
            return made[-1]

        loop.create_task(loop.connect_accepted_socket(protocol, conn))
        # no pause here: the worker keeps accepting until a request has arrived
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

    def _pause(self, seconds: float) -> None:
        self._listen(False)
        if self._timer is not None:
            self._timer.cancel()
        loop = self.listening[0][0]
        self._timer = loop.call_later(seconds, self._maybe_resume)

    def _maybe_resume(self) -> None:
        self._timer = None
        if self.busy == 0 and self.active:
            self._listen(True)

    def enter(self) -> None:
        """A request arrived (its body is in): stop accepting until it is done."""
        self.busy += 1
        if self.busy == 1 and self.active:
            try:
                self._listen(False)
            except (OSError, ValueError, RuntimeError) as e:  # loop or socket going away
                log.debug("not pausing accept: %s", e)

    def leave(self) -> None:
        self.busy -= 1
        if self.busy == 0 and self.active and self._timer is None:
            try:
                self._listen(True)
            except (OSError, ValueError, RuntimeError) as e:  # loop or socket going away
                log.debug("not resuming accept: %s", e)

    def stop(self) -> None:
        """Shutting down: stop accepting for good."""
        if self.active:
            self.active = False
            if self._timer is not None:
                self._timer.cancel()
            self._listen(False)


ACCEPTOR = IdleAcceptor()


class BusyGate:
    """ASGI middleware: counts this worker's requests in flight for :data:`ACCEPTOR`.

    A completion is in flight from the moment its whole body has arrived: a client
    that sends its body slowly does not keep the worker from accepting others.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)  # health checks, model lists: quick
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

        try:
            await self.app(scope, receive_counted, send)
        finally:
            if entered:
                ACCEPTOR.leave()


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
