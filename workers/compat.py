"""Every internal of llama_cpp.server, uvicorn and asyncio that the HTTP side uses, in one place.

Runs inside each gunicorn worker. The served app is llama-cpp-python's server with a
few of its module-level functions replaced (``app.py``); the worker takes accepting
over from the asyncio servers uvicorn starts (``worker.py``). Those are internals, read
from the versions in :data:`KNOWN` (llama-cpp-python: every release in the range of
``shmkv.llama.compat``; its ``llama_cpp.server`` is the same from 0.3.17 to 0.3.36 in what
is read here); nothing else on the HTTP side touches them.

:func:`check` runs when a worker builds its app: on a version not in :data:`KNOWN` it
verifies the internals are there and raises one ``ConfigError`` naming those missing
and the versions known (a warning if they all are). The accept takeover has a
fallback of its own: if an asyncio server lacks its sockets (:func:`listening_sockets`
raises ``ConfigError``), every worker accepts as plain uvicorn does.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import logging
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

import llama_cpp
import llama_cpp.server.app as server_app
from llama_cpp.server.errors import RouteErrorHandler
from llama_cpp.server.model import LlamaProxy
from uvicorn_worker import UvicornWorker

from shmkv.core.errors import ConfigError
from shmkv.llama import compat as llama_compat

log = logging.getLogger("shmkv.worker")

#: the versions whose internals this module was read from (llama-cpp-python: the oldest and
#: the newest of a range, as in ``shmkv.llama.compat``)
KNOWN = {
    "llama-cpp-python": llama_compat.KNOWN_VERSIONS,
    "uvicorn": ("0.54.0", "0.55.0"),
    "uvicorn-worker": ("0.4.0",),
    "python": ("3.11",),  # (asyncio's Server: ``_sockets``, ``_protocol_factory``)
}

_SERVER_FUNCTIONS = (
    "get_server_settings",
    "get_llama_proxy",
    "prepare_request_resources",
    "get_event_publisher",
    "authenticate",
    "llama_outer_lock",
)


def _installed() -> dict[str, str]:
    out = {"python": f"{sys.version_info.major}.{sys.version_info.minor}"}
    for name in ("llama-cpp-python", "uvicorn", "uvicorn-worker"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "none"
    return out


def known_versions() -> str:
    """The versions read, as one line for a message."""
    lcp = "llama-cpp-python"
    return ", ".join(f"{k} {' to '.join(v) if k == lcp else '/'.join(v)}" for k, v in KNOWN.items())


def _known(name: str, version: str) -> bool:
    if name == "llama-cpp-python":
        return llama_compat.known(version)
    return version in KNOWN[name]


def check() -> None:
    """Raise ConfigError if an internal the HTTP side replaces or reads is missing."""
    installed = _installed()
    unknown = {k: v for k, v in installed.items() if not _known(k, v)}
    if not unknown:
        return
    missing = [f"llama_cpp.server.app.{f}" for f in _SERVER_FUNCTIONS if not hasattr(server_app, f)]
    if not callable(getattr(RouteErrorHandler, "error_message_wrapper", None)):
        missing.append("RouteErrorHandler.error_message_wrapper")
    if not callable(getattr(LlamaProxy, "load_llama_from_model_settings", None)):
        missing.append("LlamaProxy.load_llama_from_model_settings")
    for name in ("_serve", "_install_sigquit_handler"):
        if not callable(getattr(UvicornWorker, name, None)):
            missing.append(f"UvicornWorker.{name}")
    now = ", ".join(f"{k} {v}" for k, v in unknown.items())
    if missing:
        raise ConfigError(
            f"{now}: missing {', '.join(missing)}, which shmkv's HTTP side uses (read from "
            f"{known_versions()}): install those versions (pip install 'shmkv[serve]')"
        )
    log.warning("%s: shmkv's HTTP side was read against %s", now, known_versions())


# ------------------------------------------------------------ llama_cpp.server
def server_settings() -> Any:
    """The server's settings (``interrupt_requests``, ...), or None."""
    return next(server_app.get_server_settings())


def llama_proxy() -> contextlib.AbstractAsyncContextManager[Any]:
    """The server's model proxy, under its model lock (``get_llama_proxy``)."""
    factory: Callable[[], AsyncIterator[Any]] = server_app.get_llama_proxy
    return contextlib.asynccontextmanager(factory)()


def prepare_request_resources(
    body: Any, proxy: Any, body_model: str | None, kwargs: dict[str, Any]
) -> llama_cpp.Llama:
    """The ``Llama`` a request's body asks for, its completion arguments set in ``kwargs``."""
    llama: llama_cpp.Llama = server_app.prepare_request_resources(body, proxy, body_model, kwargs)
    return llama


