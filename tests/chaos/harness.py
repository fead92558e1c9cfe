"""What the four chaos files share: the prompts, the llama worker driver (``Worker``, the
parent side of ``chaos/worker.py``), cold references, the arena balance check and the
summary of every kill.

Runs in the pytest process. The chaos files, every one of them SIGKILLing real processes:

1. test_chaos_workers.py: llama workers killed in restore, publish and generation;
2. test_chaos_supervisor.py: the supervisor killed in put, evict, clear and start-up,
   under client threads hammering it, and reproducers of the bugs those kills found;
3. test_chaos_restart.py: the supervisor killed and restarted under running llama workers;
4. test_chaos_serve.py: the same under gunicorn (workers/app.py) over HTTP.

After each trial: leases and arena space balance (``leases_active == 0``, ``bytes_used`` ==
sum of the listed extents and of the chunks, every indexed record intact), every finished
request's text equals a cold plain ``Llama``'s, and a killed supervisor's files are taken
over by the next one, not accumulated. Once everything is stopped nothing named
``shmkv-NAME*`` is left in /dev/shm, and no socket.

``SHMKV_CHAOS_TRIALS`` (default 80; 210 or more before a release) sets the number of kills
of files 1-3 together, ``SHMKV_CHAOS_SERVE_TRIALS`` (default 15) those of file 4. Counts
are logged at INFO (run with ``--log-cli-level=INFO``), and one summary line when the
session ends.
"""

from __future__ import annotations

import collections
import json
import logging
import mmap
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import llama_cpp

from shmkv import Client
from tests.chaos.worker import COUNT_OFF, FLAG, FLAGS_SIZE, PHASES, READY, STOP
from tests.support import SHM
from tests.support.llama_workers import KW
from tests.support.supervisors import RESERVE_DEFAULT
from tests.support.waiting import wait_until

log = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
TRIALS = int(os.environ.get("SHMKV_CHAOS_TRIALS", "80"))
WORKER_TRIALS = max(1, round(TRIALS * 0.52))
RESTART_TRIALS = max(4, round(TRIALS * 0.07))
SUPERVISOR_TRIALS = max(1, TRIALS - WORKER_TRIALS - RESTART_TRIALS)
#: the share of a chaos test's trials it runs in the arena mode that is not the default
#: (the ``reserve_mode`` fixture; the suite's time)
RESERVE_OTHER_SHARE = 0.25


def trials(n: int, reserve: str, targets: int) -> int:
    """How many of a test's ``n`` trials it runs with ``--reserve`` ``reserve``: all in the
    default mode, a share in the other, but each of its ``targets`` at least once."""
    if reserve == RESERVE_DEFAULT:
        return n
    return min(n, max(targets, round(n * RESERVE_OTHER_SHARE)))


MAX_TOKENS = 24
_SYSTEMS = [("Rule", "cat", "mat"), ("Law", "dog", "rug"), ("Clause", "owl", "branch")]
SYSTEMS = [
    " ".join(f"{w} {i}: the {a} {i % 7} sits on the {b} {i % 5}." for i in range(60))
    for w, a, b in _SYSTEMS
]
SUFFIXES = [
    " Question: who sits?",
    " Question: where is it?",
    " Tell a story:",
    " Summary:",
    " List the rules in order.",
    " Why?",
]
PROMPTS = [s + q for s in SYSTEMS for q in SUFFIXES]

#: what a kill landed in, by the worker's flags; a kill may count in several phases
GROUPS = {
    "restore": ("restore", "lease", "set_data"),
    "publish": ("capture", "get_data", "put"),
    "generation": ("prefill", "decode"),
}

SUMMARY: dict[str, str] = {}
TOTALS: collections.Counter[str] = collections.Counter()


def log_summary() -> None:
    """One line for every chaos test that ran (nothing if none did)."""
    if SUMMARY:
        log.info(
            "chaos summary: %d kills, %d outputs compared with cold runs and %d blob reads "
            "verified, %d wrong, %d leaks or problems; %s",
            TOTALS["kills"],
            TOTALS["outputs"],
            TOTALS["reads"],
            TOTALS["wrong"],
            TOTALS["leaks"],
            "; ".join(f"{k}: {v}" for k, v in SUMMARY.items()),
        )


def shm_files(name: str) -> set[str]:
    """The files in /dev/shm of the supervisor ``name``: arena, lock and any temporary arena."""
    return {p.name for p in SHM.glob(f"shmkv-{name}*")}


def socket_litter(sock: str) -> set[str]:
    """The socket and any temporary socket a supervisor binds before renaming it into place."""
    p = Path(sock)
    return {
        x.name for x in p.parent.iterdir() if x.name == p.name or x.name.startswith(f".{p.name}.")
    }


def stale_arena_maps(pid: int, name: str) -> list[str]:
    """Mappings of a replaced (deleted) arena file of ``name`` still held by process ``pid``."""
    path = f"{SHM}/shmkv-{name}"
    try:
        with open(f"/proc/{pid}/maps") as f:
            return [ln.strip() for ln in f if path in ln and "(deleted)" in ln]
    except FileNotFoundError:
        return []


