"""The CPU budget (shmkv/cpubudget.py): real processes, real llama.cpp, real gunicorn.

Several processes evaluate at once on one budget and log, from inside each eval, the
threads llama.cpp ran it on; at no instant do the logged evals add up to more threads
than the budget. A process killed while it holds cores leaks none; a stuck one delays
others at most ``--cpu-wait``, and a stopped one (no progress) one short wait per
request. Threads never change what the model computes: prompt and decode logits with
the budget equal a one-thread cold run's bit for bit, with flash attention on and off.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import llama_cpp
import numpy as np
import pytest

from shmkv.core.config import resolve
from shmkv.core.errors import UnsafePathError
from shmkv.llama.cpu import budget as cpubudget
from shmkv.llama.cpu import queue as cpuqueue
from tests.support import TESTS
from tests.support.cpu import board, wait_until_in_line
from tests.support.servers import EXTRA, SAMPLING, Server
from tests.support.waiting import wait_until

SHM = "/dev/shm"


@pytest.fixture
def name() -> str:
    """A private budget name; its file and bell are removed after the test."""
    n = f"t{uuid.uuid4().hex[:10]}"
    yield n
    cpubudget.remove(SHM, n)
    Path(cpubudget.budget_path(SHM, n)).unlink(missing_ok=True)  # (a handle a failed test
    Path(f"{SHM}/sem.{cpubudget.bell_name(n)[1:]}").unlink(missing_ok=True)  # left open)


# A process that evaluates prompts and decode steps through the hooked Llama.eval, on the
# budget, and logs each eval as the threads llama.cpp actually ran it on.
EVAL_WORKER = r"""
import json, os, sys, time
import llama_cpp
from llama_cpp import llama_cpp as lc
from shmkv.llama.cpu import budget as cpubudget
from shmkv.llama.cpu import queue as cpuqueue
from shmkv.llama import attach

model, name, cores, rounds, out, start_at = sys.argv[1:7]
llm = llama_cpp.Llama(model_path=model, n_ctx=2048, n_batch=64, n_ubatch=64, n_threads=1,
                      n_threads_batch=1, verbose=False)
log = open(out, "w")
plain = llm.eval

def recorded(tokens):
    ctx = llm._ctx.ctx
    n = lc.llama_n_threads_batch(ctx) if len(tokens) > 1 else lc.llama_n_threads(ctx)
    t0 = time.monotonic()
    plain(tokens)
    log.write(json.dumps([t0, time.monotonic(), n, len(tokens)]) + "\n")

llm.eval = recorded  # the hook below calls this, inside the cores it holds
cache = attach(llm, name=name, socket_path="/nonexistent/shmkv.sock")  # (no supervisor: cold)
cache.cpu = cpubudget.CpuBudget("/dev/shm", name, int(cores), wait=60)
while time.time() < float(start_at):
    time.sleep(0.001)
for i in range(int(rounds)):
    words = " ".join(f"w{(os.getpid() * 7 + i * 13 + k) % 97}" for k in range(150))
    llm.create_completion(words, max_tokens=6, temperature=0.0, top_k=1)
