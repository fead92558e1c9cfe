"""The worker side under a careless client or deployment: abandoned streams, idle
connections, prompt logits after a restore, states made for another context.

Real llama.cpp on the tiny models, real supervisors, real gunicorn workers on
127.0.0.1; outputs are compared with a plain ``llama_cpp.Llama``'s.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import random
import shutil
import signal
import socket
import threading
import time

import httpx
import numpy as np
import pytest

from shmkv.core import arena as A
from shmkv.core.keys import chain_digests
from tests.support.llama_workers import KW, SYSTEM, completion, last_logits, run_worker, texts
from tests.support.servers import EXTRA, N_CTX, SAMPLING, Server
from tests.support.waiting import wait_until

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


# ---------------------------------------------------------------- abandoned streams
def test_abandoned_stream_closed_by_gc_on_another_thread_leaves_a_busy_context_alone(
    supervisor, models, monkeypatch
):
    """A stream its reader dropped is only reachable from a reference cycle; the cyclic
    garbage collector then closes it on another thread while a second call decodes on
    the same context. Its cleanup (the state capture, ``llama_state_seq_get_data``)
    must not touch the context then: the capture is dropped and counted."""
    from llama_cpp import llama_cpp as lc

    first_prompt = " ".join(RULES[:10])
    second_prompt = SYSTEM + " Another question entirely?"
    kw = {"n_batch": 32, "n_ubatch": 32}  # many decode calls per prefill
    cold = _plain(models["seed0"], **kw).create_completion(
        second_prompt, max_tokens=4, temperature=0.0, seed=0
    )["choices"][0]["text"]
    llm = _shared(supervisor, models["seed0"], **kw)
    n_first = len(llm.tokenize(first_prompt.encode()))
    # past what the abandoned call covered by a chunk and more: a capture would be due
    threshold = n_first + 2 * 64

    real_decode, real_get = lc.llama_decode, lc.llama_state_seq_get_data
    seen = {"decoding": 0, "armed": False, "collected": False, "touched": []}

    def decode(ctx, batch):
        seen["decoding"] += 1
        try:
            if seen["armed"] and not seen["collected"] and llm.n_tokens >= threshold:
                seen["collected"] = True
                collector = threading.Thread(target=gc.collect, name="collector")
                collector.start()
                collector.join(30)
            return real_decode(ctx, batch)
        finally:
            seen["decoding"] -= 1

    def get_data(ctx, dst, size, seq):
        if seen["decoding"]:
            seen["touched"].append(threading.current_thread().name)
        return real_get(ctx, dst, size, seq)

    monkeypatch.setattr(lc, "llama_decode", decode)
    monkeypatch.setattr(lc, "llama_state_seq_get_data", get_data)
    gc.collect()
    gc.disable()
    try:
        stream = llm.create_completion(
            first_prompt, max_tokens=60, temperature=0.0, seed=0, stream=True
        )
        for _ in range(3):
            next(stream)
        cycle: list = [stream]
        cycle.append(cycle)  # only the cyclic collector can close it now
        del stream, cycle
        seen["armed"] = True
        got = llm.create_completion(second_prompt, max_tokens=4, temperature=0.0, seed=0)
    finally:
        gc.enable()
    assert seen["collected"], "the second call never reached the threshold"
    assert not seen["touched"], f"get_data ran during a decode, on {seen['touched']}"
    assert llm.shmkv.totals.captures_dropped == 1
    assert got["choices"][0]["text"] == cold
    llm.shmkv.close()


def test_abandoned_stream_closed_while_the_context_is_idle_still_publishes(supervisor, models):
    """The same stream, collected while nothing else ran on the context since: its cells
    are still its own, so the late close publishes prompt + completion as usual."""
    prompt = " ".join(RULES[:12])
    llm = _shared(supervisor, models["seed0"])
    gc.collect()
    gc.disable()
    try:
        stream = llm.create_completion(prompt, max_tokens=100, temperature=0.0, seed=0, stream=True)
        for _ in range(80):
            next(stream)
        before = llm.shmkv.totals.publishes
        cycle: list = [stream]
        cycle.append(cycle)
        del stream, cycle
        collector = threading.Thread(target=gc.collect)
        collector.start()
        collector.join(30)
    finally:
        gc.enable()
    assert llm.shmkv.totals.captures_dropped == 0
    assert llm.shmkv.totals.publishes == before + 1
    llm.shmkv.close()


@pytest.mark.stress
def test_streams_disconnected_at_random_points_under_load_leave_outputs_cold_exact(
    tmp_path, serve_model, make_supervisor, serve_reference
):
    """Streams whose clients go away after a random number of chunks, while other
    requests run on the same workers: every later output equals a cold run's."""
    sup = make_supervisor("--size", "256M")
    srv = Server(sup, serve_model, workers=2, tmp_path=tmp_path)
    # prompts of many lengths with different starts: a late capture of a short one would
    # meet a long one decoding, with more tokens in the context than it had
    prompts = [
        f"Topic {i}. " + " ".join(RULES[(7 * i) % 50 :] + RULES)[: 60 + 300 * i] for i in range(8)
    ]
    refs = {p: serve_reference(p) for p in prompts}
    refs120 = {p: serve_reference(p, max_tokens=120) for p in prompts}
    rng = random.Random(9)
    wrong: list[str] = []
    errors: list[BaseException] = []

    def one(prompt: str, cut: int | None) -> None:
        body = {"prompt": prompt, "stream": True, **SAMPLING, **EXTRA, "model": "tiny"}
        body["max_tokens"] = 120
        with httpx.Client(timeout=120) as http:
            with http.stream("POST", srv.base + "/v1/completions", json=body) as r:
                assert r.status_code == 200
                text, n = "", 0
                for line in r.iter_lines():
                    if cut is not None and n >= cut:
                        return  # close the connection mid-stream
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    n += 1
                    text += json.loads(line[len("data: ") :])["choices"][0]["text"]
        if text != refs120[prompt]:
            wrong.append(prompt)

    def client(seed: int) -> None:
        r = random.Random(seed)
        try:
            for _ in range(30):
                p = r.choice(prompts)
                one(p, r.choice([None, 0, 1, 2, 3, 5, 8, 13, 21, 30, 50, 80, 100]))
        except BaseException as e:  # collected below
            errors.append(e)

    try:
        threads = [threading.Thread(target=client, args=(rng.random(),)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        assert not errors, errors
        assert not wrong, wrong
        # and afterwards, with whatever the storm published: every prompt as a cold run
        for p in prompts:
            text, _ = srv.complete(p)
            assert text == refs[p], p
        gone = srv.log_path.read_text().count("client gone")
        dropped = [
            c.get("captures_dropped", 0)
            for _ in range(6)
            for c in httpx.get(srv.base + "/health", timeout=10).json()["shmkv"]
        ]
    finally:
        srv.stop()
    n, torn = _torn_records(sup, serve_model)
    log.info("disconnect storm: %d streams cut, %d records checked, torn %s", gone, n, torn)
    assert n > 0 and not torn, torn
    assert not any(dropped), dropped  # every stream was closed under its request's lock


def _torn_records(sup, model: str) -> tuple[int, list[int]]:
    """Restore every state in the arena into a fresh context and compare its next-token
    logits with those of its tokens evaluated cold: a state captured while another call
    decoded on the context (extra cells, half-written rows) does not match. Returns
    (records, lengths of the bad ones)."""
    import ctypes
    import os

    from llama_cpp import llama_cpp as lc

    fd = os.open(sup.arena, os.O_RDONLY)
    try:
        view = A.ArenaView(fd, populate=False)
    finally:
        os.close(fd)
    llm = _plain(model, n_ctx=N_CTX)
    mem = lc.llama_get_memory(llm.ctx)
    records = {(s.rec_offset, s.rec_gen) for s in view.scan()}
    bad = []
    for off, gen in sorted(records):
        rec = view.read_record(off, gen)
        toks = [int(t) for t in view.tokens(rec)]
        payload = bytes(view.blob(rec))  # (a chunked record's assembled)
        lc.llama_memory_clear(mem, True)
        llm.n_tokens = 0
        llm.eval(toks)
        cold = last_logits(llm)
        lc.llama_memory_clear(mem, True)
        buf = (ctypes.c_uint8 * len(payload)).from_buffer_copy(payload)
        ok = lc.llama_state_seq_set_data(llm.ctx, buf, len(payload), 0) == len(payload)
        ok = ok and lc.llama_memory_seq_pos_max(mem, 0) + 1 == len(toks)
        if ok:
            lc.llama_memory_seq_rm(mem, 0, len(toks) - 1, -1)
            llm.n_tokens = len(toks) - 1
            llm.eval(toks[-1:])
            warm = last_logits(llm)
            # (a state computed in other batches differs by ~1e-3 here; a torn one by far more)
            diff = float(np.max(np.abs(warm - cold)))
            ok = diff < 0.02 and int(np.argmax(warm)) == int(np.argmax(cold))
            log.debug("record of %d tokens: logits differ by %.2e", len(toks), diff)
        if not ok:
            bad.append(len(toks))
    view.close()
    return len(records), bad


# ----------------------------------------------------------------- idle connections
def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def test_idle_and_slow_connections_do_not_stall_free_workers(
    tmp_path, serve_model, make_supervisor
):
    """20 idle TCP connections a second (and a few that send their headers or body a
    byte at a time) while /health is polled: p99 stays under 0.5 s, the trickling ones hold
    their worker's accepts only for a while, and the idle ones are closed after
    --request-read-timeout."""
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
        # the trickling ones each held their worker's accepts for a while, not for good
        wait_until(
            lambda: httpx.get(srv.base + "/health", timeout=5).json()["http"]["holds_expired"],
            30,
            "a worker counting an expired accept hold",
        )
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


# --------------------------------------------------------------- graceful stops
def _cpu_ticks(pid: int) -> int:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def _stop_its_worker_mid_way(tmp_path, serve_model, make_supervisor, ask) -> str:
    """Start one worker, run ``ask(base_url)`` in a thread, SIGTERM the worker (gunicorn's
    graceful stop: what a reload, a scale-down or a clean stop sends) once 0.2 s of its CPU
    went into the request (over a second of work), wait for the request and gunicorn's new
    worker; the server's log."""
    sup = make_supervisor("--size", "64M")
    srv = Server(sup, serve_model, workers=1, tmp_path=tmp_path)
    try:
        (pid,) = srv.worker_pids()
        ticks = _cpu_ticks(pid)
        asker = threading.Thread(target=ask, args=(srv.base,))
        asker.start()
        wait_until(lambda: _cpu_ticks(pid) >= ticks + 20, 60, "the request under way")
        os.kill(pid, signal.SIGTERM)
        asker.join(120)
        wait_until(lambda: srv.worker_pids() - {pid}, 60, "gunicorn's new worker")
    finally:
        srv.stop()
    return srv.log_path.read_text()


def test_a_request_in_flight_when_its_worker_stops_gracefully_is_answered(
    tmp_path, serve_model, make_supervisor
):
    """gunicorn stops a worker gracefully while it computes a completion: the answer comes
    whole and the worker logs no exception. (The worker's accept switch touched the
    listening socket a graceful stop had closed: gunicorn's wrapper then raises
    AttributeError, which ended such requests in an exception, or in a 500 for one whose
    body came in after the stop. Found by bench/soak_system.py's SIGHUP.)"""
    body = {"prompt": "Rule 1: the cat", **SAMPLING, **EXTRA, "max_tokens": 1500}
    got: list[httpx.Response] = []

    def ask(base: str) -> None:
        got.append(httpx.post(base + "/v1/completions", json=body, timeout=120))

    log_text = _stop_its_worker_mid_way(tmp_path, serve_model, make_supervisor, ask)
    assert got and got[0].status_code == 200, got and got[0].text
    assert got[0].json()["usage"]["completion_tokens"] == 1500
    assert "Traceback" not in log_text and "Exception in ASGI" not in log_text, log_text[-3000:]


def test_a_stream_in_flight_when_its_worker_stops_gracefully_is_sent_to_its_end(
    tmp_path, serve_model, make_supervisor
):
    """The streaming twin of the test above: a stream under way when gunicorn stops its worker
    gracefully is sent whole, to its ``[DONE]``. (sse-starlette ends every stream when
    uvicorn begins a graceful stop, and from 3.x ends it cleanly: the client saw a
    well-formed stream that stopped mid-answer with no error and no finish_reason, a
    silently truncated answer. Found by bench/soak_system.py's SIGHUP.)"""
    body = {"prompt": "Rule 1: the cat", **SAMPLING, **EXTRA, "max_tokens": 1500, "stream": True}
    body["stream_options"] = {"include_usage": True}
    got = {"completion_tokens": None, "finish_reason": None, "done": False}

    def ask(base: str) -> None:
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as r:
            for line in (x for x in r.iter_lines() if x.startswith("data:")):
                if line[5:].strip() == "[DONE]":  # (a stream without it was cut short)
                    got["done"] = True
                    break
                chunk = json.loads(line[5:])
                for choice in chunk.get("choices") or []:
                    got["finish_reason"] = choice.get("finish_reason") or got["finish_reason"]
                if chunk.get("usage"):
                    got["completion_tokens"] = chunk["usage"]["completion_tokens"]

    log_text = _stop_its_worker_mid_way(tmp_path, serve_model, make_supervisor, ask)
    assert got == {"completion_tokens": 1500, "finish_reason": "length", "done": True}, got
    assert "Traceback" not in log_text and "Exception in ASGI" not in log_text, log_text[-3000:]


# ------------------------------------------------------- prompt logits after a restore
def _prompt_logprobs(out: dict) -> np.ndarray:
    lp = out["choices"][0]["logprobs"]["token_logprobs"]
    return np.array([np.nan if x is None else x for x in lp], dtype=np.float64)


def test_logits_all_echo_logprobs_after_a_restore_match_a_cold_run(supervisor, models):
    """With logits_all, a restore brings the prompt's cells but not its logits: a request
    that reads them (echo + logprobs) must get a cold run's numbers, whether its worker
    would restore or reuse what an earlier restore left in its context."""
    prompt = SYSTEM + " Question: how likely is each word?"
    params = dict(max_tokens=4, temperature=0.0, seed=0)
    want = _plain(models["seed0"], logits_all=True).create_completion(
        prompt, echo=True, logprobs=3, **params
    )
    want_plain = _plain(models["seed0"], logits_all=True).create_completion(prompt, **params)
    a = _shared(supervisor, models["seed0"], logits_all=True)
    a.create_completion(prompt, **params)
    assert a.shmkv.flush()
    # a worker that restored the prompt for a plain request, then is asked for its logits
    b = _shared(supervisor, models["seed0"], logits_all=True)
    plain = b.create_completion(prompt, **params)
    assert b.shmkv.last.tokens_restored > 0  # (the cache still serves other requests)
    reused = b.create_completion(prompt, echo=True, logprobs=3, **params)
    # a worker whose first request wants them
    c = _shared(supervisor, models["seed0"], logits_all=True)
    fresh = c.create_completion(prompt, echo=True, logprobs=3, **params)
    expected = _prompt_logprobs(want)
    for name, got in (("reused", reused), ("fresh", fresh)):
        lp = _prompt_logprobs(got)
        bad = int(np.sum(~np.isclose(lp, expected, atol=1e-4, equal_nan=True)))
        assert bad == 0, f"{name}: {bad} of {len(lp)} logprobs differ from a cold run"
        assert got["choices"][0]["text"] == want["choices"][0]["text"], name
    assert c.shmkv.last.tokens_restored == 0
    assert plain["choices"][0]["text"] == want_plain["choices"][0]["text"]
    for llm in (a, b, c):
        llm.shmkv.close()


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
        hit = c.lookup(chain_digests(root, tokens, chunk))
        assert hit is not None and hit.chunks == len(tokens) // chunk


def test_lora_is_identified_by_its_content_not_its_path(tmp_path, models):
    from shmkv.llama.fingerprint import model_fingerprint
    from tests.support.tinymodel import write_tiny_lora

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