def check_arena(c: Client, conns: int = 1, timeout: float = 10.0) -> tuple[list[str], dict]:
    """Once only ``conns`` connections remain: leases and space balance, records intact.

    Returns (problems, stats); an empty list means consistent.
    """
    st = wait_until(
        lambda: (s := c.stats())["connections"] <= conns and s,
        timeout,
        f"connections to drop to {conns}",
    )
    ls = c.ls(limit=100_000)
    problems = []
    if st["leases_active"] != 0:
        problems.append(f"{st['leases_active']} lease(s) still active")
    if any(e["leases"] for e in ls["entries"]):
        problems.append("an entry still counts leases")
    if not st["entries"] == ls["total"] == len(ls["entries"]):
        problems.append(f"entries {st['entries']} vs listed {ls['total']}/{len(ls['entries'])}")
    # records' extents, and the chunks they share counted once
    extents = sum(e["extent"] for e in ls["entries"]) + ls["chunk_bytes"]
    if st["bytes_used"] != extents:
        problems.append(
            f"bytes_used {st['bytes_used']} != sum of extents {extents} "
            f"(leaked {st['bytes_used'] - extents})"
        )
    if not st["bytes_used"] <= st["bytes_capacity"] or st["index_used"] > st["index_capacity"]:
        problems.append(f"over capacity: {st}")
    keys = {e["key"] for e in ls["entries"]}
    view = c.view
    for slot in view.scan():
        try:
            rec = view.read_record(slot.rec_offset, slot.rec_gen)
            view.verify_meta(rec)
            if not view.verify_payload(rec):
                problems.append(f"record {rec.gen} fails its payload checksum")
            if rec.key.hex() not in keys:
                problems.append(f"indexed record {rec.gen} is not a live entry")
        except Exception as e:  # reported, not raised: the caller asserts on the list
            problems.append(f"slot {slot}: {e!r}")
    return problems, st


class Refs:
    """Cold greedy output of each prompt from a fresh plain ``Llama`` (computed on demand)."""

    def __init__(self, model: str) -> None:
        self.model = model
        self._text: dict[int, str] = {}

    def __getitem__(self, p: int) -> str:
        if p not in self._text:
            llm = llama_cpp.Llama(model_path=self.model, verbose=False, **KW)
            out = llm.create_completion(PROMPTS[p], max_tokens=MAX_TOKENS, temperature=0.0, seed=0)
            self._text[p] = out["choices"][0]["text"]
            del llm
        return self._text[p]


class Worker:
    """One ``chaos/worker.py`` process, started ahead of time, and its flags file."""

    def __init__(self, tmp_path: Path, tag: str) -> None:
        self.tag = tag
        self.flags_path = tmp_path / f"flags-{tag}"
        self.flags_path.write_bytes(b"\0" * FLAGS_SIZE)
        fd = os.open(self.flags_path, os.O_RDWR)
        self.flags = mmap.mmap(fd, FLAGS_SIZE)
        os.close(fd)
        self.err_path = tmp_path / f"worker-{tag}.err"
        env = {**os.environ, "PYTHONPATH": str(HERE.parent.parent)}
        with open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(HERE / "worker.py")],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                env=env,
                text=True,
            )
        self.lines: list[dict] = []
        self.torn = 0
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            try:
                self.lines.append(json.loads(raw))
            except ValueError:
                self.torn += 1  # a line cut by the kill

    def go(self, sup, seed: int, requests: int = 0) -> None:
        spec = {
            "model": sup.model,
            "kw": KW,
            "name": sup.name,
            "socket": sup.socket,
            "flags": str(self.flags_path),
            "prompts": PROMPTS,
            "max_tokens": MAX_TOKENS,
            "seed": seed,
            "requests": requests,
        }
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(spec) + "\n")
        self.proc.stdin.close()

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def ready(self) -> bool:
        return bool(self.flags[READY])

    @property
    def finished(self) -> int:
        return int.from_bytes(self.flags[COUNT_OFF : COUNT_OFF + 4], "little")

    def phases(self) -> list[str]:
        return [p for p in PHASES if self.flags[FLAG[p]]]

    def kill(self) -> list[str]:
        """SIGKILL; returns the phases in progress at the moment of death."""
        os.kill(self.proc.pid, signal.SIGKILL)
        rc = self.proc.wait(10)
        assert rc == -signal.SIGKILL, (rc, self.stderr())
        self._reader.join(10)
        return self.phases()

    def stop(self, timeout: float = 60) -> int:
        self.flags[STOP] = 1
        rc = self.proc.wait(timeout)
        self._reader.join(10)
        return rc

    def results(self) -> list[dict]:
        return [x for x in self.lines if "text" in x]

    def totals(self) -> dict | None:
        return next((x["totals"] for x in self.lines if "totals" in x), None)

    def stderr(self) -> str:
        return self.err_path.read_text()[-3000:]

    def discard(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.flags.close()


def wait_flag(workers: list[Worker], phase: str, timeout: float) -> Worker | None:
    """Busy-wait until one of ``workers`` is in ``phase``; the windows are sub-millisecond."""
    i = FLAG[phase]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for _ in range(500):
            for w in workers:
                if w.flags[i]:
                    return w
        os.sched_yield()
        if any(w.proc.poll() is not None for w in workers):
            return None
    return None


def check_outputs(worker: Worker, refs: Refs, wrong: list[str]) -> int:
    """Compare every finished request of ``worker`` with the cold reference; returns how many."""
    results = worker.results()
    for r in results:
        if r["text"] != refs[r["p"]]:
            wrong.append(
                f"worker {worker.tag} request {r['i']} prompt {r['p']}: "
                f"{r['text']!r} != cold {refs[r['p']]!r} (last={r['last']})"
            )
    return len(results)


def kill_phase_counts(kills: list[list[str]]) -> tuple[dict[str, int], dict[str, int]]:
    """Kills by the phase they hit, and by group of phases (restore, publish, generation)."""
    per_phase = {p: sum(1 for k in kills if p in k) for p in PHASES}
    groups: collections.Counter[str] = collections.Counter()
    for k in kills:
        hit = [g for g, ps in GROUPS.items() if any(p in k for p in ps)]
        for g in hit:
            groups[g] += 1
        if not hit:
            groups["startup" if "startup" in k else "between steps" if k else "idle"] += 1
    return per_phase, dict(groups)
