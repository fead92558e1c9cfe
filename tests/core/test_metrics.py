"""Prometheus metrics: real scrapes of `shmkv supervise --metrics-port` and of `/metrics` on a
real gunicorn deployment, parsed with prometheus_client's own parser; the workers' counters
survive a worker's SIGKILL and come back after the supervisor's; the Grafana dashboard asks
only for names a scrape really has."""

from __future__ import annotations

import json
import os
import re
import signal
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields
from pathlib import Path

import httpx
import pytest

from shmkv.core.stats import RESTORE_BUCKETS, WorkerCounters, metric_name
from tests.support import ROOT
from tests.support.blobs import put_and_hit
from tests.support.cli import shmkv
from tests.support.llama_workers import SYSTEM as LLAMA_SYSTEM
from tests.support.llama_workers import completion, run_worker
from tests.support.peer import Raw
from tests.support.servers import Server, free_port, scrape
from tests.support.supervisors import wait_ready
from tests.support.waiting import wait_until

DASHBOARD = ROOT / "workers" / "grafana" / "shmkv-dashboard.json"
SYSTEM = " ".join(f"Rule {i}: the dog {i % 7} guards yard {i % 5}." for i in range(40))
#: the families the workers' reported counters become (labelled by model and tenant)
WORKER_FAMILIES = {
    "shmkv_" + metric_name(f)
    for f in fields(WorkerCounters)
    if f.metadata.get("reported") and f.name != "restore_seconds"
}


def wait_metrics(port: int, host: str = "127.0.0.1") -> str:
    """The URL of a --metrics-port once it answers (it starts after the socket)."""
    url = f"http://{host}:{port}/metrics"

    def up() -> bool:
        try:
            return httpx.get(url, timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(up, 10, "the metrics port")
    return url


def total(samples: dict[str, float], name: str) -> float:
    """The sum of a metric's samples over all its label sets."""
    return sum(v for k, v in samples.items() if k.split("{")[0] == name)


def names(samples: dict[str, float]) -> set[str]:
    return {k.split("{")[0] for k in samples}


def full_report(reporter: int, n: int) -> dict:
    """A report of every counter a worker reports, all set to ``n``."""
    counters: dict = {}
    for f in fields(WorkerCounters):
        if not f.metadata.get("reported"):
            continue
        default = getattr(WorkerCounters(), f.name)
        if isinstance(default, list):
            counters[f.name] = [n] * len(default)
        elif isinstance(default, dict):
            counters[f.name] = {"corrupt record": n}
        else:
            counters[f.name] = n
    return {
        "op": "report",
        "reporter": reporter,
        "model": "m1",
        "tenant": "t1",
        "counters": counters,
    }


# ------------------------------------------------------------------ supervise --metrics-port
def test_supervise_metrics_port_exposes_the_schema(make_supervisor) -> None:
    port = free_port()
    sup = make_supervisor("--size", "16M", "--metrics-port", str(port))
    url = wait_metrics(port)
    with sup.client() as c:
        _, _, n_tok = put_and_hit(c)
    raw = Raw(sup.socket)
    raw.attach()
    assert raw.call(full_report(7, 3))["ok"]
    s = scrape(url)
    assert s["shmkv_supervisor_up{}"] == 1
    assert s["shmkv_puts_total{}"] == 1 and s["shmkv_arena_entries{}"] == 1
    assert s["shmkv_leases_granted_total{}"] == 1
    assert (
        s["shmkv_arena_used_bytes{}"] + s["shmkv_arena_free_bytes{}"]
        == (s["shmkv_arena_capacity_bytes{}"])
    )
    assert 0 < s["shmkv_arena_largest_free_extent_bytes{}"] <= s["shmkv_arena_free_bytes{}"]
    assert s["shmkv_workers_connected{}"] == 1  # the test process (the raw connection)
    lab = 'model="m1",tenant="t1"'
    assert s[f"shmkv_requests_total{{{lab}}}"] == 3
    assert s[f'shmkv_cache_failures_total{{kind="corrupt record",{lab}}}'] == 3
    # the release's tokens_restored (a client that reports no totals) is unlabelled
    assert s['shmkv_tokens_restored_total{model="",tenant=""}'] == n_tok
    # the histogram: cumulative buckets, +Inf = count, _sum from restore_seconds
    buckets = [
        s[f'shmkv_restore_duration_seconds_bucket{{le="{b}",{lab}}}'] for b in RESTORE_BUCKETS
    ]
    assert buckets == [3 * (i + 1) for i in range(len(RESTORE_BUCKETS))]
    n = len(RESTORE_BUCKETS) + 1
    assert s[f'shmkv_restore_duration_seconds_bucket{{le="+Inf",{lab}}}'] == 3 * n
    assert s[f"shmkv_restore_duration_seconds_count{{{lab}}}"] == 3 * n
    assert s[f"shmkv_restore_duration_seconds_sum{{{lab}}}"] == 3
    assert WORKER_FAMILIES <= {re.sub(r"_(total|bucket|sum|count)$", "", k) for k in names(s)}
    raw.close()


def test_supervise_metrics_port_counts_real_requests(make_supervisor, models) -> None:
    """End to end: two llama workers' completions (one cold, one restored from the arena)
    reach the scrape through the workers' own reports; the numbers are the supervisor's
    sums, checked against what each call's own stats say."""
    port = free_port()
    sup = make_supervisor("--size", "64M", "--metrics-port", str(port))
    url = wait_metrics(port)
    prompt = LLAMA_SYSTEM + " Question: which mat?"
    calls = [run_worker(sup, models["seed0"], [completion(prompt)])["results"][0]["last"]]
    calls.append(run_worker(sup, models["seed0"], [completion(prompt)])["results"][0]["last"])
    assert [c["hit"] for c in calls] == [False, True], calls
    s = wait_until(
        lambda: (got := scrape(url)) and total(got, "shmkv_requests_total") == 2 and got,
        20,
        "the workers' reports",
    )
    assert total(s, "shmkv_cache_hits_total") == 1
    assert total(s, "shmkv_tokens_restored_total") == calls[1]["tokens_restored"] > 0
    evaluated = sum(c["tokens_evaluated"] for c in calls)
    assert total(s, "shmkv_tokens_evaluated_total") == evaluated
    assert total(s, "shmkv_restore_duration_seconds_count") == 1
    assert s["shmkv_puts_total{}"] >= 1 and s["shmkv_leases_granted_total{}"] >= 1


def test_metrics_host_is_loopback_by_default(make_supervisor) -> None:
    port = free_port()
    make_supervisor("--size", "16M", "--metrics-port", str(port))

    def listening() -> list[str]:
        rows = Path("/proc/net/tcp").read_text().splitlines()[1:]
        return [
            r.split()[1]
            for r in rows
            if r.split()[3] == "0A" and r.split()[1].endswith(f":{port:04X}")
        ]

    local = wait_until(listening, 10, "the metrics port")
    assert local == [f"0100007F:{port:04X}"]  # 127.0.0.1 only


def test_metrics_host_sets_the_address_metrics_listen_on(make_supervisor) -> None:
    """``--metrics-host 127.0.0.2``: metrics are served there and only there."""
    port = free_port()
    make_supervisor("--size", "16M", "--metrics-port", str(port), "--metrics-host", "127.0.0.2")
    url = wait_metrics(port, "127.0.0.2")
    assert scrape(url)["shmkv_supervisor_up{}"] == 1
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)


