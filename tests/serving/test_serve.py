"""Real gunicorn workers, a real supervisor and the official `openai` client, on 127.0.0.1.

The tiny model stands in for a real one; outputs are compared with a plain
``llama_cpp.Llama`` given the same settings and sampling parameters.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from shmkv import Client, SupervisorUnavailable
from tests.support.cli import clean_env
from tests.support.servers import EXTRA, N_CTX, SAMPLING, Server, free_port
from tests.support.supervisors import start_supervisor
from tests.support.waiting import wait_until

log = logging.getLogger(__name__)
SYSTEM = " ".join(f"Policy {i}: the cat {i % 7} guards mat {i % 5}." for i in range(45))


@pytest.fixture
def server(tmp_path, serve_model, make_supervisor):
    sup = make_supervisor("--size", "256M")
    srv = Server(sup, serve_model, workers=3, tmp_path=tmp_path)
    yield srv
    srv.stop()


def test_openai_client_cold_then_hits_on_other_workers(server, serve_reference):
    prompts = [SYSTEM + f" Question {i}: which mat?" for i in range(12)]
    text, first = server.complete(prompts[0])
    assert text == serve_reference(prompts[0])
    assert first["restored_tokens"] == 0 and first["evaluated_tokens"] > 500
    restored_by: dict[int, int] = {}
    results = server.complete_two_at_a_time(prompts[1:])
    assert len(results) == len(prompts) - 1
    for p, (text, info) in results.items():
        assert text == serve_reference(p), p
        if info["restored_tokens"]:
            restored_by[info["worker_pid"]] = info["restored_tokens"]
    others = {pid for pid in restored_by if pid != first["worker_pid"]}
    assert others, f"no other worker restored from the arena: {restored_by}"
    assert all(n >= 500 for n in restored_by.values())
    st = server.sup.stats_json()
    assert st["tokens_restored"] >= sum(restored_by.values())
    assert st["workers_attached"] >= 3
    log.info(
        "restored by worker: %s; supervisor stats: hits=%d tokens_restored=%d",
        restored_by,
        st["hits"],
        st["tokens_restored"],
    )


def test_streaming_and_chat(server, serve_reference):
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Which cat guards mat 3?"},
    ]
    want = serve_reference(messages=messages)
    got = server.client.chat.completions.create(
        model="tiny", messages=messages, extra_body=EXTRA, **SAMPLING
    )
    assert got.choices[0].message.content == want
    for _ in range(3):  # stream the same prompt, which some worker now restores
        chunks = list(
            server.client.chat.completions.create(
                model="tiny", messages=messages, stream=True, extra_body=EXTRA, **SAMPLING
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == want
        info = chunks[0].model_extra["shmkv"]
        assert info["prompt_tokens"] > 500
    prompt = SYSTEM + " Stream me."
    chunks = list(
        server.client.completions.create(
            model="tiny", prompt=prompt, stream=True, extra_body=EXTRA, **SAMPLING
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == serve_reference(prompt)
    models = server.client.models.list()
    assert len(models.data) == 1


def test_kill9_worker_mid_request(server, serve_reference):
    prompt = SYSTEM + " A long story:"
    server.complete(prompt)  # warm the arena
    stream = server.client.completions.create(
        model="tiny", prompt=prompt, stream=True, max_tokens=1500, temperature=0.0, extra_body=EXTRA
    )
    first = next(iter(stream))
    victim = first.model_extra["shmkv"]["worker_pid"]
    os.kill(victim, signal.SIGKILL)
    with pytest.raises((openai.APIError, httpx.HTTPError)):
        for _ in stream:
            pass
    # the others keep answering, with outputs equal to a cold run
    for i in range(4):
        p = SYSTEM + f" After the crash {i}."
        text, _ = server.complete(p)
        assert text == serve_reference(p)
    server.wait_workers(3)
    assert victim not in server.worker_pids()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        st = server.sup.stats_json()
        if st["leases_active"] == 0 and st["workers_attached"] <= 3 * 2 + 1:
            break
        time.sleep(0.2)
    assert st["leases_active"] == 0
    assert st["workers_attached"] <= 3 * 2 + 1, st  # the dead worker's connections are gone


def test_kill9_supervisor_workers_answer_cold_then_reattach(server, serve_reference, tmp_path):
    sup = server.sup
    prompt = SYSTEM + " Before the outage."
    server.complete(prompt)
    os.kill(sup.proc.pid, signal.SIGKILL)
    sup.proc.wait(10)
    errors: list[BaseException] = []

    def ask(i: int) -> None:
        try:
            p = SYSTEM + f" During the outage {i}."
            text, info = server.complete(p)
            assert text == serve_reference(p)
            assert info["restored_tokens"] == 0
        except BaseException as e:  # collected and re-raised below
            errors.append(e)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    # restart the supervisor on the same name and socket; the stale socket is taken over
    new = start_supervisor(tmp_path, "--size", "256M", name=sup.name)
    server.sup.proc = new.proc
    try:
        deadline = time.monotonic() + 30
        restored = 0
        i = 0
        while time.monotonic() < deadline and not restored:
            # two system prompts in turn: a worker that served the last request (its
            # own context reuses that prompt) must restore the other one from the arena
            p = ("Preface. " if i % 2 else "") + SYSTEM + f" After the restart {i}."
            text, info = server.complete(p)
            assert text == serve_reference(p)
            restored = info["restored_tokens"]
            i += 1
            time.sleep(0.3)
        assert restored > 500, f"workers never used the restarted supervisor's arena: {info}"
    finally:
        new.stop()


def _children(pid: int) -> dict[int, str]:
    """The child processes of ``pid``: pid -> command line."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            try:
                out[int(child)] = Path(f"/proc/{child}/cmdline").read_bytes().decode()
            except OSError:  # (gone meanwhile)
                pass
    return out


