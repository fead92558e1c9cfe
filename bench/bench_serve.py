"""Serving benchmark: gunicorn workers, shared system prompts, streaming TTFT per arm (arms,
cells, phases, goals and options: docs/benchmarks.md). Smoke run: ``--quick`` (~3 min)."""

from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import heapq
import importlib.metadata
import itertools
import logging
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import common
from llama_cpp.server.settings import ModelSettings, ServerSettings

from shmkv.core.config import parse_size
from shmkv.serving.chat_template import GEMMA3_FORMAT, GEMMA3_TEMPLATE, default_chat_format

log = logging.getLogger("bench_serve")
opt = common.option

# issue 13's goals on the shmkv arms (completions and chat), at concurrency 4 but req/s (at
# 10) and the CPU budget's (at 1: `--concurrency 1 --prompts N --requests N --idle 1`, every
# request cold on an idle deployment, against one Llama on all cores)
GOALS = [("mean TTFT (s)", "<=", 0.45), ("llama-server's mean TTFT / shmkv's", ">=", 4.0),
         ("p50 TTFT / (restore floor + suffix)", "<=", 1.5),
         ("req/s / llama-server's req/s", ">=", 1.0),
         ("PSS - arena used / llama-server's PSS", "<=", 1.5),
         ("cold TTFT / one process's on all cores", "<=", 1.10)]  # fmt: skip
SEED = 11
ARMS = {  # arm: its label, and for a shmkv arm its settings beyond the common ones
    "nocache": ("llama_cpp.server, no cache", None),
    "ramcache": ("llama_cpp.server + LlamaRAMCache", None),
    "shmkv": ("shmkv serve", {}),
    "shmkv-exact": ("shmkv serve --exact (hits bit for bit a cold run's)", {"SHMKV_EXACT": "true"}),
    "shmkv-static": ("shmkv serve --static-threads (no CPU budget)",  # always on --threads
                     {"SHMKV_STATIC_THREADS": "true"}),
    "shmkv-q8_0": ("shmkv serve --cache-type-k q8_0 --cache-type-v q8_0",
                   {"SHMKV_CACHE_TYPE_K": "q8_0", "SHMKV_CACHE_TYPE_V": "q8_0"}),
    "llama-server": ("llama.cpp llama-server -np N --cache-ram", None),
}  # fmt: skip
# the same requests as messages, to /v1/chat/completions: arm X-chat runs X's server
ARMS |= {f"{a}-chat": (f"{label}, /v1/chat/completions", env) for a, (label, env) in ARMS.items()
         if a not in ("shmkv-static", "shmkv-q8_0")}  # fmt: skip
DEFAULT_ARMS = "nocache,ramcache,llama-server,shmkv,shmkv-exact"
DEFAULT_ARMS += "," + ",".join(f"{a}-chat" for a in DEFAULT_ARMS.split(","))


THEMES = [  # system prompts in turn: an opening, then the template of its lines
    ("You are the archivist of a large museum. Follow these catalogue rules when answering "
     "visitors, and answer briefly.\n\n", "Rule {n}: the {0} room holds {1} and {2} items; "
     "visitors who ask about the {3} go to the {4} desk, never to the {5} hall.\n"),
    ("You are the dispatcher of the cargo vessel Northern Star. The shipping log below is your "
     "only source; quote it exactly.\n\n", "Day {n}. Loaded {0} crates of {1} and a barrel of "
     "{2}; the wind came from the {3}, and the {4} was stored below the {5}.\n"),
    ("You are the concierge of the Grand Hotel. Guests ask about their rooms; use the register "
     "below and be polite.\n\n", "Room {n} is painted {0}, faces the {1}, and its guest ordered "
     "{2} tea with {3} at dawn; the key hangs beside the {4} and the {5}.\n"),
    ("You are a railway timetable assistant. Answer only from the timetable below, giving "
     "platform and time.\n\n", "Train {n} leaves {0} station at platform {m} for {1}, stops at "
     "{2} and {3}, carries a {4} car and terminates near the {5} bridge.\n"),
    ("You are the librarian of an old abbey. Readers ask where books are; the shelf list below "
     "is complete.\n\n", "Shelf {n}: the book on {0} sits between the {1} atlas and the {2} "
     "herbal; it was bound in {3} leather by a {4} monk who loved the {5}.\n"),
    ("You are the head gardener's assistant. The planting plan below says what grows where; "
     "answer gardeners' questions from it.\n\n", "Bed {n} grows {0} beside {1}; water it after "
     "the {2} bell, keep the {3} away, and mulch it with {4} bark from the {5} grove.\n"),
]  # fmt: skip
QUESTION = "Question {i}: what does the plan say about the {0} and the {1}?"
TURN = "<start_of_turn>user\n{}<end_of_turn>\n<start_of_turn>model\n"


@dataclass
class Workload:
    system: list[str]
    system_tokens: list[int]
    requests: list[tuple[int, str]]  # (system prompt index, user question)

    def prompt(self, k: int) -> str:
        p, question = self.requests[k]
        return TURN.format(f"{self.system[p]}\n{question}")

    def messages(self, k: int) -> list[dict[str, str]]:
        p, question = self.requests[k]
        return [common.msg("system", self.system[p]), common.msg("user", question)]


def make_workload(model: Path, n_prompts: int, prompt_tokens: int, n_requests: int) -> Workload:
    """Each system prompt equally often, in an order shuffled with a fixed seed."""
    tok, rng = common.tokenizer(model), random.Random(SEED)

    def lines(template: str) -> Any:
        return lambda n: template.format(*rng.sample(common.WORDS, 6), n=n, m=rng.randint(1, 12))

    system = []
    for p in range(n_prompts):
        head, line = THEMES[p % len(THEMES)]
        head = f"(Edition {p // len(THEMES) + 1}) " * (p >= len(THEMES)) + head
        system.append(common.fill_to(prompt_tokens, lambda t: len(tok(t)), head, lines(line)))
    order = [k % n_prompts for k in range(n_requests)]
    rng.shuffle(order)
    qs = [(p, QUESTION.format(*rng.sample(common.WORDS, 2), i=i)) for i, p in enumerate(order)]
    return Workload(system, [len(tok(s)) for s in system], qs)