def test_reports_are_totals_that_never_go_back(make_supervisor) -> None:
    """A lower total is ignored; a reporter that reconnects is not counted twice; label sets
    are bounded; a malformed report is refused whole."""
    sup = make_supervisor("--size", "16M")
    a = Raw(sup.socket)
    a.attach()
    msg = {"op": "report", "reporter": 9, "model": "m", "counters": {"misses": 5}}
    assert a.call(msg)["ok"]
    assert a.call({**msg, "counters": {"misses": 3}})["ok"]
    assert sup.stats()["misses"] == 5
    a.close()
    wait_until(lambda: sup.stats()["connections"] == 1, 5, "the close")  # (the asking one)
    assert sup.stats()["misses"] == 5  # kept after its connection went
    b = Raw(sup.socket)  # the same process (pid) and reporter: its totals, not added again
    b.attach()
    assert b.call({**msg, "counters": {"misses": 6}})["ok"]
    assert sup.stats()["misses"] == 6
    for bad in (
        {**msg, "model": "a\nb"},
        {**msg, "tenant": "x" * 65},
        {**msg, "counters": {"restore_latency": [1, 2]}},
        {**msg, "counters": {"errors": {"\x00": 1}}},
        {**msg, "counters": {"restore_seconds": float("nan")}},
        {**msg, "counters": {"misses": 7, "bogus": 1}},
    ):
        reply = b.call(bad)
        assert not reply["ok"] and reply["error"]["code"] == "bad_request", bad
    assert sup.stats()["misses"] == 6
    c = Raw(sup.socket)
    c.attach()
    for i in range(20):  # at most 16 reporters per connection
        reply = c.call(
            {"op": "report", "reporter": 1 + i, "model": f"m{i}", "counters": {"calls": 1}}
        )
        assert reply["ok"] == (i < 16), reply
    for i in range(80):
        d = Raw(sup.socket)
        d.attach()
        assert d.call({"op": "report", "model": f"n{i}", "counters": {"calls": 1}})["ok"]
        d.close()
    st = sup.stats()
    assert len(st["series"]) <= 64 + 1
    assert any(s["model"] == "other" for s in st["series"])
    assert st["calls"] == 16 + 80  # nothing lost in the bound
    b.close()
    c.close()


