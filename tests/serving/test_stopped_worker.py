"""A worker stopped mid-prefill, through `shmkv serve --workers 2` at its defaults.

The case of issue 33, as an operator's bad day goes: a busy loop on one core, eight short
warm-up requests, a ~2,000-token prompt on one worker, that worker stopped (SIGSTOP) in
its prompt's first batch or in a later one, holding the CPU budget's cores; another
worker's 16-token completion must answer within 3 s and within twice its time with
nothing stopped. It waited out the default --cpu-wait (30 s) whenever the stopped
holder's own estimate of its batch was long (one made from short prompts on a loaded
machine), though a stopped process shows as stopped at once.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from shmkv.llama.cpu import queue as cpuqueue
from tests.support.cli import clean_env
from tests.support.cpu import board
from tests.support.servers import free_port
from tests.support.waiting import wait_until

log = logging.getLogger(__name__)

#: the issue's long prompt, cut to ~2,000 tokens of the tiny model's vocabulary (its 200
#: lines are 6,300 tokens here, past serve's default n_ctx of 4096)
LONG = " ".join(f"line {i} of a very long document about rivers" for i in range(64))
SHORT = "Once upon a time there was a dog"
#: tokens per prompt batch (llama-cpp-python's default n_batch, which serve keeps)
N_BATCH = 512


@pytest.fixture(scope="module")
def deep_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny LLaMA deep and wide enough that each batch of the long prompt takes most of
    a second (the session's serve_model prefills all of it in 0.2 s: nothing to stop)."""
    from tests.support.tinymodel import write_tiny_llama

    path = tmp_path_factory.mktemp("deep-model") / "tiny-deep.gguf"
    write_tiny_llama(path, seed=3, n_embd=256, n_layer=12, n_ctx_train=4096)
    return str(path)


@pytest.fixture
def busy_core() -> Iterator[None]:
    """A busy loop on one core (the first this process may run on), as on a busy host."""
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        os.sched_setaffinity(hog.pid, {min(os.sched_getaffinity(0))})
        yield
    finally:
        hog.kill()
        hog.wait()


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (OSError, ValueError):
        return []


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


class Served:
    """`shmkv serve --workers 2 --model MODEL` on a private name and port, at its defaults
    otherwise (--cpu-wait 30 s, every core in the budget, n_ctx 4096)."""

    def __init__(self, model: str, tmp_path: Path) -> None:
        self.name, port = f"t{uuid.uuid4().hex[:10]}", free_port()
        args = ["serve", "--workers", "2", "--model", model, "--name", self.name]
        args += ["--port", str(port), "--socket", str(tmp_path / f"{self.name}.sock")]
        self.log = tmp_path / "serve.log"
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "shmkv", *args],
                env=clean_env(),
                stdout=f,
                stderr=subprocess.STDOUT,
            )
        self.base = f"http://127.0.0.1:{port}"
        self.workers: set[int] = set()
        wait_until(self._up, 120, "shmkv serve and its two workers", step=0.1)

    def _up(self) -> bool:
        assert self.proc.poll() is None, self.log.read_text()[-3000:]
        masters = [p for p in _children(self.proc.pid) if b"gunicorn" in _cmdline(p)]
        self.workers = {w for m in masters for w in _children(m)}
        if len(self.workers) != 2:
            return False
        try:
            return httpx.get(self.base + "/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def complete(self, prompt: str, max_tokens: int) -> httpx.Response:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
        r = httpx.post(self.base + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r

    def timed_short(self) -> tuple[float, int]:
        """The 16-token completion of the issue: (seconds, the worker that answered)."""
        t0 = time.monotonic()
        r = self.complete(SHORT, 16)
        took = time.monotonic() - t0
        assert r.json()["usage"]["completion_tokens"] == 16, r.json()["usage"]
        return took, int(r.headers["x-shmkv-worker-pid"])

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


@pytest.fixture
def served(deep_model: str, tmp_path: Path, busy_core: None) -> Iterator[Served]:
    srv = Served(deep_model, tmp_path)
    try:
        for i in range(8):  # (the warm-ups)
            srv.complete(f"Warm up {i}: hello", 4)
        yield srv
    finally:
        srv.stop()


def _batch_begun(srv: Served, later: bool) -> tuple[int, int, float]:
    """Once a worker's batch of the long prompt has begun (its first, or with ``later``
    its second): the worker, the tokens it has left and its run's stamp (the board of
    the CPU budget, where each run is recorded as it takes its cores)."""
    first: dict[int, int] = {}

    def begun() -> tuple[int, int, float] | None:
        for _, left, _, state, stamp, _, pid, _ in board(srv.name):
            if state != cpuqueue.RUNNING or left <= 1 or pid not in srv.workers:
                continue
            first.setdefault(pid, left)
            if not later or left < first[pid]:
                return pid, left, stamp
        return None

    return wait_until(begun, 60, "a batch of the long prompt", step=0.002)


def _run(srv: Served, later: bool, stop: bool) -> tuple[float, dict]:
    """The long prompt on one worker; at its batch (stopped there if ``stop``), the
    16-token completion: its seconds and what happened."""
    with ThreadPoolExecutor(1) as pool:
        long: Future[httpx.Response] = pool.submit(
            srv.complete, f"Run {uuid.uuid4().hex}: {LONG}", 1
        )
        pid, left, stamp = _batch_begun(srv, later)
        try:
            if stop:
                os.kill(pid, signal.SIGSTOP)
                wait_until(lambda: _state(pid) == "T", 10, "the worker to stop", step=0.001)
                run = [r for r in board(srv.name) if r[6] == pid and r[3] == cpuqueue.RUNNING]
                assert run and run[0][4] == stamp, "stopped between batches, not in one"
            took, answered = srv.timed_short()
        finally:
            if stop:
                os.kill(pid, signal.SIGCONT)
        prompt_tokens = long.result(120).json()["usage"]["prompt_tokens"]
    assert answered != pid, "the worker that ran the long prompt answered the short one"
    return took, {"left": left, "prompt_tokens": prompt_tokens, "stopped": stop}


@pytest.mark.parametrize("later", [False, True], ids=["first-batch", "later-batch"])
def test_a_worker_stopped_mid_prefill_delays_another_by_little(served, later):
    """Stopped in its first batch (expecting its batch to take what its short warm-ups
    said per token: many seconds) or a later one (what its first batch took), the
    prefilling worker holds every core; the other worker answers at once on a thread of
    its own. Before: 30.3-30.7 s (--cpu-wait) when the estimate was long, 2.5-3.7 s
    beside one busy core when it was short."""
    took, stopped = _run(served, later, stop=True)
    normal, unstopped = _run(served, later, stop=False)
    for info in (stopped, unstopped):  # the batch each landed in
        first = info["left"] > info["prompt_tokens"] - N_BATCH
        assert first != later, info
    log.info("16 tokens: %.2f s stopped, %.2f s with nothing stopped (%s)", took, normal, stopped)
    assert took < 3.0, (took, normal, stopped)
    assert took < 2 * normal, (took, normal, stopped)
