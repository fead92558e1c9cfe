"""Exact mode (``--exact``): restores only at batch boundaries, bit for bit a cold run.

llama.cpp's numbers depend on how a prompt is split into batches (on Gemma 3 270M
Q4_K_M, evaluating a prompt as [0, k) + [k, n) instead of one pass changes its last
logits by up to ~1 for most k). Exact mode restores only at multiples of n_batch,
from states computed in whole batches, so a hit repeats a cold run's batches. The
tiny models check the mechanics (boundaries, sliding windows, local reuse, separate
keys); the real Gemma checks the logits bit for bit.
"""

from __future__ import annotations

import logging

import llama_cpp
import numpy as np
import pytest
from llama_cpp import llama_cpp as C

from tests.support.llama_workers import SYSTEM, completion, last_logits, run_worker, texts

EXACT = {"SHMKV_EXACT": "true"}
BATCH = {"n_batch": 128, "n_ubatch": 128}
QUESTIONS = [
    " Question: who sits?",
    " Question: where is the mat?",
    " Question: how many cats are there?",
]


@pytest.mark.parametrize("model", ["seed0", "swa"])
def test_exact_hits_restore_at_batch_boundaries(supervisor, models, model):
    jobs = [[completion(SYSTEM + q)] for q in QUESTIONS]
    cold = run_worker(None, models[model], sum(jobs, []), mode="cold", kw=BATCH)
    runs = [run_worker(supervisor, models[model], j, kw=BATCH, env=EXACT) for j in jobs]
    assert sum((texts(r) for r in runs), []) == texts(cold)
    first, *later = (r["results"][0]["last"] for r in runs)
    n = first["prompt_tokens"]
    assert first["tokens_restored"] == 0 and first["checkpoint"] == (n - 1) // 128 * 128
    if model == "swa":  # a window state cannot be cut: every boundary is published
        assert runs[0]["totals"]["checkpoints"] == (n - 1) // 128
    else:
        assert runs[0]["totals"]["checkpoints"] == 1
    shared = len(SYSTEM) // 2  # (the tiny tokenizer: about two characters a token)
    for r in later:
        assert r["hit"] and r["tokens_restored"] % 128 == 0 and r["tokens_restored"] > shared
        assert r["tokens_evaluated"] == r["prompt_tokens"] - r["tokens_restored"]


def test_exact_local_reuse_stops_at_a_boundary(supervisor, models):
    """The same process, a second question: its own context is reused only up to the
    last whole batch of the first prompt (the rest, and the completion, were not
    computed as a cold run of the second prompt computes them)."""
    jobs = [completion(SYSTEM + QUESTIONS[0], max_tokens=40), completion(SYSTEM + QUESTIONS[1])]
    cold = run_worker(None, models["seed0"], jobs, mode="cold", kw=BATCH)
    got = run_worker(supervisor, models["seed0"], jobs, kw=BATCH, env=EXACT)
    assert texts(got) == texts(cold)
    first, second = (r["last"] for r in got["results"])
    reused = second["tokens_reused_local"] + second["tokens_restored"]
    vocab = llama_cpp.Llama(models["seed0"], vocab_only=True, verbose=False)
    a, b = (vocab.tokenize((SYSTEM + q).encode()) for q in QUESTIONS[:2])
    shared = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    assert reused == min(shared, (len(a) - 1) // 128 * 128) // 128 * 128 > 0


def test_exact_and_fast_mode_states_never_mix(supervisor, models):
    jobs = [completion(SYSTEM + QUESTIONS[0])]
    run_worker(supervisor, models["seed0"], jobs, kw=BATCH)  # fast mode publishes
    got = run_worker(
        supervisor, models["seed0"], [completion(SYSTEM + QUESTIONS[1])], kw=BATCH, env=EXACT
    )
    assert got["results"][0]["last"]["tokens_restored"] == 0
    # and the other way round: fast mode restores nothing exact mode published
    with supervisor.client(attach=False) as c:
        c.clear()
    exact = run_worker(supervisor, models["seed0"], jobs, kw=BATCH, env=EXACT)
    assert exact["totals"]["publishes"] >= 1
    got = run_worker(supervisor, models["seed0"], [completion(SYSTEM + QUESTIONS[1])], kw=BATCH)
    assert got["results"][0]["last"]["tokens_restored"] == 0


def test_exact_multi_turn_chat_in_another_process(supervisor, models):
    sys_msg = {"role": "system", "content": SYSTEM}
    turn1 = [sys_msg, {"role": "user", "content": "Tell me about the cats."}]
    chat1 = {"kind": "chat", "messages": turn1, "max_tokens": 60}
    reply = texts(run_worker(None, models["swa"], [chat1], mode="cold", kw=BATCH))[0]
    turn2 = [
        *turn1,
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "And the mats?"},
    ]
    chat2 = {"kind": "chat", "messages": turn2, "max_tokens": 16}
    cold2 = run_worker(None, models["swa"], [chat2], mode="cold", kw=BATCH)
    a = run_worker(supervisor, models["swa"], [chat1], kw=BATCH, env=EXACT)
    b = run_worker(supervisor, models["swa"], [chat2], kw=BATCH, env=EXACT)
    assert texts(a) == [reply] and texts(b) == texts(cold2)
    last = b["results"][0]["last"]
    assert last["hit"] and last["tokens_restored"] % 128 == 0 and last["tokens_restored"] > 300


def test_exact_mode_on_gemma_gives_a_cold_runs_logits_bit_for_bit(supervisor, caplog):
    """The real model (the default of `shmkv serve`): three prompts sharing ~700 tokens.
    Every exact-mode run's last-prompt-token logits equal a plain Llama's cold pass."""
    from shmkv.llama import SharedCacheLlama
    from shmkv.serving.default_model import default_model_path

    caplog.set_level(logging.WARNING)
    kw = {
        "model_path": default_model_path(),
        "n_ctx": 2048,
        "n_threads": 2,
        "seed": 0,
        "verbose": False,
        "n_batch": 256,
        "n_ubatch": 256,
    }
    text = " ".join(f"Rule {i}: the fox {i * 7 % 13} jumps over dog {i % 5}." for i in range(40))
    plain = llama_cpp.Llama(**kw)
    cold = {}
    for q in QUESTIONS:
        plain.reset()
        C.llama_memory_clear(C.llama_get_memory(plain.ctx), True)
        plain.eval(plain.tokenize((text + q).encode()))
        cold[q] = last_logits(plain)
    del plain
    got, restored = {}, []
    for q in QUESTIONS:  # a fresh context (a new worker) each time
        llm = SharedCacheLlama(
            **kw, shmkv_name=supervisor.name, shmkv_socket=supervisor.socket, shmkv_exact=True
        )
        llm.shmkv.on_prefill = lambda cache, q=q: got.__setitem__(q, last_logits(cache.llm))
        llm.create_completion(text + q, max_tokens=2, temperature=0.0)
        assert llm.shmkv.flush()
        restored.append(llm.shmkv.last.tokens_restored)
        llm.shmkv.close()
        del llm
    assert restored[0] == 0 and all(r > 0 and r % 256 == 0 for r in restored[1:]), restored
    for q in QUESTIONS:
        assert np.array_equal(got[q], cold[q]), (q, float(np.abs(got[q] - cold[q]).max()))
    assert "shmkv" not in caplog.text  # no cache errors on the way
