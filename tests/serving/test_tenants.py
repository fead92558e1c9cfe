"""Cache tenants: two tenants of one deployment never get each other's state, from the
arena or from a worker's own context; one tenant hits across workers.

Each test proves it from three sides where it can: what the cache did for the call
(``SharedPrefixCache.last``, or the ``X-Shmkv-*`` response headers), the supervisor's
counters (``hits`` are leases granted, ``misses`` the workers' reports), and greedy
text equal to a cold run's.
"""

from __future__ import annotations

from typing import Any

import httpx
import llama_cpp
import pytest

from shmkv.core.errors import InvalidTenant
from shmkv.llama import SharedCacheLlama, tenant
from shmkv.llama.tenant import MAX_SALT_CHARS, SALT_HEADER
from tests.support.llama_workers import KW, SYSTEM
from tests.support.servers import EXTRA, SAMPLING, Server, scrape
from tests.support.waiting import wait_until

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


def test_a_continuation_across_tenants_publishes_nothing(supervisor, models):
    """``generate(reset=False)`` goes on from the context as it is: by another tenant,
    on tenant A's cells, the result is nobody's, never published (under B's keys it
    would hand A's prefix to B), and the next call reuses none of it."""
    llm = _llm(supervisor, models["seed0"])
    _ask(llm, "tenant-a")
    with tenant.scope("tenant-b"):
        more = llm.tokenize(b" And then the cat said", add_bos=False)
        gen = llm.generate(more, reset=False, temp=0.0)
        for _, _tok in zip(range(80), gen, strict=False):  # over a chunk of new tokens
            pass
        gen.close()
    assert llm.shmkv.flush()
    assert llm.shmkv.last.published == 0
    assert llm.shmkv.context_root is None
    _ask(llm, "tenant-a")
    last = llm.shmkv.last
    assert last.tokens_reused_local == 0 and last.tokens_restored >= last.prompt_tokens - 1
    llm.shmkv.close()


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


# ---------------------------------------------------------------- served: real gunicorn
SERVED = SYSTEM + " Question: which mat?"


def _served(srv: Server, salt: Any = None, header: str | None = None, **kw: Any) -> tuple:
    """A completion of SERVED (``salt``: the body's cache_salt, ``header``: the
    X-Shmkv-Cache-Salt header, ``key``: the API key, ``stream``); its text and what the
    cache did (headers, or a stream's ``shmkv`` field, and the usage's ``cached_tokens``)."""
    key, stream = kw.pop("key", None), kw.pop("stream", False)
    client = srv.client if key is None else srv.client.with_options(api_key=key)
    body = {**EXTRA, **({} if salt is None else {"cache_salt": salt})}
    extra = {"extra_body": body, "extra_headers": {} if header is None else {SALT_HEADER: header}}
    args = {"model": "tiny", "prompt": SERVED, **SAMPLING, **extra, **kw}
    if stream:
        chunks = list(client.completions.create(stream=True, **args))
        return "".join(c.choices[0].text for c in chunks), chunks[0].model_extra["shmkv"]
    raw = client.completions.with_raw_response.create(**args)
    out = raw.parse()
    info: dict[str, Any] = {
        k[len("x-shmkv-") :].replace("-", "_"): v
        for k, v in raw.headers.items()
        if k.startswith("x-shmkv-")
    }
    info = {k: v == "true" if k == "hit" else float(v) for k, v in info.items()}
    assert out.usage.prompt_tokens_details.cached_tokens == info["cached_tokens"]
    return out.choices[0].text, info


def _cold(info: dict) -> bool:
    """Nothing of the prompt came from the arena or the worker's context."""
    return (
        info["restored_tokens"] == 0
        and info["reused_local_tokens"] == 0
        and info["evaluated_tokens"] == info["prompt_tokens"]
        and info["cached_tokens"] == 0
    )


def _reported(sup, misses: int) -> dict:
    """The supervisor's stats once the workers' reports reach ``misses``."""
    return wait_until(
        lambda: (st := sup.stats())["misses"] >= misses and st, what=f"{misses} misses"
    )


def _health(srv: Server) -> dict:
    return httpx.get(srv.base + "/health", headers=srv.auth, timeout=10).json()["shmkv"][0]