# ----------------------------------------------------------------- /metrics on `shmkv serve`
def test_serve_metrics_survive_worker_and_supervisor_kills(
    tmp_path, serve_model, make_supervisor
) -> None:
    sup = make_supervisor("--size", "256M")
    srv = Server(sup, serve_model, workers=2, tmp_path=tmp_path)
    url = srv.base + "/metrics"
    try:
        # one request publishes the prefix; then pairs at once, so that a busy worker leaves
        # the other one to the second of each pair, which restores from the arena
        # (sequential requests all landed on the same worker: local reuse, no arena hit)
        infos: list[dict] = [srv.complete(SYSTEM + " Question 0?")[1]]
        with ThreadPoolExecutor(2) as pool:
            while len(infos) < 6 or not any(i["hit"] for i in infos):
                assert len(infos) < 30, "no request reached the second worker"
                asked = [SYSTEM + f" Question {len(infos) + k}?" for k in (0, 1)]
                infos += [got[1] for got in pool.map(srv.complete, asked)]
        n = len(infos)
        restored = sum(i["restored_tokens"] for i in infos)
        hits = sum(1 for i in infos if i["hit"])
        lab = 'model="tiny",tenant=""'

        def settled() -> dict[str, float]:
            s = scrape(url)
            assert s["shmkv_supervisor_up{}"] == 1
            return s

        wait_until(lambda: settled().get(f"shmkv_requests_total{{{lab}}}") == n, 20, "reports")
        before = settled()
        assert before[f"shmkv_cache_hits_total{{{lab}}}"] == hits
        assert before[f"shmkv_tokens_restored_total{{{lab}}}"] == restored
        assert before[f"shmkv_restore_duration_seconds_count{{{lab}}}"] == hits
        evaluated = sum(i["evaluated_tokens"] for i in infos)
        assert before[f"shmkv_tokens_evaluated_total{{{lab}}}"] == evaluated
        assert before["shmkv_workers_connected{}"] == 2
        # every worker answers with the deployment's numbers (one scrape target)
        for _ in range(4):
            assert settled()[f"shmkv_requests_total{{{lab}}}"] == n

        # the supervisor SIGKILLed and restarted: the live workers report their totals again
        sup.proc.kill()
        assert sup.proc.wait(10) == -signal.SIGKILL
        assert scrape(url)["shmkv_supervisor_up{}"] == 0  # a worker still answers, and says so
        sup = wait_ready(make_supervisor("--size", "256M", name=sup.name, wait=False))
        srv.sup = sup

        behind: dict[str, tuple[float, float]] = {}

        def caught_up() -> bool:
            s = settled()
            behind.clear()
            behind.update(
                {
                    k: (s.get(k, 0), v)
                    for k, v in before.items()
                    if "model=" in k and s.get(k, 0) < v
                }
            )
            return not behind

        try:
            wait_until(caught_up, 30, "the workers' totals back in the new supervisor")
        except AssertionError as e:
            raise AssertionError(f"{e}; behind (now, before): {behind}") from None
        after_restart = settled()
        assert after_restart["shmkv_puts_total{}"] == 0  # its own counters start again

        # a worker SIGKILLed: what it reported stays in the sums
        victim = next(iter(srv.worker_pids()))
        os.kill(victim, signal.SIGKILL)
        srv.wait_workers(2)
        s = settled()
        for k in after_restart:
            if "model=" in k:
                assert s.get(k, 0) >= after_restart[k], k
        assert s[f"shmkv_requests_total{{{lab}}}"] == n
    finally:
        srv.stop()


# ------------------------------------------------------------------------ the dashboard
def test_dashboard_queries_use_only_exported_names(make_supervisor) -> None:
    port = free_port()
    sup = make_supervisor("--size", "16M", "--metrics-port", str(port))
    raw = Raw(sup.socket)
    raw.attach()
    assert raw.call(full_report(1, 1))["ok"]
    exported = names(scrape(wait_metrics(port)))
    raw.close()
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [
        v["query"]["query"]
        for v in dash["templating"]["list"]
        if "query" in v and isinstance(v["query"], dict)
    ]
    assert len(exprs) >= 20
    used = {n for e in exprs for n in re.findall(r"\bshmkv_[a-z_]+\b", e)}
    assert used, exprs
    missing = used - exported
    assert not missing, f"the dashboard asks for names no scrape has: {sorted(missing)}"
    # and it shows what the issue asks for
    for want in (
        "shmkv_requests_total",
        "shmkv_cache_hits_total",
        "shmkv_tokens_restored_total",
        "shmkv_tokens_reused_local_total",
        "shmkv_restore_duration_seconds_bucket",
        "shmkv_coalesced_waits_total",
        "shmkv_sliding_window_fallbacks_total",
        "shmkv_cache_failures_total",
        "shmkv_arena_largest_free_extent_bytes",
        "shmkv_evictions_total",
        "shmkv_revocations_total",
        "shmkv_workers_connected",
    ):
        assert want in used, want


@pytest.mark.parametrize("port", ["70000", "x"])
def test_metrics_port_is_checked(port: str) -> None:
    res = shmkv("supervise", "--metrics-port", port, "--name", "never-started")
    assert res.returncode != 0 and "metrics" in res.stderr.lower(), res.stderr
