"""Checkpoints where chats diverge, on a sliding-window model.

A sliding-window state is restored only whole, so before this the second chat on a
new system prompt found nothing it could use when the first one's user message was
longer than ``--checkpoint-tail`` (that checkpoint lies inside the first user message),
and restored the whole shared part only from the third chat on. Now the first chat
publishes a checkpoint where its system message ends (and where the history before its
last user message ends) during its prefill, and the second restores exactly that.
The tiny Gemma 3 (32-token window) renders chats with its GGUF's ChatML template;
every cached run's greedy text must equal a cold run's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import httpx
import llama_cpp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmkv.core.arena import common_prefix
from shmkv.llama import policy
from shmkv.llama.boundaries import HINT_SLACK, ChatBoundaries, formatter_of, prefix_lengths
from shmkv.serving.chat_template import gemma3_formatter
from tests.support.llama_workers import SYSTEM, run_worker, texts
from tests.support.servers import EXTRA, N_CTX, SAMPLING, Server

SYS = {"role": "system", "content": SYSTEM}
# user messages far longer than the 64-token tail checkpoint, different from the first word
ASKS = [
    " ".join(f"{w} {i}: does the cat {i % 3} sit on mat {i % 4} today?" for i in range(6))
    for w in ("Question", "Puzzle", "Riddle", "Query")
]
# a few-shot block shared by the chats of test_history_boundary
SHOTS = [
    {"role": "user", "content": "Example: where does cat 1 sit? " * 8},
    {"role": "assistant", "content": "Cat 1 sits on mat 1, as rule 1 says. " * 8},
]


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def chat(messages: list[dict[str, Any]], stream: bool = False) -> dict[str, Any]:
    return {"kind": "chat", "messages": messages, "stream": stream, "max_tokens": 16}


@pytest.fixture(scope="module")
def vocab(models) -> llama_cpp.Llama:
    """The tiny Gemma's tokenizer and chat template (no weights)."""
    return llama_cpp.Llama(models["swa"], vocab_only=True, verbose=False)


def chatml_tokens(llm: llama_cpp.Llama, text: str) -> int:
    return len(llm.tokenize(text.encode(), add_bos=True, special=True))


def system_end(llm: llama_cpp.Llama) -> int:
    """Tokens of the system message's turn and the template's start of the next turn:
    what every chat with this system message shares, whatever follows."""
    return chatml_tokens(llm, f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>")


def test_second_chat_restores_the_system_message(supervisor, models, vocab):
    """A (cold) publishes a checkpoint at the end of the system message; B, another
    process with another long question, restores exactly that and evaluates only its
    own turn. Before: B restored nothing (A's tail checkpoint is inside A's question)."""
    jobs = [[chat([SYS, user(ASKS[0])])], [chat([SYS, user(ASKS[1])], stream=True)]]
    cold = run_worker(None, models["swa"], sum(jobs, []), mode="cold")
    a, b = (run_worker(supervisor, models["swa"], j) for j in jobs)
    assert texts(a) + texts(b) == texts(cold)
    first, second = a["results"][0]["last"], b["results"][0]["last"]
    n_sys = system_end(vocab)
    assert first["tokens_restored"] == 0
    assert second["hit"] and second["tokens_restored"] == n_sys
    assert second["tokens_evaluated"] == second["prompt_tokens"] - n_sys
    assert n_sys in first["checkpoints"]
    assert a["totals"]["boundary_checkpoints"] == 1
    # B's own system boundary is restored already: no second copy of it
    assert n_sys not in second["checkpoints"] and b["totals"]["boundary_checkpoints"] == 0


def test_history_boundary(supervisor, models, vocab):
    """A chat with a few-shot block (or a history) before its last user message also
    checkpoints where that block ends: B, with the same block and another question,
    restores up to there; C, with the same system message only, restores the system
    boundary A published (through ``attach`` on a plain Llama)."""
    jobs = [
        [chat([SYS, *SHOTS, user(ASKS[0])])],
        [chat([SYS, *SHOTS, user(ASKS[2])])],
        [chat([SYS, user(ASKS[3])])],
    ]
    cold = run_worker(None, models["swa"], sum(jobs, []), mode="cold")
    a = run_worker(supervisor, models["swa"], jobs[0])
    b = run_worker(supervisor, models["swa"], jobs[1])
    c = run_worker(supervisor, models["swa"], jobs[2], mode="attach")
    assert texts(a) + texts(b) + texts(c) == texts(cold)
    first, second, third = (r["results"][0]["last"] for r in (a, b, c))
    n_sys = system_end(vocab)
    shots = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in SHOTS)
    n_shots = chatml_tokens(vocab, f"<|im_start|>system\n{SYSTEM}<|im_end|>\n{shots}<|im_start|>")
    assert second["tokens_restored"] == n_shots
    assert third["tokens_restored"] == n_sys
    assert first["checkpoints"][:2] == [n_sys, n_shots]
    assert a["totals"]["boundary_checkpoints"] == 2