def llama_server_args(cfg: dict[str, Any]) -> list[str]:
    """``--workers`` slots of n_ctx each, every core, ``--cache-ram`` MiB of prompt cache."""
    slots, cores = cfg["workers"], str(os.cpu_count() or 1)
    decode = str(cfg.get("llama_server_threads") or cores)
    args = ["-m", cfg["model"], "-a", "gemma", "-c", str(cfg["n_ctx"] * slots), "-np", str(slots)]
    args += ["--no-kv-unified", "-t", decode, "-tb", cores, "--no-webui"]
    return args + ["--cache-ram", str(cfg["llama_server_cache_ram_mib"])]


# CPU only and nothing fetched at build time (the same kernels as the wheel), one binary
CMAKE_FLAGS = """-DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_CUDA=OFF -DGGML_METAL=OFF
-DGGML_VULKAN=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON
-DBUILD_SHARED_LIBS=OFF""".split()


def build_llama_server(jobs: int = 2) -> Path:
    """llama.cpp's ``llama-server`` from the llama.cpp that the installed llama-cpp-python's
    sdist vendors (cmake, CPU only, no curl, plus ``$CMAKE_ARGS``), built once into
    ``~/.cache/shmkv-bench/llama-server-<version>[-<hash of $CMAKE_ARGS>]/`` (minutes)."""
    ver = importlib.metadata.version("llama-cpp-python")  # the llama.cpp the other arms run
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "shmkv-bench"
    # $CMAKE_ARGS, as pip's build of llama-cpp-python takes them (CPU flags: both sides alike)
    extra = shlex.split(os.environ.get("CMAKE_ARGS", ""))
    tag = "-" + hashlib.sha256(" ".join(extra).encode()).hexdigest()[:8] if extra else ""
    exe = (dest := cache / f"llama-server-{ver}{tag}") / "llama-server"
    if exe.is_file() and os.access(exe, os.X_OK):
        return exe
    dest.mkdir(parents=True, exist_ok=True)
    (build_log := dest / "build.log").write_text("")
    work = Path(tempfile.mkdtemp(prefix="llama-server-build-", dir=dest))

    def run(*args: str) -> None:
        log.info("$ %s", " ".join(args))
        with open(build_log, "ab") as f:
            if rc := subprocess.run(args, cwd=work, stdout=f, stderr=subprocess.STDOUT).returncode:
                tail = build_log.read_text(errors="replace")[-3000:]
                raise click.ClickException(f"{args[0]} failed ({rc}); end of {build_log}:\n{tail}")

    try:
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        run(*pip, f"llama-cpp-python=={ver}", "-d", str(work))
        with tarfile.open(next(work.glob("*.tar.gz"))) as tar:
            tar.extractall(work, filter="data")
        src, out = next(work.glob("*/vendor/llama.cpp")), work / "build"
        gen = ["-G", "Ninja"] if shutil.which("ninja") else []
        run("cmake", "-S", str(src), "-B", str(out), *gen, *CMAKE_FLAGS, *extra)
        log.info("building llama-server with %d jobs (minutes; log: %s)", jobs, build_log)
        run("cmake", "--build", str(out), "--target", "llama-server", "-j", str(jobs))
        shutil.copy2(next(out.glob("bin/llama-server")), tmp := dest / "llama-server.tmp")
        tmp.replace(exe)  # atomic: a half-copied binary is never "cached"
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return exe


def start_server(arm: str, cfg: dict[str, Any], workdir: Path, sup: Any) -> common.Server:
    """The server of ``arm``: shmkv serve on ``sup``, llama-server, or llama_cpp.server."""
    model, threads, n_ctx = cfg["model"], str(cfg["threads"]), str(cfg["n_ctx"])
    arm, workers = arm.removesuffix("-chat"), cfg["workers"]
    chat_format = default_chat_format(model)  # (as shmkv serve: Gemma 3's own template)
    if arm == "llama-server":  # without our LLAMA_ARG_* (it would read them as settings)
        srv = common.Server("llama-server", workdir, workers, single=True)
        args = [cfg["llama_server_binary"], *llama_server_args(cfg), "--jinja"]
        if chat_format == GEMMA3_FORMAT:  # Gemma 3's template as a Jinja file (the GGUF has none)
            (path := workdir / "gemma3.jinja").write_text(GEMMA3_TEMPLATE)
            args += ["--chat-template-file", str(path)]
        env = {k: v for k, v in common.child_env().items() if not k.startswith("LLAMA_ARG_")}
        return srv.start([*args, "--host", "127.0.0.1", "--port", str(srv.port)], env)
    if sup is not None:  # the CPU budget: a prompt batch on every free core, a decode on one
        env = {"SHMKV_MODEL": model, "SHMKV_N_CTX": n_ctx, "SHMKV_EXACT": "false"}
        env |= {"SHMKV_LOG_LEVEL": "info", "SHMKV_WORKER_TIMEOUT": "900"}
        env["SHMKV_THREADS"] = threads if arm == "shmkv-static" else str(cfg["budget_threads"])
        srv = common.Server("shmkv-serve", workdir, workers)  # (on sup: no supervisor of its own)
        env |= {"SHMKV_NAME": sup.name, "SHMKV_SOCKET": sup.socket, "SHMKV_PORT": str(srv.port)}
        env |= {"SHMKV_WORKERS": str(workers), **ARMS[arm][1]}
        return srv.start([sys.executable, "-m", "shmkv", "serve"], common.child_env(env))
    env = {"MODEL": model, "N_CTX": n_ctx, "N_THREADS": threads, "N_THREADS_BATCH": threads}
    # a stream runs to its end, as in shmkv serve's app (llama_cpp.server would cut it short
    # whenever another request waits for its worker's model)
    env |= {"VERBOSE": "false", "INTERRUPT_REQUESTS": "false"}
    env |= {"CHAT_FORMAT": chat_format} if chat_format else {}
    if arm == "ramcache":
        env |= {"CACHE": "true", "CACHE_TYPE": "ram"}
        env["CACHE_SIZE"] = str(cfg["ramcache_size_per_worker"])
    srv = common.Server(f"gunicorn-{arm}", workdir, workers)
    args = f"-m gunicorn -w {workers} -k uvicorn_worker.UvicornWorker -b 127.0.0.1:{srv.port}"
    args += " --timeout 900 --graceful-timeout 30 --keep-alive 5 --log-level info"
    args += f" --pythonpath {common.HERE} plain_app:create_app()"
    return srv.start([sys.executable, *args.split()], common.child_env(env))


