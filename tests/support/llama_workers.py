"""llama worker processes (``llama_worker.py``) that run jobs through shmkv or cold."""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
from typing import Any

import numpy as np

from tests.support import HERE, ROOT
from tests.support.supervisors import Sup
from tests.support.users import python_for, spawn_kw
from tests.support.waiting import no_signal_deaths

KW = {"n_ctx": 2048, "n_threads": 1, "n_threads_batch": 1, "seed": 0}
SYSTEM = " ".join(f"Rule {i}: the cat {i % 7} sits on mat {i % 5}." for i in range(50))


def completion(prompt: str, stream: bool = False, max_tokens: int = 16) -> dict:
    """A completion job for tests/support/llama_worker.py."""
    return {"kind": "completion", "prompt": prompt, "stream": stream, "max_tokens": max_tokens}


def texts(result: dict) -> list[str]:
    """The texts of a llama worker's results, in job order."""
    return [r["text"] for r in result["results"]]


def start_worker(
    sup: Any,
    model: str,
    jobs: list[dict],
    mode: str = "shmkv",
    namespace: str = "",
    kw: dict | None = None,
    env: dict | None = None,
    user: pwd.struct_passwd | None = None,
) -> subprocess.Popen:
    """A tests/support/llama_worker.py process (``sup`` None: no supervisor; ``user``: run as that
    user); it loads its modules while it waits for the jobs that finish_worker() sends it."""
    spec = {
        "model": model,
        "kw": {**KW, **(kw or {})},
        "name": sup.name if sup else "none",
        "socket": sup.socket if sup else "/nonexistent/shmkv.sock",
        "namespace": namespace,
        "mode": mode,
        "jobs": jobs,
    }
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    proc = subprocess.Popen(
        [python_for(user), str(HERE / "llama_worker.py")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **spawn_kw(user, env),
    )
    proc.spec = json.dumps(spec)  # type: ignore[attr-defined]
    return proc


def finish_worker(proc: subprocess.Popen, timeout: float = 240) -> dict:
    """Send a start_worker() process its jobs; its JSON result, with its ``stderr`` added."""
    try:
        out, err = proc.communicate(proc.spec, timeout=timeout)  # type: ignore[attr-defined]
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    no_signal_deaths(proc)
    assert proc.returncode == 0, err[-3000:]
    result = json.loads(out)
    result["stderr"] = err
    return result


def run_worker(
    sup: Any,
    model: str,
    jobs: list[dict],
    mode: str = "shmkv",
    namespace: str = "",
    kw: dict | None = None,
    env: dict | None = None,
    timeout: float = 120,
    user: pwd.struct_passwd | None = None,
) -> dict:
    """Run ``jobs`` in a fresh llama worker process: ``mode`` "shmkv" (SharedCacheLlama),
    "attach" (a plain Llama with ``attach``) or "cold" (a fresh plain Llama per job, the
    reference); returns its results, totals and stderr."""
    return finish_worker(start_worker(sup, model, jobs, mode, namespace, kw, env, user), timeout)


# A worker that attaches (and runs its "before" jobs), says so, waits for a line on stdin,
# then runs its jobs: lets a test break the arena between the attach and the first
# restore, or hold the connections of a worker that has published.
BARRIER_WORKER = r"""
import dataclasses, json, logging, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
from tests.support.llama_worker import run_job
from shmkv.llama import SharedCacheLlama
spec = json.loads(sys.argv[1])
llm = SharedCacheLlama(model_path=spec["model"], verbose=False, **spec["kw"],
                       shmkv_name=spec["name"], shmkv_socket=spec["socket"])
for job in spec["before"]:
    run_job(llm, job)
llm.shmkv.flush()
print("attached" if llm.shmkv.reader.connected else "cold", flush=True)
sys.stdin.readline()
results = []
for job in spec["jobs"]:
    text = run_job(llm, job)
    results.append({"text": text, "last": dataclasses.asdict(llm.shmkv.last)})
llm.shmkv.close()
print(json.dumps({"results": results, "totals": dataclasses.asdict(llm.shmkv.totals)}),
      flush=True)
"""


class BarrierWorker:
    """A llama worker that attaches, then waits for go() before it runs its jobs."""

    def __init__(
        self, sup: Sup, model: str, jobs: list[dict], before: list[dict] | None = None
    ) -> None:
        spec = {
            "model": model,
            "kw": KW,
            "name": sup.name,
            "socket": sup.socket,
            "jobs": jobs,
            "before": before or [],
        }
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", BARRIER_WORKER, json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert self.proc.stdout is not None and self.proc.stdin is not None
        self.state = self.proc.stdout.readline().strip()

    def go(self, timeout: float = 120) -> dict:
        out, err = self.proc.communicate("go\n", timeout=timeout)
        no_signal_deaths(self.proc)
        assert self.proc.returncode == 0, err
        self.stderr = err
        return json.loads(out)


def last_logits(llm: Any) -> np.ndarray:
    """A copy of the logits of the last token ``llm`` (a llama_cpp.Llama) evaluated."""
    from llama_cpp import llama_cpp as C

    ptr = C.llama_get_logits_ith(llm.ctx, -1)
    return np.array(np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)), copy=True)
