"""Which prefill gets the CPU budget's cores first (shmkv/cpuqueue.py): real processes on
one real budget file, locks and bell.

The prefill with the fewest tokens left goes first, whoever waited longer; a prefill
between two batches keeps its place in line while its cores are free; a prefill that has
waited long enough passes a stream of short ones; a waiter killed or stopped in line holds
nobody up.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from shmkv.llama.cpu import budget as cpubudget
from shmkv.llama.cpu import queue as cpuqueue
from tests.support.cpu import HeldCore, board, wait_until_in_line, waiting_on_board
from tests.support.waiting import wait_until

SHM = "/dev/shm"

# One process on the budget: "take REMAINING [hold] [give_back NEXT] [pause] [take NEXT]..."
# as a JSON list of steps; prints a JSON line per step with the monotonic time it ended
# ("ready": just the line, once the budget is open).
ACTOR = r"""
import json, os, sys, time
from shmkv.llama.cpu import budget as cpubudget
name, cores, steps = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
stop = sys.argv[4] if len(sys.argv) > 4 else ""
b = cpubudget.CpuBudget("/dev/shm", name, cores, wait=60)
g = None
for op, arg in steps:
    if op == "take":
        g = b.take(cores, remaining=arg)
    elif op == "decode":  # one decode step's take: one core
        g = b.take(1)
    elif op == "give_back":
        b.give_back(g, next_remaining=arg, next_want=cores)
    elif op == "sleep":
        time.sleep(arg)
    elif op == "slow_grab":  # from now on, each grab of cores first sleeps ARG s
        plain = b._grab
        b._grab = lambda want, into, plain=plain, s=arg: (time.sleep(s), plain(want, into))[1]
        continue
    elif op == "await":  # until the file ARG exists (the process has loaded by then)
        while not os.path.exists(arg):
            time.sleep(0.002)
        continue
    elif op == "loop_short":   # short prefills back to back for ARG seconds (or until stop)
        end = time.monotonic() + arg
        n = 0
        while time.monotonic() < end and not (stop and os.path.exists(stop)):
            g = b.take(cores, remaining=20)
            time.sleep(0.02)
            b.give_back(g)
            n += 1
        print(json.dumps({"op": op, "n": n, "t": time.monotonic()}), flush=True)
        continue
    elif op == "loop_decode":  # decode steps of 20 ms back to back for ARG s (or until stop)
        end = time.monotonic() + arg
        n = worst = 0
        while time.monotonic() < end and not (stop and os.path.exists(stop)):
            t0 = time.monotonic()
            g = b.take(1)
            worst = max(worst, time.monotonic() - t0) if n else 0  # (its first: no estimate)
            time.sleep(0.02)
            b.give_back(g)
            n += 1
        print(json.dumps({"op": op, "n": n, "worst": worst, "t": time.monotonic()}), flush=True)
        continue
    elif op == "batches":  # one prefill of ARG batches of 0.25 s, back to back
        for k in range(int(arg), 0, -1):
            g = b.take(cores, remaining=1000 * k)
            time.sleep(0.25)
            b.give_back(g, next_remaining=1000 * (k - 1), next_want=cores)
    held = len(g.slots) if g is not None else 0
    print(json.dumps({"op": op, "arg": arg, "t": time.monotonic(), "cores": held}), flush=True)
