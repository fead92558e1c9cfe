"""The OpenAI-compatible app each gunicorn worker runs: llama-cpp-python's server + shmkv.

Runs inside one gunicorn (uvicorn) worker, after fork: the model is loaded
here, never in the master, and the worker attaches to the shmkv supervisor
here. Endpoints are llama-cpp-python's own (``/v1/completions``,
``/v1/chat/completions``, ``/v1/models``, ...) plus ``/health`` and ``/metrics`` (with
``--api-key``: ``/metrics`` for the keys only, ``/health`` in full for them only). Every
completion says what the cache did: in its usage, as OpenAI's
``prompt_tokens_details.cached_tokens`` (``usage.py``), and in
``X-Shmkv-Restored-Tokens`` and friends as response headers, and, in a stream (whose
headers leave before the prompt is evaluated), an extra ``shmkv`` field in the first chunk::

    "shmkv": {"prompt_tokens": 1090, "restored_tokens": 1088, "evaluated_tokens": 2,
              "cached_tokens": 1088, "restore_ms": 1.9, "hit": true, "worker_pid": 4242,
              "coalesce_wait_ms": 0.0, "remote_wait_ms": 0.0, "cpu_wait_ms": 0.0,
              "prefill_ms": 21.4, "first_decode_ms": 0.3, "received_at": 81234.501,
              "started_at": 81234.507, "first_token_at": 81234.533, ...}

The last ones say where the request's time to first token went in this worker
(``cache_field``): from ``received_at`` (the app got the request) to ``started_at``
(its generate call began: parsing, chat template, tokenizing), waiting for another
worker's prefill or ``--remote``, restoring, evaluating the prompt's new tokens
(``prefill_ms``, its waits for cores of the CPU budget included) and sampling the first
token; ``*_at`` are ``time.monotonic()`` seconds, one clock for every process on the
machine (``bench/bench_serve.py`` sets them against its send times).

Settings come from ``shmkv.core.config`` (``SHMKV_*`` variables, set by ``shmkv serve``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

import anyio
import llama_cpp
import llama_cpp.server.app as server_app
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from llama_cpp.server.errors import ErrorResponse
from llama_cpp.server.settings import ModelSettings, ServerSettings
from shmkv_workers import compat
from shmkv_workers.metrics import add_metrics_route
from shmkv_workers.tenants import Bearer, TenantScope, authenticate, key_check
from shmkv_workers.usage import UsageDetails, include_usage, usage_chunk
from shmkv_workers.worker import ACCEPTOR, BusyGate
from starlette.concurrency import iterate_in_threadpool, run_in_threadpool
from starlette.middleware import Middleware
from starlette_context import context

from shmkv.core.config import Settings, resolve
from shmkv.core.errors import ConfigError, ShmkvError
from shmkv.core.kvtypes import describe
from shmkv.core.stats import numbers
from shmkv.llama import SharedPrefixCache, attach, live_caches
from shmkv.llama.cpu import budget as cpubudget
from shmkv.serving.chat_template import (  # noqa: F401 (the template's names, re-exported from here)
    GEMMA3_FORMAT,
    GEMMA3_TEMPLATE,
    gemma3_formatter,
    gemma3_messages,
)
from shmkv.serving.default_model import default_model_path
from shmkv.serving.model_settings import load_with, model_settings

log = logging.getLogger("shmkv.worker")


def cache_field(cache: SharedPrefixCache) -> dict[str, Any]:
    """What the cache did for the last call, and where its time to first token went (read
    at its first token; ``*_at`` are ``time.monotonic()`` seconds, the same clock in every
    process of the machine, so that a client can set them against its own)."""
    last = cache.last

    def ms(seconds: float) -> float:
        return round(seconds * 1000, 3)

    return {
        "prompt_tokens": last.prompt_tokens,
        "restored_tokens": last.tokens_restored,
        "reused_local_tokens": last.tokens_reused_local,
        "evaluated_tokens": last.tokens_evaluated,
        "cached_tokens": last.cached_tokens,
        "restore_ms": ms(last.restore_seconds),
        "prefill_threads": last.prefill_threads,
        "hit": last.hit,
        "worker_pid": os.getpid(),
        "coalesce_wait_ms": ms(last.coalesce_wait_seconds),
        "remote_wait_ms": ms(last.remote_wait_seconds),
        "cpu_wait_ms": ms(last.cpu_wait_seconds),
        "prefill_ms": ms(last.prefill_seconds),
        "first_decode_ms": ms(max(0.0, last.first_token_at - last.prefill_end_at))
        if last.prefill_end_at
        else 0.0,
        "started_at": round(last.started_at, 6),
        "first_token_at": round(last.first_token_at, 6),
    }


#: the ASGI scope key under which :class:`Received` leaves the request's arrival time
RECEIVED = "shmkv.received_at"


class Received:
    """ASGI middleware, the outermost: when this worker's app began handling the request
    (``time.monotonic()``, in the scope; after uvicorn parsed its headers), for the
    ``received_at`` of :class:`CacheHeaders`."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        scope[RECEIVED] = time.monotonic()
        await self.app(scope, receive, send)


