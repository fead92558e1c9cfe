"""What the cache did, the OpenAI way: ``usage.prompt_tokens_details.cached_tokens``.

Runs inside each gunicorn (uvicorn) worker, around llama-cpp-python's server app
(``app.py``). The number is :attr:`shmkv.core.stats.CallStats.cached_tokens`: prompt
tokens not evaluated because the context already held them (restored from the
arena, or kept from the worker's own context).

* A non-streaming completion: llama-cpp-python's routes pass their result through a
  response model that drops any key it does not know, so :class:`UsageDetails`
  adds ``prompt_tokens_details`` to the JSON body on its way out, from the same
  per-request record as the ``X-Shmkv-*`` headers.
* A stream whose request sets ``stream_options: {"include_usage": true}``: llama-cpp-python
  0.3.36 ignores ``stream_options``; :func:`usage_chunk` is the last chunk OpenAI sends
  then (empty ``choices``, the whole request's ``usage``), and every other chunk gets
  ``"usage": null``, as OpenAI's do. Without it, streams are as llama-cpp-python makes them.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from starlette_context import context

from shmkv.core.stats import CallStats

log = logging.getLogger("shmkv.worker")


def usage(stats: CallStats) -> dict[str, Any]:
    """One call's usage as OpenAI reports it (what llama-cpp-python's non-streaming
    responses count, plus the cached tokens)."""
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "total_tokens": stats.prompt_tokens + stats.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
    }


async def include_usage(request: Any) -> bool:
    """Whether the request's body asks for ``stream_options: {"include_usage": true}``
    (llama-cpp-python's request models drop the field; the parsed body is cached)."""
    try:
        body = await request.json()
    except ValueError:
        return False
    options = body.get("stream_options") if isinstance(body, dict) else None
    return isinstance(options, dict) and options.get("include_usage") is True


def usage_chunk(llama: Any, last: dict[str, Any] | None) -> dict[str, Any] | None:
    """The stream's closing usage chunk, shaped like its ``last`` chunk (None: no chunk
    was sent, or this model runs without shmkv and nothing counted its tokens)."""
    cache = getattr(llama, "shmkv", None)
    if last is None or cache is None:
        log.debug("no usage chunk: %s", "no chunks" if last is None else "no shmkv cache")
        return None
    return {
        **{k: last[k] for k in ("id", "object", "created", "model") if k in last},
        "choices": [],
        "usage": usage(cache.last),
    }


def with_cached_tokens(body: bytes, cached: int) -> bytes:
    """A completion's JSON body with ``usage.prompt_tokens_details.cached_tokens`` set
    (a body that is not a completion with a usage stays as it is)."""
    try:
        doc = json.loads(body)
    except ValueError:
        return body
    found = doc.get("usage") if isinstance(doc, dict) else None
    if not isinstance(found, dict):
        return body
    details = found.get("prompt_tokens_details")
    found["prompt_tokens_details"] = {
        **(details if isinstance(details, dict) else {}),
        "cached_tokens": cached,
    }
    # (as starlette's JSONResponse renders it)
    return json.dumps(doc, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


class UsageDetails:
    """ASGI middleware: ``usage.prompt_tokens_details.cached_tokens`` in a non-streaming
    completion's body. Inside llama-cpp-python's RawContextMiddleware, whose per-request
    dict holds what the cache did (``app.cache_field``, filled at the first token)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start: dict | None = None
        cached = 0
        parts: list[bytes] = []

        async def amend(message: dict) -> None:
            nonlocal start, cached
            if message["type"] == "http.response.start":
                field = context.get("shmkv") if context.exists() else None
                if field and message.get("status") == 200 and _is_json(message):
                    start, cached = message, int(field["cached_tokens"])
                    return  # until the body is whole: its length changes
            elif message["type"] == "http.response.body" and start is not None:
                parts.append(message.get("body", b""))
                if message.get("more_body", False):
                    return
                body = with_cached_tokens(b"".join(parts), cached)
                headers = [h for h in start.get("headers", []) if h[0].lower() != b"content-length"]
                headers.append((b"content-length", str(len(body)).encode()))
                start, held = None, {**start, "headers": headers}
                await send(held)
                await send({"type": "http.response.body", "body": body})
                return
            await send(message)

        await self.app(scope, receive, amend)


def _is_json(start: dict) -> bool:
    return any(
        k.lower() == b"content-type" and v.startswith(b"application/json")
        for k, v in start.get("headers", [])
    )