def test_served_tenants_never_share_a_worker_context_or_the_arena(
    tmp_path, serve_model, make_supervisor, serve_reference
):
    """One worker: whatever tenant it served last, another tenant's identical prompt is
    evaluated in full (headers, the stream's field, supervisor stats), with a cold run's
    text; the tenant's own prompt still hits, from the context or the arena."""
    sup = make_supervisor("--size", "128M")
    srv = Server(sup, serve_model, workers=1, tmp_path=tmp_path)
    try:
        want = serve_reference(SERVED)
        text, first = _served(srv, salt="tenant-a")
        assert text == want and _cold(first), first
        text, again = _served(srv, salt="tenant-a")  # the same tenant: its own cells
        assert text == want and again["reused_local_tokens"] >= again["prompt_tokens"] - 1
        assert again["cached_tokens"] > 0
        before = _reported(sup, 1)
        # another salt; the same text as a header (another part, so another tenant);
        # no tenant at all; the stream path
        for kw in ({"salt": "tenant-b"}, {"header": "tenant-a"}, {}, {"salt": "c", "stream": True}):
            text, info = _served(srv, **kw)
            assert text == want, kw
            assert _cold(info), (kw, info)
        after = _reported(sup, before["misses"] + 4)
        assert after["hits"] == before["hits"]  # no lease granted: nothing found
        assert after["misses"] == before["misses"] + 4
        assert _health(srv)["tenant_switches"] == 4
        # tenant a again, streaming, on a context that holds c's cells: a's record
        text, info = _served(srv, salt="tenant-a", stream=True)
        assert text == want and info["reused_local_tokens"] == 0
        assert info["restored_tokens"] >= info["prompt_tokens"] - 1
        assert wait_until(lambda: sup.stats()["hits"] == after["hits"] + 1, what="a's hit")
    finally:
        srv.stop()


def test_served_salts_are_validated_and_never_label_a_metric(
    tmp_path, serve_model, make_supervisor
):
    sup = make_supervisor("--size", "64M")
    srv = Server(sup, serve_model, workers=1, tmp_path=tmp_path)
    url = srv.base + "/v1/completions"
    body = {"prompt": "Hi", "max_tokens": 1}
    try:
        for salt in ("x" * (MAX_SALT_CHARS + 1), "", 42, "a\tb"):
            r = httpx.post(url, json={**body, "cache_salt": salt}, timeout=30)
            assert r.status_code == 400, (salt, r.text)
            error = r.json()["error"]
            assert f"1 to {MAX_SALT_CHARS} printable" in error["message"]
            assert error["param"] == "cache_salt"
        for headers in ([(SALT_HEADER, "")], [(SALT_HEADER, "a"), (SALT_HEADER, "b")]):
            r = httpx.post(url, json=body, headers=headers, timeout=30)
            assert r.status_code == 400, (headers, r.text)
            assert r.json()["error"]["param"] == SALT_HEADER
        ok = httpx.post(url, json={**body, "cache_salt": "x" * MAX_SALT_CHARS}, timeout=30)
        assert ok.status_code == 200, ok.text
        r = httpx.post(url, json={**body, "cache_salt": None}, timeout=30)  # null: none
        assert r.status_code == 200, r.text
        # what a request says (its salt, its model name) never becomes a metric label
        asked = {**body, "model": "made-up-model-5e2a", "cache_salt": "body-salt-9d41"}
        assert httpx.post(url, json=asked, timeout=30).status_code == 200
        headers = {SALT_HEADER: "header-salt-77c1"}
        assert (
            httpx.post(url, json=asked | {"cache_salt": None}, headers=headers).status_code == 200
        )

        def counted() -> dict[str, float] | None:
            s = scrape(srv.base + "/metrics")
            n = sum(v for k, v in s.items() if k.startswith("shmkv_requests_total{"))
            return s if n == 4 else None

        samples = wait_until(counted, 20, "the four requests in /metrics")
        for name in samples:
            assert not any(v in name for v in ("5e2a", "9d41", "77c1")), name
        assert samples['shmkv_requests_total{model="tiny",tenant=""}'] == 4
    finally:
        srv.stop()


def _long_stream(srv: Server) -> tuple[Any, int]:
    """A stream that keeps a worker busy for a few seconds (1,500 tokens; it is read no
    further than its first chunk); the stream and that worker's pid."""
    stream = srv.client.completions.create(
        model="tiny",
        prompt="Once upon a time",
        stream=True,
        max_tokens=1500,
        temperature=0.0,
        extra_body=EXTRA,
    )
    return stream, next(iter(stream)).model_extra["shmkv"]["worker_pid"]


def _route_to(srv: Server, pid: int) -> Any:
    """Keep the other one of two workers busy with a fresh long stream, so that the next
    requests go to worker ``pid`` (a busy worker accepts no connection); the stream."""
    stream, busy = _long_stream(srv)
    if busy != pid:
        return stream
    other, busy = _long_stream(srv)  # (the only idle worker is the other one)
    stream.close()
    assert busy != pid
    return other