def mem_snapshot(pids: dict[str, list[int]], arena: Path | None) -> dict[str, Any]:
    """Memory of every server process by role; the arena's PSS once."""
    procs: dict[str, Any] = {}
    for role, pid in ((r, p) for r, ps in pids.items() for p in ps):
        if (m := common.smaps(pid, str(arena or "")))["rss"]:
            procs[str(pid)] = dict(role=role, rss=m["rss"], pss=m["pss"], uss=m["private"])
            procs[str(pid)]["arena_pss"] = m["path_pss"]
    workers = [r for r in procs.values() if r["role"] == "worker"]
    out = {"processes": procs, "arena_pss": sum(r["arena_pss"] for r in procs.values())}
    out |= {f"total_{k}": sum(r[k] for r in procs.values()) for k in ("rss", "pss", "uss")}
    out |= {f"workers_{k}": sum(r[k] for r in workers) for k in ("rss", "pss")}
    out["mem_available"] = common.meminfo("MemAvailable")
    with contextlib.suppress(OSError, AttributeError):
        st = arena.stat()  # type: ignore[union-attr]
        out.update(arena_file_bytes=st.st_size, arena_allocated_bytes=st.st_blocks * 512)
    return out


class MemoryWatch(threading.Thread):
    """Samples memory every 0.25 s; stops the cell past its memory limits."""

    def __init__(self, pids: Any, cfg: dict[str, Any], on_abort: Any) -> None:
        super().__init__(name="memory-watch", daemon=True)
        self.pids, self.on_abort, self.cfg = pids, on_abort, cfg
        self.abort, self.done = threading.Event(), threading.Event()
        self.abort_at: float | None = None  # perf_counter
        self.reason, self.peak_footprint = None, 0  # (why it stopped the cell; bytes)

    def run(self) -> None:
        while not self.done.is_set():  # (a sample, then the next after 0.25 s)
            rss = [common.status_rss(pid) for pid in self.pids()]
            shared = sum(max((r.get(k, 0) for r in rss), default=0) for k in common.RSS_KINDS[1:])
            footprint = sum(r.get("RssAnon:", 0) for r in rss) + shared
            self.peak_footprint = max(self.peak_footprint, footprint)
            avail, cap = common.meminfo("MemAvailable"), self.cfg["max_rss"]
            if footprint > cap:
                what = f"{common.fmt_b(footprint)} (private RSS + shared once)"
                self.reason = f"server memory {what} > {common.fmt_b(cap)}"
            elif avail and avail < self.cfg["min_available"]:
                self.reason = f"only {common.fmt_b(avail)} of memory available"
            if self.reason and not self.abort.is_set():
                log.warning("stopping the cell: %s", self.reason)
                self.abort_at = time.perf_counter()
                self.abort.set()
                try:
                    self.on_abort()
                except Exception:  # the watch must keep its promise: no hang
                    log.exception("stopping the server failed")
            self.done.wait(0.25)


def send(client: Any, srv: common.Server, max_tokens: int, **body: Any) -> dict[str, Any]:
    """One streaming request: ``prompt=`` to /v1/completions, ``messages=`` to chat."""
    url = srv.base + ("/v1/chat/completions" if "messages" in body else "/v1/completions")
    body |= dict(model="gemma", max_tokens=max_tokens, temperature=0.0, stream=True)
    return common.stream_completion(client, url, body)


def run_load(srv: common.Server, wl: Workload, n: int, cc: int, cfg: dict[str, Any], abort: Any,
             chat: bool) -> tuple[list[dict[str, Any]], float]:  # fmt: skip
    """Closed loop: ``cc`` clients take the next request in turn (as chat with ``chat``)."""
    results = [{"k": k, "prompt": wl.requests[k][0], "t_send": 0.0} for k in range(n)]
    nxt, lock = iter(range(n)), threading.Lock()

    def client_loop(c: int) -> None:
        with common.http_client(cfg["timeout"]) as client:
            while not abort.is_set():
                with lock:
                    if (k := next(nxt, None)) is None:
                        return
                time.sleep(cfg.get("idle", 0.0))  # (every worker's threads asleep)
                if cfg.get("aside"):  # a short unrelated prompt first, untimed (bench_prefix)
                    send(client, srv, 1, prompt=TURN.format(f"Aside {k}: name a colour."))
                what = {"messages": wl.messages(k)} if chat else {"prompt": wl.prompt(k)}
                r = send(client, srv, cfg["max_tokens"], seed=SEED, **what)
                no_text = None if r["ttft"] is not None else f"no text in {r['chunks']} chunks"
                r.update(worker_pid=(r["shmkv"] or {}).get("worker_pid"), client_thread=c)
                results[k].update(r, error=r["error"] or no_text)

    t0 = time.monotonic()  # (stream_completion's clock)
    common.in_threads(cc, client_loop)
    for r in results:  # relative to the start of the cell
        r["t_send"] = r["t_send"] - t0 if r["t_send"] else 0.0
    return results, time.monotonic() - t0


