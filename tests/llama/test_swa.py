"""Sliding-window models (Gemma 2/3, Mistral, gpt-oss): restores that stay exact.

A sliding-window layer's serialized state holds only the last ``n_swa``
positions, so such a state cannot be cut back to a shorter prefix: llama.cpp
would accept the cut and quietly attend to fewer tokens. These tests run a tiny
Gemma 3 with a 32-token window, on prompts far longer than the window, and
require every cached run's greedy text to equal a fresh plain ``Llama``'s.
"""

from __future__ import annotations

import ctypes

import llama_cpp
import numpy as np
from llama_cpp import llama_cpp as C

from tests.support.llama_workers import KW, SYSTEM, completion, last_logits, run_worker, texts

QUESTIONS = [
    " Question: who sits?",
    " Question: where is the mat?",
    " Question: how many cats are there?",
    " Question: why?",
]


def test_cutting_a_window_state_back_changes_the_output(models):
    """The hazard is real on this model: a cut restore differs from a cold prefill."""
    llm = llama_cpp.Llama(models["swa"], verbose=False, **KW)
    assert C.llama_model_n_swa(llm.model) == 32
    a = llm.tokenize((SYSTEM + QUESTIONS[0]).encode())
    b = llm.tokenize((SYSTEM + QUESTIONS[1]).encode())
    shared = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    assert shared > 200
    llm.eval(b)
    cold = last_logits(llm)
    llm.reset()
    C.llama_memory_clear(C.llama_get_memory(llm.ctx), True)
    llm.eval(a)
    size = C.llama_state_seq_get_size(llm.ctx, 0)
    buf = (ctypes.c_uint8 * size)()
    assert C.llama_state_seq_get_data(llm.ctx, buf, size, 0) == size
    mem = C.llama_get_memory(llm.ctx)
    C.llama_memory_clear(mem, False)
    assert C.llama_state_seq_set_data(llm.ctx, buf, size, 0) == size
    assert C.llama_memory_seq_pos_min(mem, 0) == len(a) - 32  # only the window is kept
    assert C.llama_memory_seq_rm(mem, 0, shared, -1)  # llama.cpp accepts the cut...
    llm.input_ids[:shared] = b[:shared]
    llm.n_tokens = shared
    llm.eval(b[shared:])
    assert not np.allclose(last_logits(llm), cold, atol=1e-3)  # ...and gets it wrong


def test_shared_system_prompt_on_a_window_model(supervisor, models):
    """A: cold; publishes its prompt and a checkpoint 64 tokens before its end. B: cannot
    cut A's prompt state back; restores the checkpoint, learns from the supervisor
    where its prompt leaves A's and publishes a checkpoint there. C, D: restore that
    one. All equal cold runs."""
    jobs = [[completion(SYSTEM + q, stream=(i == 2))] for i, q in enumerate(QUESTIONS)]
    cold = run_worker(None, models["swa"], sum(jobs, []), mode="cold")
    runs = [run_worker(supervisor, models["swa"], j) for j in jobs]
    assert sum((texts(r) for r in runs), []) == texts(cold)
    a, b, *later = (r["results"][0]["last"] for r in runs)
    assert a["tokens_restored"] == 0 and a["checkpoint"] == a["prompt_tokens"] - 64
    assert b["hit"] and b["tokens_restored"] == a["checkpoint"]
    assert b["tokens_restored"] < b["checkpoint"] < b["prompt_tokens"] - 1
    for r in (b, *later):
        assert r["tokens_evaluated"] == r["prompt_tokens"] - r["tokens_restored"]
    for r in later:  # (a question may share one token less: a one-token cut is fine)
        assert r["hit"] and r["tokens_restored"] >= b["checkpoint"] - 1
        assert r["checkpoint"] == 0
    # A: prompt + tail checkpoint; B: prompt + divergence; C, D: their prompt only (a
    # 16-token completion adds less than a chunk to a prompt just published)
    assert [r["totals"]["publishes"] for r in runs] == [2, 2, 1, 1]
    st = supervisor.stats_json()
    assert st["hits"] >= 3 and st["tokens_restored"] >= 3 * a["checkpoint"]


def test_divergence_checkpoint_without_tail_checkpoints(supervisor, models):
    """With tail checkpoints off, B prefills cold but publishes the divergence state."""
    jobs = [[completion(SYSTEM + q)] for q in QUESTIONS[:3]]
    cold = run_worker(None, models["swa"], sum(jobs, []), mode="cold")
    off = {"SHMKV_CHECKPOINT_TAIL": "0"}
    runs = [run_worker(supervisor, models["swa"], j, env=off) for j in jobs]
    assert sum((texts(r) for r in runs), []) == texts(cold)
    a, b, c = (r["results"][0]["last"] for r in runs)
    assert a["tokens_restored"] == 0 and a["checkpoint"] == 0
    assert b["tokens_restored"] == 0 and b["checkpoint"] > 200
    # (C's question shares one token less with A's: a one-token cut is within the window)
    assert c["hit"] and b["checkpoint"] - 1 <= c["tokens_restored"] <= b["checkpoint"]
    assert runs[1]["totals"]["swa_unusable"] == 1


def test_same_prompt_again_then_local_reuse_on_a_window_model(supervisor, models):
    """A restore cut by the one token llama-cpp-python re-evaluates is exact; the same
    process's next prompt must not reuse cells of a restored state that it lacks."""
    first = [completion(SYSTEM + QUESTIONS[0])]
    again = [
        completion(SYSTEM + QUESTIONS[0]),
        completion(SYSTEM + QUESTIONS[1]),
        completion(SYSTEM + QUESTIONS[1] + " Answer briefly.", stream=True),
    ]
    cold = run_worker(None, models["swa"], first + again, mode="cold")
    run_worker(supervisor, models["swa"], first)
    b = run_worker(supervisor, models["swa"], again)
    assert texts(b) == texts(cold)[1:]
    same, other, longer = (r["last"] for r in b["results"])
    assert same["hit"] and same["tokens_evaluated"] == 1
    assert other["tokens_reused_local"] == 0  # the window cells are gone: not reused
    assert other["tokens_restored"] > 200  # the tail checkpoint of the first prompt
    # the third extends the second prompt: the worker's own context is whole again
    assert longer["tokens_reused_local"] + longer["tokens_restored"] >= other["prompt_tokens"]


def test_multi_turn_chat_on_a_window_model(supervisor, models):
    sys_msg = {"role": "system", "content": SYSTEM}
    turn1 = [sys_msg, {"role": "user", "content": "Tell me about the cats."}]
    chat1 = {"kind": "chat", "messages": turn1, "max_tokens": 80}
    cold1 = run_worker(None, models["swa"], [chat1], mode="cold")
    reply = texts(cold1)[0]
    turn2 = [
        *turn1,
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "And the mats?"},
    ]
    chat2 = {"kind": "chat", "messages": turn2, "max_tokens": 16}
    cold2 = run_worker(None, models["swa"], [chat2], mode="cold")
    a = run_worker(supervisor, models["swa"], [chat1])
    b = run_worker(supervisor, models["swa"], [chat2])
    assert texts(a) == [reply] and texts(b) == texts(cold2)
    last = b["results"][0]["last"]
    assert last["hit"] and last["tokens_restored"] > 300
