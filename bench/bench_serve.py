"""Serving benchmark: 4 gunicorn workers, shared system prompts, streaming TTFT, per arm.

One run, on 127.0.0.1 only, Gemma 3 270M Q4_K_M, the same gunicorn setup for
every arm (4 ``uvicorn_worker.UvicornWorker`` workers, n_ctx 4096, the same
llama.cpp threads per worker):

* ``nocache``: llama-cpp-python's own ``llama_cpp.server.app:create_app()``;
* ``ramcache``: the same with its per-worker ``LlamaRAMCache`` (``CACHE=true``);
  total RSS of the server is watched and the arm is stopped cleanly above
  ``--max-rss`` (llama-cpp-python does not count the ``scores`` copy of an
  entry against ``CACHE_SIZE``, see NOTES.md);
* ``shmkv``: ``shmkv supervise`` plus gunicorn with ``workers/gunicorn_conf.py``;
* ``shmkv-exact`` (not run by default): ``shmkv`` with ``--exact`` (restores only
  at n_batch boundaries, so every hit gives a cold run's tokens bit for bit);
* ``shmkv-logits-all`` (diagnostic, not run by default): the same with logits
  kept for every prompt token (``SHMKV_LOGITS_ALL=true``; ``LOGITS_ALL=true``
  for versions of workers/ that inherit llama-cpp-python's server default,
  which is true).

Workload: ``--prompts`` system prompts of ~``--prompt-tokens`` Gemma tokens of
deterministic, varied text; every request is one of them plus a short,
distinct user question in Gemma's turn format, sent to ``/v1/completions``
with ``stream=true`` on a new connection. The request sequence is the same for
every arm and concurrency (a cacheless arm may run only its first
``--cacheless-requests``). Every (arm, concurrency) cell starts fresh servers
(an empty cache), warms each worker up on unrelated short prompts, then runs the
sequence closed-loop with ``concurrency`` clients. Measured per request: time
to the first chunk with text (TTFT), total time, which worker served it (the
``shmkv`` field of a stream's first chunk, or the server side of the TCP
connection), and what the cache did. Memory: RSS/PSS of every server process;
for shmkv the arena's PSS counted once (sum over processes of the PSS of the
``/dev/shm/shmkv-NAME`` mapping), for LlamaRAMCache the workers' growth.

Before every cell it waits until the 1-minute load is below ``--max-load``
(other people use this machine) and records the load and the CPU other
processes used during the cell. Every server is stopped at the end (also on
Ctrl-C/SIGTERM or an error) and nothing of ours is left in /dev/shm.

    python bench/bench_serve.py                           # full run (~30-40 min)
    python bench/bench_serve.py --quick                   # smoke run (~3 min)
    python bench/bench_serve.py --write-baseline          # also refresh bench/baseline/
    python bench/bench_serve.py --arms shmkv --concurrency 4 --requests 30
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime as dt
import json
import logging
import math
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import click
import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

log = logging.getLogger("bench_serve")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
GUNICORN_CONF = ROOT / "workers" / "gunicorn_conf.py"
GOAL_MEAN_TTFT = 0.6  # seconds, shmkv at concurrency 4 (issue 4)
GOAL_CONCURRENCY = 4
SEED = 11
HOST = "127.0.0.1"

ARMS: dict[str, str] = {
    "nocache": "llama_cpp.server, no cache",
    "ramcache": "llama_cpp.server + LlamaRAMCache",
    "shmkv": "shmkv (supervisor + workers/)",
    "shmkv-logits-all": "shmkv, logits_all=True (diagnostic)",
    "shmkv-exact": "shmkv --exact (hits bit for bit a cold run's)",
}
DEFAULT_ARMS = "nocache,ramcache,shmkv"

THREADS_WHY = (
    "1 llama.cpp thread per worker (n_threads = n_threads_batch = 1): 4 workers on 2 cores "
    "already give 4 runnable threads when all are busy. With 2 threads each, 8 threads share "
    "2 cores and ggml's per-op thread barriers make every worker wait for a descheduled "
    "sibling; 1 thread has no barrier at all. llama_cpp.server's own defaults (n_threads "
    "= cores//2 = 1, n_threads_batch = cores = 2) are overridden so all arms run alike.")

# deterministic, varied system prompts: a theme, an opening, and a line generator
WORDS = """apple river stone garden window silver market pencil orange rabbit candle
forest bridge yellow copper island winter summer ladder pocket helmet violin dragon
harbor meadow castle feather saddle anchor basket cotton desert engine falcon glacier
hammer jungle kettle lantern marble needle oyster pepper quartz rocket shadow tiger
velvet walnut zebra blanket canyon dolphin emerald fossil guitar horizon iceberg jacket
kitten lemon mirror nectar orchard parrot quiver ribbon saffron thunder umbrella valley
whistle yogurt badger cactus dagger ember goblet hazel ivory jigsaw kayak lilac
magnet nutmeg otter pebble quill raven sparrow tulip urchin vessel wagon yarn zephyr
bamboo cobalt drizzle eagle fabric granite hollow indigo juniper kernel lobster mango""".split()

THEMES: list[tuple[str, str]] = [
    ("You are the archivist of a large museum. Follow these catalogue rules when answering "
     "visitors, and answer briefly.\n\n",
     "Rule {n}: the {0} room holds {1} and {2} items; visitors who ask about the {3} go to "
     "the {4} desk, never to the {5} hall.\n"),
    ("You are the dispatcher of the cargo vessel Northern Star. The shipping log below is "
     "your only source; quote it exactly.\n\n",
     "Day {n}. Loaded {0} crates of {1} and a barrel of {2}; the wind came from the {3}, "
     "and the {4} was stored below the {5}.\n"),
    ("You are the concierge of the Grand Hotel. Guests ask about their rooms; use the "
     "register below and be polite.\n\n",
     "Room {n} is painted {0}, faces the {1}, and its guest ordered {2} tea with {3} at "
     "dawn; the key hangs beside the {4} and the {5}.\n"),
    ("You are a railway timetable assistant. Answer only from the timetable below, giving "
     "platform and time.\n\n",
     "Train {n} leaves {0} station at platform {m} for {1}, stops at {2} and {3}, carries "
     "a {4} car and terminates near the {5} bridge.\n"),
    ("You are the librarian of an old abbey. Readers ask where books are; the shelf list "
     "below is complete.\n\n",
     "Shelf {n}: the book on {0} sits between the {1} atlas and the {2} herbal; it was "
     "bound in {3} leather by a {4} monk who loved the {5}.\n"),
    ("You are the head gardener's assistant. The planting plan below says what grows "
     "where; answer gardeners' questions from it.\n\n",
     "Bed {n} grows {0} beside {1}; water it after the {2} bell, keep the {3} away, and "
     "mulch it with {4} bark from the {5} grove.\n"),
]
QUESTION = "Question {i}: what does the plan say about the {0} and the {1}?"
WARMUP_PROMPT = "<start_of_turn>user\nWarm-up {i}: name a colour.<end_of_turn>\n" \
                "<start_of_turn>model\n"


# ================================================================== workload

@dataclass
class Workload:
    system: list[str]
    system_tokens: list[int]
    requests: list[tuple[int, str]]  # (system prompt index, user question)

    def prompt(self, k: int) -> str:
        p, question = self.requests[k]
        return (f"<start_of_turn>user\n{self.system[p]}\n{question}<end_of_turn>\n"
                "<start_of_turn>model\n")


def make_workload(model: Path, n_prompts: int, prompt_tokens: int, n_requests: int
                  ) -> Workload:
    """``n_prompts`` system prompts of ~``prompt_tokens`` tokens, ``n_requests`` requests.

    Each prompt is used equally often (as far as divisible); the order is shuffled
    with a fixed seed, so early requests may share a prompt (concurrent cold prefills
    of one prompt are part of the workload, as in real traffic).
    """
    import llama_cpp

    tok = llama_cpp.Llama(model_path=str(model), vocab_only=True, verbose=False)

    def count(text: str) -> int:
        return len(tok.tokenize(text.encode(), add_bos=False, special=True))

    rng = random.Random(SEED)
    system: list[str] = []
    sizes: list[int] = []
    for p in range(n_prompts):
        head, line = THEMES[p % len(THEMES)]
        if p >= len(THEMES):
            head = f"(Edition {p // len(THEMES) + 1}) " + head
        parts = [head]
        n = 1
        while True:
            w = rng.sample(WORDS, 6)
            text = line.format(*w, n=n, m=rng.randint(1, 12))
            if count("".join(parts) + text) > prompt_tokens:
                break
            parts.append(text)
            n += 1
        system.append("".join(parts))
        sizes.append(count(system[-1]))
    order = [k % n_prompts for k in range(n_requests)]
    rng.shuffle(order)
    requests = [(p, QUESTION.format(*rng.sample(WORDS, 2), i=i)) for i, p in enumerate(order)]
    return Workload(system, sizes, requests)


# ================================================================= processes

def _child_setup() -> None:
    """In each server child: its own session (we stop the whole group), SIGTERM if we die."""
    os.setsid()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Group:
    """A child process started in its own session; stopping it signals the whole group."""

    live: list[Group] = []

    def __init__(self, name: str, args: list[str], env: dict[str, str], log_path: Path,
                 cwd: Path | None = None) -> None:
        self.name, self.log_path = name, log_path
        with open(log_path, "wb") as f:
            self.proc = subprocess.Popen(args, env=env, stdout=f, stderr=subprocess.STDOUT,
                                         cwd=cwd, preexec_fn=_child_setup)
        Group.live.append(self)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self, timeout: float = 40.0, kill: bool = False) -> int | None:
        """SIGTERM (or SIGKILL) the group; SIGKILL whatever is left after ``timeout``."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL if kill else signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0f s: killing its group", self.name, timeout)
        with contextlib.suppress(ProcessLookupError):  # workers outliving their master
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        if self in Group.live:
            Group.live.remove(self)
        return self.proc.returncode

    @classmethod
    def stop_all(cls) -> None:
        for g in list(reversed(cls.live)):  # gunicorn before its supervisor
            try:
                g.stop(timeout=20)
            except Exception:  # cleaning up: keep stopping the others
                log.exception("stopping %s failed", g.name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


CODE_DIR: Path | None = None  # set by main(): the snapshot every server runs from


def clean_env(extra: dict[str, str]) -> dict[str, str]:
    """Our environment minus anything llama_cpp.server's pydantic settings or shmkv would read."""
    from llama_cpp.server.settings import ModelSettings, ServerSettings

    fields = {f.upper() for f in (*ModelSettings.model_fields, *ServerSettings.model_fields)}
    fields.add("CONFIG_FILE")
    env = {k: v for k, v in os.environ.items()
           if k.upper() not in fields and not k.startswith("SHMKV_")}
    env["PYTHONUNBUFFERED"] = "1"
    if CODE_DIR is not None:  # the snapshot of shmkv/ and workers/ this run measures
        env["PYTHONPATH"] = os.pathsep.join(
            [str(CODE_DIR), *filter(None, [os.environ.get("PYTHONPATH")])])
    env.update(extra)
    return env


@dataclass
class Supervisor:
    name: str
    socket: str
    group: Group

    @property
    def arena(self) -> Path:
        return Path("/dev/shm") / f"shmkv-{self.name}"

    @property
    def env(self) -> dict[str, str]:
        return clean_env({"SHMKV_NAME": self.name, "SHMKV_SOCKET": self.socket})

    def stats(self) -> dict[str, Any]:
        out = subprocess.run([sys.executable, "-m", "shmkv.cli", "stats", "--json"],
                             env=self.env, cwd=Path(self.socket).parent, capture_output=True,
                             text=True, timeout=30)
        if out.returncode != 0:
            raise RuntimeError(f"shmkv stats failed: {out.stderr[-1000:]}")
        return json.loads(out.stdout)


SUPERVISOR_NAMES: list[str] = []  # every arena name we created, for the final sweep


def sweep_shm() -> list[Path]:
    """Remove whatever our supervisors left in /dev/shm (only if one had to be killed)."""
    gone = []
    for name in SUPERVISOR_NAMES:
        for p in Path("/dev/shm").glob(f"shmkv-{name}*"):
            p.unlink(missing_ok=True)
            gone.append(p)
    return gone


@contextlib.contextmanager
def supervisor(workdir: Path, size: str) -> Iterator[Supervisor]:
    name = f"bserve{uuid.uuid4().hex[:8]}"
    SUPERVISOR_NAMES.append(name)
    sock = str(workdir / f"{name}.sock")
    g = Group("supervisor", [sys.executable, "-m", "shmkv.cli", "supervise", "--name", name,
                             "--socket", sock, "--size", size, "--log-level", "warning"],
              clean_env({}), workdir / f"{name}.log", cwd=workdir)
    sup = Supervisor(name, sock, g)
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(sock):
            if g.proc.poll() is not None:
                raise click.ClickException(f"supervisor exited: {g.log_tail()}")
            if time.monotonic() > deadline:
                raise click.ClickException("supervisor socket did not appear in 60 s")
            time.sleep(0.05)
        yield sup
    finally:
        rc = g.stop(timeout=30)
        leftovers = list(Path("/dev/shm").glob(f"shmkv-{name}*"))
        if leftovers:
            log.warning("supervisor (exit %s) left %s: removing", rc, leftovers)
            for p in leftovers:
                p.unlink(missing_ok=True)


@dataclass
class ServerSpec:
    arm: str
    model: str
    workers: int
    threads: int
    n_ctx: int
    ramcache_bytes: int
    logits_all: bool | None  # None: the server's default


class Server:
    """gunicorn with 4 uvicorn workers running the arm's app."""

    def __init__(self, spec: ServerSpec, workdir: Path, sup: Supervisor | None) -> None:
        self.spec, self.port = spec, free_port()
        self.base = f"http://{HOST}:{self.port}"
        extra: dict[str, str] = {}
        if spec.logits_all is not None:  # shmkv's setting, and llama_cpp.server's variable
            extra["SHMKV_LOGITS_ALL"] = extra["LOGITS_ALL"] = str(spec.logits_all).lower()
        if spec.arm == "shmkv-exact":
            extra["SHMKV_EXACT"] = "true"
        gunicorn = [sys.executable, "-m", "gunicorn"]
        if spec.arm.startswith("shmkv"):
            assert sup is not None
            env = clean_env({
                **extra, "SHMKV_NAME": sup.name, "SHMKV_SOCKET": sup.socket,
                "SHMKV_MODEL": spec.model, "SHMKV_WORKERS": str(spec.workers),
                "SHMKV_HOST": HOST, "SHMKV_PORT": str(self.port),
                "SHMKV_THREADS": str(spec.threads), "SHMKV_N_CTX": str(spec.n_ctx),
                "SHMKV_LOG_LEVEL": "info", "SHMKV_WORKER_TIMEOUT": "900"})
            conf = CODE_DIR / "shmkv_workers" / "gunicorn_conf.py" if CODE_DIR else GUNICORN_CONF
            args = [*gunicorn, "-c", str(conf)]
        else:
            env = clean_env({
                **extra, "MODEL": spec.model, "N_CTX": str(spec.n_ctx),
                "N_THREADS": str(spec.threads), "N_THREADS_BATCH": str(spec.threads),
                "VERBOSE": "false"})
            if spec.arm == "ramcache":
                env.update(CACHE="true", CACHE_TYPE="ram", CACHE_SIZE=str(spec.ramcache_bytes))
            # the same gunicorn settings as workers/gunicorn_conf.py
            args = [*gunicorn, "-w", str(spec.workers), "-k", "uvicorn_worker.UvicornWorker",
                    "-b", f"{HOST}:{self.port}", "--timeout", "900", "--graceful-timeout", "30",
                    "--keep-alive", "5", "--log-level", "info",
                    "llama_cpp.server.app:create_app()"]
        self.group = Group(f"gunicorn[{spec.arm}]", args, env,
                           workdir / f"gunicorn-{spec.arm}-{self.port}.log", cwd=workdir)

    @property
    def master_pid(self) -> int:
        return self.group.pid

    def worker_pids(self) -> list[int]:
        try:
            return sorted(c.pid for c in psutil.Process(self.master_pid).children())
        except psutil.Error:
            return []

    def wait_ready(self, timeout: float = 180.0) -> None:
        """All workers booted (each logs 'Application startup complete') and answering."""
        deadline = time.monotonic() + timeout
        n = self.spec.workers
        while time.monotonic() < deadline:
            if self.group.proc.poll() is not None:
                raise click.ClickException(f"gunicorn exited:\n{self.group.log_tail()}")
            started = self.group.log_tail(1 << 20).count("Application startup complete")
            if started >= n and len(self.worker_pids()) == n:
                try:
                    if httpx.get(self.base + "/v1/models", timeout=10).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
            time.sleep(0.25)
        raise click.ClickException(f"{n} workers not ready in {timeout:.0f} s:\n"
                                   f"{self.group.log_tail()}")

    def stop(self, kill: bool = False) -> None:
        self.group.stop(timeout=40, kill=kill)


# ==================================================================== memory

_MAPPING_HEADER = re.compile(r"^[0-9a-f]+-[0-9a-f]+ ")


def _smaps_pss(pid: int, path_prefix: str) -> tuple[int, int]:
    """(PSS of the whole process, PSS of the mappings whose path starts with path_prefix)."""
    total = part = 0
    inside = False
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                if _MAPPING_HEADER.match(line):
                    fields = line.split(maxsplit=5)
                    inside = len(fields) == 6 and fields[5].strip().startswith(path_prefix)
                elif line.startswith("Pss:"):
                    kb = int(line.split()[1]) * 1024
                    total += kb
                    if inside:
                        part += kb
    except (OSError, ValueError):
        pass
    return total, part


def mem_snapshot(pids: dict[str, list[int]], arena: Path | None) -> dict[str, Any]:
    """RSS/PSS/USS per process role, and the arena's PSS counted once."""
    prefix = str(arena) if arena else None
    out: dict[str, Any] = {"processes": {}, "arena_pss": 0}
    tot = {"rss": 0, "pss": 0, "uss": 0}
    for role, plist in pids.items():
        for pid in plist:
            try:
                p = psutil.Process(pid)
                mi = p.memory_full_info()
            except psutil.Error:
                continue
            pss_all, pss_arena = _smaps_pss(pid, prefix) if prefix else (mi.pss, 0)
            rec = {"role": role, "rss": mi.rss, "pss": mi.pss, "uss": mi.uss,
                   "arena_pss": pss_arena}
            out["processes"][str(pid)] = rec
            out["arena_pss"] += pss_arena
            for k in tot:
                tot[k] += rec[k]
    out.update({f"total_{k}": v for k, v in tot.items()})
    workers = [r for r in out["processes"].values() if r["role"] == "worker"]
    out["workers_rss"] = sum(r["rss"] for r in workers)
    out["workers_pss"] = sum(r["pss"] for r in workers)
    out["workers_pss_without_arena"] = sum(r["pss"] - r["arena_pss"] for r in workers)
    if arena is not None:
        with contextlib.suppress(OSError):
            st = arena.stat()
            out["arena_file_bytes"] = st.st_size
            out["arena_allocated_bytes"] = st.st_blocks * 512
    out["mem_available"] = common.mem_available()
    return out


def status_rss(pid: int) -> tuple[int, int, int]:
    """(RssAnon, RssFile, RssShmem) of one process, bytes."""
    vals = {"RssAnon:": 0, "RssFile:": 0, "RssShmem:": 0}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                k = line.split(maxsplit=1)[0]
                if k in vals:
                    vals[k] = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return vals["RssAnon:"], vals["RssFile:"], vals["RssShmem:"]


class MemoryWatch(threading.Thread):
    """Samples the server's memory every ``period`` s; calls ``on_abort`` above ``max_rss``.

    The limit applies to the footprint: private (anonymous) RSS summed over the
    server processes, plus the largest file-backed and the largest shmem RSS of
    any one of them (the model mapping and the shmkv arena are shared, so summing
    their RSS would count them once per worker). The plain RSS sum is recorded too.
    The cell also stops when the machine's available memory falls below
    ``min_available``, whatever the processes say.
    """

    def __init__(self, pids_fn, max_rss: int, min_available: int, on_abort=None,
                 period: float = 0.25) -> None:
        super().__init__(name="memory-watch", daemon=True)
        self.pids_fn, self.max_rss, self.min_available = pids_fn, max_rss, min_available
        self.on_abort = on_abort
        self.period = period
        self.abort = threading.Event()
        self.abort_at: float | None = None  # perf_counter
        self.reason: str | None = None
        self.peak_rss = 0
        self.peak_footprint = 0
        self.peak_pss = 0
        self.samples: list[tuple[float, int, int]] = []
        self.cpu_last: dict[int, float] = {}  # last CPU seconds seen per pid (survives a kill)
        self._stop_evt = threading.Event()
        self.t0 = time.monotonic()

    def run(self) -> None:
        n = 0
        while not self._stop_evt.is_set():
            anon = file_max = shmem_max = rss = pss = 0
            for pid in self.pids_fn():
                cpu = common.process_cpu_seconds(pid)
                if cpu:
                    self.cpu_last[pid] = cpu
                a, fi, sh = status_rss(pid)
                anon += a
                rss += a + fi + sh
                file_max, shmem_max = max(file_max, fi), max(shmem_max, sh)
                if n % 8 == 0:  # smaps_rollup walks page tables: every 2 s only
                    with contextlib.suppress(psutil.Error):
                        pss += psutil.Process(pid).memory_full_info().pss
            footprint = anon + file_max + shmem_max
            self.peak_rss = max(self.peak_rss, rss)
            self.peak_footprint = max(self.peak_footprint, footprint)
            if n % 8 == 0:
                self.peak_pss = max(self.peak_pss, pss)
            if n % 4 == 0:
                self.samples.append((round(time.monotonic() - self.t0, 2), footprint, rss))
            avail = common.mem_available()
            if not self.abort.is_set():
                if footprint > self.max_rss:
                    self.reason = (f"server memory {footprint / 2**30:.1f} GiB (private RSS + "
                                   f"shared once) > --max-rss {self.max_rss / 2**30:.1f} GiB")
                elif avail and avail < self.min_available:
                    self.reason = f"only {avail / 2**30:.1f} GiB of memory available"
                if self.reason:
                    log.warning("stopping the cell: %s", self.reason)
                    self.abort_at = time.perf_counter()
                    self.abort.set()
                    if self.on_abort is not None:
                        try:
                            self.on_abort()
                        except Exception:  # the watch must keep its promise: no hang
                            log.exception("on_abort failed")
            n += 1
            self._stop_evt.wait(self.period)

    def stop(self) -> None:
        self._stop_evt.set()
        self.join(5)


# =================================================================== client

@dataclass
class Result:
    k: int
    prompt: int
    t_send: float = 0.0
    ttft: float | None = None  # first chunk with text
    first_chunk: float | None = None  # first data event of any kind
    total: float | None = None
    chunks: int = 0
    text_chunks: int = 0
    finish_reason: str | None = None
    status: int | None = None
    error: str | None = None
    worker_pid: int | None = None
    shmkv: dict[str, Any] | None = None
    client_thread: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttft is not None


def connection_worker(client_port: int, server_port: int, workers: list[int]) -> int | None:
    """The worker process holding the server side of our TCP connection."""
    for pid in workers:
        try:
            for c in psutil.Process(pid).net_connections(kind="tcp"):
                if (c.laddr and c.laddr.port == server_port and c.raddr
                        and c.raddr.port == client_port):
                    return pid
        except psutil.Error:
            continue
    return None


def one_request(client: httpx.Client, url: str, body: dict[str, Any], r: Result,
                server_port: int, workers: list[int] | None) -> None:
    """Stream one completion; fill ``r`` with its times and what the server said."""
    r.t_send = time.perf_counter()
    try:
        with client.stream("POST", url, json=body) as resp:
            r.status = resp.status_code
            if resp.status_code != 200:
                r.error = f"HTTP {resp.status_code}: {resp.read()[:300]!r}"
                return
            if workers:  # headers leave before the prompt is evaluated: the worker holds it now
                stream = resp.extensions.get("network_stream")
                if stream is not None:
                    port = stream.get_extra_info("client_addr")[1]
                    r.worker_pid = connection_worker(port, server_port, workers)
            for line in resp.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter() - r.t_send
                chunk = json.loads(data)
                r.chunks += 1
                if r.first_chunk is None:
                    r.first_chunk = now
                    r.shmkv = chunk.get("shmkv")
                    if r.shmkv:
                        r.worker_pid = r.shmkv.get("worker_pid")
                choice = (chunk.get("choices") or [{}])[0]
                if choice.get("text"):
                    r.text_chunks += 1
                    if r.ttft is None:
                        r.ttft = now
                if choice.get("finish_reason"):
                    r.finish_reason = choice["finish_reason"]
        r.total = time.perf_counter() - r.t_send
        if r.ttft is None:
            r.error = f"no text in {r.chunks} chunks"
    except (httpx.HTTPError, ValueError, OSError) as e:
        r.error = f"{type(e).__name__}: {e}"
        r.total = time.perf_counter() - r.t_send


def run_load(base: str, wl: Workload, n: int, concurrency: int, max_tokens: int,
             abort: threading.Event, server_port: int, workers: list[int] | None,
             timeout: float) -> tuple[list[Result], float, float]:
    """Closed loop: ``concurrency`` clients take the next request of the sequence in turn."""
    results = [Result(k, wl.requests[k][0]) for k in range(n)]
    nxt = iter(range(n))
    lock = threading.Lock()
    url = base + "/v1/completions"

    def client_loop(c: int) -> None:
        limits = httpx.Limits(max_keepalive_connections=0)  # a new connection per request
        with httpx.Client(timeout=httpx.Timeout(timeout, connect=30), limits=limits) as cl:
            while not abort.is_set():
                with lock:
                    k = next(nxt, None)
                if k is None:
                    return
                body = {"model": "gemma", "prompt": wl.prompt(k), "max_tokens": max_tokens,
                        "temperature": 0.0, "stream": True, "seed": SEED}
                results[k].client_thread = c
                one_request(cl, url, body, results[k], server_port, workers)

    threads = [threading.Thread(target=client_loop, args=(c,), daemon=True)
               for c in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():
            t.join(0.5)
    t1 = time.perf_counter()
    for r in results:  # relative to the start of the cell
        if r.t_send:
            r.t_send -= t0
    return results, t0, t1


def warm_up(base: str, workers: int, rounds: int = 3) -> None:
    """Unrelated short prompts (under one cache chunk), so first-request costs are not timed."""
    url = base + "/v1/completions"

    def go(i: int) -> None:
        body = {"model": "gemma", "prompt": WARMUP_PROMPT.format(i=i), "max_tokens": 2,
                "temperature": 0.0, "stream": True}
        r = Result(i, 0)
        with httpx.Client(timeout=300, limits=httpx.Limits(max_keepalive_connections=0)) as c:
            one_request(c, url, body, r, 0, None)
        if r.error:
            raise click.ClickException(f"warm-up request failed: {r.error}")

    for rnd in range(rounds):
        ts = [threading.Thread(target=go, args=(rnd * workers + w,)) for w in range(workers)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()


# ===================================================================== cells

def percentile(xs: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    s = sorted(xs)
    if not s:
        return float("nan")
    pos = (len(s) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summary(xs: list[float]) -> dict[str, Any]:
    if not xs:
        return {"n": 0}
    return {"n": len(xs), "mean": statistics.fmean(xs), "p50": percentile(xs, 50),
            "p90": percentile(xs, 90), "p99": percentile(xs, 99), "min": min(xs),
            "max": max(xs)}


@dataclass
class CellConfig:
    arm: str
    concurrency: int
    requests: int
    max_tokens: int
    arena_size: str
    max_rss: int
    min_available: int
    max_load: float
    max_wait: float
    timeout: float


@dataclass
class Cell:
    arm: str
    concurrency: int
    planned: int
    quiet: dict[str, Any] = field(default_factory=dict)
    results: list[dict[str, Any]] = field(default_factory=list)
    wall_s: float = 0.0
    aborted: str | None = None
    memory: dict[str, Any] = field(default_factory=dict)
    noise: dict[str, Any] = field(default_factory=dict)
    shmkv_stats: dict[str, Any] | None = None
    worker_pids: list[int] = field(default_factory=list)
    startup_s: float = 0.0
    abort_s: float | None = None  # seconds into the cell when it was stopped


def run_cell(spec: ServerSpec, cc: CellConfig, wl: Workload, workdir: Path) -> Cell:
    cell = Cell(cc.arm, cc.concurrency, cc.requests)
    with contextlib.ExitStack() as stack:
        sup = (stack.enter_context(supervisor(workdir, cc.arena_size))
               if spec.arm.startswith("shmkv") else None)
        t = time.monotonic()
        srv = Server(spec, workdir, sup)
        stack.push(lambda exc_type, _e, _tb: srv.stop(kill=exc_type is not None))  # SIGKILL on
        srv.wait_ready()  # errors and Ctrl-C: in-flight prefills would hold SIGTERM up for 30 s
        cell.startup_s = time.monotonic() - t
        workers = srv.worker_pids()
        cell.worker_pids = workers
        warm_up(srv.base, spec.workers)
        if sup is not None:
            time.sleep(0.5)  # counters of the warm-up reach the supervisor off the token path
        # quiet machine first (the idle server costs nothing); then warm again briefly
        cell.quiet = common.wait_until_quiet(cc.max_load, cc.max_wait)
        if not cell.quiet["quiet"]:
            log.warning("%s c=%d: load still %.2f after %.0f s: measuring anyway (recorded)",
                        cc.arm, cc.concurrency, cell.quiet["loadavg"][0], cell.quiet["waited_s"])
        stats0 = sup.stats() if sup else None

        def pids() -> dict[str, list[int]]:
            d = {"master": [srv.master_pid], "worker": srv.worker_pids()}
            if sup is not None:
                d["supervisor"] = [sup.group.pid]
            return d

        def flat() -> list[int]:
            return [p for ps in pids().values() for p in ps]

        arena = sup.arena if sup else None
        mem0 = mem_snapshot(pids(), arena)
        at_abort: dict[str, Any] = {}

        def abort_now() -> None:
            """Record memory as it is, then SIGKILL the server: nothing graceful to wait for."""
            at_abort.update(mem_snapshot(pids(), arena))
            srv.stop(kill=True)

        watch = MemoryWatch(flat, cc.max_rss, cc.min_available, on_abort=abort_now)
        cpu0 = {pid: common.process_cpu_seconds(pid) for pid in flat()}
        own0 = sum(os.times()[:2])
        busy0 = common.cpu_busy_seconds()
        load0 = common.loadavg()
        watch.start()
        try:
            results, t0, t1 = run_load(srv.base, wl, cc.requests, cc.concurrency, cc.max_tokens,
                                       watch.abort, srv.port,
                                       None if sup else workers, cc.timeout)
        finally:
            watch.stop()
        cell.wall_s = t1 - t0
        # server processes: now if alive, else the last sample (a killed worker's CPU time
        # would otherwise count as another process's)
        cpu1 = {pid: max(common.process_cpu_seconds(pid), watch.cpu_last.get(pid, 0.0))
                for pid in set(cpu0) | set(watch.cpu_last)}
        ours = (sum(cpu1[p] - cpu0.get(p, 0.0) for p in cpu1)
                + sum(os.times()[:2]) - own0)
        busy = common.cpu_busy_seconds() - busy0
        foreign = max(0.0, busy - ours)
        cell.noise = {"loadavg_before": list(load0), "loadavg_after": list(common.loadavg()),
                      "cpu_seconds_ours": round(ours, 2), "cpu_seconds_machine": round(busy, 2),
                      "foreign_cores": round(foreign / cell.wall_s, 3) if cell.wall_s else 0.0}
        if watch.abort.is_set():
            cell.aborted = watch.reason
            cell.abort_s = (watch.abort_at or t1) - t0
        if sup is not None and not cell.aborted:
            time.sleep(1.0)  # let the publisher threads deliver the last puts and counters
        mem1 = at_abort or mem_snapshot(pids(), arena)
        if sup is not None:
            with contextlib.suppress(RuntimeError, ValueError, subprocess.SubprocessError):
                cell.shmkv_stats = {"before": stats0, "after": sup.stats()}
        cell.memory = {"after_warmup": mem0, "end": mem1, "peak_rss_sum": watch.peak_rss,
                       "peak_footprint": watch.peak_footprint, "peak_pss": watch.peak_pss,
                       "samples_t_footprint_rsssum": watch.samples}
        cell.results = [asdict(r) for r in results]
    return cell


# ================================================================== analysis

def queueing(results: list[dict[str, Any]], workers: list[int], sys_tokens: int
             ) -> dict[str, Any]:
    """Requests served by a worker that was busy with another one when they were sent.

    A plain uvicorn worker keeps accepting connections while its single llama
    context is busy, so a new connection can queue behind a prefill although
    another worker is idle ("misrouted"). With more clients than workers some
    waiting is unavoidable; waiting while another worker idles is not.
    """
    done = [r for r in results if r["worker_pid"] and r["total"] is not None]
    if not done:
        return {"n": 0}
    known = sorted(set(workers) | {r["worker_pid"] for r in done})
    busy_land = []
    misrouted = []
    for r in done:
        ts = r["t_send"]
        inflight = {o["worker_pid"] for o in done if o is not r
                    and o["t_send"] <= ts < o["t_send"] + o["total"]}
        on_busy = r["worker_pid"] in inflight
        idle = [w for w in known if w not in inflight]
        r["_busy"] = on_busy
        r["_misrouted"] = on_busy and bool(idle)
        busy_land.append(on_busy)
        misrouted.append(r["_misrouted"])
    per_worker = {str(w): sum(1 for r in done if r["worker_pid"] == w) for w in known}
    q = [r for r in done if r["_busy"]]
    nq = [r for r in done if not r["_busy"]]
    out = {
        "n": len(done), "landed_on_busy": sum(busy_land),
        "landed_on_busy_while_another_idle": sum(misrouted),
        "requests_per_worker": per_worker,
        "ttft_landed_on_busy": summary([r["ttft"] for r in q]),
        "ttft_landed_on_idle": summary([r["ttft"] for r in nq]),
    }
    if all(r["shmkv"] for r in done) and any(r["_misrouted"] for r in done):
        # What the mean would have been had no request waited for a busy worker while
        # another was idle: each such request gets the mean TTFT of its cache class
        # (hit/local/cold) among the requests that found their worker idle.
        by_class: dict[str, list[float]] = {}
        for r in nq:
            by_class.setdefault(cache_class(r, sys_tokens), []).append(r["ttft"])
        means = {k: statistics.fmean(v) for k, v in by_class.items()}
        est = [means.get(cache_class(r, sys_tokens), r["ttft"]) if r["_misrouted"]
               else r["ttft"] for r in done]
        out["ttft_idle_by_class"] = {k: summary(v) for k, v in by_class.items()}
        out["estimated_mean_ttft_without_misrouting"] = statistics.fmean(est)
    for r in done:
        r.pop("_busy", None)
        r.pop("_misrouted", None)
    return out


def cache_class(r: dict[str, Any], sys_tokens: int) -> str:
    """hit (restored from the arena), local (the worker's context already held it), cold."""
    k = r["shmkv"]
    if k["restored_tokens"] > 0:
        return "hit"
    if k["reused_local_tokens"] >= sys_tokens // 2:
        return "local"
    return "cold"


def shmkv_breakdown(results: list[dict[str, Any]], sys_tokens: int) -> dict[str, Any]:
    """What the cache did per request, from the ``shmkv`` field of each stream."""
    rs = [r for r in results if r["shmkv"]]
    if not rs:
        return {"n": 0}
    hits = [r for r in rs if cache_class(r, sys_tokens) == "hit"]
    cold = [r for r in rs if cache_class(r, sys_tokens) == "cold"]
    local = [r for r in rs if cache_class(r, sys_tokens) == "local"]
    # cold prefills of a prompt that another request was already prefilling (in flight)
    dup = 0
    first_cold: dict[int, dict[str, Any]] = {}
    for r in sorted(cold, key=lambda r: r["t_send"]):
        f = first_cold.get(r["prompt"])
        if f is None:
            first_cold[r["prompt"]] = r
        else:
            dup += 1
    cold_per_prompt: dict[str, int] = {}
    for r in cold:
        cold_per_prompt[str(r["prompt"])] = cold_per_prompt.get(str(r["prompt"]), 0) + 1
    overlapping = 0
    for r in cold:
        if any(o is not r and o["prompt"] == r["prompt"] and o["t_send"] <= r["t_send"]
               < o["t_send"] + (o["ttft"] or o["total"] or 0) for o in cold):
            overlapping += 1
    cold_ttft_sum = sum(r["ttft"] for r in cold if r["ttft"])
    all_ttft_sum = sum(r["ttft"] for r in rs if r["ttft"])
    # hits that were sent while another worker was still prefilling the same prompt: they
    # waited for that state (in-flight coalescing) and cost a cold prefill's TTFT, not a hit's
    waited = [h for h in hits if any(c["prompt"] == h["prompt"] and c["t_send"] <= h["t_send"]
                                     < c["t_send"] + c["ttft"] for c in cold)]
    prompt_hits = [h for h in hits if h not in waited]
    return {
        "n": len(rs), "hits": len(hits), "cold": len(cold), "local_reuse": len(local),
        "cold_per_prompt": cold_per_prompt, "cold_beyond_one_per_prompt": dup,
        "cold_started_while_same_prompt_in_prefill": overlapping,
        "ttft_hit": summary([r["ttft"] for r in hits if r["ttft"]]),
        "hits_after_waiting_for_same_prompt_prefill": len(waited),
        "ttft_hit_waited": summary([r["ttft"] for r in waited]),
        "ttft_hit_no_wait": summary([r["ttft"] for r in prompt_hits]),
        "waited_share_of_ttft": (sum(r["ttft"] for r in waited) / all_ttft_sum
                                 if all_ttft_sum else None),
        "ttft_cold": summary([r["ttft"] for r in cold if r["ttft"]]),
        "ttft_local": summary([r["ttft"] for r in local if r["ttft"]]),
        "cold_share_of_ttft": cold_ttft_sum / all_ttft_sum if all_ttft_sum else None,
        "restored_tokens": summary([float(r["shmkv"]["restored_tokens"]) for r in hits]),
        "evaluated_tokens_hit": summary([float(r["shmkv"]["evaluated_tokens"]) for r in hits]),
        "evaluated_tokens_cold": summary([float(r["shmkv"]["evaluated_tokens"]) for r in cold]),
        "prompt_tokens": summary([float(r["shmkv"]["prompt_tokens"]) for r in rs]),
        "restore_ms": summary([r["shmkv"]["restore_ms"] for r in hits]),
    }


def analyse_cell(c: Cell, sys_tokens: int, nocache_mem: dict[str, Any] | None
                 ) -> dict[str, Any]:
    rs = c.results
    attempted = [r for r in rs if r["t_send"]]
    ok = [r for r in attempted if r["error"] is None and r["ttft"] is not None]
    errors = [r for r in attempted if r not in ok]
    cut = []
    if c.abort_s is not None:  # requests cut by our stopping the server are not its errors
        cut = [r for r in errors if r["t_send"] + (r["total"] or 0) >= c.abort_s]
        errors = [r for r in errors if r not in cut]
    interrupted = [r for r in ok if r["finish_reason"] is None]
    m0, m1 = c.memory["after_warmup"], c.memory["end"]
    mem: dict[str, Any] = {
        "total_pss_end": m1["total_pss"], "total_rss_end": m1["total_rss"],
        "total_pss_peak": c.memory["peak_pss"], "total_rss_sum_peak": c.memory["peak_rss_sum"],
        "footprint_peak": c.memory["peak_footprint"],
        "workers_pss_end": m1["workers_pss"],
        "workers_pss_growth": m1["workers_pss"] - m0["workers_pss"],
        "workers_rss_growth": m1["workers_rss"] - m0["workers_rss"],
        "workers_pss_without_arena_end": m1["workers_pss_without_arena"],
    }
    if c.arm.startswith("shmkv"):
        mem["cache_bytes"] = m1["arena_pss"]  # the arena, counted once
        mem["cache_how"] = "arena PSS summed over all processes that map it"
        mem["arena_allocated_bytes"] = m1.get("arena_allocated_bytes")
        mem["arena_pss_per_process"] = {pid: p["arena_pss"] for pid, p in
                                        m1["processes"].items() if p["arena_pss"]}
    elif c.arm == "ramcache":
        growth = m1["workers_pss"] - m0["workers_pss"]
        mem["cache_bytes"] = growth
        mem["cache_how"] = "workers' PSS growth from after warm-up to the end"
        if nocache_mem is not None:  # minus the growth the no-cache arm has too (logits, KV)
            nc = nocache_mem["end"]["workers_pss"] - nocache_mem["after_warmup"]["workers_pss"]
            mem["cache_bytes"] = growth - nc
            mem["cache_how"] = ("workers' PSS growth from after warm-up to the end, minus the "
                                "no-cache arm's growth at the same concurrency")
    else:
        mem["cache_bytes"] = 0
        mem["cache_how"] = "no cache"
    out: dict[str, Any] = {
        "arm": c.arm, "label": ARMS[c.arm], "concurrency": c.concurrency,
        "planned": c.planned, "attempted": len(attempted), "ok": len(ok),
        "errors": len(errors), "error_samples": sorted({r["error"] for r in errors})[:5],
        "cut_by_stop": len(cut),
        "interrupted_streams": len(interrupted), "aborted": c.aborted,
        "wall_s": c.wall_s, "requests_per_s": len(ok) / c.wall_s if c.wall_s else 0.0,
        "ttft": summary([r["ttft"] for r in ok]), "total": summary([r["total"] for r in ok]),
        "text_chunks": summary([float(r["text_chunks"]) for r in ok]),
        "memory": mem, "quiet": c.quiet, "noise": c.noise, "startup_s": c.startup_s,
        "queueing": queueing(ok, c.worker_pids, sys_tokens),
    }
    if c.arm.startswith("shmkv"):
        out["cache"] = shmkv_breakdown(ok, sys_tokens)
        if c.shmkv_stats:
            a, b = c.shmkv_stats["before"], c.shmkv_stats["after"]
            keys = ("hits", "misses", "tokens_restored", "tokens_evaluated", "puts",
                    "duplicate_puts", "rejected_puts", "evictions", "restore_failures")
            out["supervisor"] = {
                "delta": {k: b.get(k, 0) - a.get(k, 0) for k in keys if k in b},
                "end": {k: b.get(k) for k in ("entries", "bytes_used", "bytes_capacity",
                                              "workers_attached", "chunk_tokens") if k in b}}
    return out


# ==================================================================== output

def fmt_s(s: float | None) -> str:
    if s is None or s != s:
        return "-"
    return f"{s:.2f} s" if s >= 0.995 else f"{s * 1e3:.0f} ms"


def fmt_b(n: float | None) -> str:
    if n is None:
        return "-"
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 * 0.95 else f"{n / 2**20:.0f} MiB"


def table(res: dict[str, Any], baseline: dict[str, Any] | None) -> str:
    cells = res["cells"]
    ref = {c["concurrency"]: c for c in cells if c["arm"] == "nocache"}
    base = {(c["arm"], c["concurrency"]): c for c in (baseline or {}).get("cells", [])}
    hdr = ["arm", "conc", "ok/err", "cut", "TTFT mean", "p50", "p99", "total mean", "req/s",
           "vs nocache", "hits", "cache mem", "worker growth", "server PSS"]
    if base:
        hdr.append("baseline mean")
    lines = [hdr]
    for c in cells:
        t = c["ttft"]
        r = ref.get(c["concurrency"])
        ratio = (f"{r['ttft']['mean'] / t['mean']:.1f}x" if r and t.get("n") and r["ttft"].get("n")
                 and c["arm"] != "nocache" else "")
        hits = ""
        if "cache" in c and c["cache"].get("n"):
            hits = f"{c['cache']['hits']}/{c['cache']['n']}"
        ok = f"{c['ok']}/{c['errors']}" + (f" (stopped at {c['attempted']})" if c["aborted"]
                                            else "")
        line = [c["label"], str(c["concurrency"]), ok, str(c["interrupted_streams"]),
                fmt_s(t.get("mean")), fmt_s(t.get("p50")),
                fmt_s(t.get("p99")), fmt_s(c["total"].get("mean")), f"{c['requests_per_s']:.2f}",
                ratio, hits, fmt_b(c["memory"]["cache_bytes"]),
                fmt_b(c["memory"]["workers_pss_growth"]), fmt_b(c["memory"]["total_pss_end"])]
        if base:
            b = base.get((c["arm"], c["concurrency"]))
            line.append(fmt_s(b["ttft"].get("mean")) if b else "-")
        lines.append(line)
    return common.grid(lines, left=2)


def plot(res: dict[str, Any], path: Path) -> bool:
    plt = common.pyplot()
    if plt is None:
        return False
    cells = res["cells"]
    arms = [a for a in ARMS if any(c["arm"] == a for c in cells)]
    concs = sorted({c["concurrency"] for c in cells})
    by = {(c["arm"], c["concurrency"]): c for c in cells}
    colors = {"nocache": "#888888", "ramcache": "#cc8844", "shmkv": "#33aa77",
              "shmkv-logits-all": "#3377aa", "shmkv-exact": "#2266cc"}
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.2))
    width = 0.8 / max(1, len(arms))

    ax = axes[0]
    for i, a in enumerate(arms):
        xs, means, p99s = [], [], []
        for j, cc in enumerate(concs):
            c = by.get((a, cc))
            if not c or not c["ttft"].get("n"):
                continue
            xs.append(j + (i - (len(arms) - 1) / 2) * width)
            means.append(c["ttft"]["mean"])
            p99s.append(c["ttft"]["p99"])
        ax.bar(xs, p99s, width * 0.95, color=colors[a], alpha=0.35, edgecolor=colors[a],
               hatch="//")
        ax.bar(xs, means, width * 0.95, color=colors[a])
        stopped = [bool(by[(a, cc)]["aborted"]) for cc in concs
                   if by.get((a, cc)) and by[(a, cc)]["ttft"].get("n")]
        for x, m, p, st in zip(xs, means, p99s, stopped, strict=True):
            ax.text(x, p * 1.05, f"{p:.1f}", ha="center", va="bottom", fontsize=7,
                    color="#555")
            if st:  # stopped at the memory limit: these figures cover its first requests
                ax.text(x, m * 0.35, "stopped\n(memory)", ha="center", va="top", fontsize=6,
                        color="white")
            ax.text(x, m * 0.8, f"{m:.2f}" if m < 10 else f"{m:.0f}", ha="center",
                    va="top", fontsize=7, color="white", fontweight="bold")
    ax.axhline(GOAL_MEAN_TTFT, color="#c33", ls="--", lw=1)
    ax.set_yscale("log")
    lo = min([c["ttft"]["min"] for c in cells if c["ttft"].get("n")] + [GOAL_MEAN_TTFT])
    ax.set_ylim(bottom=lo / 2)
    ax.set_xticks(range(len(concs)), [f"concurrency {c}" for c in concs])
    ax.set_ylabel("time to first token, s (log)")
    ax.set_title(f"TTFT: mean (solid, value inside), p99 (hatched, value above)\n"
                 f"red line: goal, shmkv mean ≤ {GOAL_MEAN_TTFT} s at c={GOAL_CONCURRENCY}",
                 fontsize=9)

    ax = axes[1]
    for i, a in enumerate(arms):
        xs, ys = [], []
        for j, cc in enumerate(concs):
            c = by.get((a, cc))
            if c:
                xs.append(j + (i - (len(arms) - 1) / 2) * width)
                ys.append(c["requests_per_s"])
        ax.bar(xs, ys, width * 0.95, color=colors[a])
        for x, y in zip(xs, ys, strict=True):
            ax.text(x, y, f"{y:.2f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(concs)), [f"concurrency {c}" for c in concs])
    ax.set_ylabel("completed requests per second")
    ax.set_title("throughput", fontsize=10)

    ax = axes[2]
    for i, a in enumerate(arms):
        xs, tot, cache = [], [], []
        for j, cc in enumerate(concs):
            c = by.get((a, cc))
            if c:
                xs.append(j + (i - (len(arms) - 1) / 2) * width)
                tot.append(c["memory"]["total_pss_peak"] / 2**30)
                cache.append(max(0, c["memory"]["cache_bytes"]) / 2**30)
        ax.bar(xs, tot, width * 0.95, color=colors[a], alpha=0.35, edgecolor=colors[a])
        ax.bar(xs, cache, width * 0.95, color=colors[a])
        stopped = [bool(by[(a, cc)]["aborted"]) for cc in concs if by.get((a, cc))]
        for x, t, ca, st in zip(xs, tot, cache, stopped, strict=True):
            ax.text(x, t, f"{t:.1f}" + (" (limit)" if st else ""), ha="center", va="bottom",
                    fontsize=7)
            if ca:
                ax.text(x, ca, f"{ca:.2f}", ha="center", va="bottom", fontsize=7,
                        color="k")
    ax.set_xticks(range(len(concs)), [f"concurrency {c}" for c in concs])
    ax.set_ylabel("GiB")
    ax.set_title("memory: all server processes, peak PSS (light);\n"
                 "the cache (solid: shmkv arena PSS once; RAMCache worker growth)", fontsize=9)
    m, cfg = res["machine"], res["config"]
    fig.suptitle(
        f"shmkv {m['versions'].get('shmkv', '?')} ({res.get('code', {}).get('commit', '?')}"
        f"{'+dirty' if res.get('code', {}).get('dirty') else ''}) serving benchmark — "
        f"Gemma 3 270M Q4_K_M, "
        f"{cfg['workers']} gunicorn workers × {cfg['threads']} thread, n_ctx {cfg['n_ctx']}, "
        f"{cfg['prompts']} system prompts of ~{round(statistics.fmean(cfg['system_tokens']))} "
        f"tokens, {cfg['requests']} streaming requests — {m['cpu']}, {m['cores']} cores"
        + (" (quick)" if cfg["quick"] else ""), fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[a]) for a in arms]
    fig.legend(handles, [ARMS[a] for a in arms], loc="lower center", ncol=len(arms),
               fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def findings(res: dict[str, Any]) -> list[str]:
    """Short, numeric statements about where the time goes."""
    out = []
    cells = res["cells"]
    by = {(c["arm"], c["concurrency"]): c for c in cells}
    for c in cells:
        if not c["arm"].startswith("shmkv") or not c.get("cache", {}).get("n"):
            continue
        k, q = c["cache"], c["queueing"]
        hit, cold = k["ttft_hit"], k["ttft_cold"]
        line = (
            f"{c['arm']} c={c['concurrency']}: mean TTFT {fmt_s(c['ttft'].get('mean'))}; "
            f"{k['hits']} arena hits (mean {fmt_s(hit.get('mean'))}, p50 "
            f"{fmt_s(hit.get('p50'))}; {k['hits_after_waiting_for_same_prompt_prefill']} of "
            f"them waited for another worker's prefill of their prompt, mean "
            f"{fmt_s(k['ttft_hit_waited'].get('mean'))}; the others mean "
            f"{fmt_s(k['ttft_hit_no_wait'].get('mean'))}), {k['local_reuse']} reused the "
            f"worker's own context, "
            f"{k['cold']} cold prefills (mean {fmt_s(cold.get('mean'))}; "
            f"{k['cold_beyond_one_per_prompt']} beyond one per prompt, "
            f"{k['cold_started_while_same_prompt_in_prefill']} started while the same prompt "
            f"was already prefilling) = {(k['cold_share_of_ttft'] or 0) * 100:.0f} % of all "
            f"TTFT; {q.get('landed_on_busy', 0)}/{q.get('n', 0)} requests waited for a busy "
            f"worker ({q.get('landed_on_busy_while_another_idle', 0)} while another was idle), "
            f"mean TTFT {fmt_s(q.get('ttft_landed_on_busy', {}).get('mean'))} vs "
            f"{fmt_s(q.get('ttft_landed_on_idle', {}).get('mean'))} on an idle worker")
        if q.get("estimated_mean_ttft_without_misrouting") is not None:
            line += (f"; estimated mean TTFT had none waited while another worker was idle: "
                     f"{fmt_s(q['estimated_mean_ttft_without_misrouting'])}")
        sv = c.get("supervisor")
        if sv:
            d, e = sv["delta"], sv["end"]
            line += (f"; supervisor: {d.get('puts')} puts ({d.get('duplicate_puts')} "
                     f"duplicates) for {c['ok']} requests, arena {fmt_b(e.get('bytes_used'))} of "
                     f"{fmt_b(e.get('bytes_capacity'))} used, {d.get('evictions')} evictions")
        out.append(line + ".")
    default_la = res["config"].get("shmkv_logits_all_default")
    for cc in sorted({c["concurrency"] for c in cells}):
        a, b = by.get(("shmkv-logits-all", cc)), by.get(("shmkv", cc))
        if a and b and a["ttft"].get("n") and b["ttft"].get("n") and default_la is False:
            out.append(
                f"logits_all=True (llama_cpp.server's default) vs shmkv's default "
                f"(False) at c={cc}: mean TTFT {fmt_s(a['ttft']['mean'])} vs "
                f"{fmt_s(b['ttft']['mean'])}; cold prefill "
                f"{fmt_s(a['cache']['ttft_cold'].get('mean'))} vs "
                f"{fmt_s(b['cache']['ttft_cold'].get('mean'))}; arena hit "
                f"{fmt_s(a['cache']['ttft_hit'].get('p50'))} vs "
                f"{fmt_s(b['cache']['ttft_hit'].get('p50'))} (p50); workers' memory growth "
                f"{fmt_b(a['memory']['workers_pss_growth'])} vs "
                f"{fmt_b(b['memory']['workers_pss_growth'])}.")
    for c in cells:
        if c["arm"] in ("nocache", "ramcache") and c["queueing"].get("n"):
            q = c["queueing"]
            out.append(f"{c['arm']} c={c['concurrency']}: {q['landed_on_busy']}/{q['n']} "
                       f"requests waited for a busy worker "
                       f"({q['landed_on_busy_while_another_idle']} while another was idle).")
    cut = [f"{c['arm']}@{c['concurrency']}: {c['interrupted_streams']}/{c['ok']}"
           for c in cells if c["ok"]]
    out.append("streams cut short by llama_cpp.server's interrupt_requests=True (a request "
               "queued on the same worker ends the running stream after its next token, "
               "without a finish_reason): " + ", ".join(cut) + ".")
    for c in cells:
        if c["aborted"]:
            out.append(f"{c['arm']} c={c['concurrency']} was stopped after {c['attempted']} of "
                       f"{c['planned']} requests: {c['aborted']}; its figures cover only the "
                       f"{c['ok']} requests that completed (the first, mostly cold, ones).")
    return out


# ====================================================================== main

def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def code_digest(shmkv_dir: Path, workers_dir: Path) -> str:
    import hashlib

    h = hashlib.blake2b(digest_size=8)
    for base, name in ((shmkv_dir, "shmkv"), (workers_dir, "workers")):
        for path in sorted(base.glob("**/*.py")):
            h.update(f"{name}/{path.relative_to(base)}".encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def snapshot_code(dest: Path) -> dict[str, Any]:
    """Copy shmkv/ and workers/ (as package shmkv_workers) to ``dest``; servers run from it.

    A long run must measure one version of the code, even if the working tree
    changes meanwhile: every server process gets ``dest`` first on PYTHONPATH and
    a working directory outside the repository, and this is verified.
    """
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "shmkv", dest / "shmkv", ignore=ignore)
    shutil.copytree(ROOT / "workers", dest / "shmkv_workers", ignore=ignore)
    dirty = [line[3:] for line in _git("status", "--porcelain", "--", "shmkv", "workers")
             .splitlines() if line]
    return {"commit": _git("rev-parse", "--short", "HEAD"),
            "commit_subject": _git("log", "-1", "--format=%s"), "dirty": dirty,
            "code_digest": code_digest(dest / "shmkv", dest / "shmkv_workers"),
            "path": str(dest)}


def verify_snapshot(code: Path, cwd: Path) -> dict[str, str]:
    """Where a server process imports shmkv and shmkv_workers from (must be the snapshot)."""
    out = subprocess.run(
        [sys.executable, "-c", "import shmkv, shmkv_workers, json; print(json.dumps("
         "{'shmkv': shmkv.__file__, 'shmkv_workers': shmkv_workers.__file__}))"],
        env=clean_env({}), cwd=cwd, capture_output=True, text=True, timeout=60)
    where = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else {}
    if not where or not all(str(v).startswith(str(code)) for v in where.values()):
        raise click.ClickException(f"servers would not run the snapshot in {code}: {where} "
                                   f"{out.stderr[-1000:]}")
    return where


def snapshot_logits_all_default(code: Path, cwd: Path) -> bool | None:
    """What the measured workers/ does with logits unless told (None: llama_cpp.server's)."""
    out = subprocess.run(
        [sys.executable, "-c", "from shmkv.config import SETTINGS; s = SETTINGS.get("
         "'logits_all'); print('none' if s is None else str(s.default).lower())"],
        env=clean_env({}), cwd=cwd, capture_output=True, text=True, timeout=60)
    val = out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout else ""
    return {"true": True, "false": False}.get(val)


def _sigterm(_signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt("SIGTERM")


def _llama_versions() -> dict[str, str]:
    import llama_cpp

    info = llama_cpp.llama_print_system_info()
    return {"llama_cpp_python_module": llama_cpp.__version__,
            "llama_cpp_system_info": info.decode() if isinstance(info, bytes) else str(info),
            **{n: common.dist_version(n) for n in ("gunicorn", "uvicorn", "uvicorn-worker",
                                                   "fastapi", "httpx", "psutil")}}


def _parse_size(text: str) -> int:
    from shmkv.config import parse_size

    return parse_size(text)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--arms", default=DEFAULT_ARMS, show_default=True,
              help=f"Comma-separated arms, in order: {', '.join(ARMS)}.")
@click.option("--requests", "n_requests", type=int, default=None,
              help="Requests per (arm, concurrency) [60; quick 8].")
@click.option("--cacheless-requests", type=int, default=None,
              help="Run only the first N of the sequence for nocache/ramcache [= --requests].")
@click.option("--concurrency", default=None, help="Comma-separated levels [4,10; quick 4].")
@click.option("--prompts", "n_prompts", type=int, default=None,
              help="System prompts [6; quick 2].")
@click.option("--prompt-tokens", type=int, default=None,
              help="Tokens per system prompt [1000; quick 400].")
@click.option("--max-tokens", type=int, default=16, show_default=True,
              help="Tokens generated per request.")
@click.option("--workers", type=int, default=4, show_default=True, help="gunicorn workers.")
@click.option("--threads", type=int, default=1, show_default=True,
              help="llama.cpp threads (and batch threads) per worker.")
@click.option("--n-ctx", type=int, default=4096, show_default=True)
@click.option("--arena-size", default="1G", show_default=True, help="shmkv arena size.")
@click.option("--ramcache-size", default="1G", show_default=True,
              help="LlamaRAMCache capacity per worker (CACHE_SIZE).")
@click.option("--max-rss", default="16G", show_default=True,
              help="Stop a cell when the server's memory (private RSS summed, shared mappings "
              "once) exceeds this.")
@click.option("--min-available", default="3G", show_default=True,
              help="Stop a cell when the machine's available memory falls below this.")
@click.option("--max-load", type=float, default=0.7, show_default=True,
              help="Wait before each cell until the 1-minute load average is below this.")
@click.option("--max-wait", type=float, default=3600.0, show_default=True,
              help="Seconds to wait for --max-load; then run anyway and say so in the JSON.")
@click.option("--max-foreign", type=float, default=0.3, show_default=True,
              help="Re-run a cell when other processes used more cores than this during it.")
@click.option("--noisy-retries", type=int, default=2, show_default=True,
              help="How often a noisy cell is re-run (the last attempt is kept).")
@click.option("--timeout", type=float, default=900.0, show_default=True,
              help="Per-request read timeout, seconds.")
@click.option("--model", type=click.Path(dir_okay=False), default=None,
              help="GGUF [shmkv.models.default_model_path(): Gemma 3 270M Q4_K_M].")
@click.option("--quick", is_flag=True, help="Smoke run: 2 short prompts, 8 requests, c=4.")
@click.option("--out", "out_dir", default=str(HERE / "out"), show_default=True,
              type=click.Path(file_okay=False), help="Where serve.json and serve.png go.")
@click.option("--baseline", default=str(HERE / "baseline" / "serve.json"), show_default=True,
              help="Committed baseline to compare with (same mode only).")
@click.option("--write-baseline", is_flag=True, help="Also copy JSON and PNG to --baseline.")
@click.option("--from-json", "from_json", type=click.Path(exists=True, dir_okay=False),
              default=None, help="Measure nothing: re-derive the per-cell breakdowns, findings, "
              "table and chart of a saved serve.json with this version of the analysis.")
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
def main(arms: str, n_requests: int | None, cacheless_requests: int | None,
         concurrency: str | None, n_prompts: int | None, prompt_tokens: int | None,
         max_tokens: int, workers: int, threads: int, n_ctx: int, arena_size: str,
         ramcache_size: str, max_rss: str, min_available: str, max_load: float,
         max_wait: float, max_foreign: float, noisy_retries: int, timeout: float,
         model: str | None, quick: bool, out_dir: str,
         baseline: str, write_baseline: bool, from_json: str | None, verbose: bool) -> None:
    """Serve shared system prompts from 4 gunicorn workers: no cache vs LlamaRAMCache vs shmkv."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if from_json:
        res = reanalyse(json.loads(Path(from_json).read_text()))
        report(res, Path(out_dir), Path(baseline), write_baseline, compare=False)
        return
    arm_list = [a.strip() for a in arms.split(",") if a.strip()]
    unknown = [a for a in arm_list if a not in ARMS]
    if unknown:
        raise click.BadParameter(f"unknown arms {unknown}; choose from {list(ARMS)}",
                                 param_hint="--arms")
    n_requests = n_requests or (8 if quick else 60)
    n_prompts = n_prompts or (2 if quick else 6)
    prompt_tokens = prompt_tokens or (400 if quick else 1000)
    concs = [int(x) for x in (concurrency or ("4" if quick else "4,10")).split(",")]
    cacheless = min(cacheless_requests or n_requests, n_requests)
    if prompt_tokens + max_tokens + 64 > n_ctx:
        raise click.BadParameter("prompt + max tokens must fit --n-ctx")
    started = time.time()
    model_path = Path(model) if model else Path(_default_model())
    wl = make_workload(model_path, n_prompts, prompt_tokens, n_requests)
    log.info("model %s; %d system prompts of %s tokens; %d requests; concurrency %s; arms %s",
             model_path.name, n_prompts, wl.system_tokens, n_requests, concs, arm_list)
    config = {
        "quick": quick, "model": str(model_path), "model_bytes": model_path.stat().st_size,
        "workers": workers, "threads": threads, "threads_why": THREADS_WHY, "n_ctx": n_ctx,
        "prompts": n_prompts, "prompt_tokens_target": prompt_tokens,
        "system_tokens": wl.system_tokens, "requests": n_requests,
        "cacheless_requests": cacheless, "concurrency": concs, "max_tokens": max_tokens,
        "arms": arm_list, "arena_size": arena_size,
        "ramcache_size_per_worker": _parse_size(ramcache_size),
        "max_rss": _parse_size(max_rss), "max_load": max_load, "max_wait": max_wait,
        "max_foreign_cores": max_foreign, "noisy_retries": noisy_retries,
        "endpoint": "/v1/completions",
        "stream": True, "temperature": 0.0,
        "request_prompts": [p for p, _q in wl.requests],
        "prompt_format": "<start_of_turn>user\\n{system}\\n{question}<end_of_turn>\\n"
                         "<start_of_turn>model\\n",
        "new_connection_per_request": True,
        "llama_cpp_server_defaults": "nocache and ramcache run llama_cpp.server as users get "
                                     "it: logits_all=True, interrupt_requests=True",
        "shmkv_logits_all_default": None,  # filled from the snapshot below
    }
    signal.signal(signal.SIGTERM, _sigterm)
    cells: list[Cell] = []
    analysed: list[dict[str, Any]] = []
    mem_nocache: dict[int, dict[str, Any]] = {}
    interrupted = False
    global CODE_DIR
    code: dict[str, Any] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="shmkv-bench-serve-") as tmp:
            code = snapshot_code(Path(tmp) / "code")
            CODE_DIR = Path(code["path"])
            code["imports"] = verify_snapshot(CODE_DIR, Path(tmp))
            config["shmkv_logits_all_default"] = snapshot_logits_all_default(CODE_DIR, Path(tmp))
            log.info("measuring shmkv %s%s (snapshot %s)", code["commit"],
                     " + uncommitted changes" if code["dirty"] else "", code["code_digest"])
            for arm in arm_list:
                for cc in concs:
                    n = cacheless if arm in ("nocache", "ramcache") else n_requests
                    spec = ServerSpec(arm, str(model_path), workers, threads, n_ctx,
                                      _parse_size(ramcache_size),
                                      True if arm == "shmkv-logits-all" else None)
                    ccfg = CellConfig(arm, cc, n, max_tokens, arena_size, _parse_size(max_rss),
                                      _parse_size(min_available), max_load, max_wait, timeout)
                    discarded: list[dict[str, Any]] = []
                    for attempt in range(noisy_retries + 1):
                        log.info("cell %s, concurrency %d, %d requests (attempt %d) ...", arm,
                                 cc, n, attempt + 1)
                        cell = run_cell(spec, ccfg, wl, Path(tmp))
                        foreign = cell.noise.get("foreign_cores", 0.0)
                        if cell.aborted or foreign <= max_foreign or attempt == noisy_retries:
                            break
                        ttfts = [r["ttft"] for r in cell.results if r["ttft"] is not None]
                        discarded.append({"attempt": attempt + 1, "noise": cell.noise,
                                          "quiet": cell.quiet, "ttft_mean": statistics.fmean(
                                              ttfts) if ttfts else None})
                        log.warning("other processes used %.2f cores during the cell "
                                    "(> --max-foreign %.2f): measuring it again", foreign,
                                    max_foreign)
                    cells.append(cell)
                    if arm == "nocache":
                        mem_nocache[cc] = cell.memory
                    a = analyse_cell(cell, min(wl.system_tokens), mem_nocache.get(cc))
                    a["discarded_noisy_attempts"] = discarded
                    analysed.append(a)
                    log.info("  %s c=%d: %d ok, %d errors, mean TTFT %s, p99 %s, %.2f req/s%s",
                             arm, cc, a["ok"], a["errors"], fmt_s(a["ttft"].get("mean")),
                             fmt_s(a["ttft"].get("p99")), a["requests_per_s"],
                             f" (stopped: {cell.aborted})" if cell.aborted else "")
    except KeyboardInterrupt:
        interrupted = True
        log.warning("interrupted: stopping every server")
    finally:
        Group.stop_all()
        left = sweep_shm()
        if left:
            log.warning("removed leftovers of killed supervisors: %s", left)
    if interrupted and not analysed:
        raise SystemExit(130)
    res: dict[str, Any] = {
        "benchmark": "serve", "schema": 1,
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "duration_s": round(time.time() - started, 1),
        "command": " ".join(["python bench/bench_serve.py", *sys.argv[1:]]),
        "interrupted": interrupted,
        "machine": common.machine_info(_llama_versions()),
        "loadavg_end": list(common.loadavg()),
        "config": config, "goal": {"shmkv_mean_ttft_max_s": GOAL_MEAN_TTFT,
                                   "at_concurrency": GOAL_CONCURRENCY},
        "cells": analysed,
    }
    goal_cell = next((c for c in analysed if c["arm"] == "shmkv"
                      and c["concurrency"] == GOAL_CONCURRENCY), None)
    if goal_cell and goal_cell["ttft"].get("n"):
        res["goal"]["shmkv_mean_ttft_s"] = goal_cell["ttft"]["mean"]
        res["goal"]["met"] = goal_cell["ttft"]["mean"] <= GOAL_MEAN_TTFT
    res["code"] = code
    if code:
        live = code_digest(ROOT / "shmkv", ROOT / "workers")
        code["working_tree_changed_during_run"] = live != code["code_digest"]
    res["findings"] = findings(res)
    res["requests"] = {f"{c.arm}@{c.concurrency}": c.results for c in cells}
    res["memory_detail"] = {f"{c.arm}@{c.concurrency}": c.memory for c in cells}
    report(res, Path(out_dir), Path(baseline), write_baseline and not interrupted)
    if interrupted:
        raise SystemExit(130)


def reanalyse(res: dict[str, Any]) -> dict[str, Any]:
    """Re-derive the breakdowns and findings of a saved run from its per-request records."""
    sys_tokens = min(res["config"]["system_tokens"])
    for c in res["cells"]:
        rs = res["requests"].get(f"{c['arm']}@{c['concurrency']}", [])
        ok = [r for r in rs if r["t_send"] and r["error"] is None and r["ttft"] is not None]
        pids = sorted({r["worker_pid"] for r in ok if r["worker_pid"]})
        c["queueing"] = queueing(ok, pids, sys_tokens)
        if c["arm"].startswith("shmkv"):
            c["cache"] = shmkv_breakdown(ok, sys_tokens)
    res["findings"] = findings(res)
    res["reanalysed"] = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    return res


def report(res: dict[str, Any], out: Path, bpath: Path, write_baseline: bool,
           compare: bool = True) -> None:
    """Print the table and findings; write serve.json and serve.png (and the baseline)."""
    cfg, code = res["config"], res.get("code", {})
    quick, workers, threads, n_ctx = cfg["quick"], cfg["workers"], cfg["threads"], cfg["n_ctx"]
    n_prompts, n_requests, cacheless = cfg["prompts"], cfg["requests"], cfg["cacheless_requests"]
    max_tokens, sys_tokens = cfg["max_tokens"], cfg["system_tokens"]
    analysed = res["cells"]
    base = None
    if compare and bpath.exists():
        base = json.loads(bpath.read_text())
        if base.get("config", {}).get("quick") != quick:
            base = None
    out.mkdir(parents=True, exist_ok=True)
    jpath, ppath = out / "serve.json", out / "serve.png"
    jpath.write_text(json.dumps(res, indent=1) + "\n")
    plotted = plot(res, ppath)
    m = res["machine"]
    loads = [c["quiet"].get("loadavg", [None])[0] for c in analysed]
    click.echo(f"\nshmkv {m['versions'].get('shmkv')} (commit {code.get('commit')}"
               + (" + uncommitted changes" if code.get("dirty") else "") + ") "
               f"serving benchmark: Gemma 3 270M Q4_K_M, "
               f"{workers} gunicorn workers x {threads} thread, n_ctx {n_ctx}, {n_prompts} system "
               f"prompts of {min(sys_tokens)}-{max(sys_tokens)} tokens, "
               f"{n_requests} streaming requests (first {cacheless} for nocache/ramcache), "
               f"max_tokens {max_tokens}; {m['cpu']}, {m['cores']} cores; 1-min load at each "
               f"cell's start: {loads}" + (" (quick run: not comparable)" if quick else ""))
    click.echo(table(res, base))
    for line in res["findings"]:
        click.echo("- " + line)
    if "met" in res["goal"]:
        click.echo(f"goal (shmkv mean TTFT <= {GOAL_MEAN_TTFT} s at c={GOAL_CONCURRENCY}): "
                   f"{'met' if res['goal']['met'] else 'MISSED'} "
                   f"({fmt_s(res['goal']['shmkv_mean_ttft_s'])})")
    click.echo(f"\nwrote {jpath}" + (f" and {ppath}" if plotted else ""))
    if write_baseline:
        bpath.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(jpath, bpath)
        if plotted:
            shutil.copyfile(ppath, bpath.with_suffix(".png"))
        click.echo(f"wrote baseline {bpath}")


def _default_model() -> str:
    from shmkv.models import default_model_path

    return default_model_path()


if __name__ == "__main__":
    main()