log.close()
"""


def _max_threads_at_once(intervals: list[tuple[float, float, int]]) -> int:
    """The largest sum of threads of intervals open at one instant (a sweep)."""
    events = sorted(
        [(t0, 1, n) for t0, _, n in intervals] + [(t1, 0, -n) for _, t1, n in intervals]
    )  # (at equal times, ends before starts)
    now = best = 0
    for _, _, delta in events:
        now += delta
        best = max(best, now)
    return best


def test_concurrent_evals_never_exceed_the_budget(tmp_path, models, name):
    cores, procs, rounds = 3, 4, 6
    start_at = time.time() + 8  # all start together, after loading their models
    outs = [tmp_path / f"evals{k}.jsonl" for k in range(procs)]
    ps = [
        subprocess.Popen(
            [sys.executable, "-c", EVAL_WORKER, models["seed0"], name, str(cores), str(rounds)]
            + [str(out), str(start_at)],
            cwd=TESTS,
        )
        for out in outs
    ]
    for p in ps:
        assert p.wait(300) == 0
    evals = [json.loads(line) for out in outs for line in out.read_text().splitlines()]
    intervals = [(t0, t1, n) for t0, t1, n, _ in evals]
    assert _max_threads_at_once(intervals) <= cores
    batches = [n for _, _, n, k in evals if k > 1]
    decodes = [n for _, _, n, k in evals if k == 1]
    assert decodes and set(decodes) == {1}, "a decode step runs on one thread"
    assert max(batches) == cores, "a batch with every core free takes them all"
    # the evals did overlap: the bound above was tested, not just never approached
    assert _max_threads_at_once([(t0, t1, 1) for t0, t1, _ in intervals]) >= 2


HOLDER = r"""
import sys, time
from shmkv.llama.cpu import budget as cpubudget
from shmkv.llama.cpu import queue as cpuqueue
b = cpubudget.CpuBudget("/dev/shm", sys.argv[1], int(sys.argv[2]))
g = b.take(int(sys.argv[2]))
print(len(g.slots), flush=True)
time.sleep(600)
"""


def _holder(name: str, cores: int) -> subprocess.Popen:
    p = subprocess.Popen(
        [sys.executable, "-c", HOLDER, name, str(cores)], stdout=subprocess.PIPE, text=True
    )
    assert p.stdout is not None and int(p.stdout.readline()) == cores
    return p


def test_a_killed_holder_leaks_no_core(name):
    cores = 3
    holder = _holder(name, cores)
    try:
        assert cpubudget.held_cores(SHM, name, cores) == cores
        with cpubudget.CpuBudget(SHM, name, cores, wait=60) as b:
            got: list[cpubudget.Grant] = []
            waiter = threading.Thread(target=lambda: got.append(b.take(cores)))
            waiter.start()
            wait_until_in_line(name, 1)  # (it found no core free, and waits)
            assert not got, "every core is held: the waiter waits"
            killed_at = time.monotonic()
            holder.send_signal(signal.SIGKILL)
            waiter.join(10)
            assert got and len(got[0].slots) == cores and not got[0].timed_out
            # a dead holder rings no bell: its cores are found by the next poll (0.05 s),
            # not at the end of --cpu-wait (60 s here); the bound leaves a loaded machine room
            assert time.monotonic() - killed_at < 15
            b.give_back(got[0])
            g = b.take(cores)  # and the next prefill gets them all at once
            assert len(g.slots) == cores and g.waited == 0
            b.give_back(g)
        assert cpubudget.held_cores(SHM, name, cores) == 0
    finally:
        holder.kill()
        holder.wait()


def test_a_stuck_holder_delays_others_at_most_cpu_wait(name):
    holder = _holder(name, 2)
    try:
        with cpubudget.CpuBudget(SHM, name, 2, wait=0.3) as b:
            g = b.take(2)
            assert g.timed_out and g.slots == [] and g.threads == 1
            assert 0.3 <= g.waited < 3
    finally:
        holder.kill()
        holder.wait()


# A holder of every core whose record expects a short run (a first, instant run gave its
# budget a rate): it spins for ARGV[3] s as a batch slowed by a loaded machine would, gives
# the cores back, then (on a line on stdin) takes them again and sleeps: no progress.
SLOWED_HOLDER = r"""
import sys, time
from shmkv.llama.cpu import budget as cpubudget
name, cores, spin = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
b = cpubudget.CpuBudget("/dev/shm", name, cores)
b.give_back(b.take(cores, tokens=100))
g = b.take(cores, tokens=100)
print("spinning", flush=True)
end = time.monotonic() + spin
while time.monotonic() < end:
    pass
