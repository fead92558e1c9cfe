"""Real gunicorn workers, a real supervisor and the official `openai` client, on 127.0.0.1.

The tiny model stands in for a real one; outputs are compared with a plain
``llama_cpp.Llama`` given the same settings and sampling parameters.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import llama_cpp
import openai
import pytest
from conftest import start_supervisor
from tinymodel import write_tiny_llama

log = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parent.parent
SYSTEM = " ".join(f"Policy {i}: the cat {i % 7} guards mat {i % 5}." for i in range(45))
SAMPLING = {"temperature": 0.0, "max_tokens": 12}
EXTRA = {"repeat_penalty": 1.0, "top_k": 1}  # identical sampling on both sides
N_CTX = 2048


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """gunicorn with workers/gunicorn_conf.py, as `shmkv serve` or systemd runs it."""

    def __init__(self, sup, model: str, workers: int, tmp_path: Path) -> None:
        self.sup, self.port = sup, free_port()
        self.env = {**sup.env, "SHMKV_MODEL": model, "SHMKV_WORKERS": str(workers),
                    "SHMKV_PORT": str(self.port), "SHMKV_THREADS": "1",
                    "SHMKV_N_CTX": str(N_CTX), "SHMKV_LOG_LEVEL": "info",
                    "SHMKV_TIMEOUT": "2"}
        self.log_path = tmp_path / "gunicorn.log"
        with open(self.log_path, "wb") as f:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gunicorn", "-c", str(ROOT / "workers/gunicorn_conf.py")],
                env=self.env, stdout=f, stderr=subprocess.STDOUT, cwd=tmp_path)
        self.base = f"http://127.0.0.1:{self.port}"
        self.wait_workers(workers)
        # a new connection per request, so that requests spread over the workers
        self.client = openai.OpenAI(
            base_url=self.base + "/v1", api_key="unused", max_retries=0, timeout=60,
            http_client=httpx.Client(limits=httpx.Limits(max_keepalive_connections=0)))

    def worker_pids(self) -> set[int]:
        path = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        try:
            return {int(p) for p in path.read_text().split()}
        except (FileNotFoundError, ValueError):
            return set()

    def wait_workers(self, n: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        seen: set[int] = set()
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log_path.read_text()[-3000:]
            pids = self.worker_pids()
            if len(pids) == n:  # every worker answers /health (a worker that is still
                try:            # loading its model would skew which worker gets what)
                    r = httpx.get(self.base + "/health", timeout=5)
                    if r.status_code == 200:
                        seen.add(r.json()["worker_pid"])
                        if pids <= seen:
                            return
                except httpx.HTTPError:
                    pass
                time.sleep(0.02)
                continue
            time.sleep(0.2)
        raise TimeoutError(self.log_path.read_text()[-3000:])

    def complete(self, prompt: str, **kw) -> tuple[str, dict]:
        raw = self.client.completions.with_raw_response.create(
            model="tiny", prompt=prompt, extra_body=EXTRA, **{**SAMPLING, **kw})
        body = raw.parse()
        h = {k[len("x-shmkv-"):].replace("-", "_"): v for k, v in raw.headers.items()
             if k.startswith("x-shmkv-")}
        info = {k: (v == "true" if k == "hit" else float(v) if k == "restore_ms" else int(v))
                for k, v in h.items()}
        return body.choices[0].text, info

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(40)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("serve-model") / "tiny.gguf"
    write_tiny_llama(path, seed=3)
    return str(path)


@pytest.fixture(scope="module")
def reference(tiny_model):
    """Cold greedy output from a fresh plain Llama with the workers' settings."""
    kw = dict(model_path=tiny_model, n_ctx=N_CTX, n_threads=1, n_threads_batch=1,
              verbose=False)

    def run(prompt: str | None = None, messages: list | None = None, **over) -> str:
        llm = llama_cpp.Llama(**kw)
        params = {**SAMPLING, **EXTRA, **over}
        if messages is not None:
            return llm.create_chat_completion(messages, **params)["choices"][0]["message"][
                "content"]
        return llm.create_completion(prompt, **params)["choices"][0]["text"]

    return run


@pytest.fixture
def server(tmp_path, tiny_model, make_supervisor):
    sup = make_supervisor("--size", "256M")
    srv = Server(sup, tiny_model, workers=3, tmp_path=tmp_path)
    yield srv
    srv.stop()


