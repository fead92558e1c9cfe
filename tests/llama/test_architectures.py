"""The tiny-model matrix: each family whose states llama.cpp keeps differently.

Every cached run's greedy text must equal a fresh plain ``Llama``'s, across worker
processes. Attention models (Qwen 2 with its attention biases, Qwen 3 MoE with its
experts) take the plain path: a state is cut back to any shorter prefix. A recurrent
model (Mamba) and a hybrid (Qwen 3.5: gated delta-net layers and attention) cannot cut
a state back: only states of exactly the reused length are restored, the checkpoints
published at chat message boundaries, where prompts part, and before a prompt's end.
"""

from __future__ import annotations

from pathlib import Path

import llama_cpp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shmkv.core.arena import common_prefix
from shmkv.llama import policy
from tests.support import tinymodel
from tests.support.llama_workers import KW, SYSTEM, completion, run_worker, texts
from tests.support.servers import EXTRA, N_CTX, SAMPLING, Server

ARCHS = ("mamba", "qwen35", "qwen2", "qwen3moe")
CANNOT_CUT = {"mamba", "qwen35"}
QUESTIONS = [
    " Question: who sits?",
    " Question: where is the mat?",
    " Question: how many cats are there?",
]


@pytest.fixture(scope="module")
def arch_models(tmp_path_factory) -> dict[str, str]:
    """One tiny GGUF of each architecture in ARCHS."""
    d: Path = tmp_path_factory.mktemp("archs")
    out = {}
    for arch in ARCHS:
        path = d / f"tiny-{arch}.gguf"
        getattr(tinymodel, f"write_tiny_{arch}")(path)
        out[arch] = str(path)
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_shared_prompt_across_workers(supervisor, arch_models, arch):
    """Three workers in turn, one prompt each on the same ~1,150-token prefix: texts
    equal cold runs'; the third restores nearly all of the shared prefix."""
    model = arch_models[arch]
    llm = llama_cpp.Llama(model, vocab_only=True, verbose=False)
    cannot_cut = bool(
        llama_cpp.llama_model_is_recurrent(llm.model) or llama_cpp.llama_model_is_hybrid(llm.model)
    )
    assert cannot_cut == (arch in CANNOT_CUT)
    shared = len(llm.tokenize(SYSTEM.encode())) + 1  # (the questions share " Question:")
    jobs = [[completion(SYSTEM + q, stream=(i == 1))] for i, q in enumerate(QUESTIONS)]
    cold = run_worker(None, model, sum(jobs, []), mode="cold")
    runs = [run_worker(supervisor, model, j) for j in jobs]
    assert sum((texts(r) for r in runs), []) == texts(cold)
    a, b, c = (r["results"][0]["last"] for r in runs)
    assert a["tokens_restored"] == 0
    assert b["hit"] and c["hit"]
    assert c["tokens_restored"] >= 0.9 * shared
    for r in runs:
        assert "model mismatch" not in r["stderr"], r["stderr"][-2000:]
        assert r["totals"]["restore_failures"] == 0


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


@pytest.mark.parametrize("arch", sorted(CANNOT_CUT))
def test_chat_system_message_restored_whole(supervisor, arch_models, arch):
    """Three chats on one ~1,150-token system message, each in its own worker: the first
    checkpoints where the system message ends, the second and third restore exactly
    that state (a recurrent state of more tokens would be useless to them)."""
    model = arch_models[arch]
    system = {"role": "system", "content": SYSTEM}
    asks = [f"{w}: does the cat {i} sit on mat {i}?" for i, w in enumerate(("Why", "How", "Who"))]
    jobs = [[{"kind": "chat", "messages": [system, user(a)], "max_tokens": 16}] for a in asks]
    cold = run_worker(None, model, sum(jobs, []), mode="cold")
    runs = [run_worker(supervisor, model, j) for j in jobs]
    assert sum((texts(r) for r in runs), []) == texts(cold)
    vocab = llama_cpp.Llama(model, vocab_only=True, verbose=False)
    n_sys = len(
        vocab.tokenize(
            f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>".encode(),
            add_bos=True,
            special=True,
        )
    )
    a, b, c = (r["results"][0]["last"] for r in runs)
    assert n_sys in a["checkpoints"]
    assert b["tokens_restored"] == c["tokens_restored"] == n_sys
    assert c["tokens_evaluated"] == c["prompt_tokens"] - n_sys
    for r in runs:
        assert r["totals"]["restore_failures"] == 0 and not r["totals"]["errors"]