b.give_back(g)
sys.stdin.readline()
b.give_back(b.take(cores, tokens=100))  # (a short run again: what it expects next)
g = b.take(cores, tokens=100)
print("sleeping", flush=True)
time.sleep(600)
"""


def test_a_holder_slowed_by_load_is_not_taken_for_stalled(name, monkeypatch):
    """A holder whose run takes far longer than it expected but that still gets CPU (a
    loaded machine) keeps its cores: a waiter waits for them instead of running past the
    budget beside it (which put 5 threads on a budget of 3 beside a CPU hog). Once the
    holder makes no progress (it sleeps holding them) the waiter stops waiting. The bound
    is made short here (0.25 s); the holder spins well past it and PROGRESS_SECONDS."""
    monkeypatch.setattr(cpuqueue, "STALL_MIN_SECONDS", 0.25)
    cores, spin = 2, 3 * cpuqueue.PROGRESS_SECONDS
    holder = subprocess.Popen(
        [sys.executable, "-c", SLOWED_HOLDER, name, str(cores), str(spin)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdin is not None
        assert holder.stdout.readline() == "spinning\n"
        with cpubudget.CpuBudget(SHM, name, cores, wait=60) as b:
            g = b.take(cores)
            assert not g.timed_out and len(g.slots) == cores, "taken for stalled while it ran"
            assert g.waited > 2 * cpuqueue.STALL_MIN_SECONDS, "it waited past the bound"
            b.give_back(g)
            holder.stdin.write("go\n")
            holder.stdin.flush()
            assert holder.stdout.readline() == "sleeping\n"
            g = b.take(cores)
            assert g.stalled and g.slots == [], "a holder that makes no progress is stalled"
            assert g.waited < 30, "well before --cpu-wait"
    finally:
        holder.kill()
        holder.wait()


# A worker on the budget (default --cpu-wait) that prefills a long prompt and stops itself
# (SIGSTOP) inside its fourth batch, holding every core; SIGCONT lets it finish.
STOPPED_PREFILL = r"""
import os, signal, sys
import llama_cpp
from shmkv.llama.cpu import budget as cpubudget
from shmkv.llama.cpu import queue as cpuqueue
from shmkv.llama import attach

model, name, cores, marker = sys.argv[1:5]
llm = llama_cpp.Llama(model_path=model, n_ctx=2048, n_batch=64, n_ubatch=64, verbose=False)
plain, batches = llm.eval, []

def stopping(tokens):
    batches.append(len(tokens))
    if len(batches) == 4:  # (inside the hook: the cores are held)
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGSTOP)
    plain(tokens)

llm.eval = stopping
cache = attach(llm, name=name, socket_path="/nonexistent/shmkv.sock")
cache.cpu = cpubudget.CpuBudget("/dev/shm", name, int(cores))
words = " ".join(f"w{k % 97}" for k in range(300))
llm.create_completion(words, max_tokens=2, temperature=0.0, top_k=1)
print(len(batches), flush=True)
"""

# Another worker of the same budget: one 16-token completion of a short prompt when told to
# (its time and cpu_wait_timeouts); first the same completion while nobody holds a core.
SIXTEEN_TOKENS = r"""
import json, os, sys, time
import llama_cpp
from shmkv.llama.cpu import budget as cpubudget
from shmkv.llama.cpu import queue as cpuqueue
from shmkv.llama import attach

model, name, cores, go = sys.argv[1:5]
llm = llama_cpp.Llama(model_path=model, n_ctx=512, n_batch=64, n_ubatch=64, verbose=False)
cache = attach(llm, name=name, socket_path="/nonexistent/shmkv.sock")
cache.cpu = cpubudget.CpuBudget("/dev/shm", name, int(cores))
no_eos = {llm.token_eos(): -1e9}

def sixteen(prompt):
    t0 = time.monotonic()
    out = llm.create_completion(prompt, max_tokens=16, temperature=0.0, top_k=1,
                                logit_bias=no_eos)
    assert out["usage"]["completion_tokens"] == 16, out["usage"]
    return time.monotonic() - t0

normal = sixteen("a b c d e f g h")
print(json.dumps({"ready": True}), flush=True)
while not os.path.exists(go):
    time.sleep(0.01)
