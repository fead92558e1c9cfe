"""gunicorn with ``workers/gunicorn_conf.py``, as ``shmkv serve`` or systemd runs it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tests.support import ROOT
from tests.support.supervisors import Sup

SAMPLING = {"temperature": 0.0, "max_tokens": 12}
EXTRA = {"repeat_penalty": 1.0, "top_k": 1}  # identical sampling on both sides
N_CTX = 2048


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """gunicorn with workers/gunicorn_conf.py, as `shmkv serve` or systemd runs it.

    (httpx and openai are imported here, not at the top: the child processes of the
    crash tests import this module too, and openai alone takes a third of a second.)
    """

    def __init__(
        self,
        sup: Sup,
        model: str,
        workers: int,
        tmp_path: Path,
        env: dict[str, str] | None = None,
    ) -> None:
        import httpx
        import openai

        self.sup, self.port = sup, free_port()
        self.env = {
            **sup.env,
            "SHMKV_MODEL": model,
            "SHMKV_WORKERS": str(workers),
            "SHMKV_PORT": str(self.port),
            "SHMKV_THREADS": "1",
            "SHMKV_N_CTX": str(N_CTX),
            "SHMKV_LOG_LEVEL": "info",
            "SHMKV_TIMEOUT": "2",
            **(env or {}),
        }
        self.log_path = tmp_path / "gunicorn.log"
        with open(self.log_path, "wb") as f:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gunicorn", "-c", str(ROOT / "workers/gunicorn_conf.py")],
                env=self.env,
                stdout=f,
                stderr=subprocess.STDOUT,
                cwd=tmp_path,
            )
        self.base = f"http://{self.env.get('SHMKV_HOST', '127.0.0.1')}:{self.port}"
        #: what /health and /metrics need with --api-key (its first key)
        key = self.env.get("SHMKV_API_KEY", "").split(",")[0]
        self.auth = {"Authorization": f"Bearer {key}"} if key else {}
        self.wait_workers(workers)
        # a new connection per request, so that requests spread over the workers
        self.client = openai.OpenAI(
            base_url=self.base + "/v1",
            api_key="unused",
            max_retries=0,
            timeout=60,
            http_client=httpx.Client(limits=httpx.Limits(max_keepalive_connections=0)),
        )

    def worker_pids(self) -> set[int]:
        path = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        try:
            return {int(p) for p in path.read_text().split()}
        except (FileNotFoundError, ValueError):
            return set()

    def accepting(self) -> set[int]:
        """The workers whose event loop watches the listening socket now, i.e. that would take
        a new connection (their epoll set, from ``/proc/PID/fdinfo``, holds its inode)."""
        port = f"{self.port:04X}"
        inodes = set()
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            path = Path(table)
            rows = path.read_text().splitlines()[1:] if path.exists() else []
            for row in rows:
                cols = row.split()  # local address, ..., state (0A: LISTEN), ..., inode
                if cols[1].endswith(f":{port}") and cols[3] == "0A":
                    inodes.add(f"ino:{int(cols[9]):x}")
        out = set()
        for pid in self.worker_pids():
            try:
                for fd in os.listdir(f"/proc/{pid}/fd"):
                    if os.readlink(f"/proc/{pid}/fd/{fd}") != "anon_inode:[eventpoll]":
                        continue
                    with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                        watched = {w for w in f.read().split() if w.startswith("ino:")}
                    if watched & inodes:
                        out.add(pid)
            except FileNotFoundError:  # the worker or the descriptor went away
                continue
        return out

    def wait_workers(self, n: int, timeout: float = 60) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        seen: set[int] = set()
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log_path.read_text()[-3000:]
            pids = self.worker_pids()
            if len(pids) == n:  # every worker answers /health (a worker that is still
                try:  # loading its model would skew which worker gets what)
                    r = httpx.get(self.base + "/health", headers=self.auth, timeout=5)
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

    def complete(self, prompt: str, **kw: Any) -> tuple[str, dict]:
        """A completion and what the cache did for it (the ``x-shmkv-*`` headers)."""
        raw = self.client.completions.with_raw_response.create(
            model="tiny", prompt=prompt, extra_body=EXTRA, **{**SAMPLING, **kw}
        )
        body = raw.parse()
        h = {
            k[len("x-shmkv-") :].replace("-", "_"): v
            for k, v in raw.headers.items()
            if k.startswith("x-shmkv-")
        }
        info = {
            k: (v == "true" if k == "hit" else float(v) if k.endswith(("_ms", "_at")) else int(v))
            for k, v in h.items()
        }
        return body.choices[0].text, info

    def complete_two_at_a_time(self, prompts: list[str]) -> dict[str, tuple[str, dict]]:
        """Completions from two clients at once, each taking every other prompt in order, so
        that requests land on more than one worker: {prompt: (text, info)}."""
        with ThreadPoolExecutor(2) as pool:
            done = pool.map(
                lambda half: [(p, self.complete(p)) for p in half], [prompts[0::2], prompts[1::2]]
            )
            return {p: got for half in done for p, got in half}

    def until_other_worker(
        self, prompt: Callable[[int], str], first_pid: int, most: int = 16
    ) -> tuple[list[tuple[str, str, dict]], dict]:
        """Completions two at a time until one is answered by a worker other than
        ``first_pid`` (a busy worker leaves the second of a pair to the other one; sequential
        requests may all land on one idle worker): every (prompt, text, info) in order, and
        the first other worker's info. ``prompt(i)`` is the i-th prompt."""
        out: list[tuple[str, str, dict]] = []
        with ThreadPoolExecutor(2) as pool:
            while len(out) < most:
                asked = [prompt(len(out) + k) for k in (0, 1)]
                for p, (text, info) in zip(asked, pool.map(self.complete, asked), strict=True):
                    out.append((p, text, info))
                other = [i for _, _, i in out if i["worker_pid"] != first_pid]
                if other:
                    return out, other[0]
        raise AssertionError(f"no request of {most} reached a second worker")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(40)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def scrape(url: str, kinds: bool = False) -> dict[str, Any]:
    """Every sample of a Prometheus scrape of ``url``, parsed with prometheus_client's own
    parser: ``name{label="v",...}`` -> value, or -> (family type, value) with ``kinds``."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(url, timeout=10)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    out: dict[str, Any] = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}"] = (fam.type, s.value) if kinds else s.value
    return out