def model_lock_wanted() -> bool:
    """Whether a request waits for (or holds) the server's model lock."""
    return bool(server_app.llama_outer_lock.locked())


def current_alias(proxy: Any) -> str | None:
    """The alias of the model the proxy serves now."""
    alias = getattr(proxy, "_current_model_alias", None)
    return alias if isinstance(alias, str) else None


def authenticate_dependency() -> Any:
    """The server's api-key dependency (to override in ``app.dependency_overrides``)."""
    return server_app.authenticate


def replace_event_publisher(publisher: Callable[..., Any]) -> None:
    """Replace the server's ``get_event_publisher`` (the routes look it up per request)."""
    server_app.get_event_publisher = publisher


def wrap_request_resources(
    wrap: Callable[[Callable[..., llama_cpp.Llama]], Callable[..., llama_cpp.Llama]],
) -> None:
    """Replace the server's ``prepare_request_resources`` with ``wrap(the original)``, once."""
    plain = server_app.prepare_request_resources
    if getattr(plain, "shmkv", False):
        return
    wrapped = wrap(plain)
    wrapped.shmkv = True  # type: ignore[attr-defined]
    server_app.prepare_request_resources = wrapped


def wrap_error_formatter(wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace ``RouteErrorHandler.error_message_wrapper`` with ``wrap(the original)``, once."""
    plain = RouteErrorHandler.error_message_wrapper
    if getattr(plain, "shmkv", False):
        return
    wrapped = wrap(plain)
    wrapped.shmkv = True  # type: ignore[attr-defined]
    RouteErrorHandler.error_message_wrapper = wrapped  # type: ignore[method-assign]


#: ``LlamaProxy``'s own loader, before :func:`replace_loader`
_PLAIN_LOADER: Callable[[Any], llama_cpp.Llama] = LlamaProxy.load_llama_from_model_settings


def original_loader() -> Callable[[Any], llama_cpp.Llama]:
    """``LlamaProxy``'s own model loader (what the replaced one wraps)."""
    return _PLAIN_LOADER


def replace_loader(load: Callable[[Any], llama_cpp.Llama]) -> None:
    """Load every model of the server with ``load`` (``LlamaProxy``'s loader)."""
    LlamaProxy.load_llama_from_model_settings = staticmethod(load)  # type: ignore[method-assign,assignment]


# ------------------------------------------------------------ sse-starlette
def streams_run_through_a_graceful_stop() -> bool:
    """Let a stream under way when uvicorn begins a graceful stop run to its end.

    sse-starlette ends every stream when uvicorn is told to exit, and from 3.x ends it with a
    well-formed close: a reload (SIGHUP), a scale-down or a clean stop gave each client an
    answer cut mid-way with no error, no ``finish_reason`` and no ``[DONE]``. With its
    automatic drain off a stream is sent whole while uvicorn waits for its tasks (as a plain
    request is), within gunicorn's ``graceful_timeout``, after which the worker is killed and
    the client sees a broken body. False where sse-starlette lacks the switch (streams are
    then ended as before)."""
    try:
        from sse_starlette.sse import AppStatus
    except ImportError:  # (no sse-starlette: llama_cpp.server cannot stream at all)
        return False
    switch = getattr(AppStatus, "disable_automatic_graceful_drain", None)
    if not callable(switch):
        log.info("sse-starlette without disable_automatic_graceful_drain: a graceful stop "
                 "ends the streams under way")  # fmt: skip
        return False
    switch()
    return True


# ------------------------------------------------------------ asyncio / uvicorn
def listening_sockets(servers: list[Any]) -> list[tuple[asyncio.AbstractEventLoop, Any, Any]]:
    """(loop, listening socket, protocol factory) of each of uvicorn's asyncio servers.

    Raises ConfigError, naming the versions known, if a server lacks them.
    """
    out = []
    for srv in servers:  # asyncio.base_events.Server
        sockets = getattr(srv, "_sockets", None)
        factory = getattr(srv, "_protocol_factory", None)
        if sockets is None or factory is None or not hasattr(srv, "get_loop"):
            raise ConfigError(
                f"{type(srv).__name__} has no _sockets/_protocol_factory (read from "
                f"{known_versions()}; installed: "
                f"{', '.join(f'{k} {v}' for k, v in _installed().items())}): every worker "
                "accepts, busy or not"
            )
        out += [(srv.get_loop(), sock, factory) for sock in sockets]
    return out