took = sixteen("h g f e d c b a")
t = cache.ledger.totals
print(json.dumps({"normal": normal, "took": took, "timeouts": t.cpu_wait_timeouts}), flush=True)
"""


def _stopped(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


def test_a_stopped_prefill_costs_another_worker_one_short_wait(tmp_path, models, name):
    """A worker stopped mid-prefill (SIGSTOP: a paused container, a debugger) holds every
    core; another worker's 16-token completion, at the default --cpu-wait, waits once for
    the stalled holder (about a second), not --cpu-wait per token, counted once."""
    cores, marker, go = 2, tmp_path / "stopped", tmp_path / "go"
    b = subprocess.Popen(
        [sys.executable, "-c", SIXTEEN_TOKENS, models["seed0"], name, str(cores), str(go)],
        cwd=TESTS,
        stdout=subprocess.PIPE,
        text=True,
    )
    procs = [b]
    try:
        assert b.stdout is not None and json.loads(b.stdout.readline())["ready"]
        a = subprocess.Popen(  # (once b is idle: a's batches take every core)
            [sys.executable, "-c", STOPPED_PREFILL, models["seed0"], name, str(cores)]
            + [str(marker)],
            cwd=TESTS,
            stdout=subprocess.PIPE,
            text=True,
        )
        procs.append(a)
        wait_until(lambda: marker.exists() and _stopped(a.pid), 60, "the prefill to stop")
        assert cpubudget.held_cores(SHM, name, cores) == cores
        go.touch()
        got: list[str] = []
        reader = threading.Thread(target=lambda: got.append(b.stdout.readline()))
        reader.start()
        reader.join(30)  # (today: 17 evals x 30 s)
        assert got, "the 16-token completion did not finish in 30 s behind a stopped holder"
        res = json.loads(got[0])
        # one short wait (the stall bound, about a second), not the default --cpu-wait (30 s)
        # once, let alone per token; the slack is for a loaded machine
        assert res["took"] < res["normal"] + 15, res
        assert res["timeouts"] == 1, "one wait per request, counted once"
        assert b.wait(30) == 0
        a.send_signal(signal.SIGCONT)
        out, _ = a.communicate(timeout=60)
        assert a.returncode == 0 and int(out) > 4, "the stopped prefill finishes when resumed"
    finally:
        for p in procs:
            p.send_signal(signal.SIGCONT)
            p.kill()
            p.wait()


def test_cores_go_to_a_waiter_when_given_back(name, monkeypatch):
    """The bell: a waiter wakes when cores are given back, not at its next poll. The poll
    is made 60 s here, so that a waiter woken within the 10 s it is given was rung."""
    monkeypatch.setattr(cpubudget, "POLL_SECONDS", 60.0)
    delays = []
    with (
        cpubudget.CpuBudget(SHM, name, 1) as a,
        cpubudget.CpuBudget(SHM, name, 1, wait=120) as b,
    ):
        for _ in range(3):
            g = a.take(1)
            got: list[cpubudget.Grant] = []
            waiter = threading.Thread(target=lambda out=got: out.append(b.take(1)))
            waiter.start()
            wait_until_in_line(name, 1)  # (it found the core held, and waits)
            given = time.monotonic()
            a.give_back(g)
            waiter.join(10)
            delays.append(time.monotonic() - given)
            assert got and got[0].slots == [0], f"no bell woke the waiter: {delays}"
            b.give_back(got[0])


# ------------------------------------------------------------------ results unchanged
def _gemma() -> str:
    from shmkv.core.errors import ConfigError
    from shmkv.serving.default_model import default_model_path

    try:
        return default_model_path()
    except ConfigError as e:
        pytest.skip(str(e))


@pytest.mark.parametrize(
    ("model", "flash_attn"),
    # Gemma once, without flash attention (about 10 s on 2 cores): the tiny model covers both
    [("tiny", False), ("tiny", True), ("gemma", False)],
)
def test_threads_do_not_change_logits(models, name, model, flash_attn):
    """Prompt and decode logits with the budget (prompt batches on 4 threads, then on 2
    while another process holds 2 cores) equal a one-thread cold run's bit for bit."""
    import llama_cpp

    path = models["seed0"] if model == "tiny" else _gemma()
    kw = dict(
        model_path=path,
        n_ctx=1024,
        n_batch=128,
        n_ubatch=128,
        n_threads=1,
        n_threads_batch=1,
        flash_attn=flash_attn,
        logits_all=True,
        verbose=False,
    )
    llm = llama_cpp.Llama(**kw)
    # two prompt batches on Gemma (its 262k-entry vocabulary makes each token's logits cost
    # most of the case), four on the tiny model
    sentences = 40 if model == "tiny" else 20
    prompt = " ".join(f"The cat {i % 7} sits on mat {i % 5}." for i in range(sentences))
    params = {**SAMPLING, **EXTRA, "max_tokens": 8}
    ref_text = llm.create_completion(prompt, **params)["choices"][0]["text"]
    ref = llm.scores[: llm.n_tokens].copy()

    from shmkv.llama import attach

    cold = llama_cpp.Llama(**kw)
    cache = attach(cold, name=name, socket_path="/nonexistent/shmkv.sock", publish=False)
    cache.cpu = cpubudget.CpuBudget(SHM, name, 4)
    for busy, threads in ((0, 4), (2, 2)):
        holder = _holder(name, busy) if busy else None
        try:
            cold.reset()
            text = cold.create_completion(prompt, **params)["choices"][0]["text"]
        finally:
            if holder is not None:
                holder.kill()
                holder.wait()
        assert cache.last.prefill_threads == threads
        assert text == ref_text
        got = cold.scores[: cold.n_tokens]
        assert got.shape == ref.shape and np.array_equal(got, ref), (
            f"logits differ with {threads} threads: max {np.abs(got - ref).max()}"
        )
    cache.close()


