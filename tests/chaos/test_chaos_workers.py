"""Chaos, part 1: llama workers SIGKILLed in restore, publish and generation.

Workers (``chaos/worker.py``: SharedCacheLlama on the tiny model, a loop of requests over
three long system prompts with suffixes drawn at random from a pool) are killed in a phase
the test picks (restore, lease, set_data, claim, prefill, capture, get_data, put, decode) or
after a random delay. The worker raises a flag byte in a shared file around each step, so the
phases a kill hit are read exactly, after the kill. What every chaos file checks after each
trial, and the settings of the number of trials, are in harness.py.
"""

from __future__ import annotations

import logging
import random
import time

import pytest

from tests.chaos.harness import (
    SUMMARY,
    TOTALS,
    WORKER_TRIALS,
    Worker,
    check_arena,
    check_outputs,
    kill_phase_counts,
    shm_files,
    socket_litter,
    trials,
    wait_flag,
)
from tests.support.waiting import fd_count, wait_until

log = logging.getLogger(__name__)

pytestmark = [pytest.mark.stress, pytest.mark.usefixtures("chaos_summary")]

WORKER_TARGETS = [
    "restore",
    "lease",
    "set_data",
    "prefill",
    "capture",
    "get_data",
    "put",
    "decode",
    "random",
    "claim",
]


@pytest.mark.timeout(600)
def test_workers_killed_in_restore_publish_and_generation(
    make_supervisor, models, chaos_refs, tmp_path, reserve_mode
):
    t_start = time.monotonic()
    sup = make_supervisor("--size", "8M")  # ~9 blobs of ~0.75 MB: constant eviction
    sup.model = models["seed0"]
    rnd = random.Random(1)
    kills: list[list[str]] = []
    wrong: list[str] = []
    leaks: list[str] = []
    outputs = hits = torn = firsts = 0
    target_missed = 0
    spare = Worker(tmp_path, "w0")
    live = [spare]
    try:
        with sup.client() as c:
            wait_until(lambda: c.stats()["connections"] == 1, what="a quiet supervisor")
            base_fds = fd_count(sup.proc.pid)
            for t in range(trials(WORKER_TRIALS, reserve_mode, len(WORKER_TARGETS))):
                w, spare = spare, None
                w.go(sup, seed=t)
                spare = Worker(tmp_path, f"w{t + 1}")  # its imports overlap this trial
                live[:] = [w, spare]
                target = WORKER_TARGETS[t % len(WORKER_TARGETS)]
                if target == "random":  # from the start: model load and attach included
                    time.sleep(rnd.uniform(0.0, 0.5))
                else:
                    # a claim is only taken on a miss of >= 2 chunks (an evicted system prompt)
                    if wait_flag([w], target, timeout=2.0 if target == "claim" else 8.0) is None:
                        target_missed += 1
                    if target not in ("set_data", "get_data"):
                        time.sleep(rnd.choice([0.0, rnd.uniform(0.0, 0.003)]))
                assert w.proc.poll() is None, f"worker died by itself: {w.stderr()}"
                phases = w.kill()
                if not w.ready:
                    phases.append("startup")
                kills.append(phases)
                outputs += check_outputs(w, chaos_refs, wrong)
                firsts += bool(w.results())  # a fresh process's first request, after the last kill
                hits += sum(1 for r in w.results() if r["last"]["hit"])
                torn += w.torn
                problems, st = check_arena(c)
                leaks += [f"trial {t} ({phases}): {p}" for p in problems]
                log.debug(
                    "trial %d: target %s, died in %s after %d requests; %d entries, %d bytes",
                    t,
                    target,
                    phases,
                    len(w.results()),
                    st["entries"],
                    st["bytes_used"],
                )
                w.discard()
            # a fresh worker after all that: clean requests, every output equal to a cold run
            spare.go(sup, seed=10_000, requests=8)
            assert spare.proc.wait(120) == 0, spare.stderr()
            spare._reader.join(10)
            final = spare.results()
            outputs += check_outputs(spare, chaos_refs, wrong)
            assert len(final) == 8
            assert any(r["last"]["hit"] for r in final), final
            totals = spare.totals()
            assert totals is not None
            bad = {k: v for k, v in totals["errors"].items() if k != "supervisor unavailable"}
            assert not bad, totals
            problems, st = check_arena(c)
            leaks += [f"final: {p}" for p in problems]
            fds = fd_count(sup.proc.pid)
            if fds != base_fds:
                leaks.append(f"supervisor holds {fds} descriptors, {base_fds} at start")
            # no torn or foreign blob ever reached set_data (nor did llama.cpp refuse one)
            assert st["restore_failures"] == 0 and st["states_refused"] == 0, st
            assert c.clear() == st["entries"]
            st = c.stats()
            if st["bytes_used"] != 0:
                leaks.append(f"after clear, {st['bytes_used']} bytes still used")
    finally:  # no worker may outlive a failure
        for x in live:
            x.discard()
    assert sup.stop() == 0
    left = shm_files(sup.name) | socket_litter(sup.socket)
    per_phase, groups = kill_phase_counts(kills)
    wall = time.monotonic() - t_start
    log.info(
        "worker kills: %d trials (%d targeted kills missed their phase); kills by phase "
        "%s; by group %s",
        len(kills),
        target_missed,
        per_phase,
        groups,
    )
    log.info(
        "worker kills: %d outputs compared with cold runs (%d of them the first request "
        "of the fresh worker after a kill), %d restored from the arena, %d wrong; %d leaks; "
        "supervisor stats at the end: puts %d, evictions %d, hits %d, restore_failures %d; "
        "%.1f s",
        outputs,
        firsts,
        hits,
        len(wrong),
        len(leaks),
        st["puts"],
        st["evictions"],
        st["hits"],
        st["restore_failures"],
        wall,
    )
    TOTALS.update(kills=len(kills), outputs=outputs, wrong=len(wrong), leaks=len(leaks))
    SUMMARY[f"worker kills (--reserve {reserve_mode})"] = (
        f"{len(kills)} trials {groups}, {outputs} outputs, "
        f"{len(wrong)} wrong, {len(leaks)} leaks, {wall:.0f} s"
    )
    assert not wrong, wrong[:5]
    assert not leaks, leaks[:10]
    assert not left, f"left behind: {left}"
    assert groups.get("restore", 0) and groups.get("publish", 0) and groups.get("generation", 0)
    assert hits > 0
