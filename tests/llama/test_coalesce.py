"""Coalescing: a worker about to prefill a prefix another worker is already prefilling waits
for that worker's publish instead of computing it again."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from shmkv.core.keys import chain_digests
from shmkv.supervisor.claims import Claims
from tests.support.blobs import blob
from tests.support.llama_workers import KW, SYSTEM, completion, run_worker, texts
from tests.support.waiting import wait_until


def test_claims_table_rules():
    c = Claims(ttl=10)
    d = [bytes([i]) * 16 for i in range(3)]
    assert c.claim(1, 1, d, now=0, wait=5) == ("go", None)
    status, w = c.claim(2, 7, d[1:], now=0, wait=5)  # d[1] is claimed by 1
    assert status == "wait" and w.rid == 7
    assert c.claim(1, 2, d[1:], now=0, wait=5)[0] == "go"  # an owner never waits on itself
    assert [(x.rid, s) for x, s in c.indexed([d[1]])] == [(7, "ready")]
    _, w = c.claim(2, 8, d[2:], now=1, wait=2)
    assert [(x.rid, s) for x, s in c.expire(now=3.5)] == [(8, "timeout")]
    _, w = c.claim(2, 9, d[2:], now=4, wait=100)
    assert [(x.rid, s) for x, s in c.drop_owner(1)] == [(9, "retry")]
    assert c.claim(3, 1, d, now=5, wait=5)[0] == "go"
    assert [s for _, s in c.expire(now=16)] == []  # claims expire silently without waiters
    assert not c.claims and not c.waiters


def test_waiter_is_woken_by_the_put_that_indexes_the_claimed_digest(supervisor):
    root, tokens, data = blob(1, 50_000, n_tokens=4 * 64)
    ds = chain_digests(root, tokens, 64)
    with supervisor.client() as a, supervisor.client() as b:
        assert a.claim(ds, wait=5) == "go"
        result = {}
        t = threading.Thread(target=lambda: result.update(status=b.claim(ds, wait=60)))
        t.start()
        waiting_for_claims(a)
        assert t.is_alive() and not result  # b waits for a
        a.put_bytes(root, tokens, b"fp", data)
        t.join(30)
        assert result["status"] == "ready" and a.stats()["claims_waiting"] == 0
        hit = b.lookup(ds)
        assert hit is not None and hit.chunks == len(ds)


def test_claim_timeout_ends_a_live_claimers_claim(make_supervisor):
    """``--claim-timeout 1``: a claimer that stays connected but never puts holds its claim
    about a second, not the default two minutes: a waiter willing to wait 30 s is told
    "retry" once the claim ended, then claims it itself."""
    sup = make_supervisor("--size", "16M", "--claim-timeout", "1")
    ds = blob(3, 0, n_tokens=4 * 64).digests()
    with sup.client() as a, sup.client() as b:
        assert a.claim(ds, wait=5) == "go"
        t0 = time.monotonic()
        assert b.claim(ds, wait=30) == "retry"
        assert 0.9 <= time.monotonic() - t0 < 25
        assert b.claim(ds, wait=30) == "go"


def waiting_for_claims(client, n: int = 1) -> None:
    """Until ``n`` requests wait for a claim (the supervisor's ``claims_waiting``)."""
    wait_until(lambda: client.stats()["claims_waiting"] == n, 120, f"{n} to wait for a claim")


def test_waiter_gets_retry_when_the_claimer_dies_and_timeout_on_its_deadline(supervisor):
    ds = blob(2, 0, n_tokens=4 * 64).digests()
    a = supervisor.client()
    with supervisor.client() as b, ThreadPoolExecutor(1) as pool:
        assert a.claim(ds, wait=5) == "go"
        t0 = time.monotonic()
        assert b.claim(ds, wait=0.3) == "timeout"
        assert time.monotonic() - t0 >= 0.25
        retry = pool.submit(b.claim, ds, wait=60)
        waiting_for_claims(a)
        a.close()
        assert retry.result(60) == "retry"
        assert b.claim(ds, wait=10) == "go"  # nobody holds it any more


@pytest.mark.parametrize("publisher", [False, True])
def test_llama_worker_waits_for_a_prefill_in_flight(supervisor, models, publisher):
    """A worker whose prompt another worker is prefilling waits instead of prefilling too;
    when that worker publishes it restores, when it gives up it computes: same output."""
    import llama_cpp

    from shmkv.llama import key_root, model_fingerprint

    prompt = SYSTEM + " Question: who waits?"
    llm = llama_cpp.Llama(model_path=models["seed0"], verbose=False, **KW)
    tokens = np.array(llm.tokenize(prompt.encode()), dtype=np.int32)
    root = key_root(model_fingerprint(llm), "")
    del llm
    ds = chain_digests(root, tokens, 64)
    cold = run_worker(None, models["seed0"], [completion(prompt)], mode="cold")
    claimer = supervisor.client()
    assert claimer.claim(ds, wait=5) == "go"  # a slow worker prefilling this prompt

    def meanwhile() -> None:  # once the worker waits for the claim
        with supervisor.client() as c:
            waiting_for_claims(c)
        if publisher:  # another worker, not coalescing, computes and publishes it
            env = {"SHMKV_COALESCE_WAIT": "0"}
            run_worker(supervisor, models["seed0"], [completion(prompt)], env=env)
        else:  # the slow worker dies without publishing
            claimer.close()

    with ThreadPoolExecutor(1) as pool:
        other = pool.submit(meanwhile)
        got = run_worker(supervisor, models["seed0"], [completion(prompt)])
        other.result()
    claimer.close()
    assert texts(got) == texts(cold)
    last = got["results"][0]["last"]
    assert last["coalesce_wait_seconds"] > 0
    if publisher:
        assert last["tokens_restored"] > 500  # it waited and restored
    else:
        assert last["tokens_restored"] == 0 and last["tokens_evaluated"] == len(tokens)