# ------------------------------------------------------------------ who may touch it
def test_files_are_private_and_squatted_ones_refused(name):
    path = cpubudget.budget_path(SHM, name)
    with cpubudget.CpuBudget(SHM, name, 2):
        st = os.stat(path)
        assert st.st_uid == os.geteuid() and (st.st_mode & 0o777) == 0o600
        bell = Path(f"{SHM}/sem.{cpubudget.bell_name(name)[1:]}")
        assert bell.exists() and (bell.stat().st_mode & 0o777) == 0o600
    assert cpubudget.remove(SHM, name) and not path.exists() and not bell.exists()

    path.write_bytes(b"")  # ours, but open to others: they could lock its bytes
    os.chmod(path, 0o666)
    with pytest.raises(UnsafePathError, match="open to others"):
        cpubudget.CpuBudget(SHM, name, 2)
    path.unlink()
    os.symlink("/etc/passwd", path)
    with pytest.raises(UnsafePathError, match="symbolic link"):
        cpubudget.CpuBudget(SHM, name, 2)
    path.unlink()
    if os.geteuid() == 0:  # another user's file under our name
        path.write_bytes(b"")
        os.chmod(path, 0o600)
        os.chown(path, 65534, 65534)
        with pytest.raises(UnsafePathError, match="owned by uid 65534"):
            cpubudget.CpuBudget(SHM, name, 2)
        settings = resolve("serve", env={"SHMKV_NAME": name})
        assert cpubudget.for_settings(settings) is None  # the workers: static split
        path.unlink()


def test_remove_leaves_a_file_in_use(name):
    with cpubudget.CpuBudget(SHM, name, 2):
        assert not cpubudget.remove(SHM, name)
        assert cpubudget.budget_path(SHM, name).exists()
    assert cpubudget.remove(SHM, name)


# ------------------------------------------------------------------ gunicorn workers
# ------------------------------------------------------------- the cgroup's CPU quota
@pytest.mark.parametrize("layout", ["v2", "hybrid"])
def test_cgroup_quota_is_the_tightest_up_the_tree(tmp_path, layout):
    """Pure cgroup v2 (``0::`` the only line; ``cpu.max``), and a hybrid host (the cpu
    controller on v1, ``cpu.cfs_quota_us``; the unified ``0::`` line last, its tree with
    no cpu.max): the tightest quota from our cgroup up, in CPUs."""
    proc, root = tmp_path / "cgroup", tmp_path / "fs"
    if layout == "v2":
        proc.write_text("0::/a/b\n")
        for d, quota in [("", "max 100000"), ("a", "150000 100000"), ("a/b", "max 100000")]:
            (root / d).mkdir(parents=True, exist_ok=True)
            (root / d / "cpu.max").write_text(quota + "\n")
        want = 1.5
    else:
        proc.write_text("12:pids:/a/b\n4:cpu,cpuacct:/a/b\n1:name=systemd:/a/b\n0::/a/b\n")
        (root / "unified/a/b").mkdir(parents=True)
        for d, quota in [("", -1), ("a", 250000), ("a/b", -1)]:
            (root / "cpu,cpuacct" / d).mkdir(parents=True, exist_ok=True)
            (root / "cpu,cpuacct" / d / "cpu.cfs_quota_us").write_text(f"{quota}\n")
            (root / "cpu,cpuacct" / d / "cpu.cfs_period_us").write_text("100000\n")
        want = 2.5
    assert cpubudget.cgroup_quota(proc, root) == want
    proc.write_text("0::/\n")
    assert cpubudget.cgroup_quota(proc, root) is None  # (the root: no quota)


