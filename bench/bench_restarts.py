"""Restarts: a supervisor restarted and its successor's first hit timed (docs/guides/restarts.md).
``restart``: from a ``kill -9`` to the first hit on the adopted arena, against a ``--fresh``
start. ``persist``: the refill from ``--persist`` after a reboot against the cold prefills it
saves. Smoke run: ``restart --quick``, ``persist --quick``."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import click
import common
import numpy as np

from shmkv.core.errors import ShmkvError
from shmkv.core.keys import chain_digests

log = logging.getLogger("bench")
opt = common.option
FP = b"bench-persist"
BLOB = 16 << 20
TOKENS = 1984  # 31 chunks of 64
GOALS = [("adopt: first hit p50 (s)", "<=", 1.0)]


def state(i: int) -> tuple[bytes, np.ndarray, bytes]:
    """State ``i``: a pure function of ``i`` (root, tokens, payload)."""
    root = hashlib.blake2b(b"restart-%d" % i, digest_size=16).digest()
    rng = np.random.default_rng(i)
    return root, rng.integers(0, 30_000, TOKENS).astype("<i4"), rng.bytes(BLOB)


def first_hit(sup: common.Supervisor, i: int, data: bytes) -> float:
    """Poll until state ``i`` is read back intact; the monotonic time it was."""
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
    """Poll until ``sup`` answers a ping; the monotonic time it did."""
    return common.poll(lambda: sup.answers() and time.monotonic(), 60, "answer", sup.child)


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


def restart_rounds(workdir: Path, size: str, rounds: int) -> dict[str, Any]:
    name = f"bench{uuid.uuid4().hex[:8]}"
    sup = common.start_supervisor(workdir, name, "--size", size)
    answers(sup)
    with sup.client() as c:
        n = int(c.view.geometry.data_size // (BLOB + 16384))
    t0 = time.monotonic()
    fill(sup, n)
    st, fill_s = sup.stats(), time.monotonic() - t0
    size_used = common.fmt_b(st["bytes_used"])
    log.info("filled %d states (%s) in %.1f s", st["entries"], size_used, fill_s)
    probe, probe_data = n - 1, state(n - 1)[2]
    out: dict[str, Any] = {"entries": st["entries"], "bytes_used": st["bytes_used"], "rounds": []}
    try:
        for r in range(rounds):
            for mode in ("adopt", "fresh"):
                sup.child.stop(kill=True)
                args, t0 = ("--fresh",) if mode == "fresh" else (), time.monotonic()
                sup = common.start_supervisor(workdir, name, "--size", size, *args)
                row: dict[str, Any] = {"round": r, "mode": mode, "ready_s": answers(sup) - t0}
                if mode == "adopt":
                    row["first_hit_s"] = first_hit(sup, probe, probe_data) - t0
                    line = r"adopted (\d+) entries .* in ([\d.]+) s"
                    m = re.search(line, sup.child.log_tail(1 << 16))
                    row["adopted"], row["check_s"] = (int(m[1]), float(m[2])) if m else (None, None)
                else:
                    row["entries_after"] = sup.stats()["entries"]
                    fill(sup, n)  # for the next round's kill
                out["rounds"].append(row)
                log.info("round %d %s: %s", r, mode, row)
    finally:
        sup.child.stop()
        for p in common.SHM.glob(f"shmkv-{name}*"):
            p.unlink(missing_ok=True)
    return out


@common.command("restart", quick="128 MiB arena, 2 rounds.")
@opt("--size", help="Arena --size [1G; quick 128M].")
@opt("--rounds", type=int, help="kill -9 and restarts of each kind [5].")
def restart(report: common.Report, o: Any) -> None:
    """Time from a supervisor's kill -9 to its successor's first hit, against a fresh start."""
    size, rounds = o.size or ("128M" if o.quick else "1G"), o.rounds or (2 if o.quick else 5)
    (workdir := common.HERE / "out" / "restart-run").mkdir(parents=True, exist_ok=True)
    logging.getLogger("shmkv.core.client").setLevel(logging.ERROR)  # (refused while it starts)
    load_before, res = common.loadavg(), restart_rounds(workdir, size, rounds)
    cold, cold_tokens = cold_prefill_s()
    saved = None if cold is None else res["entries"] * cold
    rows = [("kill -9, restart adopting: first hit", "adopt", "first_hit_s"),
            ("  of which: supervisor answers", "adopt", "ready_s"),
            ("  of which: checking every record", "adopt", "check_s"),
            ("kill -9, restart --fresh: answers (empty)", "fresh", "ready_s")]  # fmt: skip
    a = {f"{m}_{k}": common.summary([x[k] for x in res["rounds"] if x["mode"] == m and x.get(k)])
         for _, m, k in rows}  # fmt: skip
    cfg = dict(quick=o.quick, size=size, rounds=rounds, blob_bytes=BLOB)
    out = {**report.header(), "config": cfg}
    out["cold_prefill"] = dict(seconds=cold, tokens=cold_tokens, source="baseline/restore.json")
    out |= res | {"analysis": a | {"cold_prefills_saved_s": saved}, "loadavg_before": load_before}
    out["goals"] = common.check_goals(GOALS, {"": {GOALS[0][0]: a["adopt_first_hit_s"]["p50"]}})
    click.echo(f"\n{common.title(out, 'restart')}; load {load_before[0]} before")
    click.echo(f"{res['entries']} states, {common.fmt_b(res['bytes_used'])} in a {size} arena")
    rows = [(label, a[f"{m}_{k}"]) for label, m, k in rows]
    table = [[label, *(common.fmt_s(s[k]) for k in ("p50", "max"))] for label, s in rows]
    click.echo(common.grid([["", "p50", "max"], *table]))
    if saved is not None:
        what = f"{res['entries']} x {cold:.2f} s ({cold_tokens} tokens, Gemma 3 270M, baseline)"
        click.echo(f"cold prefills the adopted states save: {what} = {saved:.0f} s of CPU")
    click.echo(common.goal_table(out["goals"]))
    report.write(out, [(label, s.get("p50"), s.get("p99")) for label, s in rows])


def real_states(model: Path, n: int, tokens: int, threads: int) -> list[dict[str, Any]]:
    """``n`` prompt states of ``tokens`` tokens: their bytes and cold prefill seconds."""
    llm, tok, out = common.llama(model, threads), common.tokenizer(model), []
    for k in range(n):
        text = " ".join(f"{common.WORDS[(k * 7 + i) % len(common.WORDS)]}" for i in range(tokens))
        ids = tok(f"Document {k}: {text}")[:tokens]
        llm._ctx.kv_cache_clear()
        f = common.Floor(llm, ids)  # (a reset, the prefill timed, the state copied out)
        toks, data = np.asarray(ids, dtype="<i4"), bytes(f.buf)
        out.append({"tokens": toks, "data": data, "cold_s": f.eval_seconds})
    return out


def refill_case(tmp: Path, states: list[dict[str, Any]], n: int, drop: bool) -> dict[str, Any]:
    disk, size = tmp / "persist", sum(len(states[i % len(states)]["data"]) for i in range(n))
    arena_size = str(int(size * 1.2) + (64 << 20))
    args = ("--size", arena_size, "--persist", str(disk), "--persist-size", str(4 * size))
    with common.supervisor(tmp, *args) as sup:
        t, digests = time.perf_counter(), []  # n records: the states, round robin, fresh roots
        with sup.client() as c:
            chunk = c.view.geometry.chunk_tokens
            for s, root in ((states[i % len(states)], os.urandom(16)) for i in range(n)):
                c.put_bytes(root, s["tokens"], FP, s["data"])
                digests.append(chain_digests(root, s["tokens"], chunk))
        put_s = time.perf_counter() - t
        common.poll(lambda: sup.stats()["persisted"] >= n, 600, "write-behind", every=0.005)
        written_s = time.perf_counter() - t
        disk_bytes = sup.stats()["persist_bytes"]  # (copies of one state share its chunks)
    if drop:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    t0 = time.perf_counter()
    with common.supervisor(tmp, *args) as sup:
        ready_s = time.perf_counter() - t0
        with sup.client() as c:
            common.poll(lambda: c.lookup(digests[-1]) is not None, 60, "first hit", every=0.005)
            first_hit_s = time.perf_counter() - t0
            done = lambda: (s := sup.stats())["refilling"] == 0 and s  # noqa: E731
            st = common.poll(done, 600, "refill", every=0.005)
            hits = sum(c.lookup(d) is not None for d in digests)
    gb_s = st["refilled_bytes"] / secs / 1e9 if (secs := st["refill_seconds"]) else 0.0
    cold_saved = sum(states[i % len(states)]["cold_s"] for i in range(st["refilled"]))
    return dict(states=n, bytes=size, disk_bytes=disk_bytes, put_s=put_s,
                written_behind_s=written_s,
                write_behind_gb_s=size / written_s / 1e9, page_cache_dropped=drop, ready_s=ready_s,
                first_hit_s=first_hit_s, refill_s=secs, refill_first_s=st["refill_first_seconds"],
                refilled=st["refilled"], refill_skipped=st["refill_skipped"], refill_gb_s=gb_s,
                hits_after_refill=hits, cold_prefill_saved_s=cold_saved,
                cold_over_refill=secs and cold_saved / secs)  # fmt: skip


@common.command("persist", quick="Smoke run.", model=True, threads=2)
@opt("--states", type=int, help="Records on disk to refill [256; quick 24].")
@opt("--real", type=int, help="Distinct states prefilled (the rest are copies) [8; quick 3].")
@opt("--prefix-tokens", type=int, help="Tokens per state [1000; quick 300].")
@opt("--drop-caches", is_flag=True, help="Empty the page cache before the refill (root).")
def persist(report: common.Report, o: Any) -> None:
    """Benchmark the refill from --persist after a reboot."""
    q, n, real = o.quick, o.states or (24 if o.quick else 256), o.real or (3 if o.quick else 8)
    tokens = o.prefix_tokens or (300 if q else 1000)
    states = real_states(o.model, real, tokens, o.threads)
    with tempfile.TemporaryDirectory(prefix="shmkv-bench-persist-") as tmp:
        refill = refill_case(Path(tmp), states, n, o.drop_caches)
    res = {**report.header(), "refill": (r := refill)}
    res["cold_prefill_s"] = [s["cold_s"] for s in states]
    res["config"] = dict(quick=q, states=n, real=real, prefix_tokens=tokens, threads=o.threads)
    res["state_bytes"] = [len(s["data"]) for s in states]
    click.echo(f"\n{common.title(res, 'persist')}; {tokens}-token states, {n} on disk")
    saved = f"{r['cold_over_refill']:.0f}x the refill" if r["cold_over_refill"] else ""
    rows = [["", "value", "vs cold prefill"]]
    rows += [["refill", f"{r['refill_gb_s']:.2f} GB/s, {r['refill_s']:.2f} s", ""]]
    rows += [["first hit after start", common.fmt_s(r["first_hit_s"]), ""]]
    rows += [["cold prefills saved", common.fmt_s(r["cold_prefill_saved_s"]), saved]]
    rows += [["write-behind", f"{r['write_behind_gb_s']:.2f} GB/s", ""]]
    rows += [["on disk", f"{common.fmt_b(r['disk_bytes'])} of {common.fmt_b(r['bytes'])}", ""]]
    click.echo(common.grid(rows))
    chart = [("first hit after the start", r["first_hit_s"], None), ("refill", r["refill_s"], None)]
    report.write(res, chart)


main = click.Group(commands={"restart": restart, "persist": persist}, help=__doc__)

if __name__ == "__main__":
    main()