"""


@pytest.fixture
def name() -> str:
    n = f"q{uuid.uuid4().hex[:10]}"
    yield n
    cpubudget.remove(SHM, n)
    Path(cpubudget.budget_path(SHM, n)).unlink(missing_ok=True)
    Path(f"{SHM}/sem.{cpubudget.bell_name(n)[1:]}").unlink(missing_ok=True)


def actor(
    name: str, cores: int, steps: list[tuple[str, float]], stop: Path | None = None
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", ACTOR, name, str(cores), json.dumps(steps), str(stop or "")],
        stdout=subprocess.PIPE,
        text=True,
    )


def events(p: subprocess.Popen[str], timeout: float = 60) -> list[dict[str, float]]:
    out, _ = p.communicate(timeout=timeout)
    assert p.returncode == 0, out
    return [json.loads(line) for line in out.splitlines()]


def test_shortest_prefill_first_whoever_waited_longer(name):
    """One core, held; a 1,000-token prefill gets in line, then a 20-token one: when the
    core comes free the short one runs first (a bell ring alone would wake the long one)."""
    with cpubudget.CpuBudget(SHM, name, 1, wait=60):
        held = HeldCore(name)
        long = actor(name, 1, [("take", 1000), ("sleep", 0.3), ("give_back", 0)])
        wait_until_in_line(name, 1)
        short = actor(name, 1, [("take", 20), ("sleep", 0.3), ("give_back", 0)])
        wait_until_in_line(name, 2)
        held.release()
        got_long = events(long)[0]["t"]
        got_short = events(short)[0]["t"]
    assert got_short < got_long, "the long prefill took the core before the short one"
    assert got_long - got_short >= 0.25  # (the long one waited for the short one's batch)


def _between_batches(
    name: str, pause: float, waiter: list[tuple[str, float]]
) -> tuple[list[dict[str, float]], float]:
    """One core, held; a prefill of 1,000 tokens gets in line, then the 2,000-token
    ``waiter``; the core comes free. The prefill runs a batch, gives the core back with 500
    tokens to go and takes it again ``pause`` s later. (The prefill's steps, when the waiter
    got the core.)"""
    with cpubudget.CpuBudget(SHM, name, 1, wait=60):
        held = HeldCore(name)
        first = actor(
            name,
            1,
            [("take", 1000), ("sleep", 0.2), ("give_back", 500), ("sleep", pause)]
            + [("take", 500), ("sleep", 0.2), ("give_back", 0)],
        )
        wait_until_in_line(name, 1)
        second = actor(name, 1, [*waiter, ("take", 2000), ("give_back", 0)])
        wait_until_in_line(name, 2)
        held.release()
        steps = events(first)
        got_second = events(second)[0]["t"]
    return steps, got_second


def test_a_prefill_between_batches_keeps_its_place(name):
    """A prefill gives back its core after a batch with 500 tokens to go and takes it again
    50 ms later; a 2,000-token prefill in line all the while does not get it in between."""
    steps, got_second = _between_batches(name, 0.05, [])
    second_batch = steps[3]["t"]  # (the take of its 500 remaining)
    assert second_batch < got_second, "the longer prefill took the core between two batches"


def test_a_waiter_that_grabbed_the_core_of_a_prefill_back_in_line_gives_it_back(name):
    """The race the test above met once in a full run: a waiter reads the line while the
    other prefill runs (nobody ahead), and grabs the core just after that prefill posted
    itself back in line and gave it back between two batches. Made certain here: each grab
    of the 2,000-token waiter first sleeps 0.3 s, and the prefill pauses 0.5 s between its
    batches. The waiter must give the core back: the prefill's second batch goes first."""
    steps, got_second = _between_batches(name, 0.5, [("slow_grab", 0.3)])
    second_batch = steps[4]["t"]  # (the take of its 500 remaining)
    assert second_batch < got_second, "the waiter kept the core it grabbed between two batches"


def test_a_long_wait_passes_a_stream_of_short_prefills(name, tmp_path):
    """Short prefills back to back on one core (for up to 12 s) do not starve a 1,000-token
    one: it ages ahead of them within ~1,000 / AGING_TOKENS_PER_SECOND seconds (without
    ageing it waits for the stream's end)."""
    stop = tmp_path / "stop"
    shorts = actor(name, 1, [("loop_short", 12.0)], stop)
    try:
        wait_until(lambda: _held(name, 1), 30, "the short prefills to run", step=0.002)
        t0 = time.monotonic()
        long = actor(name, 1, [("take", 1000), ("give_back", 0)])
        got = events(long)[0]["t"] - t0
    finally:
        stop.touch()
    n = events(shorts)[0]["n"]
    bound = 1000 / cpuqueue.AGING_TOKENS_PER_SECOND + 2.5
    assert got < bound, f"the long prefill waited {got:.1f} s (bound {bound:.1f} s)"
    assert n >= 5  # (the short ones did run: a stream, not one; fewer run on a loaded machine)