def run_cell(arm: str, cc: int, n: int, cfg: dict[str, Any], wl: Workload, workdir: Path) -> Any:
    """One (arm, concurrency) cell on fresh servers; its raw record."""
    cell: dict[str, Any] = {"arm": arm, "concurrency": cc, "planned": n}
    cell |= dict.fromkeys(["aborted", "abort_s", "shmkv_stats"])
    with contextlib.ExitStack() as stack:
        sup = None
        if arm.startswith("shmkv"):
            disk: tuple[str, ...] = ()  # (a store of its own: none refills another cell's)
            if cfg.get("persist"):
                disk = ("--persist", tempfile.mkdtemp(prefix=f"persist-{arm}-", dir=workdir))
            sup = stack.enter_context(
                common.supervisor(workdir, "--size", cfg["arena_size"], *disk)
            )
        t, srv = time.monotonic(), start_server(arm, cfg, workdir, sup)
        # SIGKILL on errors and Ctrl-C: in-flight prefills would hold SIGTERM up for 30 s
        stack.push(lambda exc_type, _e, _tb: srv.stop(kill=exc_type is not None))
        llama_server = arm.removesuffix("-chat") == "llama-server"
        srv.wait_ready(logged=None if llama_server else "Application startup complete")
        cell["startup_s"], cell["worker_pids"] = time.monotonic() - t, srv.worker_pids()

        def warm_up(first: int, w: int) -> None:  # a short unrelated prompt (under one chunk)
            with common.http_client(300) as client:
                r = send(client, srv, 2, prompt=TURN.format(f"Warm-up {first + w}: name a colour."))
            if r["error"] or r["ttft"] is None:
                raise click.ClickException(f"warm-up request failed: {r['error']}")

        for rnd in range(3):  # on every worker, untimed
            common.in_threads(srv.workers, functools.partial(warm_up, rnd * srv.workers))
        time.sleep(0.5 * (sup is not None))  # the warm-up's counters reach the supervisor
        cell["quiet"] = common.wait_until_quiet(cfg["max_load"], cfg["max_wait"])
        stats0 = sup.stats() if sup else None

        def pids() -> dict[str, list[int]]:  # every process a user of the server pays for
            if llama_server:
                return {"server": [srv.child.pid]}
            roles = {"master": [srv.master_pid()], "worker": srv.worker_pids()}
            if srv.master_pid() != srv.child.pid:  # `shmkv serve`, which watches the others
                roles["watcher"] = [srv.child.pid]
            return roles | ({"supervisor": [sup.child.pid]} if sup else {})

        snapshot = functools.partial(mem_snapshot, arena=sup and common.SHM / f"shmkv-{sup.name}")
        mem0, at_abort = snapshot(pids()), {}

        def abort_now() -> None:  # memory as it is, then SIGKILL: nothing graceful to wait for
            at_abort.update(snapshot(pids()))
            srv.stop(kill=True)

        watch = MemoryWatch(lambda: [p for ps in pids().values() for p in ps], cfg, abort_now)
        watch.start()
        t0 = time.perf_counter()
        try:
            chat = arm.endswith("-chat")
            cell["results"], cell["wall_s"] = run_load(srv, wl, n, cc, cfg, watch.abort, chat)
        finally:
            watch.done.set()
            watch.join(5)
        if watch.abort.is_set():
            cell["aborted"], cell["abort_s"] = watch.reason, (watch.abort_at or t0) - t0
        elif sup is not None:
            time.sleep(1.0)  # the publisher threads deliver the last puts and counters
        mem1 = at_abort or snapshot(pids())
        if sup is not None:
            if cfg.get("persist"):  # the write-behind idle: its queue empty, nothing new
                seen: list[int] = []

                def on_disk() -> bool:
                    st = sup.stats()
                    seen.append(st["persisted"] + st["persist_gone"])
                    return st["persist_queue"] == 0 and seen[-3:] == [seen[-1]] * 3

                common.poll(on_disk, 120, "the write-behind", every=0.25)
            with contextlib.suppress(Exception):
                cell["shmkv_stats"] = {"before": stats0, "after": sup.stats()}
        cell["memory"] = dict(after_warmup=mem0, end=mem1, peak_footprint=watch.peak_footprint)
    return cell


def cache_class(r: dict[str, Any], sys_tokens: int) -> str:
    """hit (restored from the arena), local (the worker's context already held it), cold."""
    k = r["shmkv"]
    local = "local" if k["reused_local_tokens"] >= sys_tokens // 2 else "cold"
    return "hit" if k["restored_tokens"] > 0 else local


def queueing(done: list[dict[str, Any]], workers: list[int]) -> dict[str, Any]:
    """Requests that reached a worker busy with another (while another was idle), on the server's
    clock: each in flight from ``received_at`` to ``first_token_at`` + the decode its client saw."""
    spans = [(k["received_at"], k["first_token_at"] + r["total"] - r["first_chunk"], w)
             for r in done if (w := r["worker_pid"]) and (k := r["shmkv"])]  # fmt: skip
    if not spans:
        return {"n": 0}
    known, busy, misrouted = set(workers) | {w for *_, w in spans}, [], []
    for i, (at, _, pid) in enumerate(spans):
        inflight = {w for j, (a, b, w) in enumerate(spans) if j != i and a <= at < b}
        busy.append(pid in inflight)
        misrouted.append(busy[-1] and any(w not in inflight for w in known))
    return {"n": len(spans), "landed_on_busy": sum(busy),
            "landed_on_busy_while_another_idle": sum(misrouted), "clock": "server"}  # fmt: skip


def shmkv_breakdown(rs: list[dict[str, Any]], sys_tokens: int) -> dict[str, Any]:
    """What the cache did, from each stream's ``shmkv`` field (hits, waits, colds)."""
    if not (rs := [r for r in rs if r["shmkv"]]):
        return {"n": 0}
    by = {c: [r for r in rs if cache_class(r, sys_tokens) == c] for c in ("hit", "cold", "local")}
    hits, cold, total = by["hit"], by["cold"], sum(r["ttft"] for r in rs)
    per_prompt = dict(collections.Counter(str(r["prompt"]) for r in cold))
    tokens = [("restored_tokens", hits, "restored_tokens"), ("prompt_tokens", rs, "")]
    tokens += [("evaluated_tokens_hit", hits, "evaluated_tokens")]
    return {
        "n": len(rs), "hits": len(hits), "cold": len(cold), "local_reuse": len(by["local"]),
        "cold_per_prompt": per_prompt, "cold_beyond_one_per_prompt": len(cold) - len(per_prompt),
        "cold_share_of_ttft": sum(r["ttft"] for r in cold) / total if total else None,
        **{f"ttft_{g}": common.summary([r["ttft"] for r in v]) for g, v in by.items()},
        **{k: common.summary([r["shmkv"][f or k] for r in v]) for k, v, f in tokens},
    }  # fmt: skip


