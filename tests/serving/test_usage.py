"""What the cache did, the OpenAI way: ``usage.prompt_tokens_details.cached_tokens``, and
a stream's closing usage chunk with ``stream_options.include_usage``.

Two single-worker gunicorn servers on one supervisor, so that a request goes to the
worker the test means: ``a`` prefills, ``b`` restores from the arena, then reuses its own
context. Through the official ``openai`` client; numbers are checked against the
``X-Shmkv-*`` headers and a cold run of a plain ``llama_cpp.Llama``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from tests.support.servers import EXTRA, N_CTX, SAMPLING, Server

SYSTEM = " ".join(f"Rule {i}: the owl {i % 7} keeps branch {i % 5}." for i in range(45))
MESSAGES = [{"role": "system", "content": SYSTEM}]


@pytest.fixture
def servers(tmp_path, serve_model, make_supervisor) -> Iterator[tuple[Server, Server]]:
    sup = make_supervisor("--size", "256M")
    started: list[Server] = []
    try:
        for name in ("a", "b"):
            (tmp_path / name).mkdir()
            started.append(Server(sup, serve_model, workers=1, tmp_path=tmp_path / name))
        yield started[0], started[1]
    finally:
        for srv in started:
            srv.stop()


@pytest.fixture(scope="module")
def cold(serve_model) -> Callable[..., dict[str, Any]]:
    """A cold run's whole response (text and usage), from a fresh plain Llama with the
    workers' settings: ``cold(prompt=...)`` or ``cold(messages=[...])``."""
    import llama_cpp

    kw = dict(model_path=serve_model, n_ctx=N_CTX, n_threads=1, n_threads_batch=1, verbose=False)

    def run(prompt: str | None = None, messages: list | None = None) -> dict[str, Any]:
        llm = llama_cpp.Llama(**kw)
        if messages is not None:
            return dict(llm.create_chat_completion(messages, **SAMPLING, **EXTRA))
        return dict(llm.create_completion(prompt, **SAMPLING, **EXTRA))

    return run


def headers(raw: Any) -> dict[str, int]:
    """The ``x-shmkv-*`` token counts of a response."""
    return {
        k[len("x-shmkv-") :].replace("-", "_"): int(v)
        for k, v in raw.headers.items()
        if k.startswith("x-shmkv-") and k.endswith("-tokens")
    }


def complete(srv: Server, prompt: str, **kw: Any) -> tuple[str, Any, dict[str, int]]:
    raw = srv.client.completions.with_raw_response.create(
        model="tiny", prompt=prompt, extra_body=EXTRA, **{**SAMPLING, **kw}
    )
    resp = raw.parse()
    return resp.choices[0].text, resp.usage, headers(raw)


def chat(srv: Server, question: str) -> tuple[str, Any, dict[str, int]]:
    raw = srv.client.chat.completions.with_raw_response.create(
        model="tiny", messages=_messages(question), extra_body=EXTRA, **SAMPLING
    )
    resp = raw.parse()
    return resp.choices[0].message.content, resp.usage, headers(raw)


def _messages(question: str) -> list[dict[str, str]]:
    return [*MESSAGES, {"role": "user", "content": question}]


def cached(usage: Any) -> int:
    assert usage.prompt_tokens_details is not None, f"no prompt_tokens_details: {usage}"
    return usage.prompt_tokens_details.cached_tokens


def same_as_cold(text: str, usage: Any, ref: dict[str, Any], content: str) -> None:
    """Greedy text and token counts as a cold run's: the cache changes neither."""
    assert text == content
    assert usage.prompt_tokens == ref["usage"]["prompt_tokens"]
    assert usage.completion_tokens == ref["usage"]["completion_tokens"]
    assert usage.total_tokens == ref["usage"]["total_tokens"]


def check_sequence(ask: Callable[[Server, str], tuple], refs: Callable[[str], tuple], a, b):
    """Cold on ``a``; a new question on ``b`` restores the shared prefix from the arena;
    another on ``b`` reuses it from its own context; a repeat on ``a`` reuses all of it."""
    text, usage, h = ask(a, "first")
    same_as_cold(text, usage, *refs("first"))
    assert cached(usage) == 0 == h["restored_tokens"] == h["reused_local_tokens"]
    assert h["evaluated_tokens"] == usage.prompt_tokens > 500

    text, usage, h = ask(b, "second")
    same_as_cold(text, usage, *refs("second"))
    assert h["restored_tokens"] > 500 and h["reused_local_tokens"] == 0
    assert cached(usage) == h["restored_tokens"] == h["cached_tokens"]
    assert usage.prompt_tokens == h["prompt_tokens"] == cached(usage) + h["evaluated_tokens"]

    text, usage, h = ask(b, "third")
    same_as_cold(text, usage, *refs("third"))
    assert h["restored_tokens"] == 0 and h["reused_local_tokens"] > 500
    assert cached(usage) == h["reused_local_tokens"]
    assert usage.prompt_tokens == cached(usage) + h["evaluated_tokens"]

    text, usage, h = ask(a, "first")  # the whole prompt is in a's context: llama-cpp-python
    same_as_cold(text, usage, *refs("first"))  # evaluates its last token again, for logits
    assert h["reused_local_tokens"] == usage.prompt_tokens and h["evaluated_tokens"] == 1
    assert cached(usage) == usage.prompt_tokens - 1