DEFAULT_CORES = r"""
import os, sys
if len(sys.argv) > 1:
    with open(sys.argv[1], "w") as f:  # join the cgroup
        f.write(str(os.getpid()))
from shmkv.llama.cpu import budget
print(budget.default_cores())
"""


@contextmanager
def cgroup_of_one_cpu() -> Iterator[Path]:
    """A new cgroup with a CPU quota of one CPU (v2 ``cpu.max``, or v1 where the cpu
    controller is on v1); its ``cgroup.procs``. Skips unless root can make one."""
    fs = Path("/sys/fs/cgroup")
    name = f"shmkv-test-{uuid.uuid4().hex[:8]}"
    try:
        v2 = fs / "cgroup.controllers"
        if v2.exists() and "cpu" in v2.read_text().split():  # pure v2
            (fs / "cgroup.subtree_control").write_text("+cpu")
            d = fs / name
            d.mkdir()
            (d / "cpu.max").write_text("100000 100000")
        else:
            d = fs / "cpu" / name  # v1 (or hybrid: the cpu controller on v1)
            d.mkdir()
            (d / "cpu.cfs_period_us").write_text("100000")
            (d / "cpu.cfs_quota_us").write_text("100000")
    except OSError as e:
        pytest.skip(f"cannot make a cgroup with a CPU quota here (needs root): {e}")
    try:
        yield d / "cgroup.procs"
    finally:
        d.rmdir()


def test_the_default_budget_is_capped_by_a_real_cgroups_quota():
    """A process in a cgroup limited to one CPU (on a machine with more) gets a default
    budget of one core, whatever cgroup version the machine has."""
    outside = subprocess.run(
        [sys.executable, "-c", DEFAULT_CORES], capture_output=True, text=True, check=True
    )
    if int(outside.stdout) < 2:
        pytest.skip("one core here already: nothing for a quota to cap")
    with cgroup_of_one_cpu() as procs:
        inside = subprocess.run(
            [sys.executable, "-c", DEFAULT_CORES, str(procs)],
            capture_output=True,
            text=True,
            check=True,
        )
    assert int(inside.stdout) == 1, (inside.stdout, outside.stdout)


LONG = " ".join(f"Policy {i}: the cat {i % 7} guards mat {i % 5}." for i in range(45))


def test_gunicorn_workers_share_the_budget(tmp_path, serve_model, make_supervisor, serve_reference):
    sup = make_supervisor("--size", "128M")
    env = {"SHMKV_CPU_BUDGET": "2", "SHMKV_THREADS": "0"}
    srv = Server(sup, serve_model, workers=4, tmp_path=tmp_path, env=env)
    path = cpubudget.budget_path(SHM, sup.name)
    try:
        # a cold prompt on an idle deployment runs on the whole budget
        text, info = srv.complete(LONG + " Which mat?")
        assert text == serve_reference(LONG + " Which mat?")
        assert info["prefill_threads"] == 2 and info["evaluated_tokens"] > 500
        seen: list[int] = []
        stop = threading.Event()
        every_slot = max(64, os.cpu_count() or 1)

        def probe() -> None:  # (every byte a core could be, not just the budget's two)
            while not stop.is_set():
                seen.append(cpubudget.held_cores(SHM, sup.name, every_slot))

        prober = threading.Thread(target=probe)
        prober.start()
        results: dict[int, tuple[str, dict]] = {}

        def ask(k: int) -> None:
            results[k] = srv.complete(f"Question {k}: " + LONG)

        askers = [threading.Thread(target=ask, args=(k,)) for k in range(4)]
        for t in askers:
            t.start()
        for t in askers:
            t.join(120)
        stop.set()
        prober.join()
        assert len(results) == 4
        for k, (text, _) in results.items():
            assert text == serve_reference(f"Question {k}: " + LONG)
        assert 1 <= max(seen) <= 2, f"the workers held {max(seen)} cores of a budget of 2"
        assert len({info["worker_pid"] for _, info in results.values()}) >= 2
    finally:
        srv.stop()
    assert not path.exists(), "the master removes the budget when it exits"


