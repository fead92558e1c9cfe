"""The gunicorn worker class for shmkv: uvicorn's, except that a busy worker stops accepting.

Runs inside each gunicorn worker. A worker has one llama.cpp context, so it
serves one completion at a time; but a uvicorn worker keeps accepting
connections while it computes, and the kernel hands a new connection to any
worker waiting in accept, busy or not. Requests then queue behind a busy
worker while others sit idle. Here a worker stops listening
for new connections while it has a request in flight and starts again when
it is done: new connections wait in the shared listen backlog for the first
idle worker instead. Connections already accepted (keep-alive) still reach
their worker.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from typing import Any

from gunicorn.arbiter import Arbiter
from uvicorn.server import Server
from uvicorn_worker import UvicornWorker

log = logging.getLogger("shmkv.worker")


class IdleAcceptor:
    """Accepts one connection at a time, and none while a request is in flight.

    asyncio's own accept loop takes up to `backlog` queued connections at once, so
    it is replaced on the listening sockets by a reader that takes one, then waits
    until this worker is idle again (or, if that connection sends no request, a
    short grace period).
    """

    GRACE = 0.2

    def __init__(self) -> None:
        self.busy = 0
        self.listening: list[tuple[Any, Any, Any]] = []  # (loop, socket, protocol factory)
        self.active = False
        self._timer: asyncio.TimerHandle | None = None

    def attach(self, servers: list[Any]) -> None:
        """Take over accepting from uvicorn's asyncio servers (best effort)."""
        try:
            for srv in servers:  # asyncio.base_events.Server: its raw listening sockets
                for sock in srv._sockets:
                    self.listening.append((srv.get_loop(), sock, srv._protocol_factory))
            for loop, sock, _ in self.listening:
                loop.remove_reader(sock.fileno())
            self.active = True
            self._listen(True)
        except Exception:  # an event loop without these internals: accept as usual
            log.warning("cannot take over accepting; every worker accepts", exc_info=True)
            self.listening = []

    def _listen(self, on: bool) -> None:
        for loop, sock, factory in self.listening:
            if sock.fileno() < 0:  # closed by uvicorn's shutdown
                self.active = False
                continue
            if on:
                loop.add_reader(sock.fileno(), self._accept, loop, sock, factory)
            else:
                loop.remove_reader(sock.fileno())

    def _accept(self, loop: Any, sock: Any, factory: Any) -> None:
        try:
            conn, _ = sock.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return
        except OSError as e:  # EMFILE and friends: back off a little, keep serving
            log.warning("accept failed: %s", e)
            self._pause(1.0)
            return
        conn.setblocking(False)
        loop.create_task(loop.connect_accepted_socket(factory, conn))
        self._pause(self.GRACE)  # until its request is done, or the grace period

    def _pause(self, grace: float) -> None:
        self._listen(False)
        if self._timer is not None:
            self._timer.cancel()
        loop = self.listening[0][0]
        self._timer = loop.call_later(grace, self._maybe_resume)

    def _maybe_resume(self) -> None:
        self._timer = None
        if self.busy == 0 and self.active:
            self._listen(True)

    def enter(self) -> None:
        self.busy += 1
        if self._timer is not None:  # the request arrived: now wait for it to finish
            self._timer.cancel()
            self._timer = None

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
    """ASGI middleware: counts this worker's requests in flight for :data:`ACCEPTOR`."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)  # health checks, model lists: quick
            return
        ACCEPTOR.enter()
        try:
            await self.app(scope, receive, send)
        finally:
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
        ACCEPTOR.attach(getattr(server, "servers", []))
        try:
            await serving
        finally:
            ACCEPTOR.stop()
        if not server.started:
            sys.exit(Arbiter.WORKER_BOOT_ERROR)
