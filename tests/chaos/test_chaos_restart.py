"""Chaos, part 3: the supervisor SIGKILLed and restarted under running llama workers.

Two workers keep serving while the supervisor is killed in the middle of their requests
(restoring, publishing, generating): they run cold meanwhile, then restore from the new
supervisor's arena (the old one adopted, or replaced by a fresh one every other time) and
let go of a replaced one. The file ends with reproducers of the bugs
these restarts found. What every chaos file checks after each trial is in harness.py.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import logging
import math
import os
import random
import signal
import time

import pytest

from shmkv import SupervisorUnavailable
from tests.chaos.harness import (
    RESTART_TRIALS,
    SUMMARY,
    TOTALS,
    Worker,
    check_arena,
    check_outputs,
    kill_phase_counts,
    shm_files,
    socket_litter,
    stale_arena_maps,
    trials,
    wait_flag,
)
from tests.chaos.worker import VIEWS_LISTED
from tests.support.blobs import blob
from tests.support.supervisors import kill9, restart, try_stats, wait_ready
from tests.support.waiting import shm_fds, wait_until

log = logging.getLogger(__name__)

pytestmark = [pytest.mark.stress, pytest.mark.usefixtures("chaos_summary")]

RESTART_TARGETS = ["lease", "put", "restore", "capture", "set_data", "get_data", "decode"]


@pytest.mark.timeout(600)
def test_supervisor_restart_under_running_workers(
    make_supervisor, models, chaos_refs, tmp_path, reserve_mode
):
    t_start = time.monotonic()
    rnd = random.Random(3)
    sup = make_supervisor("--size", "16M")
    sup.model = models["seed0"]
    workers = [Worker(tmp_path, f"r{i}") for i in range(2)]
    kills: list[list[str]] = []
    problems: list[str] = []
    wrong: list[str] = []
    reattach_s: list[float] = []
    try:
        for i, w in enumerate(workers):
            w.go(sup, seed=100 + i)
        wait_until(lambda: all(w.finished >= 2 for w in workers), 60, "workers warming up")
        for t in range(trials(RESTART_TRIALS, reserve_mode, len(RESTART_TARGETS))):
            target = RESTART_TARGETS[t % len(RESTART_TARGETS)]
            w = wait_flag(workers, target, timeout=10.0)
            if target not in ("set_data", "get_data"):
                time.sleep(rnd.choice([0.0, rnd.uniform(0.0, 0.002)]))
            os.kill(sup.proc.pid, signal.SIGKILL)
            phases = sorted({p for x in workers for p in x.phases()})
            kills.append(phases if w is not None else phases + ["missed"])
            assert sup.proc.wait(10) == -signal.SIGKILL
            t_kill = time.monotonic()
            before = [len(x.results()) for x in workers]
            left = shm_files(sup.name)
            if not left <= {f"shmkv-{sup.name}", f"shmkv-{sup.name}.lock"}:
                problems.append(f"trial {t}: the kill left {sorted(left)}")
            time.sleep(rnd.uniform(0.0, 0.5))  # workers run cold meanwhile
            # every other restart drops the old arena (--fresh): a new file replaces it
            fresh = ("--fresh",) if t % 2 else ()
            sup = wait_ready(make_supervisor("--size", "16M", *fresh, name=sup.name, wait=False))
            sup.model = models["seed0"]
            with sup.client(populate=False) as c:
                new_id = c.view.geometry.arena_id.hex()

            def done(arena: str = new_id, n0: list[int] = before) -> bool:
                if any(x.proc.poll() is not None for x in workers):
                    return True
                return all(
                    any(r["arena"] == arena and r["last"]["hit"] for r in x.results()[n:])
                    for x, n in zip(workers, n0, strict=True)
                )

            wait_until(done, 30, "both workers to restore from the new arena")
            for x in workers:
                assert x.proc.poll() is None, f"worker {x.tag} died: {x.stderr()}"
            reattach_s.append(time.monotonic() - t_kill)
            log.debug(
                "restart %d: supervisor killed in %s; workers restore from the new arena "
                "%.2f s after the kill",
                t,
                phases,
                reattach_s[-1],
            )

            # a replaced (--fresh) arena is unlinked: a worker still mapping it would pin its
            # tmpfs space (each lets go of it once it has reattached, within a request or so;
            # an adopted one is the same file)
            def let_go(name: str = sup.name) -> bool:
                return not any(stale_arena_maps(x.pid, name) for x in workers)

            with contextlib.suppress(AssertionError):  # (those that do not: below)
                wait_until(let_go, 10, "the workers to unmap the replaced arena")
            for x in workers:
                stale = stale_arena_maps(x.pid, sup.name)
                if stale:
                    listed = x.err_path.read_text().count(VIEWS_LISTED)
                    os.kill(x.pid, signal.SIGUSR1)  # the worker prints who holds it
                    wait_until(
                        lambda w=x, n=listed: w.err_path.read_text().count(VIEWS_LISTED) > n,
                        30,
                        "the worker to list what holds the replaced arena",
                    )
                    log.warning("worker %s holds a replaced arena: %s", x.tag, x.stderr())
                    problems.append(
                        f"trial {t}: worker {x.tag} still maps a replaced arena: {stale[:2]}"
                    )
        for w in workers:
            assert w.stop() == 0, w.stderr()
        outputs = sum(check_outputs(w, chaos_refs, wrong) for w in workers)
        totals = [w.totals() for w in workers]
        with sup.client() as c:
            found, st = check_arena(c)
            problems += [f"final: {p}" for p in found]
    finally:
        for w in workers:
            w.discard()
    assert sup.stop() == 0
    left = shm_files(sup.name) | socket_litter(sup.socket)
    errors = collections.Counter()
    for tt in totals:
        assert tt is not None
        errors.update(tt["errors"])
    per_phase, groups = kill_phase_counts(kills)
    wall = time.monotonic() - t_start
    log.info(
        "restarts under load: %d supervisor kills while workers were in %s (by group %s); "
        "%d outputs compared with cold, %d wrong; worker errors seen and absorbed: %s; "
        "reattached within %.2f s (max); %d problems; %.1f s",
        len(kills),
        per_phase,
        groups,
        outputs,
        len(wrong),
        dict(errors),
        max(reattach_s, default=math.nan),
        len(problems),
        wall,
    )
    TOTALS.update(kills=len(kills), outputs=outputs, wrong=len(wrong), leaks=len(problems))
    SUMMARY[f"restarts under load (--reserve {reserve_mode})"] = (
        f"{len(kills)} trials {groups}, {outputs} outputs, "
        f"{len(wrong)} wrong, {len(problems)} problems, "
        f"reattach <= {max(reattach_s, default=0):.1f} s, "
        f"{wall:.0f} s"
    )
    assert not wrong, wrong[:5]
    assert not problems, problems[:10]
    assert not left, f"left behind: {left}"
    bad = {
        k: v
        for k, v in errors.items()
        if k not in ("supervisor unavailable", "publish failed", "claim failed", "cache error")
    }
    assert not bad, errors


# ------------------------------------------- reproducers of bugs these restarts found
@pytest.mark.timeout(60)
def test_client_unmaps_a_replaced_arena_without_waiting_for_the_gc(make_supervisor):
    """After a supervisor restart a worker kept the old (unlinked) arena mapped, its tmpfs
    pages pinned: ``last_error`` kept the traceback of the failed request, whose frames held
    the old ArenaView, and a local bound to the raised error made a cycle through it."""
    sup = make_supervisor("--size", "16M")
    c = sup.client(timeout=1.0)
    gc.disable()  # a worker may go a long time without a full collection
    try:
        root, tokens, data = b = blob(2, 200_000)
        c.put_bytes(root, tokens, b"fp", data)
        digests = b.digests()
        hit = c.lookup(digests)
        os.kill(sup.proc.pid, signal.SIGSTOP)  # hung, then killed: the request times out
        try:
            c.acquire(hit)  # the error passes through frames that hold the view
        except SupervisorUnavailable:
            pass
        else:
            pytest.fail("acquire from a stopped supervisor succeeded")
        sup.proc.kill()
        sup.proc.wait(10)
        new = wait_ready(make_supervisor("--size", "16M", "--fresh", name=sup.name, wait=False))
        st = wait_until(lambda: try_stats(c), 15, "the client to reconnect")
        assert st["pid"] == new.proc.pid and c.lookup(digests) is None
        assert not stale_arena_maps(os.getpid(), sup.name)
        assert str(sup.arena) + " (deleted)" not in shm_fds(os.getpid(), f"shmkv-{sup.name}")
    finally:
        gc.enable()
        c.close()


@pytest.mark.timeout(90)
def test_client_holds_one_arena_descriptor_across_restarts_and_none_once_closed(make_supervisor):
    """Each reattach after a supervisor restart left the replaced arena's descriptor open (the
    ArenaView's own, which nothing closed once the Client let go of the view), and so did
    close(): a long-running worker pinned every old arena's tmpfs pages, one per restart."""
    sup = make_supervisor("--size", "16M")
    arena = f"shmkv-{sup.name}"
    c = sup.client(timeout=1.0)
    gc.disable()  # a worker may go a long time without a full collection
    try:
        c.stats()
        held = shm_fds(os.getpid(), arena)  # the view's and its mapping's (mmap dups it)
        assert set(held) == {str(sup.arena)}, held
        for _ in range(3):
            kill9(sup)
            sup = restart(make_supervisor, sup, "--size", "16M", "--fresh")
            st = wait_until(lambda: try_stats(c), 15, "the client to reattach")
            assert st["pid"] == sup.proc.pid
            # the new arena's only: the replaced ones (unlinked by --fresh) are let go
            assert shm_fds(os.getpid(), arena) == [str(sup.arena)] * len(held)
        c.close()
        assert shm_fds(os.getpid(), arena) == []
    finally:
        gc.enable()
        c.close()


@pytest.mark.timeout(60)
def test_client_whose_lookups_miss_follows_a_restarted_supervisor(make_supervisor):
    """A worker whose lookups all missed sent no request, so it never noticed its supervisor
    had died and kept searching the dead one's frozen arena, missing everything new."""
    sup = make_supervisor("--size", "16M")
    root, tokens, data = b = blob(3, 200_000)
    digests = b.digests()
    with sup.client() as reader:
        assert reader.lookup(digests) is None
        sup.proc.kill()
        sup.proc.wait(10)
        new = wait_ready(make_supervisor("--size", "16M", name=sup.name, wait=False))
        with new.client() as writer:
            writer.put_bytes(root, tokens, b"fp", data)
        hit = wait_until(lambda: reader.lookup(digests), 5, "the reader to see the new arena")
        with reader.acquire(hit) as lease:
            assert bytes(lease.payload) == data
            assert lease.finish()
        assert reader.attach_info["supervisor_pid"] == new.proc.pid