WAITS = ("cpu_waits", "cpu_wait_seconds", "cpu_wait_timeouts")


def health_waits(srv: Server) -> dict[str, float]:
    """The CPU wait counters of ``srv``'s /health (its one worker's contexts summed)."""
    caches = httpx.get(srv.base + "/health", timeout=10).json()["shmkv"]
    return {k: sum(c[k] for c in caches) for k in WAITS}


def test_health_counts_waits_for_cores(tmp_path, serve_model, make_supervisor):
    """A worker that waits for the budget's one core (held here) counts the wait in
    /health; one that stops waiting without a core counts a timeout too."""
    sup = make_supervisor("--size", "64M")
    env = {"SHMKV_CPU_BUDGET": "1", "SHMKV_CPU_WAIT": "2"}
    srv = Server(sup, serve_model, workers=1, tmp_path=tmp_path, env=env)
    holder = cpubudget.CpuBudget(SHM, sup.name, 1, wait=10)
    board_fd = os.open(cpubudget.budget_path(SHM, sup.name), os.O_RDWR)
    board = cpuqueue.Queue(board_fd)  # (a record of our own: we see the others')
    try:
        srv.complete(LONG)  # (loaded, and its batches timed)
        before = health_waits(srv)
        g = holder.take(1)
        with ThreadPoolExecutor(1) as pool:
            asked = pool.submit(srv.complete, "Question: " + LONG)
            wait_until(lambda: board.waiting(), 30, "the worker to wait for the core")
            holder.give_back(g)
            asked.result(60)
        waited = health_waits(srv)
        assert waited["cpu_waits"] >= before["cpu_waits"] + 1, (before, waited)
        assert waited["cpu_wait_seconds"] > before["cpu_wait_seconds"], (before, waited)
        assert waited["cpu_wait_timeouts"] == before["cpu_wait_timeouts"], (before, waited)
        g = holder.take(1)  # and kept: the worker stops waiting (--cpu-wait, or sooner: we
        # make no progress with it)
        srv.complete("Another question: " + LONG)
        holder.give_back(g)
        late = health_waits(srv)
        assert late["cpu_wait_timeouts"] == waited["cpu_wait_timeouts"] + 1, (waited, late)
        least = min(2.0, cpuqueue.STALL_MIN_SECONDS)  # (a holder that makes no progress)
        assert late["cpu_wait_seconds"] >= waited["cpu_wait_seconds"] + 0.9 * least, (waited, late)
    finally:
        os.close(board_fd)
        holder.close()
        srv.stop()


def test_static_threads_switch(tmp_path, serve_model, make_supervisor):
    sup = make_supervisor("--size", "64M")
    srv = Server(sup, serve_model, workers=1, tmp_path=tmp_path, env={"SHMKV_STATIC_THREADS": "1"})
    try:
        _, info = srv.complete(LONG)
        assert info["prefill_threads"] == 0
        assert not cpubudget.budget_path(SHM, sup.name).exists()
    finally:
        srv.stop()


# A holder of every core that is not stalled: its record expects a run of hours (a first,
# timed run gives its budget a rate), so only --cpu-wait ends another's wait for it.
BUSY_HOLDER = r"""
import sys, time
from shmkv.llama.cpu import budget as cpubudget
b = cpubudget.CpuBudget("/dev/shm", sys.argv[1], int(sys.argv[2]))
g = b.take(int(sys.argv[2]), tokens=1000)
time.sleep(0.1)
b.give_back(g)
g = b.take(int(sys.argv[2]), tokens=10**8)
print(len(g.slots), flush=True)
time.sleep(600)
"""


