"""Quantized KV caches: ``--cache-type-k`` / ``--cache-type-v`` and the states they make.

Real llama worker processes and real gunicorn on a tiny llama whose attention heads
are 32 wide (q8_0's block size; the default tiny model's 16-wide heads cannot hold a
quantized V cache). A q8_0 state is about half an f16 one, the two never restore each
other, and a q8_0 hit gives the tokens of a cold q8_0 run.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import uuid
from pathlib import Path

import llama_cpp
import pytest
from llama_cpp import llama_cpp as lc

from shmkv.core.config import resolve
from shmkv.core.errors import ConfigError
from shmkv.core.kvtypes import KV_TYPES, llama_kwargs
from tests.support.cli import assert_one_error_line, clean_env, shmkv
from tests.support.llama_workers import KW, SYSTEM, completion, run_worker, texts
from tests.support.servers import EXTRA, N_CTX, SAMPLING, Server, free_port

Q8 = {"type_k": llama_cpp.GGML_TYPE_Q8_0, "type_v": llama_cpp.GGML_TYPE_Q8_0, "flash_attn": True}
Q8_ENV = {"SHMKV_CACHE_TYPE_K": "q8_0", "SHMKV_CACHE_TYPE_V": "q8_0"}
# measured on this model: 0.54 (34 bytes per 32 values instead of 64, plus cell headers)
MAX_Q8_RATIO = 0.6


@pytest.fixture(scope="module")
def q8_model(tmp_path_factory) -> str:
    """A tiny llama with 32-wide attention heads (64 wide, 2 heads), own weights."""
    from tests.support.tinymodel import write_tiny_llama

    path = tmp_path_factory.mktemp("q8-model") / "tiny-q8.gguf"
    write_tiny_llama(path, seed=5, n_embd=64, n_head=2)
    return str(path)


def state_size(model: str, n_tokens: int, **kw) -> int:
    """Bytes of a sequence state of ``n_tokens`` cells in a context with these settings."""
    llm = llama_cpp.Llama(model_path=model, verbose=False, **{**KW, **kw})
    llm.eval([300 + i % 200 for i in range(n_tokens)])  # any tokens: the size counts cells
    return int(lc.llama_state_seq_get_size(llm.ctx, 0))


def entries(sup) -> dict[str, dict]:
    return {e["key"] + e["root"]: e for e in json.loads(sup.cli("ls", "--json").stdout)}


def test_kv_type_names_are_llama_cpps_ids():
    """The ids are llama.cpp's ``enum ggml_type`` (llama-cpp-python lacks GGML_TYPE_BF16;
    the installed ggml.h has them all)."""
    header = Path(llama_cpp.__file__).parent.parent / "include" / "ggml.h"
    declared = {}
    if header.exists():
        found = re.findall(r"GGML_TYPE_(\w+)\s*=\s*(\d+)", header.read_text())
        declared = {name.lower(): int(value) for name, value in found}
    for name, type_id in KV_TYPES.items():
        expected = getattr(llama_cpp, f"GGML_TYPE_{name.upper()}", declared.get(name))
        assert expected == type_id, name


def test_kv_settings_parse_and_quantized_v_needs_flash_attention(serve_model):
    s = resolve("serve", env={"SHMKV_CACHE_TYPE_K": "Q8_0", "SHMKV_CACHE_TYPE_V": "q4_0"})
    assert (s.cache_type_k, s.cache_type_v, s.flash_attn) == ("q8_0", "q4_0", "auto")
    assert llama_kwargs(s.cache_type_k, s.cache_type_v, s.flash_attn) == {
        "type_k": llama_cpp.GGML_TYPE_Q8_0,
        "type_v": llama_cpp.GGML_TYPE_Q4_0,
        "flash_attn": True,  # auto: llama.cpp refuses a quantized V cache without it
    }
    # defaults: llama-cpp-python's own (f16, no flash attention)
    d = resolve("serve", env={})
    assert llama_kwargs(d.cache_type_k, d.cache_type_v, d.flash_attn) == {
        "type_k": llama_cpp.GGML_TYPE_F16,
        "type_v": llama_cpp.GGML_TYPE_F16,
        "flash_attn": False,
    }
    assert llama_kwargs("q8_0", "f16", "auto")["flash_attn"] is False  # K alone needs none
    with pytest.raises(ConfigError, match="--cache-type-v q8_0 needs flash attention"):
        llama_kwargs("f16", "q8_0", "off")
    with pytest.raises(ConfigError, match="unknown KV cache type 'q9'"):
        resolve("serve", env={"SHMKV_CACHE_TYPE_K": "q9"})
    # `shmkv serve` says so in one line, before it starts anything
    res = shmkv(
        "serve", "--model", serve_model, "--cache-type-v", "q8_0", "--flash-attn", "off",
        env=clean_env(SHMKV_SOCKET="/nonexistent/kvtype.sock"),
    )  # fmt: skip
    assert_one_error_line(res, "--cache-type-v q8_0 needs flash attention", "--flash-attn")


def test_q8_0_and_f16_states_never_meet(supervisor, q8_model):
    """An f16 state is never restored into a q8_0 context (nor a q8_0 state into an f16
    one, K-only q8_0 or f16 with flash attention); a q8_0 hit equals a cold q8_0 run, and
    its state is about half the f16 one's size."""
    prompt = SYSTEM + " Question: how big is my cache?"
    jobs = [completion(prompt)]
    cold_f16 = run_worker(None, q8_model, jobs, mode="cold")
    cold_q8 = run_worker(None, q8_model, jobs, mode="cold", kw=Q8)

    run_worker(supervisor, q8_model, jobs)  # f16 publishes
    f16_entries = entries(supervisor)
    assert f16_entries
    got = run_worker(supervisor, q8_model, jobs, kw=Q8)  # q8_0: a miss, then it publishes
    assert texts(got) == texts(cold_q8)
    last = got["results"][0]["last"]
    assert last["tokens_restored"] == 0 and not last["hit"], last
    assert not got["totals"]["errors"], got["totals"]  # not even found, not refused

    q8_entries = {k: e for k, e in entries(supervisor).items() if k not in f16_entries}
    assert q8_entries
    f16_by_len = {e["tokens"]: e["bytes"] for e in f16_entries.values()}
    pairs = [(e["bytes"], f16_by_len[e["tokens"]]) for e in q8_entries.values()]
    pairs = [(q8, f16) for q8, f16 in pairs if f16]
    assert pairs and all(q8 < MAX_Q8_RATIO * f16 for q8, f16 in pairs), pairs

    hit = run_worker(supervisor, q8_model, jobs, kw=Q8)
    assert texts(hit) == texts(cold_q8)
    last = hit["results"][0]["last"]
    assert last["hit"] and last["tokens_restored"] > 500, last

    # each setting finds its own states only
    f16 = run_worker(supervisor, q8_model, jobs)
    assert texts(f16) == texts(cold_f16) and f16["results"][0]["last"]["hit"]
    for kw in ({"type_k": llama_cpp.GGML_TYPE_Q8_0}, {"flash_attn": True}):
        cold = run_worker(None, q8_model, jobs, mode="cold", kw=kw)
        got = run_worker(supervisor, q8_model, jobs, kw=kw)
        assert texts(got) == texts(cold)
        last = got["results"][0]["last"]
        assert last["tokens_restored"] == 0 and not last["hit"], (kw, last)
        assert not got["totals"]["errors"], (kw, got["totals"])