def test_openai_client_cold_then_hits_on_other_workers(server, reference):
    prompts = [SYSTEM + f" Question {i}: which mat?" for i in range(12)]
    text, first = server.complete(prompts[0])
    assert text == reference(prompts[0])
    assert first["restored_tokens"] == 0 and first["evaluated_tokens"] > 500
    restored_by: dict[int, int] = {}
    results: dict[str, tuple[str, dict]] = {}

    def ask(batch: list[str]) -> None:
        for p in batch:
            results[p] = server.complete(p)

    # two clients at a time, so that requests land on several workers
    threads = [threading.Thread(target=ask, args=(prompts[1 + k::2],)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == len(prompts) - 1
    for p, (text, info) in results.items():
        assert text == reference(p), p
        if info["restored_tokens"]:
            restored_by[info["worker_pid"]] = info["restored_tokens"]
    others = {pid for pid in restored_by if pid != first["worker_pid"]}
    assert others, f"no other worker restored from the arena: {restored_by}"
    assert all(n >= 500 for n in restored_by.values())
    st = server.sup.stats_json()
    assert st["tokens_restored"] >= sum(restored_by.values())
    assert st["workers_attached"] >= 3
    log.info("restored by worker: %s; supervisor stats: hits=%d tokens_restored=%d",
             restored_by, st["hits"], st["tokens_restored"])


def test_streaming_and_chat(server, reference):
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Which cat guards mat 3?"}]
    want = reference(messages=messages)
    got = server.client.chat.completions.create(model="tiny", messages=messages,
                                                extra_body=EXTRA, **SAMPLING)
    assert got.choices[0].message.content == want
    for _ in range(3):  # stream the same prompt, which some worker now restores
        chunks = list(server.client.chat.completions.create(
            model="tiny", messages=messages, stream=True, extra_body=EXTRA, **SAMPLING))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == want
        info = chunks[0].model_extra["shmkv"]
        assert info["prompt_tokens"] > 500
    prompt = SYSTEM + " Stream me."
    chunks = list(server.client.completions.create(model="tiny", prompt=prompt, stream=True,
                                                   extra_body=EXTRA, **SAMPLING))
    assert "".join(c.choices[0].text for c in chunks) == reference(prompt)
    models = server.client.models.list()
    assert len(models.data) == 1


def test_kill9_worker_mid_request(server, reference):
    prompt = SYSTEM + " A long story:"
    server.complete(prompt)  # warm the arena
    stream = server.client.completions.create(model="tiny", prompt=prompt, stream=True,
                                              max_tokens=1500, temperature=0.0,
                                              extra_body=EXTRA)
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
        assert text == reference(p)
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


def test_kill9_supervisor_workers_answer_cold_then_reattach(server, reference, tmp_path):
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
            assert text == reference(p)
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
            assert text == reference(p)
            restored = info["restored_tokens"]
            i += 1
            time.sleep(0.3)
        assert restored > 500, f"workers never used the restarted supervisor's arena: {info}"
    finally:
        new.stop()


def test_concurrent_streams_on_one_worker_all_complete(server, reference):
    """More streams than workers: none is cut short (llama-cpp-python's server interrupts
    a stream when another request waits for the model unless interrupt_requests=False)."""
    prompts = [SYSTEM + f" Concurrent {i}." for i in range(8)]
    out: dict[str, str] = {}
    errors: list[BaseException] = []

    def stream(p: str) -> None:
        try:
            chunks = server.client.completions.create(model="tiny", prompt=p, stream=True,
                                                      extra_body=EXTRA, **SAMPLING)
            out[p] = "".join(c.choices[0].text for c in chunks)
        except BaseException as e:  # collected below
            errors.append(e)

    threads = [threading.Thread(target=stream, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert out == {p: reference(p) for p in prompts}


def test_a_busy_worker_accepts_no_new_connection(tmp_path, tiny_model, make_supervisor):
    """While one worker streams a long completion, new connections all go to the idle one
    (workers/worker.py), instead of queueing behind the busy worker."""
    sup = make_supervisor("--size", "128M")
    srv = Server(sup, tiny_model, workers=2, tmp_path=tmp_path)
    try:
        stream = srv.client.completions.create(model="tiny", prompt=SYSTEM + " Long story:",
                                               stream=True, max_tokens=1500,
                                               temperature=0.0, extra_body=EXTRA)
        it = iter(stream)
        busy = next(it).model_extra["shmkv"]["worker_pid"]
        pids = [srv.complete(SYSTEM + f" Quick {i}.", max_tokens=2)[1]["worker_pid"]
                for i in range(6)]
        assert busy not in pids, (busy, pids)
        for _ in it:  # the long stream still completes
            pass
    finally:
        srv.stop()