# where a shmkv request's time to first token went, in order (each phase's span is in the docs'
# table "Where the time to first token goes"); they add up to its TTFT
PHASES = ("queue", "app", "coalesce wait", "remote wait", "restore", "cpu wait", "prefill",
          "first decode", "other", "response")  # fmt: skip
IN_CALL = ("coalesce wait", "remote wait", "restore", "cpu wait", "prefill", "first decode")
WAITS = ("queue", "app", "coalesce wait", "remote wait", "cpu wait")


def phases_of(r: dict[str, Any]) -> dict[str, float] | None:
    """The phases of one request's TTFT in seconds (they sum to it); None without them."""
    k = r.get("shmkv") or {}
    if None in (r.get("sent_at"), r["ttft"]) or not {"first_token_at", "received_at"} <= set(k):
        return None
    p = {"queue": k["received_at"] - r["sent_at"], "app": k["started_at"] - k["received_at"]}
    p |= {ph: k[ph.replace(" ", "_") + "_ms"] / 1e3 for ph in IN_CALL}
    p["prefill"] -= p["cpu wait"]
    p["other"] = k["first_token_at"] - k["started_at"] - sum(p[x] for x in IN_CALL)
    p["response"] = r["sent_at"] + r["ttft"] - k["first_token_at"]
    return p


def phase_breakdown(rs: list[dict[str, Any]], sys_tokens: int) -> dict[str, Any]:
    """Per request class: each phase's mean and share of the summed TTFT."""
    rows, out = [(r, p) for r in rs if (p := phases_of(r)) is not None], {}
    for cls in ("all", "cold", "hit", "local"):
        if sel := [(r, p) for r, p in rows if cls == "all" or cache_class(r, sys_tokens) == cls]:
            ttft = sum(r["ttft"] for r, _ in sel)
            sums = {ph: sum(p[ph] for _, p in sel) for ph in PHASES}
            out[cls] = {"n": len(sel), "ttft_mean": ttft / len(sel)}
            out[cls]["mean"] = {ph: v / len(sel) for ph, v in sums.items()}
            out[cls]["share"] = {ph: v / ttft if ttft else None for ph, v in sums.items()}
    return out


def ideal_mean_ttft(prompts: list[int], cc: int, prefill: dict[int, float], hit: float,
                    decode: float, workers: int) -> float:  # fmt: skip
    """The ideal line, a lower bound: the cell's requests in order, each once one of its clients
    and one of the deployment's workers (one stream each) are free; a prompt's first request
    prefilled alone on all cores (timed in one process), one at a time; a later one waits for
    that, then costs the cell's mean hit or local reuse less its waits (queue, app, coalesce,
    remote, CPU); no core shared. No assumption adds a cost (nothing beats all cores alone, equal
    prefills in turn end sooner on average than sharing cores if all cores are >= 1.5x as fast
    as half, no prefix is restored before it exists, no worker serves two streams), but hits
    and decodes cost what they did in the cell."""
    free, lane, ready, ttfts, idle = [0.0] * cc, 0.0, {}, [], [0.0] * workers
    for p in prompts:
        t = heapq.heappop(free)
        if p in ready:
            first = max(t, heapq.heappop(idle), ready[p]) + hit
        else:
            first = lane = ready[p] = max(t, heapq.heappop(idle), lane) + prefill[p]
        ttfts.append(first - t)
        for heap in (free, idle):
            heapq.heappush(heap, first + decode)
    return sum(ttfts) / len(ttfts) if ttfts else 0.0


def ideal(c: dict[str, Any], out: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any] | None:
    """``ideal_mean_ttft`` of a shmkv cell: the prefills timed before it, its hits less WAITS."""
    measured, sys_tokens = (cfg.get("cold_prefill") or {}).get("seconds"), min(cfg["system_tokens"])
    done = [r for r in c["results"] if r["ttft"] is not None and r["total"] is not None]
    warm = [p for r in done if r.get("shmkv") and cache_class(r, sys_tokens) != "cold"
            if (p := phases_of(r)) is not None]  # fmt: skip
    if not measured or not warm or not done:
        return None
    hit = sum(sum(p.values()) - sum(p[w] for w in WAITS) for p in warm) / len(warm)
    decode = sum(r["total"] - r["ttft"] for r in done) / len(done)
    prefill, prompts = {int(p): s for p, s in measured.items()}, cfg["request_prompts"]
    args = (prompts[: c["planned"]], c["concurrency"], prefill, hit, decode)
    return dict(mean_ttft_s=ideal_mean_ttft(*args, cfg["workers"]), hit_s=hit, decode_s=decode,
                unlimited_mean_ttft_s=ideal_mean_ttft(*args, c["concurrency"]),
                measured_mean_ttft_s=out["ttft"].get("mean"), cold_prefill=cfg["cold_prefill"],
                assumes=" ".join((ideal_mean_ttft.__doc__ or "").split()))  # fmt: skip


