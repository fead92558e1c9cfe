"""Chaos, part 4: gunicorn workers (workers/app.py) and the supervisor SIGKILLed under HTTP
clients.

What every chaos file checks after each trial is in harness.py.
"""

from __future__ import annotations

import logging
import math
import os
import random
import signal
import threading
import time

import httpx
import openai
import pytest

from tests.chaos.harness import (
    MAX_TOKENS,
    PROMPTS,
    SUMMARY,
    TOTALS,
    check_arena,
    shm_files,
    socket_litter,
)
from tests.support.servers import Server
from tests.support.supervisors import wait_ready
from tests.support.waiting import wait_until

log = logging.getLogger(__name__)

pytestmark = [pytest.mark.stress, pytest.mark.usefixtures("chaos_summary")]

SERVE_TRIALS = int(os.environ.get("SHMKV_CHAOS_SERVE_TRIALS", "15"))


@pytest.mark.timeout(600)
def test_serving_through_worker_and_supervisor_kills(make_supervisor, models, chaos_refs, tmp_path):
    """gunicorn workers (workers/app.py) SIGKILLed mid-request and respawned, and the supervisor
    SIGKILLed and restarted, under two HTTP clients: every response equals a cold run; the only
    failed requests are those in flight on a killed worker."""
    t_start = time.monotonic()
    rnd = random.Random(4)
    sup = make_supervisor("--size", "16M")
    srv = Server(sup, models["seed0"], workers=2, tmp_path=tmp_path)
    stop = threading.Event()
    done: list[tuple[float, float, int, str, dict]] = []
    failed: list[tuple[float, float, str]] = []
    worker_kills: list[float] = []
    sup_kills: list[float] = []
    reattach_s: list[float] = []

    def ask(k: int) -> None:
        r = random.Random(k)
        while not stop.is_set():
            p = r.randrange(len(PROMPTS))
            t0 = time.monotonic()
            try:
                text, info = srv.complete(PROMPTS[p], max_tokens=MAX_TOKENS)
                done.append((t0, time.monotonic(), p, text, info))
            except (openai.APIError, httpx.HTTPError) as e:
                failed.append((t0, time.monotonic(), repr(e)))
                time.sleep(0.05)

    threads = [threading.Thread(target=ask, args=(k,), daemon=True) for k in range(2)]
    try:
        for t in threads:
            t.start()
        wait_until(lambda: len(done) >= 4, 60, "the first responses")
        for trial in range(SERVE_TRIALS):
            time.sleep(rnd.uniform(0.2, 0.8))
            if trial % 3 == 2:
                sup.proc.kill()
                sup_kills.append(time.monotonic())
                assert sup.proc.wait(10) == -signal.SIGKILL
                sup = wait_ready(make_supervisor("--size", "16M", name=sup.name, wait=False))
                srv.sup = sup
                n0 = len(done)
                wait_until(
                    lambda n0=n0: (
                        {i["worker_pid"] for *_, i in done[n0:] if i["hit"]} >= srv.worker_pids()
                    ),
                    60,
                    "every worker to restore from the new arena",
                )
                reattach_s.append(time.monotonic() - sup_kills[-1])
            else:
                victim = rnd.choice(sorted(srv.worker_pids()))
                os.kill(victim, signal.SIGKILL)
                worker_kills.append(time.monotonic())
                wait_until(lambda v=victim: v not in srv.worker_pids(), 30, "the victim to go")
                srv.wait_workers(2)
        stop.set()
        for t in threads:
            t.join(120)
        srv.wait_workers(2)
        with sup.client() as c:  # two live workers: a reader and a writer connection each
            problems, st = check_arena(c, conns=5, timeout=30)
    finally:
        stop.set()
        srv.stop()
    with sup.client() as c:
        found, st = check_arena(c)
        problems += found
    assert sup.stop() == 0
    left = shm_files(sup.name) | socket_litter(sup.socket)
    wrong = [
        f"prompt {p}: {text!r} != {chaos_refs[p]!r}"
        for _, _, p, text, _ in done
        if text != chaos_refs[p]
    ]
    # a request fails only if a worker was killed while it was in flight
    unexplained = [
        f for f in failed if not any(f[0] - 0.1 <= k <= f[1] + 0.1 for k in worker_kills)
    ]
    hits = sum(1 for *_, i in done if i["hit"])
    wall = time.monotonic() - t_start
    log.info(
        "serving: %d gunicorn worker kills and %d supervisor kills under 2 HTTP clients; "
        "%d responses compared with cold runs (%d restored from the arena), %d wrong; %d "
        "requests failed, all in flight on a killed worker: %s; workers restored from the "
        "new arena within %.1f s of a supervisor kill; %d problems; %.1f s",
        len(worker_kills),
        len(sup_kills),
        len(done),
        hits,
        len(wrong),
        len(failed),
        not unexplained,
        max(reattach_s, default=math.nan),
        len(problems),
        wall,
    )
    TOTALS.update(
        kills=len(worker_kills) + len(sup_kills),
        outputs=len(done),
        wrong=len(wrong),
        leaks=len(problems) + len(unexplained),
    )
    SUMMARY["serving"] = (
        f"{len(worker_kills)} worker + {len(sup_kills)} supervisor kills, "
        f"{len(done)} responses, {len(wrong)} wrong, {len(unexplained)} "
        f"unexplained errors, {len(problems)} problems, {wall:.0f} s"
    )
    assert not wrong, wrong[:5]
    assert not unexplained, unexplained[:5]
    assert not problems, problems[:10]
    assert not left, f"left behind: {left}"
    assert hits > 0
