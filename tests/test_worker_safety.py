"""The worker side under a careless client or deployment: abandoned streams, idle
connections, prompt logits after a restore, states made for another context.

Real llama.cpp on the tiny models, real supervisors, real gunicorn workers on
127.0.0.1; outputs are compared with a plain ``llama_cpp.Llama``'s.
"""

from __future__ import annotations

import json
import logging
import shutil
import socket
import threading
import time

import httpx
import numpy as np
from helpers import (
    KW,
    SYSTEM,
    Server,
    completion,
    run_worker,
    texts,
)

from shmkv import arena as A

log = logging.getLogger(__name__)

RULES = [f"Rule {i}: the cat {i % 7} sits on mat {i % 5}." for i in range(50)]


def _plain(model: str, **kw):
    import llama_cpp

    return llama_cpp.Llama(model_path=model, verbose=False, **{**KW, **kw})


def _shared(sup, model: str, **kw):
    from shmkv.llama import SharedCacheLlama

    return SharedCacheLlama(
        model_path=model,
        verbose=False,
        shmkv_name=sup.name,
        shmkv_socket=sup.socket,
        **{**KW, **kw},
    )


# ----------------------------------------------------------------- idle connections
def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def test_idle_and_slow_connections_do_not_stall_free_workers(
    tmp_path, serve_model, make_supervisor
):
    """20 idle TCP connections a second (and a few that send their headers or body a
    byte at a time) while /health is polled: p99 stays under 0.5 s, and the idle ones
    are closed after --request-read-timeout."""
    sup = make_supervisor("--size", "64M", env_extra={"SHMKV_REQUEST_READ_TIMEOUT": "2"})
    srv = Server(sup, serve_model, workers=2, tmp_path=tmp_path)
    stop = threading.Event()
    idle: list[tuple[float, socket.socket]] = []

    def open_idle() -> None:
        while not stop.is_set():
            idle.append((time.monotonic(), socket.create_connection(("127.0.0.1", srv.port))))
            stop.wait(0.05)

    def trickle(at_once: bytes, slowly: bytes) -> None:
        with socket.create_connection(("127.0.0.1", srv.port)) as s:
            s.sendall(at_once)
            for b in slowly:
                if stop.is_set():
                    return
                try:
                    s.sendall(bytes([b]))
                except OSError:  # closed by the server (slow headers): fine
                    return
                stop.wait(0.3)

    body = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
    slow_head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    full_head = slow_head + b"Content-Length: %d\r\n\r\n" % len(body)
    loaders = [threading.Thread(target=open_idle)]
    loaders += [threading.Thread(target=trickle, args=(slow_head, b"")) for _ in range(2)]
    loaders += [threading.Thread(target=trickle, args=(full_head, body)) for _ in range(2)]
    latencies: list[float] = []
    try:
        for t in loaders:
            t.start()
        end = time.monotonic() + 12
        with httpx.Client(limits=httpx.Limits(max_keepalive_connections=0)) as http:
            while time.monotonic() < end:
                t0 = time.monotonic()
                try:
                    assert http.get(srv.base + "/health", timeout=5).status_code == 200
                    latencies.append(time.monotonic() - t0)
                except httpx.TimeoutException:
                    latencies.append(5.0)
                time.sleep(0.05)
        p50, p99 = _percentile(latencies, 0.5), _percentile(latencies, 0.99)
        log.info("/health: %d polls, p50 %.3f s, p99 %.3f s", len(latencies), p50, p99)
        assert p99 < 0.5, (p50, p99)
        # a completion still goes through at once
        t0 = time.monotonic()
        srv.complete("Rule 1: the cat", max_tokens=2)
        completion_s = time.monotonic() - t0
        # idle connections opened early are closed by the server by now
        closed = 0
        for _, s in idle[:20]:
            s.settimeout(5)
            try:
                closed += s.recv(1) == b""
            except OSError:
                closed += 1
        health = httpx.get(srv.base + "/health", timeout=5).json()
    finally:
        stop.set()
        for t in loaders:
            t.join(10)
        for _, s in idle:
            s.close()
        srv.stop()
    log.info("%d idle connections; completion %.2f s; http %s", len(idle), completion_s, health)
    assert len(idle) >= 150
    assert completion_s < 5
    assert closed == 20
    assert health["http"]["idle_closed"] >= 1


