"""Restart: from a supervisor's ``kill -9`` to its successor's first hit on an adopted arena,
against a ``--fresh`` start (docs/benchmarks.md). Smoke run: ``--quick``."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import re
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import click
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # the harness, and the shmkv of this checkout
import common  # noqa: E402

log = logging.getLogger("bench")

BLOB = 16 << 20
TOKENS = 1984  # 31 chunks of 64
GOAL_ADOPT_S = 1.0


def state(i: int) -> tuple[bytes, np.ndarray, bytes]:
    """State ``i``: a pure function of ``i`` (root, tokens, payload)."""
    root = hashlib.blake2b(b"restart-%d" % i, digest_size=16).digest()
    rng = np.random.default_rng(i)
    return root, rng.integers(0, 30_000, TOKENS).astype("<i4"), rng.bytes(BLOB)


def start(workdir: Path, name: str, size: str, *args: str) -> common.Child:
    sock = str(workdir / f"{name}.sock")
    cmd = [sys.executable, "-m", "shmkv", "supervise", "--name", name, "--socket", sock]
    cmd += ["--size", size, *args]
    return common.Child("the supervisor", cmd, common.child_env(), workdir / f"{name}.log")


def first_hit(sup: common.Supervisor, i: int, data: bytes) -> float:
    """Poll until state ``i`` is read back intact; the monotonic time it was."""
    from shmkv.core.errors import ShmkvError
    from shmkv.core.keys import chain_digests

    root, tokens, _ = state(i)

    def hit() -> float | None:
        with contextlib.suppress(ShmkvError), sup.client(timeout=2.0) as c:
            c._backoff = 0.0
            if (h := c.lookup(chain_digests(root, tokens, 64))) is not None:
                with c.acquire(h) as lease:
                    if bytes(lease.payload) == data and lease.finish():
                        return time.monotonic()
        return None

    return common.poll(hit, 60, "hit", sup.child)


def answers(sup: common.Supervisor) -> float:
    from shmkv.core.errors import ShmkvError

    def ping() -> float | None:
        with contextlib.suppress(ShmkvError):
            return sup.request("ping") and time.monotonic()
        return None

    return common.poll(ping, 60, "answer", sup.child)


def fill(sup: common.Supervisor, n: int) -> None:
    with sup.client() as c:
        for i in range(n):
            root, tokens, data = state(i)
            c.put_bytes(root, tokens, b"bench-restart", data)


def cold_prefill_s() -> tuple[float | None, int | None]:
    """Cold TTFT p50 of the ~2,000-token prompt of the committed bench_restore run."""
    try:
        base = json.loads((common.HERE / "baseline" / "restore.json").read_text())
        return base["analysis"]["ttft"]["cold"]["ttft"]["p50"], base["config"]["prefix_tokens"]
    except (OSError, KeyError, ValueError):
        return None, None


def run(workdir: Path, size: str, rounds: int) -> dict[str, Any]:
    name = f"bench{uuid.uuid4().hex[:8]}"
    sock = str(workdir / f"{name}.sock")
    child = start(workdir, name, size)
    sup = common.Supervisor(name, sock, child)
    answers(sup)
    with sup.client() as c:
        n = int(c.view.geometry.data_size // (BLOB + 16384))
    t0 = time.monotonic()
    fill(sup, n)
    fill_s = time.monotonic() - t0
    st = sup.stats()
    used = common.fmt_b(st["bytes_used"])
    log.info("filled %d states (%s) in %.1f s", st["entries"], used, fill_s)
    probe, probe_data = n - 1, state(n - 1)[2]
    out: dict[str, Any] = {"entries": st["entries"], "bytes_used": st["bytes_used"], "rounds": []}
    try:
        for r in range(rounds):
            for mode in ("adopt", "fresh"):
                child.stop(kill=True)
                args = ("--fresh",) if mode == "fresh" else ()
                t0 = time.monotonic()
                child = start(workdir, name, size, *args)
                sup = common.Supervisor(name, sock, child)
                t_ready = answers(sup)
                row: dict[str, Any] = {"round": r, "mode": mode, "ready_s": t_ready - t0}
                if mode == "adopt":
                    row["first_hit_s"] = first_hit(sup, probe, probe_data) - t0
                    line = r"adopted (\d+) entries .* in ([\d.]+) s"
                    m = re.search(line, child.log_tail(1 << 16))
                    row["adopted"], row["check_s"] = (int(m[1]), float(m[2])) if m else (None, None)
                else:
                    row["entries_after"] = sup.stats()["entries"]
                    fill(sup, n)  # for the next round's kill
                out["rounds"].append(row)
                log.info("round %d %s: %s", r, mode, row)
    finally:
        child.stop()
        for p in common.SHM.glob(f"shmkv-{name}*"):
            p.unlink(missing_ok=True)
    return out


@common.command("restart")
@click.option("--quick", is_flag=True, help="128 MiB arena, 2 rounds.")
@click.option("--size", default=None, help="Arena --size [1G; quick 128M].")
@click.option("--rounds", type=int, default=None, help="kill -9 and restarts of each kind [5].")
def main(report: common.Report, o: Any) -> None:
    """Time from a supervisor's kill -9 to its successor's first hit, against a fresh start."""
    size = o.size or ("128M" if o.quick else "1G")
    rounds = o.rounds or (2 if o.quick else 5)
    workdir = common.HERE / "out" / "restart-run"
    workdir.mkdir(parents=True, exist_ok=True)
    logging.getLogger("shmkv.core.client").setLevel(logging.ERROR)  # (refused while it starts)
    load_before = common.loadavg()
    res = run(workdir, size, rounds)
    cold, cold_tokens = cold_prefill_s()
    adopt = [x for x in res["rounds"] if x["mode"] == "adopt"]
    fresh = [x for x in res["rounds"] if x["mode"] == "fresh"]
    first = common.summary([x["first_hit_s"] for x in adopt])
    saved = None if cold is None else res["entries"] * cold
    out = {
        **report.header(),
        "config": dict(quick=o.quick, size=size, rounds=rounds, blob_bytes=BLOB),
    }
    out["goals"] = {"adopt_first_hit_s": GOAL_ADOPT_S}
    out["cold_prefill"] = dict(seconds=cold, tokens=cold_tokens, source="baseline/restore.json")
    a = out["analysis"] = {"adopt_first_hit_s": first}
    a["adopt_ready_s"] = common.summary([x["ready_s"] for x in adopt])
    a["adopt_check_s"] = common.summary([x["check_s"] for x in adopt if x["check_s"]])
    a["fresh_ready_s"] = common.summary([x["ready_s"] for x in fresh])
    a["cold_prefills_saved_s"] = saved
    out |= res | {"load_average": {"before": load_before, "after": common.loadavg()}}
    out["goals_met"] = {"adopt_first_hit": first["p50"] <= GOAL_ADOPT_S}
    click.echo(f"\n{common.title(out, 'restart')}; load {load_before[0]} before")
    click.echo(f"{res['entries']} states, {common.fmt_b(res['bytes_used'])} in a {size} arena")
    rows = [
        ("kill -9, restart adopting: first hit", a["adopt_first_hit_s"]),
        ("  of which: supervisor answers", a["adopt_ready_s"]),
        ("  of which: checking every record", a["adopt_check_s"]),
        ("kill -9, restart --fresh: answers (empty)", a["fresh_ready_s"]),
    ]
    for label, s in rows:
        click.echo(f"{label:44} p50 {common.fmt_s(s['p50'])}  max {common.fmt_s(s['max'])}")
    if saved is not None:
        what = f"{res['entries']} x {cold:.2f} s ({cold_tokens} tokens, Gemma 3 270M, baseline)"
        click.echo(f"cold prefills the adopted states save: {what} = {saved:.0f} s of CPU")
    click.echo(f"goals: {out['goals_met']}")

    report.write(out, [(label, s.get("p50"), s.get("p99")) for label, s in rows])


if __name__ == "__main__":
    main()
