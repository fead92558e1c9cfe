"""Chat completions through real gunicorn workers: the default model (Gemma 3 270M, whose
GGUF has no chat template) renders Gemma 3's own template, system message included;
responses name the model by its alias; `shmkv serve` starts without warnings.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import jinja2
import pytest

from tests.support.cli import clean_env
from tests.support.servers import EXTRA, SAMPLING, Server, free_port
from tests.support.waiting import wait_until

SYSTEM = "You are a terse geography tutor. Answer with one word, then stop."
QUESTION = "What is the capital of France?"


def render_gemma3(messages: list[dict[str, Any]]) -> str:
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    # the template the workers register, rendered with plain jinja2 as transformers does
    # (the exact expected strings below check its text independently)
    from shmkv_workers.app import GEMMA3_TEMPLATE

    return env.from_string(GEMMA3_TEMPLATE).render(
        messages=messages, bos_token="<bos>", add_generation_prompt=True
    )


@pytest.fixture(scope="module")
def gemma_model() -> str:
    from shmkv.core.errors import ConfigError
    from shmkv.serving.default_model import default_model_path

    try:
        return default_model_path()
    except ConfigError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def gemma_plain(gemma_model):
    """A plain Llama with the workers' settings, to count and continue rendered prompts."""
    import llama_cpp

    return llama_cpp.Llama(
        model_path=gemma_model, n_ctx=2048, n_threads=1, n_threads_batch=1, verbose=False
    )


@pytest.fixture
def gemma_server(tmp_path, gemma_model, make_supervisor):
    sup = make_supervisor("--size", "128M")
    srv = Server(sup, gemma_model, workers=1, tmp_path=tmp_path)
    yield srv
    srv.stop()


def _chat(srv: Server, messages: list[dict[str, Any]], **kw: Any) -> Any:
    return srv.client.chat.completions.create(
        model="whatever-the-client-says",
        messages=messages,  # type: ignore[arg-type]
        extra_body=EXTRA,
        **{**SAMPLING, **kw},
    )


def _n_tokens(llm: Any, text: str) -> int:
    return len(llm.tokenize(text.encode(), add_bos=False, special=True))


def _continuation(llm: Any, prompt: str, max_tokens: int) -> str:
    llm.reset()
    tokens = llm.tokenize(prompt.encode(), add_bos=False, special=True)  # <bos> is in it
    params = {**SAMPLING, **EXTRA, "max_tokens": max_tokens, "stop": ["<end_of_turn>"]}
    out = llm.create_completion(tokens, **params)
    return out["choices"][0]["text"]


def test_template_text_is_gemma3s(gemma_model):
    """The worker's registered format renders exactly what the published template does,
    and what Gemma's documentation shows for a system message and several turns."""
    from shmkv_workers.app import gemma3_formatter

    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"},
    ]
    expected = (
        f"<bos><start_of_turn>user\n{SYSTEM}\n\n{QUESTION}<end_of_turn>\n"
        "<start_of_turn>model\nParis.<end_of_turn>\n"
        "<start_of_turn>user\nAnd of Italy?<end_of_turn>\n<start_of_turn>model\n"
    )
    assert render_gemma3(messages) == expected
    assert gemma3_formatter()(messages=messages).prompt == expected


def test_system_message_is_in_the_prompt(gemma_server, gemma_plain):
    """The same question with and without a system message: the difference in
    prompt_tokens is the system message's, and the worker evaluated exactly the
    prompt that Gemma 3's template renders (same length, same greedy answer)."""
    user = [{"role": "user", "content": QUESTION}]
    with_system = [{"role": "system", "content": SYSTEM}, *user]
    bare = _chat(gemma_server, user)
    full = _chat(gemma_server, with_system)
    assert bare.usage is not None and full.usage is not None
    rendered = render_gemma3(with_system)
    assert SYSTEM in rendered
    system_tokens = _n_tokens(gemma_plain, rendered) - _n_tokens(gemma_plain, render_gemma3(user))
    assert system_tokens >= _n_tokens(gemma_plain, SYSTEM) > 5
    assert full.usage.prompt_tokens - bare.usage.prompt_tokens == system_tokens
    assert full.usage.prompt_tokens == _n_tokens(gemma_plain, rendered)
    text = full.choices[0].message.content
    assert text == _continuation(gemma_plain, rendered, SAMPLING["max_tokens"])


def test_multi_turn_renders_as_gemma3(gemma_server, gemma_plain):
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And the capital of Italy?"},
    ]
    got = _chat(gemma_server, messages)
    rendered = render_gemma3(messages)
    assert got.usage is not None
    assert got.usage.prompt_tokens == _n_tokens(gemma_plain, rendered)
    text = got.choices[0].message.content
    assert text == _continuation(gemma_plain, rendered, SAMPLING["max_tokens"])


def _models_named(srv: Server) -> set[str]:
    c = srv.client
    names = {
        c.completions.create(
            model="x/y.gguf", prompt="The cat", extra_body=EXTRA, **SAMPLING
        ).model,
        c.chat.completions.create(
            model="x", messages=[{"role": "user", "content": "Hi"}], extra_body=EXTRA, **SAMPLING
        ).model,
    }
    for chunk in c.chat.completions.create(
        model="x",
        messages=[{"role": "user", "content": "Hi"}],
        stream=True,
        extra_body=EXTRA,
        **SAMPLING,
    ):
        names.add(chunk.model)
    for listed in c.models.list():
        names.add(listed.id)
    return names