def test_a_prefill_that_waited_goes_before_a_shorter_newcomer(name, tmp_path):
    """Ageing, in an order that first-come-first-served and shortest-first both get wrong.
    One core, held; A (300 tokens) gets in line, then B (4,000), then C (20) once A has
    waited longer than (300 - 20) / AGING_TOKENS_PER_SECOND s: A has aged ahead of C, and
    C is still far ahead of B. The core goes to A, then C, then B (first come: A, B, C;
    shortest first: C, A, B)."""
    gap = (300 - 20) / cpuqueue.AGING_TOKENS_PER_SECOND
    go = {k: tmp_path / k for k in "ABC"}
    procs = {
        k: actor(name, 1, [("await", str(go[k])), ("take", n), ("sleep", 0.1), ("give_back", 0)])
        for k, n in (("A", 300), ("B", 4000), ("C", 20))
    }  # (started first: each gets in line at once when told to, whatever its start-up took)
    with cpubudget.CpuBudget(SHM, name, 1, wait=60):
        held = HeldCore(name)
        go["A"].touch()
        wait_until_in_line(name, 1)
        go["B"].touch()
        wait_until_in_line(name, 2)
        since_a = min(rec[0] for rec in board(name) if rec[3] == cpuqueue.WAITING)
        wait_until(lambda: time.monotonic() - since_a > gap + 0.2, 10, "A to age")
        go["C"].touch()
        wait_until_in_line(name, 3)
        # the order the queue's keys give (tokens left - rate x time in line), from the board
        line = sorted(
            (left - cpuqueue.AGING_TOKENS_PER_SECOND * (time.monotonic() - since), left)
            for since, left, _, state, *_ in board(name)
            if state == cpuqueue.WAITING
        )
        assert [left for _, left in line] == [300, 20, 4000], line  # (not a race lost)
        held.release()
        took = {k: events(p)[0]["t"] for k, p in procs.items()}
    assert sorted(took, key=took.__getitem__) == ["A", "C", "B"], took


def test_a_waiter_killed_in_line_holds_nobody_up(name):
    """A 5-token prefill killed while in line leaves a record that says it goes first;
    nobody holds its slot's lock any more, so a 1,000-token prefill is not held up."""
    with cpubudget.CpuBudget(SHM, name, 1, wait=60):
        held = HeldCore(name)
        long = actor(name, 1, [("take", 1000), ("give_back", 0)])
        wait_until_in_line(name, 1)
        doomed = actor(name, 1, [("take", 5)])
        wait_until_in_line(name, 2)
        doomed.send_signal(signal.SIGKILL)
        doomed.wait()
        assert waiting_on_board(name) == 2  # (its record is still there, saying "waiting")
        t0 = time.monotonic()
        held.release()
        got = events(long)[0]["t"] - t0
    # (a dead record obeyed would hold it back for the waiter's --cpu-wait, 60 s)
    assert got < 10.0, f"a dead waiter's record held the core back {got:.1f} s"


def _state(pid: int) -> str:
    got = cpuqueue.holder_state(pid)
    return "" if got is None else got[0]