def measure_cold_prefill(model: Path, wl: Workload, cfg: dict[str, Any]) -> dict[str, Any]:
    """In one Llama on all cores: each system prompt's cold TTFT (its first request), and the
    restore floor plus suffix (``set_data`` of a shared prefix's state from a private buffer,
    the rest of the prompt and the first token) for the next three requests of each prompt."""
    cores, by_prompt = os.cpu_count() or 1, {}
    quiet = common.wait_until_quiet(cfg["max_load"], cfg["max_wait"])
    for k, (p, _) in enumerate(wl.requests):
        by_prompt.setdefault(p, []).append(k)
    llm, seconds, ttfts, suffixes = common.llama(model, cores, n_ctx=cfg["n_ctx"]), {}, [], []
    try:
        llm.create_completion(TURN.format("Warm-up: name a colour."), max_tokens=1)
        for p, ks in sorted(by_prompt.items()):
            llm.reset()  # (nothing of the last prompt is reused)
            seconds[str(p)] = common.first_token(llm, wl.prompt(ks[0]), max_tokens=1)["ttft"]
        for ks in (ks for ks in by_prompt.values() if len(ks) > 1):
            toks = [llm.tokenize(wl.prompt(k).encode(), special=True) for k in ks[:4]]
            diff = (i for i, (a, b) in enumerate(zip(*toks[:2], strict=False)) if a != b)
            fl = common.Floor(llm, toks[0][: next(diff, min(map(len, toks[:2])))])
            for k, t in zip(ks[1:4], toks[1:], strict=True):
                llm.reset()
                r = common.first_token(llm, wl.prompt(k), fl.restore, max_tokens=1, temperature=0.0)
                ttfts.append(r["ttft"])
                suffixes.append(float(len(t) - len(fl.tokens)))
    finally:
        llm.close()
    floor = {"ttft": common.summary(ttfts), "suffix_tokens": common.summary(suffixes)}
    return {"seconds": seconds, "threads": cores, "quiet": quiet, "floor": floor}


def supervisor_own_pss(snapshot: dict[str, Any]) -> int | None:
    """The supervisor's PSS less its arena pages' in a :func:`mem_snapshot` (None: none)."""
    procs = snapshot["processes"].values()
    return next((p["pss"] - p["arena_pss"] for p in procs if p["role"] == "supervisor"), None)


def analyse_cell(c: dict[str, Any], sys_tokens: int) -> dict[str, Any]:
    """A cell's figures."""
    attempted = [r for r in c["results"] if r["t_send"]]
    ok = [r for r in attempted if r["error"] is None and r["ttft"] is not None]
    errors = [r for r in attempted if r not in ok]
    stop = float("inf") if c["abort_s"] is None else c["abort_s"]
    cut = [r for r in errors if r["t_send"] + (r["total"] or 0) >= stop]  # by our stopping it
    errors, m1 = [r for r in errors if r not in cut], c["memory"]["end"]
    mem: dict[str, Any] = {f"{k}_end": m1[k] for k in ("total_pss", "total_rss", "workers_pss")}
    mem |= dict(footprint_peak=c["memory"]["peak_footprint"], arena_pss_end=m1["arena_pss"])
    mem |= common.pick(m1, "arena_allocated_bytes")
    w0, w1 = (supervisor_own_pss(m) for m in (c["memory"]["after_warmup"], m1))  # issue 34
    mem |= dict(supervisor_own_pss_after_warmup=w0, supervisor_own_pss_end=w1)
    if w0 is not None and w1 is not None:
        mem["supervisor_own_pss_growth"] = w1 - w0
    out: dict[str, Any] = common.pick(c, "arm concurrency planned aborted wall_s quiet startup_s")
    out |= dict(label=ARMS[c["arm"]][0], attempted=len(attempted), ok=len(ok), errors=len(errors))
    out |= dict(error_samples=sorted({r["error"] for r in errors})[:5], cut_by_stop=len(cut))
    out["interrupted_streams"] = sum(r["finish_reason"] is None for r in ok)
    out["requests_per_s"] = len(ok) / c["wall_s"] if c["wall_s"] else 0.0
    out |= {k: common.summary([r[k] for r in ok]) for k in ("ttft", "total", "text_chunks")}
    out |= dict(memory=mem, queueing=queueing(ok, c["worker_pids"]))
    if c["arm"].startswith("shmkv"):
        out["cache"] = shmkv_breakdown(ok, sys_tokens)
        out["phases"] = phase_breakdown(ok, sys_tokens)
        if c["shmkv_stats"]:
            a, b = c["shmkv_stats"]["before"], c["shmkv_stats"]["after"]
            counters = "hits misses tokens_restored tokens_evaluated puts duplicate_puts"
            counters += " rejected_puts evictions restore_failures"
            ends = "entries bytes_used bytes_capacity workers_attached chunk_tokens"
            ends += " persist_records persist_bytes persisted_bytes"
            delta = {k: v - a.get(k, 0) for k, v in common.pick(b, counters).items()}
            out["supervisor"] = {"delta": delta, "end": common.pick(b, ends)}
    used = (out.get("supervisor") or {}).get("end", {}).get("bytes_used", 0)
    mem["arena_used_end"] = used  # the goal's measure: PSS the cache's own bytes do not explain
    mem["total_pss_minus_arena_used_end"] = mem["total_pss_end"] - used
    return out


def goals(cells: list[dict[str, Any]], cfg: dict[str, Any]) -> dict[str, Any]:
    """GOALS, each checked on the shmkv cells it applies to."""
    cp = cfg.get("cold_prefill") or {}
    floor = (cp.get("floor") or {}).get("ttft", {}).get("p50")
    alone = sum(cp["seconds"].values()) / len(cp["seconds"]) if cp.get("seconds") else None
    where = {}
    for c in cells:
        if c["arm"] not in ("shmkv", "shmkv-chat") or not c["ttft"].get("n"):
            continue
        ref = (r := llama_server_cell(c, cells)) and r["ttft"].get("n") and r
        m, cold, t = {}, c.get("cache", {}).get("ttft_cold", {}).get("mean"), c["ttft"]
        if c["concurrency"] == 4:
            m["mean TTFT (s)"] = t["mean"]
            m["llama-server's mean TTFT / shmkv's"] = ref and ref["ttft"]["mean"] / t["mean"]
            m["p50 TTFT / (restore floor + suffix)"] = floor and t["p50"] / floor
            m["PSS - arena used / llama-server's PSS"] = c["memory"].get("vs_llama_server")
        if c["concurrency"] == 10 and ref and ref["requests_per_s"]:
            m["req/s / llama-server's req/s"] = c["requests_per_s"] / ref["requests_per_s"]
        if c["concurrency"] == 1 and cold and alone:
            m["cold TTFT / one process's on all cores"] = cold / alone
        where[cell_key(c)] = m
    return {"checks": common.check_goals(GOALS, where), "floor_p50_s": floor}