def test_served_chats_restore_the_system_message(tmp_path, make_supervisor, models, vocab):
    """Through gunicorn: a streamed chat (llama-cpp-python's stream path calls the class's
    method, not the hooked one) checkpoints its system message; the next chat on it
    restores exactly that (from the arena: an unrelated prompt went between, so the
    worker's own context no longer holds it). Both answers equal a fresh plain Llama's."""
    sup = make_supervisor("--size", "64M")
    srv = Server(sup, models["swa"], workers=1, tmp_path=tmp_path)
    try:
        first = [SYS, user(ASKS[0])]
        second = [SYS, user(ASKS[1])]
        stream = srv.client.chat.completions.create(
            model="tiny", messages=first, stream=True, extra_body=EXTRA, **SAMPLING
        )
        got = [c.choices[0].delta.content or "" for c in stream if c.choices]
        # (the worker's context then holds another prompt: the next chat must restore)
        srv.complete("An unrelated prompt.")
        raw = srv.client.chat.completions.with_raw_response.create(
            model="tiny", messages=second, extra_body=EXTRA, **SAMPLING
        )
        answer = raw.parse().choices[0].message.content
        restored = int(raw.headers["x-shmkv-restored-tokens"])
        health = httpx.get(srv.base + "/health", timeout=10).json()
    finally:
        srv.stop()
    kw = dict(model_path=models["swa"], n_ctx=N_CTX, n_threads=1, n_threads_batch=1)
    for messages, text in ((first, "".join(got)), (second, answer)):
        plain = llama_cpp.Llama(**kw, verbose=False)
        ref = plain.create_chat_completion(messages, **SAMPLING, **EXTRA)
        assert text == ref["choices"][0]["message"]["content"]
    assert restored == system_end(vocab)
    assert health["shmkv"][0]["boundary_checkpoints"] == 1