def test_a_waiter_stopped_in_line_holds_nobody_up(name):
    """A 5-token prefill stopped (SIGSTOP) while in line still holds its slot's lock and
    its record says it goes first; a stopped holder cannot use the core, so a 1,000-token
    prefill takes it instead of waiting out its --cpu-wait (60 s here) behind it."""
    with cpubudget.CpuBudget(SHM, name, 1, wait=60):
        held = HeldCore(name)
        long = actor(name, 1, [("take", 1000), ("give_back", 0)])
        wait_until_in_line(name, 1)
        stopped = actor(name, 1, [("take", 5), ("give_back", 0)])
        try:
            wait_until_in_line(name, 2)
            stopped.send_signal(signal.SIGSTOP)
            wait_until(lambda: _state(stopped.pid) == "T", 10, "the waiter to stop")
            t0 = time.monotonic()
            held.release()
            try:
                got = events(long, timeout=20)[0]["t"] - t0
            except subprocess.TimeoutExpired:
                got = float("inf")
        finally:
            stopped.kill()
            stopped.wait()
            long.kill()
            long.wait()
    assert got < 10.0, f"a stopped waiter's place in line held the core back {got:.1f} s"


def _held(name: str, cores: int) -> int:
    try:
        return cpubudget.held_cores(SHM, name, cores)
    except FileNotFoundError:  # (not created yet)
        return 0


def test_a_decode_step_waits_at_most_about_one_batch(name):
    """A long prefill takes every core batch after batch (0.25 s each), giving them back
    in between; a decode step that finds no core goes first in line, so it gets one at
    the next batch's end instead of losing every race to the prefill's next batch."""
    cores, batch = 2, 0.25
    prefill = actor(name, cores, [("batches", 16)])
    try:
        wait_until(lambda: _held(name, cores) == cores, 30, "the prefill to take the cores")
        waits = []
        with cpubudget.CpuBudget(SHM, name, cores, wait=60) as b:
            for _ in range(6):
                t0 = time.monotonic()
                g = b.take(1)
                waits.append(time.monotonic() - t0)
                assert len(g.slots) == 1 and not g.timed_out
                time.sleep(0.01)  # (the step)
                b.give_back(g)
        assert max(waits) < 2.5 * batch, waits
        assert events(prefill)[-1]["op"] == "batches"
    finally:
        prefill.kill()
        prefill.wait()


def test_a_prefill_batch_beside_decode_steps_runs_on_every_core(name, tmp_path):
    """Two cores; two other workers stream, one 20 ms decode step after another, so the
    cores are nearly always held by decode steps. A 512-token prefill batch waits for
    the steps holding them to end (``Queue.gather``; decode steps take no core meanwhile)
    and runs on both, every time (without the gather it runs its whole batch on the one
    core that happened to be free); the decode steps still get in between the batches. A
    20-token batch (an arena hit's suffix) does not wait: it runs on the core free."""
    cores, stop = 2, tmp_path / "stop"
    decoders = [actor(name, cores, [("loop_decode", 60.0)], stop) for _ in range(2)]
    try:
        wait_until(lambda: _held(name, cores) >= 1, 30, "the decode steps to run", step=0.002)
        with cpubudget.CpuBudget(SHM, name, cores, wait=60) as b:
            wait_until(lambda: b._queue.ending(1.0), 30, "a decode step with an estimate")
            threads = []
            for _ in range(5):
                g = b.take(cores, remaining=512, tokens=512)
                threads.append(len(g.slots))
                time.sleep(0.1)  # (the batch)
                b.give_back(g)
                time.sleep(0.05)  # (the decode steps' turn)
            short = []
            for _ in range(5):
                t0 = time.monotonic()
                g = b.take(cores, remaining=20, tokens=20)
                short.append((len(g.slots), time.monotonic() - t0))
                b.give_back(g)
                time.sleep(0.05)
    finally:
        stop.touch()
    got = [events(d)[0] for d in decoders]
    assert threads == [cores] * 5, f"prefill batches ran on {threads} cores"
    assert all(d["n"] >= 10 for d in got), got  # (the decode steps did run throughout)
    # a decode step waits for at most a gather and one batch (0.2 s), with slack for a hog
    assert all(d["worst"] < 2.0 for d in got), got
    assert any(n == 1 for n, _ in short), f"every short batch waited for both cores: {short}"


