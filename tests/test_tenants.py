"""Cache tenants: two tenants of one deployment never get each other's state, from the
arena or from a worker's own context; one tenant hits across workers.

Each test proves it from three sides where it can: what the cache did for the call
(``SharedPrefixCache.last``, or the ``X-Shmkv-*`` response headers), the supervisor's
counters (``hits`` are leases granted, ``misses`` the workers' reports), and greedy
text equal to a cold run's.
"""

from __future__ import annotations

import llama_cpp
import pytest
from helpers import KW, SYSTEM

from shmkv import tenant
from shmkv.errors import InvalidTenant
from shmkv.llama import SharedCacheLlama

PROMPT = SYSTEM + " Question: which cat sits on mat 3?"
GREEDY = {"max_tokens": 8, "temperature": 0.0}


def _llm(supervisor, model: str) -> SharedCacheLlama:
    return SharedCacheLlama(
        model_path=model,
        verbose=False,
        **KW,
        shmkv_name=supervisor.name,
        shmkv_socket=supervisor.socket,
    )


def _ask(llm: SharedCacheLlama, salt: str | None) -> str:
    with tenant.scope(salt):
        text = llm.create_completion(PROMPT, **GREEDY)["choices"][0]["text"]
    assert llm.shmkv.flush()
    return text


def test_another_tenant_reuses_nothing_of_the_context_and_restores_nothing(supervisor, models):
    """A context that has just served tenant A serves tenant B's identical prompt cold:
    none of A's cells reused, none of A's records restored; A still hits from the arena
    in another context, and a third tenant there finds nothing."""
    cold = llama_cpp.Llama(model_path=models["seed0"], verbose=False, **KW).create_completion(
        PROMPT, **GREEDY
    )["choices"][0]["text"]
    llm = _llm(supervisor, models["seed0"])
    assert _ask(llm, "tenant-a") == cold
    a1 = llm.shmkv.last
    assert a1.tokens_restored == 0 and a1.tokens_evaluated == a1.prompt_tokens
    assert _ask(llm, "tenant-a") == cold  # the same tenant: its own cells serve it
    assert llm.shmkv.last.tokens_reused_local >= a1.prompt_tokens - 1

    before = supervisor.stats_json()
    for salt in ("tenant-b", None, "tenant-a "):  # (a salt is compared as it is)
        assert _ask(llm, salt) == cold
        last = llm.shmkv.last
        assert last.tokens_reused_local == 0, (salt, last)
        assert last.tokens_restored == 0, (salt, last)
        assert last.tokens_evaluated == last.prompt_tokens, (salt, last)
    after = supervisor.stats_json()
    assert after["hits"] == before["hits"]  # no lease granted: nothing found
    assert after["misses"] == before["misses"] + 3
    assert llm.shmkv.totals.tenant_switches == 3

    other = _llm(supervisor, models["seed0"])  # a second context (another worker)
    assert _ask(other, "tenant-a") == cold
    assert other.shmkv.last.tokens_restored >= a1.prompt_tokens - 1  # A hits A's records
    assert _ask(other, "tenant-c") == cold
    last = other.shmkv.last
    assert last.tokens_restored == 0 and last.tokens_reused_local == 0
    assert supervisor.stats_json()["hits"] == after["hits"] + 1
    for cache in (llm.shmkv, other.shmkv):
        cache.close()


def test_salts_are_validated_and_kept_apart():
    base = bytes(16)
    roots = {
        tenant.make(salt).root(base) if salt else base  # type: ignore[union-attr]
        for salt in (None, "a", "b", "ab")
    }
    roots.add(tenant.make(header_salt="a").root(base))  # type: ignore[union-attr]
    roots.add(tenant.make("b", header_salt="a").root(base))  # type: ignore[union-attr]
    roots.add(tenant.make(api_key="a").root(base))  # type: ignore[union-attr]
    roots.add(tenant.make("a", api_key="a").root(base))  # type: ignore[union-attr]
    assert len(roots) == 8
    assert tenant.make("a").root(base) == tenant.make("a").root(base)  # type: ignore[union-attr]
    assert tenant.make("a").root(base) != tenant.make("a").root(bytes(15) + b"\1")  # type: ignore[union-attr]
    assert tenant.make("x" * tenant.MAX_SALT_CHARS) is not None
    for bad in ("", "x" * (tenant.MAX_SALT_CHARS + 1), "a\nb", "a\x00", 42, ["a"]):
        with pytest.raises(InvalidTenant, match=f"1 to {tenant.MAX_SALT_CHARS} printable"):
            tenant.make(bad)  # type: ignore[arg-type]