def test_completion_reports_cached_tokens(servers, cold):
    a, b = servers

    def prompt(q: str) -> str:
        return SYSTEM + f" Question {q}: which branch?"

    def refs(q: str) -> tuple[dict, str]:
        ref = cold(prompt=prompt(q))
        return ref, ref["choices"][0]["text"]

    check_sequence(lambda srv, q: complete(srv, prompt(q)), refs, a, b)


def test_chat_reports_cached_tokens(servers, cold):
    a, b = servers

    def refs(q: str) -> tuple[dict, str]:
        ref = cold(messages=_messages(f"Which owl, {q}?"))
        return ref, ref["choices"][0]["message"]["content"]

    check_sequence(lambda srv, q: chat(srv, f"Which owl, {q}?"), refs, a, b)


def stream(srv: Server, with_usage: bool, **kw: Any) -> list[Any]:
    create = (
        srv.client.chat.completions.create if "messages" in kw else srv.client.completions.create
    )
    options = {"stream_options": {"include_usage": True}} if with_usage else {}
    return list(create(model="tiny", stream=True, extra_body=EXTRA, **options, **SAMPLING, **kw))


def raw_events(srv: Server, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """A stream's ``data:`` events as JSON, as they come over the wire."""
    events = []
    body = {"model": "tiny", "stream": True, **SAMPLING, **EXTRA, **body}
    with httpx.stream("POST", srv.base + path, json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[len("data: ") :]))
    return events


def chunk_text(chunk: Any) -> str:
    choice = chunk.choices[0]
    delta = getattr(choice, "delta", None)  # (a chat chunk; a completion's has text)
    return (delta.content if delta is not None else choice.text) or ""


def check_usage_chunk(chunks: list[Any], want: Any, text: str, same_cache: bool = True) -> None:
    """A stream with include_usage: every chunk but the last has choices and a null usage;
    the last has no choices and the whole request's usage, the non-streamed numbers (the
    cached tokens too, if ``same_cache``: the request met the cache as the non-streamed one)."""
    *body, last = chunks
    assert last.choices == [] and last.usage is not None, last
    assert all(c.choices and c.usage is None for c in body)
    assert "".join(chunk_text(c) for c in body) == text
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.total_tokens) == (
        want.prompt_tokens,
        want.completion_tokens,
        want.total_tokens,
    )
    assert not same_cache or cached(last.usage) == cached(want)
    # the same call's cache report, in the first chunk
    info = body[0].model_extra["shmkv"]
    assert (
        cached(last.usage)
        == info["cached_tokens"]
        == info["prompt_tokens"] - info["evaluated_tokens"]
    )


def check_streams(a: Server, b: Server, want: Any, text: str, **kw: Any) -> None:
    """Streamed where the cache meets it as it met the non-streamed ``want`` (all but the
    last token cached): on ``a`` from its own context, on ``b`` from the arena."""
    for srv, source in ((a, "reused_local_tokens"), (b, "restored_tokens")):
        chunks = stream(srv, True, **kw)
        check_usage_chunk(chunks, want, text)
        assert chunks[0].model_extra["shmkv"][source] == want.prompt_tokens


def test_stream_usage_with_include_usage_only(servers, cold):
    a, b = servers
    prompt = SYSTEM + " Stream me a branch."
    ref = cold(prompt=prompt)
    complete(a, prompt)  # cold, then a non-streamed repeat: cached all but the last token
    text, usage, _ = complete(a, prompt)
    same_as_cold(text, usage, ref, ref["choices"][0]["text"])
    assert cached(usage) == usage.prompt_tokens - 1 > 500
    check_streams(a, b, usage, text, prompt=prompt)

    question = "Which owl streams?"
    ref_chat = cold(messages=_messages(question))
    chat(a, question)
    chat_text, chat_usage, _ = chat(a, question)
    same_as_cold(chat_text, chat_usage, ref_chat, ref_chat["choices"][0]["message"]["content"])
    assert cached(chat_usage) == chat_usage.prompt_tokens - 1 > 500
    check_streams(a, b, chat_usage, chat_text, messages=_messages(question))

    # ended by the end-of-generation token (forced): that token is not counted, as without
    # streaming
    eos = {"logit_bias": {"2": 100.0}}
    eos_text, eos_usage, _ = complete(b, prompt + " Stop.", **eos)
    assert eos_text == "" and eos_usage.completion_tokens == 0
    chunks = stream(b, True, prompt=prompt + " Stop.", **eos)  # (now cached but its last token)
    check_usage_chunk(chunks, eos_usage, "", same_cache=False)
    assert cached(chunks[-1].usage) == eos_usage.prompt_tokens - 1

    # without include_usage, streams stay as they were: no usage anywhere
    for path, body in (
        ("/v1/completions", {"prompt": prompt}),
        ("/v1/chat/completions", {"messages": _messages(question)}),
        ("/v1/completions", {"prompt": prompt, "stream_options": {"include_usage": False}}),
    ):
        events = raw_events(b, path, body)
        assert events and all(e["choices"] and "usage" not in e for e in events), events
    chunks = stream(b, False, prompt=prompt)
    assert "".join(chunk_text(c) for c in chunks) == text