def test_decode_steps_take_no_core_while_a_prefill_gathers(name, tmp_path):
    """While a long prefill batch gathers cores (its record says so, renewed within
    GATHER_STALE), another worker's decode step takes none, though one is free: it gets a
    core only after the gather has ended (without the rule it takes the free core at
    once, and a stream of decode steps keeps the gathering prefill waiting). A take
    after a renewal came later than GATHER_STALE (this process descheduled on a loaded
    machine: the gather is stale, as a stopped gatherer's is) is allowed; one that came
    while the record was fresh is not."""
    go = tmp_path / "go"
    decode = actor(name, 2, [("ready", 0), ("await", str(go)), ("take", 1), ("give_back", 0)])
    assert decode.stdout is not None and "ready" in decode.stdout.readline()  # (started)
    renewed: list[float] = []  # (monotonic times just before each renewal: <= its stamp)
    with cpubudget.CpuBudget(SHM, name, 2, wait=60) as b:
        g = b.take(1)  # (one core held, one free)
        renewed.append(time.monotonic())
        b._queue.gather(2)
        go.touch()
        end = time.monotonic() + 0.5
        while time.monotonic() < end:  # (the gather, renewed as a long one would be)
            renewed.append(time.monotonic())
            b._queue.gather(2)
            time.sleep(cpuqueue.GATHER_STALE / 5)
        b._queue.run(1)
        ended = time.monotonic()
        b.give_back(g)
    took = events(decode)[0]["t"]
    last = max((t for t in renewed if t <= took), default=renewed[0])
    stale = took - last >= cpuqueue.GATHER_STALE
    assert took >= ended or stale, (
        f"a decode step took a core {ended - took:.3f} s before the gather ended, "
        f"{took - last:.3f} s after its last renewal"
    )


def test_a_long_batch_lets_a_decode_step_ahead_go_then_takes_every_core(name, tmp_path):
    """Both cores held; a decode step (its worker's first: its length is not known, and a
    decode step is taken to be short) and a 512-token prefill wait in line, the decode step
    ahead. When the cores come free, the prefill does not take the core the decode step
    leaves and run its batch on it: it lets the step take its core, waits for it to end,
    and runs on both (without the rule it starts at once on one core)."""
    go = tmp_path / "go"
    steps = [("ready", 0), ("await", str(go)), ("decode", 0)]
    decode = actor(name, 2, [*steps, ("sleep", 0.15), ("give_back", 0)])
    assert decode.stdout is not None and "ready" in decode.stdout.readline()
    held = [HeldCore(name, slot) for slot in (0, 1)]
    prefill = actor(name, 2, [("ready", 0), ("take", 512), ("give_back", 0)])
    assert prefill.stdout is not None and "ready" in prefill.stdout.readline()
    go.touch()
    wait_until_in_line(name, 2)
    for h in held:
        h.release()
    took = events(prefill)[0]
    stepped = [e for e in events(decode) if e["op"] == "decode"][-1]
    assert took["cores"] == 2, f"the prefill's batch ran on {took['cores']} core(s)"
    assert stepped["t"] < took["t"], "the decode step ahead in line did not go first"


def test_a_prefill_ages_by_its_waits_not_by_its_batches(name):
    """A 1,000-token prefill runs its first batch (0.6 s) and gets back in line with 500
    tokens left; a 450-token one gets in line then: it goes first (it has fewer left, and
    neither has waited). Ageing by the time since the long one first got in line would
    put it ahead (500 - 256 x 0.6 < 450): a cold prompt's last tokens, evaluated apart
    after a checkpoint, then waited for the next cold prompt's whole prefill."""
    with (
        cpubudget.CpuBudget(SHM, name, 1, wait=60) as long,
        cpubudget.CpuBudget(SHM, name, 1, wait=60) as short,
    ):
        g = long.take(1, remaining=1000, tokens=500)
        time.sleep(0.6)  # (the batch)
        long.give_back(g, next_remaining=500, next_want=1)
        short._queue.wait(450, 1)
        assert long._queue.ahead() == (1, 1), "the long prefill aged ahead while it ran"
        assert short._queue.ahead()[0] == 0