# ------------------------------------------------ what a state means; states refused
def test_workers_with_different_n_ctx_never_restore_each_others_states(supervisor, models):
    prompt = " ".join(RULES[:20]) + " Question: who sits?"
    run_worker(supervisor, models["seed0"], [completion(prompt)], kw={"n_ctx": 2048})
    cold = run_worker(None, models["seed0"], [completion(prompt)], mode="cold", kw={"n_ctx": 1024})
    got = run_worker(supervisor, models["seed0"], [completion(prompt)], kw={"n_ctx": 1024})
    assert texts(got) == texts(cold)
    assert got["results"][0]["last"]["tokens_restored"] == 0
    assert not got["totals"]["errors"], got["totals"]  # not even found
    again = run_worker(supervisor, models["seed0"], [completion(prompt)], kw={"n_ctx": 2048})
    assert again["results"][0]["last"]["tokens_restored"] > 0  # its own kind still hits


def test_failed_set_data_is_a_miss_not_a_corruption_report(supervisor, models):
    """A state with a valid checksum and the right fingerprint that llama.cpp refuses
    (as a state made for a context of another size would be): counted as a refused
    state and a miss; the supervisor is not asked to re-check it, the record stays."""
    from shmkv.llama import key_root, model_fingerprint

    prompt = SYSTEM + " Question: does it fit?"
    llm = _plain(models["seed0"])
    tokens = np.array(llm.tokenize(prompt.encode()), dtype=np.int32)
    fp = model_fingerprint(llm)
    del llm
    root = key_root(fp, "")
    with supervisor.client() as c:
        c.put_bytes(root, tokens, fp, np.random.default_rng(1).bytes(200_000))
        chunk = c.view.geometry.chunk_tokens
    cold = run_worker(None, models["seed0"], [completion(prompt)], mode="cold")
    got = run_worker(supervisor, models["seed0"], [completion(prompt)])
    assert texts(got) == texts(cold)
    totals = got["totals"]
    assert got["results"][0]["last"]["tokens_restored"] == 0
    assert "corrupt record" not in totals["errors"], totals["errors"]
    assert totals["errors"].get("state refused") == 1, totals["errors"]
    assert totals["states_refused"] == 1 and totals["misses"] >= 1
    assert totals["restore_failures"] == 0
    st = supervisor.stats()
    assert st["corrupt_removed"] == 0 and st["restore_failures"] == 0
    assert st["states_refused"] == 1
    with supervisor.client() as c:  # the record is still there
        hit = c.lookup(A.chain_digests(root, tokens, chunk))
        assert hit is not None and hit.chunks == len(tokens) // chunk


def test_lora_is_identified_by_its_content_not_its_path(tmp_path, models):
    from tinymodel import write_tiny_lora

    from shmkv.fingerprint import model_fingerprint

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    write_tiny_lora(tmp_path / "a" / "adapter.gguf", seed=0)
    shutil.copy(tmp_path / "a" / "adapter.gguf", tmp_path / "b" / "renamed.gguf")
    write_tiny_lora(tmp_path / "other.gguf", seed=1)

    def fp(lora: str | None, **kw) -> bytes:
        return model_fingerprint(_plain(models["seed0"], lora_path=lora, **kw))

    same_a = fp(str(tmp_path / "a" / "adapter.gguf"))
    same_b = fp(str(tmp_path / "b" / "renamed.gguf"))
    other = fp(str(tmp_path / "other.gguf"))
    assert same_a == same_b
    assert other != same_a
    assert fp(None) not in (same_a, other)
    assert fp(str(tmp_path / "a" / "adapter.gguf"), lora_scale=0.5) != same_a
    assert fp(None, n_ctx=1024) != fp(None, n_ctx=2048)