def test_responses_name_the_model_by_its_stem(tmp_path, serve_model, make_supervisor):
    srv = Server(make_supervisor("--size", "64M"), serve_model, workers=1, tmp_path=tmp_path)
    try:
        assert _models_named(srv) == {Path(serve_model).stem}
    finally:
        srv.stop()


def test_responses_name_the_model_by_its_alias(tmp_path, serve_model, make_supervisor):
    sup = make_supervisor("--size", "64M")
    env = {"SHMKV_MODEL_ALIAS": "tiny-chat"}
    srv = Server(sup, serve_model, workers=1, tmp_path=tmp_path, env=env)
    try:
        assert _models_named(srv) == {"tiny-chat"}
    finally:
        srv.stop()


def start_serve(
    tmp_path: Path, serve_model: str, workers: int
) -> tuple[subprocess.Popen, int, Path]:
    """`shmkv serve` of the tiny model in its own session (32M arena, 1 thread, n_ctx 2048),
    its stderr in ``serve.err``: the process, its port and that file."""
    name, port = f"t{uuid.uuid4().hex[:10]}", free_port()
    args = ["serve", "--model", serve_model, "--workers", str(workers), "--size", "32M"]
    args += ["--name", name, "--socket", str(tmp_path / f"{name}.sock"), "--port", str(port)]
    err_path = tmp_path / "serve.err"
    with open(err_path, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "shmkv", *args],
            env=clean_env(SHMKV_THREADS="1", SHMKV_N_CTX="2048"),
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
        )
    return proc, port, err_path


def test_serve_starts_without_warnings(tmp_path, serve_model):
    """`shmkv serve` starts its own supervisor: no "cache unavailable" while it waits."""
    proc, port, err_path = start_serve(tmp_path, serve_model, workers=2)
    try:
        pids: set[int] = set()
        deadline = time.monotonic() + 60
        while len(pids) < 2 and time.monotonic() < deadline:
            assert proc.poll() is None, err_path.read_text()[-3000:]
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
                if r.status_code == 200 and r.json()["shmkv"][0]["connected"]:
                    pids.add(r.json()["worker_pid"])
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        assert len(pids) == 2, err_path.read_text()[-3000:]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    log = err_path.read_text()
    assert "serving tiny.gguf" in log
    assert "cache unavailable" not in log, log
    assert " WARNING " not in log, log


def test_sighup_to_serve_reloads_its_workers_and_keeps_serving(tmp_path, serve_model):
    """SIGHUP (systemd's reload, a closed terminal) to `shmkv serve`: gunicorn replaces its
    worker, the supervisor logs its stats, and serve keeps serving (it used to die of the
    signal, taking its gunicorn and supervisor with it)."""
    proc, port, err_path = start_serve(tmp_path, serve_model, workers=1)

    def worker_pid() -> int | None:
        try:
            r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
            return r.json()["worker_pid"] if r.status_code == 200 else None
        except httpx.HTTPError:
            return None

    try:
        first = wait_until(worker_pid, 60, "the worker")
        os.kill(proc.pid, signal.SIGHUP)
        wait_until(lambda: worker_pid() not in (None, first), 60, "the reloaded worker")
        assert proc.poll() is None, err_path.read_text()[-3000:]
        wait_until(lambda: "stats: {" in err_path.read_text(), 30, "the supervisor's stats")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    assert proc.returncode == 0, err_path.read_text()[-3000:]


def test_serve_refuses_more_aliases_than_models(tmp_path, serve_model):
    """Checked before anything starts: one line, no supervisor, no workers."""
    from tests.support.cli import assert_one_error_line, shmkv

    sock = str(tmp_path / "none.sock")
    res = shmkv("serve", "--model", serve_model, "--model-alias", "a,b", "--socket", sock)
    assert_one_error_line(res, "2 --model-alias for 1 --model")
    assert not os.path.exists(sock)


@pytest.mark.parametrize(
    "messages, expected",
    [
        (  # two system messages, two user messages in a row
            [
                {"role": "system", "content": "Be brief."},
                {"role": "system", "content": "Be kind."},
                {"role": "user", "content": "Hi."},
                {"role": "user", "content": [{"type": "text", "text": "Who are you?"}]},
            ],
            "<bos><start_of_turn>user\nBe brief.\n\nBe kind.\n\nHi.\n\nWho are you?<end_of_turn>\n"
            "<start_of_turn>model\n",
        ),
        (  # a system message alone
            [{"role": "system", "content": "Be brief."}],
            "<bos><start_of_turn>user\nBe brief.\n\n<end_of_turn>\n<start_of_turn>model\n",
        ),
        (  # a system message later on, and the model speaking first
            [
                {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "Hi."},
                {"role": "system", "content": "Now in French."},
                {"role": "assistant", "content": "Bonjour."},
            ],
            "<bos><start_of_turn>user\n<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
            "<start_of_turn>user\nHi.\n\nNow in French.<end_of_turn>\n"
            "<start_of_turn>model\nBonjour.<end_of_turn>\n<start_of_turn>model\n",
        ),
    ],
    ids=["systems-and-users-in-a-row", "system-alone", "system-later-model-first"],
)
def test_every_message_is_in_the_prompt(gemma_server, gemma_plain, messages, expected):
    """Conversations Gemma's template would refuse (roles not alternating) or cut (a
    system message with no user turn) still put every message in the prompt."""
    from shmkv_workers.app import gemma3_formatter

    assert gemma3_formatter()(messages=messages).prompt == expected
    got = _chat(gemma_server, messages)
    assert got.usage is not None
    assert got.usage.prompt_tokens == _n_tokens(gemma_plain, expected)