def _record(cache: SharedPrefixCache) -> None:
    """At the first token: leave what the cache did in this request's context dict."""
    if context.exists():  # the same dict the middleware reads, across the threadpool
        context["shmkv"] = cache_field(cache)


async def send_error(
    send: Any, status: int, message: str, code: str, param: str | None = None
) -> None:
    """Answer with an OpenAI-style ``invalid_request_error`` (raw ASGI: from middleware)."""
    error = {"message": message, "type": "invalid_request_error"}
    if param is not None:
        error["param"] = param
    body = json.dumps({"error": {**error, "code": code}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class CacheHeaders:
    """ASGI middleware: ``X-Shmkv-*`` response headers for non-streaming completions.

    It sits inside llama-cpp-python's RawContextMiddleware, whose per-request
    dict the completion wrapper fills from the worker thread. (A stream's headers
    leave before the prompt is evaluated: its first chunk carries the field.)
    It also holds a stream's headers until its first event, so that a prompt
    longer than the context gets a 400, as without streaming, not an empty 200.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        streaming = False
        annotated = False
        held: dict | None = None
        ended = False

        async def send_annotated(message: dict) -> None:
            nonlocal streaming, annotated, held, ended
            field = context.get("shmkv") if context.exists() else None
            if field and RECEIVED in scope:
                field = {**field, "received_at": round(scope[RECEIVED], 6)}
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                streaming = any(
                    k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                    for k, v in headers
                )
                if streaming:  # hold a stream's 200 until its first event: a prompt the
                    held = message  # model refuses (too long) can still get its 400
                    return
                if field:
                    for k, v in field.items():
                        name = "x-shmkv-" + k.replace("_", "-")
                        headers.append((name.encode(), str(v).lower().encode()))
                    message = {**message, "headers": headers}
            elif message["type"] == "http.response.body":
                if held is not None:
                    if not message.get("body"):
                        ended = ended or not message.get("more_body", False)
                        return  # nothing said yet (the stream may be failing): keep holding
                    start, held = held, None
                    await send(start)
                if streaming and field and not annotated:
                    body = message.get("body", b"")
                    if body.startswith(b"data: {"):
                        annotated = True
                        message = {**message, "body": _with_field(body, field)}
            await send(message)

        try:
            await self.app(scope, receive, send_annotated)
        except Exception as e:
            match = _context_exceeded(e) if held is not None else None
            if match is None:
                raise
            log.info("refused a stream: %s", e)
            message = (
                f"This model's maximum context length is {match[2]} tokens, however the "
                f"prompt has {match[1]} tokens. Please reduce the length of the prompt or "
                "messages."
            )
            await send_error(send, 400, message, "context_length_exceeded", param="messages")
            return
        if held is not None:  # a stream that ended without a single event
            await send(held)
            if ended:
                await send({"type": "http.response.body", "body": b""})


_CONTEXT_EXCEEDED = re.compile(r"Requested tokens \((\d+)\) exceed context window of (\d+)")


def _context_exceeded(exc: BaseException) -> re.Match | None:
    """llama-cpp-python's too-long-prompt error, possibly inside an exception group."""
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            if (m := _context_exceeded(inner)) is not None:
                return m
        return None
    return _CONTEXT_EXCEEDED.search(str(exc)) if isinstance(exc, ValueError) else None


def _with_field(event: bytes, field: dict[str, Any]) -> bytes:
    """Add ``"shmkv": field`` to the JSON of one server-sent ``data:`` event."""
    head, sep, tail = event.partition(b"\n")
    try:
        chunk = json.loads(head[len(b"data: ") :])
    except ValueError:
        return event
    if not isinstance(chunk, dict):
        return event
    chunk["shmkv"] = field
    return b"data: " + json.dumps(chunk).encode() + sep + tail


class BodyLimit:
    """ASGI middleware: refuse request bodies over ``limit`` bytes with 413, before parsing."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            await self._refuse(send)
            return
        seen = 0
        started = refused = False

        async def limited() -> dict:
            nonlocal seen, refused
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:  # chunked upload past the limit: stop reading it,
                    if not started and not refused:  # answer 413 ourselves (the app sees
                        refused = True  # a disconnect and would answer nothing at all)
                        await self._refuse(send)
                    return {"type": "http.disconnect"}
            return message

        async def send_unless_refused(message: dict) -> None:
            nonlocal started
            if refused:
                return
            started = True
            await send(message)

        try:
            await self.app(scope, limited, send_unless_refused)
        except Exception:
            if not refused:  # the app failing on the disconnect we made up is expected
                raise

    async def _refuse(self, send: Any) -> None:
        message = f"request body over {self.limit} bytes (--max-request-bytes)"
        await send_error(send, 413, message, "request_too_large")


# ------------------------------------------------------------ streams
async def _event_publisher(
    request: Any,
    inner_send_chan: Any,
    body: Any,
    body_model: str | None,
    llama_call: Any,
    kwargs: dict[str, Any],
) -> None:
    """llama-cpp-python's ``get_event_publisher``, except that the completion's iterator
    is closed while this request still holds the model lock, on the threadpool, however
    the stream ends (done, failed, client gone).

    The original leaves an abandoned iterator to the garbage collector, which closes it
    later on whatever thread it runs on: the generator's cleanup (shmkv's state capture)
    would then touch the llama context while another request decodes on it. It also
    calls the class's method (``Llama.create_chat_completion``), not the instance's,
    which shmkv hooks (a chat's message boundaries): the instance's is called here.
    With ``stream_options.include_usage``, the stream ends with a usage chunk
    (``usage.py``).
    """
    with_usage = await include_usage(request)
    server_settings = compat.server_settings()
    interrupt_requests = server_settings.interrupt_requests if server_settings else False
    async with compat.llama_proxy() as llama_proxy:
        llama = compat.prepare_request_resources(body, llama_proxy, body_model, kwargs)
        async with inner_send_chan:
            iterator = None
            try:
                method = getattr(llama, llama_call.__name__)  # (the hooked one)
                iterator = await run_in_threadpool(method, **kwargs)
                last = None
                async for chunk in iterate_in_threadpool(iterator):
                    if with_usage:
                        last = chunk = {**chunk, "usage": None}
                    await inner_send_chan.send(dict(data=json.dumps(chunk)))
                    if await request.is_disconnected():
                        raise anyio.get_cancelled_exc_class()()
                    if interrupt_requests and compat.model_lock_wanted():
                        await inner_send_chan.send(dict(data="[DONE]"))
                        raise anyio.get_cancelled_exc_class()()
                if with_usage and (final := usage_chunk(llama, last)) is not None:
                    await inner_send_chan.send(dict(data=json.dumps(final)))
                await inner_send_chan.send(dict(data="[DONE]"))
            except anyio.get_cancelled_exc_class():
                log.info("stream to %s ended early (client gone)", request.client)
                raise
            finally:
                close = getattr(iterator, "close", None)
                if close is not None:
                    with anyio.CancelScope(shield=True):
                        try:
                            await run_in_threadpool(close)
                        except Exception as e:  # (a completion that failed as it closed)
                            log.warning("closing a completion stream failed: %s", e)


# ------------------------------------------------------------ client errors
# llama-cpp-python's route handler answers 500 (and prints a traceback) to a body that
# is not JSON or whose fields have the wrong types: client errors, so 422 here.
def _invalid(message: str, code: str, param: str | None = None) -> ErrorResponse:
    return ErrorResponse(message=message, type="invalid_request_error", param=param, code=code)


def _client_errors_are_4xx(plain: Any) -> Any:
    """Wrap the route handler's error formatter: a failed validation is a 422."""

    def error_message_wrapper(self, error: Exception, body: Any = None):
        if isinstance(error, RequestValidationError):
            problems = "; ".join(
                f"{'.'.join(str(x) for x in e.get('loc', ()))}: {e.get('msg')}"
                for e in error.errors()[:5]
            )
            return 422, _invalid(f"invalid request: {problems}", "invalid_request")
        return plain(self, error, body)

    return error_message_wrapper


async def _invalid_json(request: Any, exc: Exception) -> JSONResponse:
    """The route handler re-reads a body that failed validation: not JSON at all."""
    return JSONResponse(
        {"error": _invalid(f"request body is not valid JSON: {exc}", "invalid_json")},
        status_code=422,
    )


def make_loader(settings: Settings):
    """A ``LlamaProxy`` loader that attaches every model it loads to the shmkv arena."""
    plain = compat.original_loader()

    def load(model_settings: ModelSettings) -> llama_cpp.Llama:
        try:
            llm = load_with(model_settings, settings.swa_full, plain)
        except ValueError as e:  # (llama.cpp's own reason is not logged with verbose off)
            default_kv = (settings.cache_type_k, settings.cache_type_v) == ("f16", "f16")
            if default_kv or "llama_context" not in str(e):
                raise
            kv = describe(settings.cache_type_k, settings.cache_type_v, settings.flash_attn)
            raise ConfigError(
                f"llama.cpp could not create a context for {Path(model_settings.model).name} "
                f"with KV cache {kv}: a quantized cache type needs the model's attention head "
                "size to be a multiple of its block size (32); use --cache-type-k f16 "
                "--cache-type-v f16 for this model"
            ) from e
        try:
            cache = attach(llm, settings=settings)
        except ShmkvError as e:  # no cache is never a reason not to serve
            log.warning("serving %s without shmkv: %s", model_settings.model, e)
            if not settings.swa_full and llama_cpp.llama_model_n_swa(llm.model) > 0:
                # plain llama-cpp-python reuses its context's tokens without asking whether
                # a window layer still holds them (shmkv asks): only a full window always does
                log.warning("reloading %s with a full window cache", model_settings.model)
                llm.close()
                llm = load_with(model_settings, True, plain)
            return llm
        cache.on_prefill = _record
        if model_settings.model_alias:  # (the label of its counters in /metrics)
            cache.ledger.labels = (model_settings.model_alias, cache.namespace)
        cache.cpu = cpubudget.for_settings(settings, llm)  # (None: static split, or a GPU)
        log.info(
            "worker %d loaded %s with shmkv arena %r",
            os.getpid(),
            Path(model_settings.model).name,
            settings.name,
        )
        return llm

    return load


def _aliases(settings: Settings, models: list[str]) -> list[str]:
    """Each model's API name: --model-alias in --model's order, else the file's stem."""
    given = list(settings.model_alias or [])
    if len(given) > len(models):
        raise ConfigError(f"{len(given)} --model-alias for {len(models)} model(s)")
    names = given + [Path(m).stem for m in models[len(given) :]]
    if len(set(names)) != len(names):
        raise ConfigError(f"model aliases must differ: {names}")
    return names


def _named_by_alias(plain: Any) -> Any:
    """Responses carry the served model's alias in ``model``, not the client's string
    nor (when the client sent none) the GGUF's path on this server."""

    def prepare_request_resources(
        body: Any, llama_proxy: Any, body_model: str | None, kwargs: dict[str, Any]
    ) -> llama_cpp.Llama:
        llama = plain(body, llama_proxy, body_model, kwargs)
        alias = compat.current_alias(llama_proxy)
        if alias:
            kwargs["model"] = alias
        return llama

    return prepare_request_resources


def create_app(settings: Settings | None = None):
    """Build the app for one worker (gunicorn calls this after fork)."""
    settings = settings or resolve("serve")
    logging.basicConfig(
        level=getattr(logging, settings.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s",
    )
    models = settings.model or [default_model_path()]
    aliases = _aliases(settings, models)
    settings_of_models = [
        model_settings(settings, m, alias) for m, alias in zip(models, aliases, strict=True)
    ]
    # interrupt_requests=False: llama-cpp-python would otherwise end a stream in flight
    # (with a truncated body) whenever another request waits for this worker's model
    # (api keys are checked by tenants.authenticate; the first one here keeps
    # llama-cpp-python's own check closed should any route still use it)
    keys = settings.api_key or []
    server_settings = ServerSettings(
        host=settings.host,
        port=settings.port,
        api_key=keys[0] if keys else None,
        interrupt_requests=False,
    )
    compat.check()
    compat.replace_loader(make_loader(settings))
    compat.replace_event_publisher(_event_publisher)
    compat.wrap_error_formatter(_client_errors_are_4xx)
    compat.wrap_request_resources(_named_by_alias)
    compat.streams_run_through_a_graceful_stop()
    app = server_app.create_app(server_settings=server_settings, model_settings=settings_of_models)

    app.dependency_overrides[compat.authenticate_dependency()] = authenticate(keys)
    app.user_middleware.append(Middleware(CacheHeaders))  # innermost: inside the context
    app.user_middleware.append(Middleware(UsageDetails))
    app.user_middleware.append(  # each completion runs as its request's cache tenant
        Middleware(TenantScope, per_api_key=settings.namespace_per_api_key)
    )
    app.add_middleware(BodyLimit, limit=settings.max_request_bytes)
    # a worker accepts only while idle; a completion's connection closes after it, so that
    # a keep-alive client's next one reaches an idle worker
    app.add_middleware(BusyGate, close_completions=settings.workers > 1)
    app.add_middleware(Received)  # outermost: when the request reached the app
    app.add_exception_handler(json.JSONDecodeError, _invalid_json)
    app.add_exception_handler(UnicodeDecodeError, _invalid_json)

    add_metrics_route(app, settings)

    key_ok = key_check(keys)

    @app.get("/health", tags=["shmkv"])
    def health(authorization: Bearer) -> dict[str, Any]:
        """Liveness for anyone; the worker's pid, tenants and counters only with a key of
        --api-key (they tell which tenants are served and how busy they are)."""
        if not key_ok(authorization):
            return {"status": "ok"}
        caches = list(live_caches())
        return {
            "status": "ok",
            "worker_pid": os.getpid(),
            "models": aliases,
            "shmkv": [
                {"connected": c.reader.connected, "namespace": c.namespace, **numbers(c.totals)}
                for c in caches
            ],
            "http": numbers(ACCEPTOR.counters),
        }

    return app