def llama_server_cell(c: dict[str, Any], cells: list[dict[str, Any]]) -> dict[str, Any] | None:
    """llama-server's cell at the same concurrency and endpoint as ``c``, if it ran."""
    key = ("llama-server" + "-chat" * c["arm"].endswith("-chat"), c["concurrency"])
    return next((r for r in cells if (r["arm"], r["concurrency"]) == key), None)


def table(res: dict[str, Any], baseline: dict[str, Any] | None) -> str:
    """Every cell and what the cache did."""
    f, b, rows, detail = common.fmt_s, common.fmt_b, [], []
    base = {cell_key(c): c["ttft"] for c in (baseline or {}).get("cells", [])}
    for c in res["cells"]:
        k, q, t, m = c.get("cache", {}), c["queueing"], c["ttft"], c["memory"]
        stopped = f" (stopped at {c['attempted']})" if c["aborted"] else ""
        row = {"arm": c["label"], "conc": c["concurrency"], "ok/err": f"{c['ok']}/{c['errors']}"}
        row |= {"ok/err": row["ok/err"] + stopped, "cut": c["interrupted_streams"]}
        row |= {"TTFT mean": f(t.get("mean")), "p50": f(t.get("p50")), "p99": f(t.get("p99"))}
        row |= {"req/s": f"{c['requests_per_s']:.2f}", "server PSS": b(m["total_pss_end"])}
        row |= {"PSS - arena": b(m["total_pss_minus_arena_used_end"])}
        row["vs llama-server"] = f"{v:.2f}x" if (v := m.get("vs_llama_server")) else "-"
        rows.append(row | {"baseline mean": f(base.get(cell_key(c), {}).get("mean"))})
        if k.get("n"):
            detail.append({
                "cell": cell_key(c), "hits": k["hits"], "hit mean": f(k["ttft_hit"].get("mean")),
                "local": k["local_reuse"], "cold": k["cold"],
                "cold mean": f(k["ttft_cold"].get("mean")),
                "cold dup": k["cold_beyond_one_per_prompt"],
                "cold share": f"{(k['cold_share_of_ttft'] or 0) * 100:.0f} %",
                "on busy": q.get("landed_on_busy", "-"),
                "busy+idle": q.get("landed_on_busy_while_another_idle", "-"),
                "evictions": c.get("supervisor", {}).get("delta", {}).get("evictions", "-"),
                "arena used": b(m["arena_used_end"]),
                "supervisor own +": b(m.get("supervisor_own_pss_growth"))})  # fmt: skip
    return "\n\n".join(filter(None, [common.dict_table(rows, left=2), common.dict_table(detail)]))


def phase_table(cells: list[dict[str, Any]], cfg: dict[str, Any]) -> str:
    """Each shmkv cell's phases per request class, and the ideal scheduler's mean."""
    rows, notes, f = [], [], common.fmt_s
    label = {"all": "all", "cold": "cold", "hit": "arena hit", "local": "local reuse"}
    for c in cells:
        for cls, ph in (c.get("phases") or {}).items():
            row = {"cell": cell_key(c), "requests": label[cls], "n": ph["n"]}
            row["TTFT mean"] = f(ph["ttft_mean"])
            share = {k: f" ({(v or 0) * 100:.0f} %)" for k, v in ph["share"].items()}
            rows.append(row | {k: f(ph["mean"][k]) + share[k] for k in PHASES})
        if i := c.get("ideal"):
            m, u, cp = i["measured_mean_ttft_s"], i["unlimited_mean_ttft_s"], i["cold_prefill"]
            notes.append(f"- {cell_key(c)}: mean TTFT {f(m)}, ideal line {f(i['mean_ttft_s'])} "
                         f"({m / i['mean_ttft_s']:.2f}x; hit {f(i['hit_s'])}, decode "
                         f"{f(i['decode_s'])}; without the worker limit {f(u)}); cold prefill "
                         f"alone on {cp['threads']} threads, timed before the cell: "
                         f"{', '.join(f(v) for v in cp['seconds'].values())}")  # fmt: skip
    notes += [c["ideal"]["assumes"] for c in cells if c.get("ideal")][:1]
    return "\n\n".join([common.dict_table(rows, left=2), "\n".join(notes)]) if rows else ""


def cell_key(c: dict[str, Any]) -> str:
    return f"{c['arm']}@{c['concurrency']}"


