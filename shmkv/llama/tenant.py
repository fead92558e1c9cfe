"""Cache tenants: whose cached prefixes one call may find, restore and publish.

Runs inside a worker: in the library (around a ``Llama`` call) and in the served
app, which sets the tenant of each request. A tenant narrows the deployment's key
root (model fingerprint and ``--namespace``, ``keys.key_root``): its parts (a
request's ``cache_salt``, the ``X-Shmkv-Cache-Salt`` header, an API key's identity)
go through BLAKE2b keyed with that root, so every call of one tenant chains its keys
from a root no other tenant's calls share, and no part appears in a key as it is.
A call with no tenant uses the deployment's root itself.

The tenant of a call is a context variable: :func:`scope` sets it around a
completion. It follows the request into llama-cpp-python's threadpool (Starlette's
``run_in_threadpool`` runs each step in a copy of the request's context), and it is
read when the call starts, at its first token; a stream started outside the scope
has no tenant.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from shmkv.core.errors import InvalidTenant

__all__ = [
    "MAX_SALT_CHARS",
    "SALT_FIELD",
    "SALT_HEADER",
    "Tenant",
    "check_salt",
    "current",
    "key_identity",
    "make",
    "scope",
    "using",
]

#: longest salt accepted, in characters (a longer one is refused, never cut)
MAX_SALT_CHARS = 256
#: the request body field (vLLM's name for it)
SALT_FIELD = "cache_salt"
#: the request header (e.g. set per user by a proxy in front of the server)
SALT_HEADER = "X-Shmkv-Cache-Salt"

_current: ContextVar[Tenant | None] = ContextVar("shmkv_tenant", default=None)


@dataclass(frozen=True)
class Tenant:
    """Who a call's cached prefixes belong to, within the deployment's namespace.

    ``parts`` are (tag, bytes) pairs in a fixed order; an API key is kept only as its
    digest. Two tenants share cached prefixes only if all their parts are equal.
    """

    parts: tuple[tuple[str, bytes], ...]

    def root(self, base: bytes) -> bytes:
        """The key root of this tenant's calls: BLAKE2b keyed with the deployment's root
        ``base`` over the length-prefixed parts (so no two part lists collide)."""
        h = hashlib.blake2b(digest_size=len(base), key=base, person=b"shmkv-tenant")
        for tag, value in self.parts:
            name = tag.encode()
            h.update(len(name).to_bytes(1, "little") + name)
            h.update(len(value).to_bytes(4, "little") + value)
        return h.digest()

    def __repr__(self) -> str:  # (never print a salt or key digest into a log)
        return f"Tenant({', '.join(tag for tag, _ in self.parts)})"


def check_salt(value: Any, source: str = SALT_FIELD) -> str:
    """``value`` if it is a salt shmkv accepts: a string of 1 to ``MAX_SALT_CHARS``
    printable characters. Raises :class:`InvalidTenant` naming ``source`` and the limit."""
    rule = f"{source} must be a string of 1 to {MAX_SALT_CHARS} printable characters"
    if not isinstance(value, str):
        raise InvalidTenant(f"{rule}, got {type(value).__name__}")
    if not value:
        raise InvalidTenant(f"{rule}, got an empty string")
    if len(value) > MAX_SALT_CHARS:
        raise InvalidTenant(f"{rule}, got {len(value)} characters")
    if not value.isprintable():
        raise InvalidTenant(f"{rule}, got control or unprintable characters")
    return value


def key_identity(api_key: str) -> bytes:
    """The digest an API key is known by in a tenant (the key itself is kept nowhere)."""
    return hashlib.blake2b(
        api_key.encode("utf-8", "surrogateescape"), digest_size=32, person=b"shmkv-apikey"
    ).digest()


def make(
    salt: str | None = None, *, header_salt: str | None = None, api_key: str | None = None
) -> Tenant | None:
    """The tenant of a call with these parts (None: none given, the deployment's own).

    ``salt`` is the body's ``cache_salt``, ``header_salt`` the ``X-Shmkv-Cache-Salt``
    header; they are separate parts (the same text in the header and in the body names
    two tenants). ``api_key``: the request's API key (``--namespace-per-api-key``);
    a salt then narrows that key's tenant, it never reaches another key's.
    """
    parts: list[tuple[str, bytes]] = []
    if api_key is not None:
        parts.append(("api-key", key_identity(api_key)))
    if header_salt is not None:
        parts.append(("header", check_salt(header_salt, SALT_HEADER).encode()))
    if salt is not None:
        parts.append(("cache_salt", check_salt(salt, SALT_FIELD).encode()))
    return Tenant(tuple(parts)) if parts else None


def current() -> Tenant | None:
    """The tenant of calls made now, in this context (None: the deployment's own)."""
    return _current.get()


@contextmanager
def using(tenant: Tenant | None) -> Iterator[Tenant | None]:
    """Calls started inside are ``tenant``'s."""
    token = _current.set(tenant)
    try:
        yield tenant
    finally:
        _current.reset(token)


@contextmanager
def scope(
    salt: str | None = None, *, header_salt: str | None = None, api_key: str | None = None
) -> Iterator[Tenant | None]:
    """Calls started inside belong to the tenant :func:`make` builds from these parts::

    with shmkv.llama.tenant.scope("user-42"):
        llm.create_chat_completion(messages)
    """
    with using(make(salt, header_salt=header_salt, api_key=api_key)) as tenant:
        yield tenant