def test_warm_pins_the_system_message_checkpoint(make_supervisor, models, vocab, tmp_path):
    """`shmkv warm --pin` on a chat pins its system message's checkpoint too: the state
    every later chat with that system message restores."""
    sup = make_supervisor("--size", "64M")
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"messages": [SYS, user(ASKS[0])]}) + "\n")
    res = subprocess.run(
        [sys.executable, "-m", "shmkv", "warm", "--model", models["swa"], "--pin", str(path)],
        env={**sup.env, "SHMKV_N_CTX": str(N_CTX)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    with sup.client(attach=False) as c:
        pinned = sorted(r["tokens"] for r in c.ls()["entries"] if r["pinned"])
    assert system_end(vocab) in pinned


def boundaries_of(llm: llama_cpp.Llama, messages: list[dict[str, Any]]) -> list[int]:
    """Where the prompt of ``messages`` and each prefix ChatBoundaries finds for it part
    (as ``SharedPrefixCache`` takes them), and check that prefixes of the prompt they are."""
    formatter = formatter_of(llm)
    assert formatter is not None
    whole = formatter(messages=messages)
    prompt = np.asarray(
        llm.tokenize(whole.prompt.encode(), add_bos=not whole.added_special, special=True)
    )
    points = []
    for prefix in ChatBoundaries(llm).prefixes(messages):
        n = common_prefix(prefix, prompt)
        assert n >= len(prefix) - HINT_SLACK
        points.append(n)
    return points


def test_boundaries_of_a_chat(vocab):
    """Where the formatter's rendering of the leading messages and the whole prompt
    part; chats with no shared leading part (or a handler we cannot render) get none."""
    n_sys = system_end(vocab)
    shots = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in SHOTS)
    n_shots = chatml_tokens(vocab, f"<|im_start|>system\n{SYSTEM}<|im_end|>\n{shots}<|im_start|>")
    assert boundaries_of(vocab, [SYS, *SHOTS, user("Why?")]) == [n_sys, n_shots]
    # (llama-cpp-python's chatml renders an empty system turn when there is none)
    empty = "<|im_start|>system\n<|im_end|>\n"
    assert boundaries_of(vocab, [*SHOTS, user("Why?")]) == [
        chatml_tokens(vocab, f"{empty}{shots}<|im_start|>")
    ]
    assert prefix_lengths([user("hi")]) == []
    assert prefix_lengths([SYS]) == []
    assert prefix_lengths([SYS, user("a"), {"role": "assistant", "content": "b"}]) == [1]
    assert prefix_lengths([user("a"), {"role": "assistant", "content": "b"}, user("c")]) == [2]
    assert ChatBoundaries(vocab).prefixes([user("hi")]) == []
    other = llama_cpp.Llama(
        vocab.model_path, vocab_only=True, verbose=False, chat_handler=lambda **kw: None
    )
    assert ChatBoundaries(other).prefixes([SYS, user("hi")]) == []


def test_gemma3_system_boundary():
    """With Gemma 3's own template (the system message opens the first user turn) and
    its real tokenizer, the boundary falls right after the system text and its blank
    line, where chats with different questions part."""
    from shmkv.core.errors import ConfigError
    from shmkv.serving.chat_template import register_gemma3
    from shmkv.serving.default_model import default_model_path

    try:
        path = default_model_path()
    except ConfigError as e:
        pytest.skip(str(e))
    register_gemma3()
    llm = llama_cpp.Llama(path, vocab_only=True, verbose=False, chat_format="shmkv-gemma3")
    system = {"role": "system", "content": "You are the support bot of ACME. " * 20}
    asks = [user("How do I reset my password?"), user("Where is my order?")]
    (n,) = boundaries_of(llm, [system, asks[0]])
    (m,) = boundaries_of(llm, [system, asks[1]])
    render = gemma3_formatter()  # (its prompt has its <bos>: no other added)
    prompts = [
        llm.tokenize(render(messages=[system, a]).prompt.encode(), add_bos=False, special=True)
        for a in asks
    ]
    assert n == m == common_prefix(np.asarray(prompts[0]), np.asarray(prompts[1]))
    assert llm.detokenize(prompts[0][:n]).endswith(b"ACME. \n\n")


def test_boundary_checkpoints_policy():
    """Which hinted boundaries get a checkpoint: past what was restored, worth a chunk,
    apart from each other, at most two; the tail checkpoint gives way to them."""
    sw = policy.SlidingWindow(policy.Rules(n_swa=32, min_tokens=0, checkpoint_tail=64))
    plan = sw.checkpoints(2000, 0, 0, 64, [1000])
    assert plan.points == [1000, 1936]  # the tail lies in the last user message: kept
    assert sw.checkpoints(1050, 0, 0, 64, [1000]).points == [1000]  # tail before it: dropped
    assert sw.checkpoints(2000, 990, 0, 64, [1000]).points == [1936]  # restored already
    assert sw.checkpoints(2000, 0, 0, 64, [30, 500, 510, 900, 1200]).points == [500, 900, 1936]
    assert sw.checkpoints(2000, 0, 1005, 64, [1000]).points == [1000]  # a divergence near it
    assert sw.checkpoints(2000, 0, 1500, 64, [1000]).points == [1000, 1500]
    # the prompt's own state stands in for a boundary one token before its end
    assert sw.checkpoints(1001, 0, 0, 64, [1000]).points == [937]
    off = policy.SlidingWindow(policy.Rules(n_swa=32, publish=False, checkpoint_tail=64))
    assert off.checkpoints(2000, 0, 0, 64, [1000]).points == []
    plain = policy.Plain(policy.Rules())
    assert plain.checkpoints(2000, 0, 0, 64, [1000]).points == []
    assert not plain.wants_boundaries and sw.wants_boundaries
    assert not policy.Exact(policy.Rules(n_swa=32, exact=True, align=64)).wants_boundaries


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(2, 3000),
    reused=st.integers(0, 3000),
    divergence=st.integers(0, 3000),
    marks=st.lists(st.integers(-5, 3005), max_size=6),
)
def test_boundary_checkpoints_are_bounded(n, reused, divergence, marks):
    """Whatever the hints: checkpoints lie inside the prompt past what was restored, at
    most two of them are boundaries, and those are a chunk long and apart."""
    sw = policy.SlidingWindow(policy.Rules(n_swa=32, min_tokens=0, checkpoint_tail=64))
    points = sw.checkpoints(n, reused, divergence, 64, marks).points
    assert points == sorted(set(points))
    assert all(reused < p < n - 1 for p in points)
    chosen = sw.boundary_checkpoints(n, reused, 64, marks)
    assert set(chosen) <= set(points) and set(chosen) <= set(marks)
    assert len(chosen) <= policy.MAX_BOUNDARY_CHECKPOINTS
    assert all(p >= 64 and p >= reused + policy.SWA_MIN_GAIN for p in chosen)
    assert all(b - a >= policy.SWA_MIN_GAIN for a, b in zip(chosen, chosen[1:], strict=False))
    assert len(points) <= policy.MAX_BOUNDARY_CHECKPOINTS + 1
