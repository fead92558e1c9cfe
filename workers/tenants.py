"""The cache tenant of each request, and the API keys a worker accepts.

Runs inside one gunicorn (uvicorn) worker. :class:`TenantScope` reads a completion
request's tenant parts (the ``cache_salt`` body field, the ``X-Shmkv-Cache-Salt``
header, and with ``--namespace-per-api-key`` its bearer token) and runs the request
inside ``shmkv.llama.tenant.using(...)``: the context variable follows it into
llama-cpp-python's threadpool, where the cache reads it when the completion starts.
A salt shmkv does not accept gets a 400 that says the rule; a completion without a
bearer token, when each key is a tenant, a 401. :func:`authenticate` replaces
llama-cpp-python's single-key check: any of ``--api-key``'s keys, compared in
constant time.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import Depends, HTTPException, status
from fastapi.security import HTTPAuthorizationCredentials
from llama_cpp.server.app import bearer_scheme

from shmkv.core.errors import InvalidTenant
from shmkv.llama import tenant

log = logging.getLogger("shmkv.worker")

_HEADER = tenant.SALT_HEADER.lower().encode()


def _error(status_code: int, message: str, code: str, param: str | None = None) -> tuple:
    body = json.dumps(
        {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": param,
                "code": code,
            }
        }
    ).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status_code == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    return status_code, headers, body


def bearer_token(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The request's bearer token, as FastAPI's ``HTTPBearer`` reads it (None: none)."""
    for k, v in headers:
        if k.lower() == b"authorization":
            scheme, _, credentials = v.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and credentials:
                return credentials
            return None
    return None


def header_salt(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The ``X-Shmkv-Cache-Salt`` header, checked (None: absent); twice is refused."""
    values = [v for k, v in headers if k.lower() == _HEADER]
    if len(values) > 1:
        raise InvalidTenant(f"{tenant.SALT_HEADER} must be sent at most once")
    if not values:
        return None
    return tenant.check_salt(values[0].decode("latin-1"), tenant.SALT_HEADER)


def body_salt(body: bytes) -> str | None:
    """The body's ``cache_salt`` (None: absent, null, or a body that is not a JSON
    object, which the route refuses by itself)."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(doc, dict):
        return None
    value = doc.get(tenant.SALT_FIELD)
    if value is None:
        return None
    return tenant.check_salt(value, tenant.SALT_FIELD)


class TenantScope:
    """ASGI middleware: completions run as their request's cache tenant.

    It reads the whole body (under ``BodyLimit``'s cap) before the route does, to find
    ``cache_salt``, and hands the route the same messages.
    """

    def __init__(self, app: Any, per_api_key: bool = False) -> None:
        self.app, self.per_api_key = app, per_api_key

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if (
            scope["type"] != "http"
            or scope.get("method") != "POST"
            or not str(scope.get("path", "")).endswith("/completions")
        ):
            await self.app(scope, receive, send)
            return
        headers = list(scope.get("headers") or [])
        api_key = None
        if self.per_api_key:
            api_key = bearer_token(headers)
            if api_key is None:
                await _send(
                    send,
                    _error(
                        401,
                        "this server keeps one cache tenant per API key "
                        "(--namespace-per-api-key): send Authorization: Bearer <key>",
                        "invalid_api_key",
                    ),
                )
                return
        messages: list[dict] = []
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request" or not message.get("more_body"):
                break  # (the whole body, or a disconnect, which the route sees too)
        replay = iter(messages)

        async def replayed() -> dict:
            message = next(replay, None)
            return message if message is not None else await receive()

        if messages[-1]["type"] != "http.request":
            await self.app(scope, replayed, send)
            return
        param = tenant.SALT_HEADER
        try:
            from_header = header_salt(headers)
            param = tenant.SALT_FIELD
            body = b"".join(m.get("body", b"") for m in messages)
            who = tenant.make(body_salt(body), header_salt=from_header, api_key=api_key)
        except InvalidTenant as e:
            await _send(send, _error(400, str(e), "invalid_cache_salt", param))
            return
        with tenant.using(who):
            await self.app(scope, replayed, send)


async def _send(send: Any, response: tuple) -> None:
    status_code, headers, body = response
    await send({"type": "http.response.start", "status": status_code, "headers": headers})
    await send({"type": "http.response.body", "body": body})


#: a request's bearer token, as FastAPI reads it (None: none sent)
Bearer = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer_scheme)]


def key_check(keys: list[str] | None) -> Callable[[HTTPAuthorizationCredentials | None], bool]:
    """Is a request's bearer token one of ``keys``? (Always, when there are none.)"""
    wanted = [k.encode() for k in keys or ()]

    def ok(authorization: HTTPAuthorizationCredentials | None) -> bool:
        if not wanted:
            return True
        given = authorization.credentials.encode("latin-1") if authorization else b""
        found = False
        for key in wanted:  # (every key compared, in constant time: no timing per key)
            found |= hmac.compare_digest(given, key)
        return found

    return ok


def authenticate(keys: list[str] | None) -> Any:
    """A FastAPI dependency in place of llama-cpp-python's ``authenticate``: the bearer
    token must be one of ``keys`` (None: any request passes). Also guards ``/metrics``."""
    ok = key_check(keys)

    async def check(authorization: Bearer) -> Any:
        if not ok(authorization):
            raise HTTPException(
                status_code=status.HTTP_401_UNAUTHORIZED,
                detail="Invalid API key: send Authorization: Bearer KEY, KEY one of --api-key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return authorization.credentials if authorization else True

    return check
