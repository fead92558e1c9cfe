"""Resource exhaustion with real llama.cpp workers on the tiny model.

* An arena ten times smaller than the working set, under concurrent load from
  several worker processes: eviction never stops, no output differs from a
  cold run, and the hit rate is reported.
* More workers than the supervisor's connection limit: the extra ones run
  cold, say why (SupervisorBusy), produce the same outputs, and nothing hangs.

(/dev/shm smaller than asked and a peer of another uid are in test_cli.py:
test_shm_too_small_is_one_line_and_leaves_nothing, test_peer_of_another_uid_is_refused.)
"""

from __future__ import annotations

import logging
import random
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.support.llama_workers import (
    BarrierWorker,
    completion,
    finish_worker,
    run_worker,
    start_worker,
    texts,
)

log = logging.getLogger(__name__)

pytestmark = pytest.mark.timeout(300)

FAMILIES = 8
SUFFIXES = 8
WORKERS = 4


def family_prompt(f: int, s: int) -> str:
    """~1,150 tokens of a per-family system prompt, then a short per-request suffix."""
    rules = " ".join(
        f"Rule {i}: the cat {(i * (f + 3)) % 7} sits on mat {(i + f) % 5}." for i in range(50)
    )
    return f"Family {f}. {rules} Question {s}: which cat sits where?"


# ----------------------------------------------------------- a tiny arena
@pytest.mark.stress
def test_arena_ten_times_smaller_than_the_working_set(make_supervisor, models) -> None:
    # 2 MiB: about three families' shared prefixes (the arena stores each once), so the
    # families' turns evict one another
    sup = make_supervisor("--size", "2M")
    prompts = [family_prompt(f, s) for f in range(FAMILIES) for s in range(SUFFIXES)]
    t0 = time.monotonic()
    cold = dict(
        zip(
            prompts,
            texts(run_worker(None, models["seed0"], [completion(p) for p in prompts], mode="cold")),
            strict=True,
        )
    )
    t_cold = time.monotonic() - t0
    # every worker runs every prompt, in its own order: families recur (hits) while the
    # arena holds about a dozen of the ~130 blobs published (evictions)
    orders = []
    for w in range(WORKERS):
        order = prompts[:]
        random.Random(w).shuffle(order)
        orders.append(order)
    t0 = time.monotonic()
    procs = [
        start_worker(
            sup,
            models["seed0"],
            [completion(p, stream=i % 2 == w % 2) for i, p in enumerate(order)],
        )
        for w, order in enumerate(orders)
    ]
    with ThreadPoolExecutor(WORKERS) as pool:
        results = list(pool.map(finish_worker, procs))
    wall = time.monotonic() - t0
    st = sup.stats_json()
    wrong = [
        (p, r["text"])
        for order, res in zip(orders, results, strict=True)
        for p, r in zip(order, res["results"], strict=True)
        if r["text"] != cold[p]
    ]
    outputs = sum(len(r["results"]) for r in results)
    worker_hits = sum(r["totals"]["hits"] for r in results)
    restored = sum(r["totals"]["tokens_restored"] for r in results)
    errors: dict[str, int] = {}
    for r in results:
        for k, v in r["totals"]["errors"].items():
            errors[k] = errors.get(k, 0) + v
    lookups = st["hits"] + st["misses"]
    hit_rate = st["hits"] / lookups if lookups else 0.0
    working_set = st["bytes_put"]
    log.info(
        "tiny arena: %d workers x %d prompts = %d outputs in %.1fs (cold reference "
        "%.1fs), %d wrong; arena %.1f MiB data, %.1f MiB published (%.0fx), "
        "%d puts, %d evictions, %d rejected puts; supervisor hits %d misses %d "
        "(hit rate %.0f%%), worker hits %d restoring %d tokens; worker errors %s",
        WORKERS,
        len(prompts),
        outputs,
        wall,
        t_cold,
        len(wrong),
        st["bytes_capacity"] / 2**20,
        working_set / 2**20,
        working_set / st["bytes_capacity"],
        st["puts"],
        st["evictions"],
        st["rejected_puts"],
        st["hits"],
        st["misses"],
        100 * hit_rate,
        worker_hits,
        restored,
        errors,
    )
    assert not wrong, wrong[:3]
    assert outputs == WORKERS * len(prompts)
    assert working_set > 10 * st["bytes_capacity"], st  # the ten times of the name
    assert st["evictions"] > 50, st
    assert worker_hits > 0 and restored > 0 and st["hits"] > 0
    assert st["restore_failures"] == 0, st
    # only an arena too full for one more blob (all of it leased) may cost a publish
    assert set(errors) <= {"publish failed"}, errors
    assert st["leases_active"] == 0 and st["bytes_used"] <= st["bytes_capacity"]
    assert sup.proc.poll() is None and "Traceback" not in sup.log()


# ------------------------------------------------------ the connection limit
def test_more_workers_than_the_connection_limit_run_cold_and_say_why(
    make_supervisor, models
) -> None:
    sup = make_supervisor("--size", "32M", "--max-connections", "2")
    prompt = family_prompt(0, 0)
    jobs = [completion(prompt), completion(family_prompt(0, 1)), completion(family_prompt(1, 0))]
    cold = texts(run_worker(None, models["seed0"], jobs, mode="cold"))
    # one worker takes both connections (reader at attach, writer at its first publish)
    # and keeps them while the others start
    holder = BarrierWorker(sup, models["seed0"], jobs, before=jobs[:1])
    assert holder.state == "attached"
    t0 = time.monotonic()
    extra = [start_worker(sup, models["seed0"], jobs) for _ in range(4)]
    with ThreadPoolExecutor(len(extra)) as pool:
        results = list(pool.map(lambda p: finish_worker(p, timeout=120), extra))
    wall = time.monotonic() - t0
    for r in results:
        assert texts(r) == cold
        assert r["totals"]["tokens_restored"] == 0 and r["totals"]["hits"] == 0
        assert r["totals"]["errors"].get("supervisor unavailable", 0) >= 1, r["totals"]
        assert "connection limit (2) reached" in r["stderr"], r["stderr"][-2000:]
        assert "--max-connections" in r["stderr"]
    assert wall < 60, f"refused workers took {wall:.1f}s: something waited"
    assert "refused pid" in sup.log() and "connection limit 2 reached" in sup.log()
    # the holder itself still works, then leaves: its connections are free again
    got = holder.go()
    assert texts(got) == cold
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            st = sup.stats_json()
        except subprocess.CalledProcessError:  # its sockets may not be closed yet
            time.sleep(0.2)
            continue
        if st["connections"] <= 1:
            break
    later = run_worker(sup, models["seed0"], jobs)
    assert texts(later) == cold
    assert later["totals"]["hits"] >= 1, later["totals"]  # attached, and used the arena
    refused = sup.log().count("connection limit 2 reached")
    log.info(
        "connection limit 2: %d refusals, %d extra workers ran cold in %.1fs with equal "
        "outputs; after the holder left a new worker restored %d tokens",
        refused,
        len(results),
        wall,
        later["totals"]["tokens_restored"],
    )
    assert sup.proc.poll() is None and "Traceback" not in sup.log()