def _supervisor_of(serve: subprocess.Popen, sock: Path, not_pid: int = 0) -> int:
    """The pid of the supervisor ``shmkv serve`` started (other than ``not_pid``), once it
    answers on ``sock``."""

    def answers() -> int:
        assert serve.poll() is None, "shmkv serve exited"
        pids = [p for p, cmd in _children(serve.pid).items() if "\0supervise" in cmd]
        if len(pids) != 1 or pids[0] == not_pid:
            return 0
        try:
            with Client(socket_path=str(sock), attach=False, populate=False) as c:
                return pids[0] if c.stats()["pid"] == pids[0] else 0
        except SupervisorUnavailable:
            return 0

    return wait_until(answers, 60, "the supervisor of shmkv serve", step=0.05)


def test_shmkv_serve_restarts_a_dead_supervisor(tmp_path, serve_model, serve_reference):
    """kill -9 the supervisor `shmkv serve` started: serve starts another, which adopts the
    arena, and requests restore from it again."""
    name, port = f"t{uuid.uuid4().hex[:10]}", free_port()
    sock = tmp_path / f"{name}.sock"
    args = ["serve", "--model", serve_model, "--workers", "1", "--size", "64M", "--name", name]
    args += ["--socket", str(sock), "--port", str(port), "--threads", "1", "--n-ctx", str(N_CTX)]
    with open(tmp_path / "serve.log", "wb") as log_file:
        serve = subprocess.Popen(
            [sys.executable, "-m", "shmkv", *args],
            env=clean_env(),
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}/v1/completions"
    prompts = ["Preface. " + SYSTEM + " Which mat?", SYSTEM + " Which cat?"]
    want: dict[str, str] = {}

    def complete(prompt: str) -> int:
        r = httpx.post(url, json={"prompt": prompt, **SAMPLING, **EXTRA}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want[prompt]
        return int(r.headers["x-shmkv-restored-tokens"])

    try:
        want.update({p: serve_reference(p) for p in prompts})  # (while serve starts)
        first = _supervisor_of(serve, sock)
        wait_until(lambda: _up(url), 120, "the server")
        for p in prompts:  # both published; the worker's own context holds the second
            complete(p)
        os.kill(first, signal.SIGKILL)
        second = _supervisor_of(serve, sock, not_pid=first)
        with Client(socket_path=str(sock), attach=False, populate=False) as c:
            assert c.stats()["adopted"] == 2
        restored = wait_until(
            lambda: max(complete(p) for p in prompts), 60, "a restore from the new arena", 0.2
        )
        assert restored > 500
        assert second in _children(serve.pid)
    finally:
        serve.send_signal(signal.SIGTERM)
        rc = serve.wait(60)
    assert rc == 0, (tmp_path / "serve.log").read_text()[-3000:]
    assert not Path(f"/dev/shm/shmkv-{name}").exists()


def _up(url: str) -> bool:
    try:
        return httpx.get(url.replace("/v1/completions", "/health"), timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def test_more_concurrent_streams_than_workers_all_complete(server, serve_reference):
    """More streams at once than workers: none is cut short (a busy worker accepts no new
    connection, and llama-cpp-python's server, which interrupts a stream when another
    request waits for the model, runs with interrupt_requests=False)."""
    prompts = [SYSTEM + f" Concurrent {i}." for i in range(8)]
    out: dict[str, str] = {}
    errors: list[BaseException] = []

    def stream(p: str) -> None:
        try:
            chunks = server.client.completions.create(
                model="tiny", prompt=p, stream=True, extra_body=EXTRA, **SAMPLING
            )
            out[p] = "".join(c.choices[0].text for c in chunks)
        except BaseException as e:  # collected below
            errors.append(e)

    threads = [threading.Thread(target=stream, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert out == {p: serve_reference(p) for p in prompts}


def test_a_busy_worker_accepts_no_new_connection(tmp_path, serve_model, make_supervisor):
    """While one worker streams a long completion, new connections all go to the idle one
    (workers/worker.py), instead of queueing behind the busy worker."""
    sup = make_supervisor("--size", "128M")
    srv = Server(sup, serve_model, workers=2, tmp_path=tmp_path)
    try:
        stream = srv.client.completions.create(
            model="tiny",
            prompt=SYSTEM + " Long story:",
            stream=True,
            max_tokens=1500,
            temperature=0.0,
            extra_body=EXTRA,
        )
        it = iter(stream)
        busy = next(it).model_extra["shmkv"]["worker_pid"]
        pids = [
            srv.complete(SYSTEM + f" Quick {i}.", max_tokens=2)[1]["worker_pid"] for i in range(6)
        ]
        assert busy not in pids, (busy, pids)
        for _ in it:  # the long stream still completes
            pass
    finally:
        srv.stop()


def test_requests_sent_at_once_to_idle_workers_never_wait_behind_one_another(
    tmp_path, serve_model, make_supervisor
):
    """gunicorn's accept race: a worker that had accepted a connection still accepted
    others until that connection's completion began, so of two requests sent at once to two
    idle workers both could land on one, the second waiting behind the first's prefill while
    the other worker sat idle (11-15 pairs of 30 before). A worker now takes no other connection
    until the request of the one it accepted is in (workers/worker.py). (Both may still land
    on one worker when the other does not get a core before the first is done: the second
    then reached the app after the first's first token, behind nothing.)"""
    sup = make_supervisor("--size", "64M")
    srv = Server(sup, serve_model, workers=2, tmp_path=tmp_path)
    pairs: list[list[dict]] = []
    try:
        with ThreadPoolExecutor(2) as pool:
            for trial in range(20):
                wait_until(lambda: srv.accepting() == srv.worker_pids(), 30, "idle workers")
                at_once = threading.Barrier(2)

                def ask(k: int, trial: int = trial, at_once: threading.Barrier = at_once) -> dict:
                    at_once.wait()  # each prompt new: a cold prefill of ~300 tokens
                    prompt = f"Trial {trial}, client {k}. " + SYSTEM[:900]
                    return srv.complete(prompt, max_tokens=1)[1]

                pairs.append(sorted(pool.map(ask, (0, 1)), key=lambda i: i["received_at"]))
    finally:
        srv.stop()
    one_worker = [(a, b) for a, b in pairs if a["worker_pid"] == b["worker_pid"]]
    behind = [(a, b) for a, b in one_worker if b["received_at"] < a["first_token_at"]]
    assert not behind, (
        f"{len(behind)} of {len(pairs)} pairs: the second waited behind the first's prefill "
        f"({len(one_worker)} on one worker): {behind}"
    )


def test_a_keep_alive_clients_next_completion_is_not_sent_to_a_busy_worker(
    tmp_path, serve_model, make_supervisor
):
    """A completion's connection is closed after it (``Connection: close``), so a client that
    keeps connections alive sends its next completion on a new connection, which the idle
    worker takes, instead of on its old one to the worker now busy with another client."""
    sup = make_supervisor("--size", "128M")
    srv = Server(sup, serve_model, workers=2, tmp_path=tmp_path)
    body = {"model": "tiny", "max_tokens": 2, **EXTRA, "temperature": 0.0}
    try:
        with httpx.Client(base_url=srv.base, timeout=60) as keep:  # pools its connections

            def complete(i: int) -> int:
                r = keep.post("/v1/completions", json={**body, "prompt": SYSTEM + f" Q{i}."})
                assert r.status_code == 200 and r.headers["connection"] == "close", r.headers
                return int(r.headers["x-shmkv-worker-pid"])

            for attempt in range(16):
                first = complete(2 * attempt)
                wait_until(lambda: srv.accepting() == srv.worker_pids(), 30, "idle workers")
                stream = srv.client.completions.create(
                    model="tiny",
                    prompt=SYSTEM + f" Long story {attempt}:",
                    stream=True,
                    max_tokens=1500,
                    temperature=0.0,
                    extra_body=EXTRA,
                )
                with stream:
                    it = iter(stream)
                    if next(it).model_extra["shmkv"]["worker_pid"] != first:
                        continue  # the stream went to the other worker: again
                    assert complete(2 * attempt + 1) != first  # not behind the stream
                    for _ in it:  # the long stream still completes
                        pass
                    break
            else:
                raise AssertionError("no stream of 16 reached the keep-alive client's worker")
            assert httpx.get(srv.base + "/health").headers.get("connection") != "close"
    finally:
        srv.stop()


def test_accepting_falls_back_to_plain_asyncio_on_a_server_without_its_internals(caplog):
    """workers/compat.py: an asyncio server of a version without ``_sockets`` leaves every
    connection to asyncio's own accept loop (with one warning naming the versions known);
    one with them is taken over and counts what it accepts."""
    from shmkv_workers.worker import IdleAcceptor

    async def main() -> None:
        async def hello(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(b"hello")
            await writer.drain()
            writer.close()

        async def ask(port: int) -> bytes:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                return await asyncio.wait_for(reader.read(), 30)
            finally:
                writer.close()

        server = await asyncio.start_server(hello, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]

        class OtherVersion:  # an asyncio server whose listening sockets are elsewhere
            def get_loop(self) -> asyncio.AbstractEventLoop:
                return server.get_loop()

        plain = IdleAcceptor()
        plain.attach([OtherVersion()], read_timeout=30.0)
        assert not plain.active and plain.listening == []
        assert await ask(port) == b"hello"  # asyncio's own accept loop still serves
        assert plain.counters.connections_accepted == 0

        taken = IdleAcceptor()
        taken.attach([server], read_timeout=30.0)
        assert taken.active and taken.listening
        assert await ask(port) == b"hello"
        assert taken.counters.connections_accepted == 1
        taken.stop()
        server.close()
        await server.wait_closed()

    with caplog.at_level(logging.WARNING, logger="shmkv.worker"):
        asyncio.run(main())
    warned = [r.getMessage() for r in caplog.records if "cannot take over" in r.getMessage()]
    assert len(warned) == 1 and "uvicorn 0.54.0" in warned[0], warned


# ------------------------------------------- serve settings (issue 22): one deployment
@pytest.fixture(scope="module")
def tuned(tmp_path_factory, serve_model):
    """One worker with --host 127.0.0.2, --chat-format llama-2, --logits-all and
    --worker-timeout 4 (as SHMKV_* variables, as `shmkv serve` passes them)."""
    tmp = tmp_path_factory.mktemp("tuned")
    sup = start_supervisor(tmp, "--size", "64M")
    env = {
        "SHMKV_HOST": "127.0.0.2",
        "SHMKV_CHAT_FORMAT": "llama-2",
        "SHMKV_LOGITS_ALL": "true",
        "SHMKV_WORKER_TIMEOUT": "4",
    }
    srv = Server(sup, serve_model, workers=1, tmp_path=tmp, env=env)
    yield srv
    srv.stop()
    assert sup.stop() == 0


def test_host_is_the_address_served(tuned):
    """--host 127.0.0.2: the API answers there (the fixture's requests go there) and
    nothing listens on 127.0.0.1."""
    assert tuned.base.startswith("http://127.0.0.2:")
    assert httpx.get(tuned.base + "/health", timeout=10).status_code == 200
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{tuned.port}/health", timeout=10)


def test_chat_format_renders_the_served_chat(tuned, serve_model):
    """--chat-format llama-2: a served chat is rendered as a plain Llama with
    chat_format="llama-2" renders it (same prompt tokens, same greedy text), not with the
    tiny model's own template (ChatML: another number of prompt tokens)."""
    import llama_cpp

    from tests.support.servers import N_CTX

    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Which mat?"}]
    got = tuned.client.chat.completions.create(
        model="tiny", messages=messages, extra_body=EXTRA, **SAMPLING
    )
    kw = dict(model_path=serve_model, n_ctx=N_CTX, n_threads=1, n_threads_batch=1, verbose=False)
    want = llama_cpp.Llama(**kw, chat_format="llama-2").create_chat_completion(
        messages, **SAMPLING, **EXTRA
    )
    default = llama_cpp.Llama(**kw).create_chat_completion(messages, max_tokens=1)
    assert got.usage.prompt_tokens == want["usage"]["prompt_tokens"]
    assert got.usage.prompt_tokens != default["usage"]["prompt_tokens"]
    assert got.choices[0].message.content == want["choices"][0]["message"]["content"]


def test_logits_all_gives_prompt_logprobs(tuned):
    """--logits-all: a completion with echo and logprobs gets a logprob for every prompt
    token (without it llama-cpp-python refuses logprobs)."""
    got = tuned.client.completions.create(
        model="tiny", prompt=SYSTEM[:400], echo=True, logprobs=1, extra_body=EXTRA, **SAMPLING
    )
    lp = got.choices[0].logprobs
    assert len(lp.token_logprobs) >= got.usage.prompt_tokens > 50
    assert all(x is not None for x in lp.token_logprobs[1 : got.usage.prompt_tokens])


def test_worker_timeout_replaces_a_silent_worker(tuned):
    """--worker-timeout 4: a worker stopped (SIGSTOP) is killed and replaced by gunicorn
    (the default, 600 s, would leave it stopped for ten minutes). (Last: it replaces the
    fixture's worker.)"""
    (pid,) = tuned.worker_pids()
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_until(lambda: tuned.worker_pids() - {pid}, 60, "a new worker")
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert "WORKER TIMEOUT" in tuned.log_path.read_text()
    tuned.wait_workers(1)
    text, info = tuned.complete(SYSTEM + " Which cat?")
    assert info["worker_pid"] != pid