def test_served_tenant_hits_across_workers_and_only_its_own(
    tmp_path, serve_model, make_supervisor, serve_reference
):
    """Tenant A's prompt, computed on one worker, is restored on the other; tenant B's
    identical prompt there, right after A's, finds nothing, neither in the arena nor in
    that worker's context."""
    sup = make_supervisor("--size", "128M")
    srv = Server(sup, serve_model, workers=2, tmp_path=tmp_path)
    want = serve_reference(SERVED)
    held = None
    try:
        text, a1 = _served(srv, salt="tenant-a")
        assert text == want and _cold(a1), a1
        wait_until(lambda: sup.stats()["entries"] >= 1, what="a's publish")
        (there,) = srv.worker_pids() - {a1["worker_pid"]}
        held = _route_to(srv, there)
        before = sup.stats()
        text, a2 = _served(srv, salt="tenant-a")
        assert text == want and a2["worker_pid"] == there
        assert a2["restored_tokens"] >= a2["prompt_tokens"] - 1, a2
        assert a2["cached_tokens"] > 0
        text, b = _served(srv, salt="tenant-b")
        assert text == want and b["worker_pid"] == there
        assert _cold(b), b
        after = _reported(sup, before["misses"] + 1)
        assert after["hits"] == before["hits"] + 1  # a's lease; none for b
    finally:
        if held is not None:
            held.close()
        srv.stop()


def test_served_namespace_per_api_key(tmp_path, serve_model, make_supervisor, serve_reference):
    """--namespace-per-api-key with two keys: a key's tenant is its own whatever the
    other key's client sends (a salt narrows a key's tenant, never reaches another's);
    no key or a wrong one gets 401."""
    sup = make_supervisor("--size", "128M")
    env = {"SHMKV_API_KEY": "key-one,key-two", "SHMKV_NAMESPACE_PER_API_KEY": "true"}
    srv = Server(sup, serve_model, workers=1, tmp_path=tmp_path, env=env)
    want = serve_reference(SERVED)
    try:
        url = srv.base + "/v1/completions"
        for headers in ({}, {"Authorization": "Bearer key-three"}, {"Authorization": "key-one"}):
            r = httpx.post(url, json={"prompt": "Hi", "max_tokens": 1}, headers=headers)
            assert r.status_code == 401, (headers, r.text)
        text, one = _served(srv, key="key-one")
        assert text == want and _cold(one), one
        text, one = _served(srv, key="key-one")
        assert one["reused_local_tokens"] >= one["prompt_tokens"] - 1
        # key two, as it is and with every salt it might try: nothing of key one's
        for kw in ({}, {"salt": "key-one"}, {"header": "key-one"}, {"salt": "x", "stream": True}):
            text, two = _served(srv, key="key-two", **kw)
            assert text == want and _cold(two), (kw, two)
        text, narrowed = _served(srv, key="key-one", salt="x")  # key one, narrowed
        assert text == want and _cold(narrowed), narrowed
        text, one = _served(srv, key="key-one")  # key one's own record, from the arena
        assert text == want and one["reused_local_tokens"] == 0
        assert one["restored_tokens"] >= one["prompt_tokens"] - 1, one
        assert _health(srv)["tenant_switches"] == 6
        assert sup.stats()["hits"] == 1
    finally:
        srv.stop()


def test_served_health_and_metrics_need_the_api_key(tmp_path, serve_model, make_supervisor):
    """With --api-key and --namespace-per-api-key, /health (worker pid, namespace, every
    counter) and /metrics (entries, bytes, puts after a tenant's prompt) answered anyone
    who could reach the port: without a key, /metrics is 401 and /health says only that
    the worker is up; with a key (a Prometheus bearer token), both answer in full."""
    sup = make_supervisor("--size", "128M")
    env = {"SHMKV_API_KEY": "key-one,key-two", "SHMKV_NAMESPACE_PER_API_KEY": "true"}
    srv = Server(sup, serve_model, workers=1, tmp_path=tmp_path, env=env)
    try:
        _served(srv, key="key-one")  # a tenant's traffic, which the counters show
        wait_until(lambda: sup.stats()["entries"] >= 1, what="the tenant's state stored")
        health, metrics = srv.base + "/health", srv.base + "/metrics"
        for headers in ({}, {"Authorization": "Bearer key-three"}, {"Authorization": "key-one"}):
            r = httpx.get(metrics, headers=headers, timeout=10)
            assert r.status_code == 401, (headers, r.status_code, r.text)
            assert "shmkv_" not in r.text and r.headers["www-authenticate"] == "Bearer"
            r = httpx.get(health, headers=headers, timeout=10)
            assert r.status_code == 200 and r.json() == {"status": "ok"}, (headers, r.text)
        for key in ("key-one", "key-two"):
            auth = {"Authorization": f"Bearer {key}"}
            r = httpx.get(metrics, headers=auth, timeout=10)
            assert r.status_code == 200 and "shmkv_arena_entries 1.0" in r.text, r.text
            body = httpx.get(health, headers=auth, timeout=10).json()
            assert body["status"] == "ok" and body["worker_pid"] in srv.worker_pids()
            assert body["shmkv"][0]["connected"] is True and "http" in body, body
    finally:
        srv.stop()