def test_hybrid_checkpoints_share_the_prompts_attention_cells(supervisor, arch_models):
    """Qwen 3.5: a chat checkpoints where its system message ends and every n_batch tokens
    before, each by copying the recurrent state alone (no attention cell); each checkpoint
    is published cut from the prompt's state, and all are chunked records that hold the
    system message's full chunks once. A second chat restores exactly the system message;
    a third, whose system message parts from it two thirds in, the checkpoint below where
    it parts. Every text equals a cold run's."""
    model = arch_models["qwen35"]
    system = {"role": "system", "content": SYSTEM}
    other = {"role": "system", "content": SYSTEM[: len(SYSTEM) * 2 // 3] + " Cats never sit."}
    jobs = [
        [{"kind": "chat", "messages": [sys_, user(a)], "max_tokens": 16}]
        for sys_, a in (
            (system, "Why does the cat sit?"),
            (system, "Who sits on mat 2?"),
            (other, "Who sits on mat 2?"),
        )
    ]
    cold = run_worker(None, model, sum(jobs, []), mode="cold")
    a = run_worker(supervisor, model, jobs[0])
    s = supervisor.stats()
    b, c = (run_worker(supervisor, model, j) for j in jobs[1:])
    assert texts(a) + texts(b) + texts(c) == texts(cold)
    vocab = llama_cpp.Llama(model, vocab_only=True, verbose=False)

    def chatml(text: str) -> list[int]:
        return vocab.tokenize(text.encode(), add_bos=True, special=True)

    n_sys = len(chatml(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>"))
    every = 512  # (n_batch, llama-cpp-python's default)
    want = [p for p in range(every, n_sys - policy.SWA_MIN_GAIN, every)] + [n_sys]
    first, second, third = (r["results"][0]["last"] for r in (a, b, c))
    assert first["checkpoints"] == want
    assert a["totals"]["recurrent_checkpoints"] == len(want)
    assert a["totals"]["publishes"] == len(want) + 1
    assert s["entries"] == s["chunked_puts"] == len(want) + 1
    ct = s["chunk_tokens"]
    assert s["chunks"] == first["prompt_tokens"] // ct
    # each checkpoint holds its full chunks by reference: f16 K and V of the one attention
    # layer's 4 heads of 16, per token
    per_chunk = ct * 2 * 4 * 16 * 2
    assert s["chunk_bytes_shared"] == sum(p // ct for p in want) * per_chunk
    assert second["tokens_restored"] == n_sys
    parts = common_prefix(
        np.array(chatml(f"<|im_start|>system\n{SYSTEM}")),
        np.array(chatml(f"<|im_start|>system\n{other['content']}")),
    )
    assert every < parts < 2 * every
    assert third["tokens_restored"] == every
    for r in (a, b, c):
        assert r["totals"]["restore_failures"] == 0 and not r["totals"]["errors"]


def test_exact_mode_copies_a_hybrids_checkpoints_whole(supervisor, arch_models):
    """``--exact`` on Qwen 3.5: its checkpoints are whole batches' states and no state of
    the whole prompt is published, so there is nothing to cut them from: each is copied
    whole, as before, and published (none held back and dropped). A second prompt on the
    same prefix restores the last of them; both texts equal cold runs'."""
    model = arch_models["qwen35"]
    jobs = [[completion(SYSTEM + q)] for q in QUESTIONS[:2]]
    cold = run_worker(None, model, sum(jobs, []), mode="cold")
    env = {"SHMKV_EXACT": "true"}
    a, b = (run_worker(supervisor, model, j, env=env) for j in jobs)
    assert texts(a) + texts(b) == texts(cold)
    first = a["results"][0]["last"]
    assert first["checkpoints"] and a["totals"]["recurrent_checkpoints"] == 0
    assert a["totals"]["publishes"] == a["totals"]["checkpoints"] == len(first["checkpoints"])
    assert b["results"][0]["last"]["tokens_restored"] == first["checkpoints"][-1]


def test_a_refused_cut_switches_the_worker_to_whole_states(
    supervisor, arch_models, monkeypatch, caplog
):
    """On a llama-cpp-python that cannot tell a recurrent model (no
    ``llama_model_is_recurrent``): the first restore that needs a cut is refused by
    llama.cpp, which the log says (not "model mismatch"); the worker then plans whole
    states, and its next prompt restores one. Every text equals a cold run's."""
    from llama_cpp import llama_cpp as lc

    from shmkv.llama import attach, policy

    model = arch_models["mamba"]
    prompts = [SYSTEM + q for q in QUESTIONS]
    cold = run_worker(None, model, [completion(p) for p in prompts], mode="cold")
    # publishes A's prompt state only: B's plan then needs a cut of it
    run_worker(supervisor, model, [completion(prompts[0])], env={"SHMKV_CHECKPOINT_TAIL": "0"})
    llm = llama_cpp.Llama(model, verbose=False, **KW)
    for kind in ("recurrent", "hybrid"):
        monkeypatch.delattr(lc, f"llama_model_is_{kind}")
    attach(llm, name=supervisor.name, socket_path=supervisor.socket)
    try:
        assert llm.shmkv.n_swa == 0  # (it cannot tell)
        got = []
        for p in prompts[1:]:
            out = llm.create_completion(p, max_tokens=16, temperature=0.0, seed=0)
            got.append((out["choices"][0]["text"], llm.shmkv.last.tokens_restored))
            llm.shmkv.flush()
    finally:
        llm.shmkv.close()
    assert [t for t, _ in got] == texts(cold)[1:]
    assert got[0][1] == 0 and got[1][1] > 0.9 * len(llm.tokenize(SYSTEM.encode()))
    assert llm.shmkv.n_swa == policy.WHOLE
    assert "state cannot be cut" in caplog.text and "model mismatch" not in caplog.text
    assert "restores whole states only" in caplog.text


def test_served_mamba_restores_across_workers(tmp_path, make_supervisor, arch_models):
    """``shmkv serve``'s workers on the tiny Mamba: a prompt on one worker, then prompts on
    the same prefix until one lands on the other worker, which restores a whole state of
    nearly all of the prefix. Every answer equals a fresh plain Llama's."""
    model = arch_models["mamba"]
    sup = make_supervisor("--size", "64M")
    srv = Server(sup, model, workers=2, tmp_path=tmp_path)
    answers = []
    try:
        text, first = srv.complete(SYSTEM + QUESTIONS[0])
        answers.append((SYSTEM + QUESTIONS[0], text))
        asked, info = srv.until_other_worker(
            lambda i: SYSTEM + f" Question {i}: who sits?", first["worker_pid"]
        )
        answers += [(prompt, text) for prompt, text, _ in asked]
    finally:
        srv.stop()
    plain = llama_cpp.Llama(model, n_ctx=N_CTX, n_threads=1, n_threads_batch=1, verbose=False)
    for prompt, text in answers:
        plain.reset()
        ref = plain.create_completion(prompt, **SAMPLING, **EXTRA)["choices"][0]["text"]
        assert text == ref
    shared = len(plain.tokenize(SYSTEM.encode()))
    assert first["restored_tokens"] == 0
    assert info["restored_tokens"] >= 0.9 * shared


@given(n_state=st.integers(0, 64), keep=st.integers(0, 64), pos_min=st.integers(-1, 64))
def test_whole_states_are_never_cut(n_state, keep, pos_min):
    """A recurrent state is used only if it holds no token past ``keep``; a recurrent
    context (llama.cpp reports its last position as its first) keeps its tokens only if
    the prompt goes past all of them; planning asks for checkpoints as for windows."""
    from shmkv.llama import policy

    assert policy.window_allows_cut(policy.WHOLE, n_state, keep) == (keep >= n_state)
    assert policy.context_allows_cut(policy.WHOLE, pos_min, keep) == (keep <= 0 or pos_min < keep)
    whole = policy.strategy(policy.Rules(n_swa=policy.WHOLE, checkpoint_tail=64))
    assert whole.wants_boundaries
    assert whole.checkpoints(2000, 0, 0, 64, [1000]).points == [1000, 1936]


@given(
    n=st.integers(0, 5000),
    have=st.integers(0, 5000),
    every=st.sampled_from([0, 64, 100, 512]),
    taken=st.lists(st.integers(0, 5000), max_size=3),
    tail=st.sampled_from([0, 64]),
)
def test_interval_checkpoints_are_bounded(n, have, every, taken, tail):
    """A hybrid's checkpoints every ``checkpoint_every`` tokens: multiples of it past
    what was restored (by a worthwhile gain) and before the prompt's tail, at most
    MAX_INTERVAL_CHECKPOINTS of them, the first ones, none close to one taken already;
    none at all without the setting."""
    rules = policy.Rules(n_swa=policy.WHOLE, checkpoint_every=every, checkpoint_tail=tail)
    got = policy.strategy(rules).interval_checkpoints(n, have, 64, taken)
    assert got == sorted(set(got)) and len(got) <= policy.MAX_INTERVAL_CHECKPOINTS
    if not every:
        assert got == []
        return
    want = [
        p
        for p in range(every, n - max(tail, policy.SWA_MIN_GAIN), every)
        if p >= have + policy.SWA_MIN_GAIN
        and p >= 64
        and all(abs(p - t) >= policy.SWA_MIN_GAIN for t in taken)
    ]
    assert got == want[: policy.MAX_INTERVAL_CHECKPOINTS]