@common.command("serve", "Smoke run: 2 short prompts, 8 requests, c=4.", True, 1, 0.7, 3600.0)
@opt("--arms", default=DEFAULT_ARMS, help=f"Comma-separated, of {', '.join(ARMS)}.")
@opt("--requests", type=int, help="Requests per cell [60; quick 8].")
@opt("--cacheless-requests", type=int, help="Only the first N for nocache/ramcache [all].")
@opt("--concurrency", help="Comma-separated levels [4,10; quick 4].")
@opt("--prompts", type=int, help="System prompts [6; quick 2].")
@opt("--prompt-tokens", type=int, help="Tokens per system prompt [1000; quick 400].")
@opt("--max-tokens", default=16)
@opt("--workers", default=4, help="gunicorn workers.")
@opt("--n-ctx", default=4096)
@opt("--arena-size", default="1G", help="shmkv arena size.")
@opt("--timeout", default=900.0, help="Per-request read timeout, seconds.")
@opt("--idle", default=0.0, help="Seconds each client waits before each request.")
@opt("--ideal/--no-ideal", default=True, help="Time one cold prefill per system prompt first.")
def main(report: common.Report, o: Any) -> None:
    """Serve shared system prompts: no cache vs LlamaRAMCache vs llama-server vs shmkv."""
    quick, arms = o.quick, [a.strip() for a in o.arms.split(",") if a.strip()]
    if unknown := [a for a in arms if a not in ARMS]:
        raise click.BadParameter(f"unknown arms {unknown}; choose from {list(ARMS)}")
    n, model = o.requests or (8 if quick else 60), o.model
    cfg = dict(quick=quick, model=str(model), model_bytes=model.stat().st_size, arms=arms)
    cfg |= common.pick(vars(o), "workers threads n_ctx max_tokens arena_size timeout idle")
    cfg |= common.pick(vars(o), "max_load max_wait") | dict(requests=n, budget_threads=0)
    cfg |= dict(prompts=o.prompts or (2 if quick else 6), llama_server_threads=0)
    cfg |= dict(prompt_tokens_target=o.prompt_tokens or (400 if quick else 1000))
    cfg |= dict(cacheless_requests=min(o.cacheless_requests or n, n))
    cfg["concurrency"] = [int(x) for x in (o.concurrency or ("4" if quick else "4,10")).split(",")]
    cfg |= dict(ramcache_size_per_worker=1 << 30, max_rss=16 << 30, min_available=3 << 30)
    cfg |= dict(llama_server_cache_ram_mib=parse_size(o.arena_size) >> 20, phases=PHASES)
    if any(a.removesuffix("-chat") == "llama-server" for a in arms):
        cfg["llama_server_binary"] = str(build_llama_server())
        cfg["llama_server_args"] = llama_server_args(cfg)
    # every request streamed, greedy, on a new connection; a chat arm's as these messages
    cfg["prompt_format"] = TURN.format("{system}\n{question}")
    cfg["chat_messages"] = [common.msg("system", "{system}"), common.msg("user", "{question}")]
    if cfg["prompt_tokens_target"] + cfg["max_tokens"] + 64 > cfg["n_ctx"]:
        raise click.BadParameter("prompt + max tokens must fit --n-ctx")
    wl = make_workload(model, cfg["prompts"], cfg["prompt_tokens_target"], n)
    cfg.update(system_tokens=wl.system_tokens, request_prompts=[p for p, _ in wl.requests])
    what = "%d system prompts of %s tokens; %d requests; concurrency %s; arms %s"
    log.info(what, cfg["prompts"], wl.system_tokens, n, cfg["concurrency"], arms)
    fields = {f.upper() for f in [*ModelSettings.model_fields, *ServerSettings.model_fields]}
    for k in [k for k in os.environ if k.upper() in fields | {"CONFIG_FILE"}]:
        del os.environ[k]  # llama_cpp.server would read them: every arm gets only ours
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # as Ctrl-C: servers stopped
    cells, analysed, interrupted = [], [], False
    try:
        with tempfile.TemporaryDirectory(prefix="shmkv-bench-serve-") as tmp:
            for arm, cc in itertools.product(arms, cfg["concurrency"]):
                cacheless = arm.removesuffix("-chat") in ("nocache", "ramcache")
                n_cell = cfg["cacheless_requests"] if cacheless else n
                if o.ideal and arm.startswith("shmkv"):  # (just before: the machine's speed drifts)
                    cfg["cold_prefill"] = measure_cold_prefill(model, wl, cfg)
                    log.info("cold prefill on all cores, one process: %s", cfg["cold_prefill"])
                log.info("cell %s, concurrency %d, %d requests", arm, cc, n_cell)
                cells.append(run_cell(arm, cc, n_cell, cfg, wl, Path(tmp)))
                a = analyse_cell(cells[-1], min(wl.system_tokens))
                if a.get("phases"):
                    a["ideal"] = ideal(cells[-1], a, cfg)
                analysed.append(a)
                done = f"{a['ok']} ok, {a['errors']} errors, {a['requests_per_s']:.2f} req/s"
                stopped = f" (stopped: {a['aborted']})" if a["aborted"] else ""
                log.info("  %s, mean TTFT %s%s", done, common.fmt_s(a["ttft"].get("mean")), stopped)
    except KeyboardInterrupt:  # the cell's servers were stopped on the way out
        interrupted = True
    if interrupted and not analysed:
        raise SystemExit(130)
    for c in analysed:  # (llama-server may run after the others: its cells come last)
        if (r := llama_server_cell(c, analysed)) and (ref := r["memory"]["total_pss_end"]):
            m = c["memory"]  # PSS - arena used over llama-server's PSS
            m["vs_llama_server"] = m["total_pss_minus_arena_used_end"] / ref
    goal = goals(analysed, cfg)
    res = {**report.header(*"gunicorn uvicorn uvicorn-worker fastapi httpx psutil".split())}
    res |= dict(interrupted=interrupted, config=cfg, goal=goal, cells=analysed)
    res["requests"] = {cell_key(c): c["results"] for c in cells}
    res["memory_detail"] = {cell_key(c): c["memory"] for c in cells}
    click.echo(f"\n{common.title(res, 'serving')}; {cfg['workers']} workers x {cfg['threads']} "
               f"thread, {cfg['prompts']} system prompts of {min(wl.system_tokens)}-"
               f"{max(wl.system_tokens)} tokens, {n} requests (first {cfg['cacheless_requests']} "
               f"for nocache/ramcache); 1-min load at each cell's start: "
               f"{[c['quiet']['loadavg'][0] for c in analysed]}")  # fmt: skip
    click.echo(table(res, report.baseline(quick)))
    if text := phase_table(analysed, cfg):
        click.echo(f"\nwhere the shmkv arms' time to first token went (mean per request)\n{text}")
    if goal["checks"]:
        floor = f"(restore floor + suffix, p50, one Llama: {common.fmt_s(goal['floor_p50_s'])})"
        click.echo(f"\ngoals\n{common.goal_table(goal['checks'])}\n{floor}")
    chart = [(f"{cell_key(c)}: TTFT", c["ttft"].get("p50"), c["ttft"].get("p99")) for c in analysed]
    report.write(res, chart, "the run was interrupted" * interrupted)
    if interrupted:
        raise SystemExit(130)


if __name__ == "__main__":
    main()