def test_serve_q8_0_restores_on_another_worker(tmp_path, q8_model, make_supervisor):
    """`shmkv serve` settings reach every worker: a second request on another worker
    restores a q8_0 state, and every answer is a cold q8_0 run's."""
    reference = llama_cpp.Llama(
        model_path=q8_model, n_ctx=N_CTX, n_threads=1, n_threads_batch=1, verbose=False, **Q8
    )

    def cold(prompt: str) -> str:
        reference.reset()
        out = reference.create_completion(prompt, **{**SAMPLING, **EXTRA})
        return out["choices"][0]["text"]

    sup = make_supervisor("--size", "256M")
    server = Server(sup, q8_model, workers=2, tmp_path=tmp_path, env=Q8_ENV)
    try:
        system = " ".join(f"Policy {i}: the cat {i % 7} guards mat {i % 5}." for i in range(45))
        prompts = [system + f" Question {i}: which mat?" for i in range(7)]
        text, first = server.complete(prompts[0])
        assert text == cold(prompts[0])
        assert first["restored_tokens"] == 0
        results = server.complete_two_at_a_time(prompts[1:])
        assert len(results) == len(prompts) - 1
        for p, (text, _info) in results.items():
            assert text == cold(p), p
        others = [
            info
            for _t, info in results.values()
            if info["restored_tokens"] >= 500 and info["worker_pid"] != first["worker_pid"]
        ]
        assert others, f"no other worker restored: {results.values()}"
        # the arena holds q8_0 states: about half of what f16 ones of that length take
        stored = json.loads(sup.cli("ls", "--json").stdout)
        longest = max(stored, key=lambda e: e["tokens"])
        f16 = state_size(q8_model, longest["tokens"])
        assert longest["bytes"] < MAX_Q8_RATIO * f16, (longest, f16)
    finally:
        server.stop()


def test_serve_says_when_the_model_cannot_take_the_cache_type(tmp_path, serve_model):
    """The default tiny model's heads are 16 wide: q8_0 (blocks of 32) cannot hold its V
    cache. The workers fail to load and `shmkv serve` stops, naming the setting."""
    name = f"t{uuid.uuid4().hex[:10]}"
    args = ["serve", "--model", serve_model, "--workers", "1", "--size", "32M", "--name", name]
    args += ["--socket", str(tmp_path / f"{name}.sock"), "--port", str(free_port())]
    args += ["--cache-type-k", "q8_0", "--cache-type-v", "q8_0"]
    res = shmkv(*args, env=clean_env(SHMKV_THREADS="1", SHMKV_N_CTX="2048"), timeout=120)
    assert res.returncode != 0
    assert "could not create a context for tiny.gguf with KV cache K q8_0, V q8_0" in res.stderr
    assert "--cache-type-k f16 --cache-type-v f16" in res.stderr


def test_warm_with_q8_0_keys_states_as_q8_0_workers_do(supervisor, q8_model, tmp_path):
    """`shmkv warm` takes serve's KV options: its states are hits for q8_0 workers (with a
    cold q8_0 run's text), and f16 workers never find them."""
    prompt = SYSTEM + " Question: was this warmed in q8_0?"
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps(prompt) + "\n")
    res = subprocess.run(
        [sys.executable, "-m", "shmkv", "warm", "--model", q8_model, str(path)],
        env={**supervisor.env, "SHMKV_N_CTX": str(KW["n_ctx"]), **Q8_ENV},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    jobs = [completion(prompt)]
    hot = run_worker(supervisor, q8_model, jobs, kw=Q8)
    last = hot["results"][0]["last"]
    assert last["tokens_restored"] >= last["prompt_tokens"] - 1 > 500, last
    assert texts(hot) == texts(run_worker(None, q8_model, jobs, mode="cold", kw=Q8))
    f16 = run_worker(supervisor, q8_model, jobs)
    assert not f16["results"][0]["last"]["hit"]