def test_a_stopped_holder_is_stalled_whatever_it_expected(name):
    """A holder of every core whose record expects a run of hours, stopped (SIGSTOP): a
    waiter stops waiting within a fraction of a second, not at its --cpu-wait (30 s here),
    which the record's bound would outlast (an estimate from short batches on a loaded
    machine can be that far off)."""
    cores = 2
    holder = subprocess.Popen(
        [sys.executable, "-c", BUSY_HOLDER, name, str(cores)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and int(holder.stdout.readline()) == cores
        holder.send_signal(signal.SIGSTOP)
        wait_until(lambda: _stopped(holder.pid), 10, "the holder to stop")
        with cpubudget.CpuBudget(SHM, name, cores, wait=30) as b:
            g = b.take(cores)
            assert g.stalled and g.slots == [], "a stopped holder is stalled"
            assert g.waited < 2.0, g.waited
    finally:
        holder.kill()
        holder.wait()


def test_threads_caps_a_prefill_and_cpu_wait_bounds_its_wait(
    tmp_path, serve_model, make_supervisor
):
    """Served workers on a budget of 2 cores: ``--threads 1`` caps a cold prefill at one
    thread though both cores are free (``--threads 0`` takes both: above); with both cores
    held by another process that is not stalled, ``--cpu-wait 0.5`` (not the default
    30 s) is how long the next prefill waits before it runs on one thread anyway, counted
    as a timeout."""
    sup = make_supervisor("--size", "64M")
    env = {"SHMKV_CPU_BUDGET": "2", "SHMKV_THREADS": "1", "SHMKV_CPU_WAIT": "0.5"}
    srv = Server(sup, serve_model, workers=1, tmp_path=tmp_path, env=env)
    holder = None
    try:
        _, info = srv.complete(LONG[:500] + " Which cat?")
        assert info["prefill_threads"] == 1 and info["evaluated_tokens"] > 50, info
        assert info["cpu_wait_ms"] == 0, info
        holder = subprocess.Popen(
            [sys.executable, "-c", BUSY_HOLDER, sup.name, "2"], stdout=subprocess.PIPE, text=True
        )
        assert holder.stdout is not None and int(holder.stdout.readline()) == 2
        _, info = srv.complete(LONG[:500] + " Which mat?")
        assert info["prefill_threads"] == 1 and 500 <= info["cpu_wait_ms"] < 15_000, info
        health = httpx.get(srv.base + "/health", timeout=10).json()
        assert health["shmkv"][0]["cpu_wait_timeouts"] >= 1, health
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()
        srv.stop()


def test_an_eval_with_tokens_after_it_keeps_its_place_in_line(models, name):
    """An eval that says more tokens follow apart (``Request.after``: a cold prompt's last
    tokens, evaluated after its checkpoint is captured) ends in line for them, at their
    count, instead of leaving the line: a prefill with more left waiting meanwhile does not
    take the cores in between (it did, and the cold prompt's last 64 tokens waited for its
    whole prefill). ``leave_line`` takes it out if they never come."""
    llm = llama_cpp.Llama(model_path=models["seed0"], n_ctx=512, n_batch=64, verbose=False)
    with (
        cpubudget.CpuBudget(SHM, name, 2, wait=60) as b,
        cpubudget.CpuBudget(SHM, name, 2, wait=60) as other,
    ):
        request = b.request(object())
        request.after = 64
        cpubudget.evaluate(b, llm, llm.eval, list(range(1, 101)), request=request)
        other._queue.wait(500, 2)
        assert other._queue.ahead()[0] == 2, "the eval left the line before its last tokens"
        mine = [rec for rec in board(name) if rec[3] == cpuqueue.WAITING and rec[1] == 64]
        assert len(mine) == 1
        b.leave_line()
        assert other._queue.ahead()[0] == 0
    llm.close()
