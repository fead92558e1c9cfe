"""One shared prefix (docs/benchmarks.md): the arena's bytes after N completions on one system
prompt over the first's, on Gemma 3, a LLaMA model (no sliding window) and a Qwen 3.5 hybrid
(attention and recurrent layers: how much of the prefix a new question restores), and the same
of ``--persist``'s disk (``--persist``). Smoke: ``--quick``."""

from __future__ import annotations

import ctypes
import tempfile
import time
from pathlib import Path
from typing import Any

import bench_serve
import click
import common
import llama_cpp
import llama_cpp.llama_cpp as llama_c
import numpy as np

from shmkv.core import kvformat
from shmkv.llama import kvstate
from tests.support.tinymodel import write_tiny_llama, write_tiny_qwen35

RATIO = "arena used after N / after the first"
DISK = "disk used after N / after the first"
RESTORED = "prefix not evaluated again by the 2nd-Nth (least)"
GOALS = {"gemma3": [(RATIO, "<=", 4.0)], "llama": [(RATIO, "<=", 2.0)],  # at N = 12 (7.0x, ~12x)
         "qwen35": [(RATIO, "<=", 2.5), (RESTORED, ">=", 0.95)]}  # fmt: skip
LLAMA = dict(n_vocab=512, n_embd=256, n_layer=4, n_head=4, n_ctx_train=4096)  # 4 KiB/token f16
#: 6 delta-net layers (34 KiB of recurrent state) and 2 attention layers (512 bytes/token f16)
QWEN35 = dict(n_layer=8)
MODELS = ("gemma3", "llama", "qwen35")


def run_model(model: Path, o: Any, work: Path) -> dict[str, Any]:
    """bench_serve's cells of the first request and of all ``o.n``, at concurrency 1, each after
    an aside (unrelated: a worker that took the aside holds none of the prefix: an arena hit)."""
    cfg = dict(model=str(model), threads=1, n_ctx=4096, workers=o.workers, budget_threads=0,
               arena_size="1G", max_tokens=4, timeout=600.0, max_load=float("inf"),
               max_wait=0.0, max_rss=16 << 30, min_available=1 << 30, aside=True,
               persist=o.persist)  # fmt: skip
    wl, cells = bench_serve.make_workload(model, 1, o.prefix_tokens, o.n), []
    for n in (1, o.n):
        cell = bench_serve.run_cell("shmkv-chat" if o.chat else "shmkv", 1, n, cfg, wl, work)
        a = bench_serve.analyse_cell(cell, wl.system_tokens[0]) | {"requests": cell["results"]}
        cells.append(a)
        if a["ok"] != n or not a.get("supervisor"):
            raise click.ClickException(f"{a['ok']} of {n} requests answered: {a['error_samples']}")
    (first, last), k = (c["supervisor"]["end"] for c in cells), cells[1]["cache"]
    out = dict(path=str(model), prefix_tokens=wl.system_tokens[0], first_bytes=first["bytes_used"])
    out |= dict(last_bytes=last["bytes_used"], entries=last["entries"], hits=k["hits"])
    out |= {RATIO: last["bytes_used"] / first["bytes_used"], "first_cell": cells[0]}
    later = [(r["shmkv"]["restored_tokens"] + r["shmkv"]["reused_local_tokens"])
             / wl.system_tokens[0] for r in cells[1]["requests"][1:]]  # fmt: skip
    out |= {RESTORED: min(later, default=0.0), "not_evaluated_share": common.summary(later)}
    if o.persist:  # bytes stored on disk, and the payloads written (what whole blobs take)
        out |= {k: last[k] for k in ("persist_records", "persist_bytes", "persisted_bytes")}
        out |= {"first_persist_bytes": first["persist_bytes"]}
        out |= {DISK: last["persist_bytes"] / first["persist_bytes"]}
    return out | {"ttft": common.pick(k, "ttft_hit ttft_local ttft_cold"), "cell": cells[1]}


def checkpoint_cost(model: Path, n: int, reps: int = 30) -> dict[str, Any]:
    """What one of a hybrid's checkpoints costs at ``n`` tokens, in one context: the copy of
    its recurrent state alone (what a prefill pays at each now) against the copy of the whole
    state (what it paid before), the cut the publisher writes from the state of ``2 n`` tokens,
    and the bytes it adds to the arena beyond the chunks it shares (manifest skeleton: cell
    metadata and the recurrent state; the partial group)."""
    llm = llama_cpp.Llama(str(model), n_ctx=4096, n_threads=1, n_threads_batch=1, verbose=False)
    ids = [5 + (7 * i) % 490 for i in range(2 * n)]
    llm.eval(ids[:n])

    def timed(fn: Any) -> tuple[float, Any]:
        out, ts = None, []
        for _ in range(reps):
            t0 = time.perf_counter()
            out = fn()
            ts.append(time.perf_counter() - t0)
        return float(np.median(ts)), out

    t_rec, rec = timed(lambda: kvstate.copy_recurrent(llm, n))
    size = llama_c.llama_state_seq_get_size(llm.ctx, 0)
    buf = (ctypes.c_uint8 * size)()
    t_seq, _ = timed(lambda: llama_c.llama_state_seq_get_data(llm.ctx, buf, size, 0))
    llm.eval(ids[n:])
    got = (ctypes.c_uint8 * llama_c.llama_state_seq_get_size(llm.ctx, 0))()
    llama_c.llama_state_seq_get_data(llm.ctx, got, len(got), 0)
    cut = kvformat.cut_hybrid(longer := bytes(got), n, rec)
    assert cut is not None and cut.size == size
    out = bytearray(cut.size)
    t_cut, _ = timed(lambda: cut.write(longer, rec, memoryview(out)))
    plan = kvformat.plan(out, 64, min_full=0)
    assert plan is not None and bytes(out) == bytes(buf)
    own = len(plan.skeleton) + sum(
        g for g, f in zip(plan.group_sizes, plan.group_full, strict=True) if not f
    )
    return dict(tokens=n, recurrent_bytes=len(rec), state_bytes=size, arena_bytes_own=own,
                copy_recurrent_s=t_rec, copy_state_s=t_seq, cut_write_s=t_cut,
                copy_ratio=t_seq / t_rec)  # fmt: skip


@common.command("prefix", quick="4 completions, a 400-token prefix.", model=True)
@common.option("--n", type=int, help="Completions on the one prefix [12; quick 4].")
@common.option("--prefix-tokens", type=int, help="Tokens of the prefix [1000; quick 400].")
@common.option("--workers", default=4, help="shmkv serve's workers (its default).")
@common.option("--persist", is_flag=True, help="Also --persist to a disk store: its bytes.")
@common.option("--chat", is_flag=True, help="As chats: the prefix a system message.")
@common.option("--models", default=",".join(MODELS), help="Which of them, comma-separated.")
def main(report: common.Report, o: Any) -> None:
    """N completions on one shared prefix: arena bytes after all N over the first's."""
    o.n = o.n or (4 if o.quick else 12)
    o.prefix_tokens = o.prefix_tokens or (400 if o.quick else 1000)
    with tempfile.TemporaryDirectory(prefix="bench-prefix-") as tmp:
        write_tiny_llama(llama := Path(tmp) / "tiny-llama.gguf", **LLAMA)  # type: ignore[arg-type]
        write_tiny_qwen35(qwen35 := Path(tmp) / "tiny-qwen35.gguf", **QWEN35)
        paths = {"gemma3": o.model, "llama": llama, "qwen35": qwen35}
        wanted = [m.strip() for m in o.models.split(",") if m.strip()]
        if unknown := set(wanted) - set(MODELS):
            raise click.BadParameter(f"{sorted(unknown)}: choose from {', '.join(MODELS)}")
        cells = {m: run_model(paths[m], o, Path(tmp)) for m in wanted}
        cost = checkpoint_cost(qwen35, o.prefix_tokens) if "qwen35" in wanted else None
    checks = [g for m in cells if o.n == 12 for g in common.check_goals(GOALS[m], {m: cells[m]})]
    cfg = common.pick(vars(o), "quick n prefix_tokens workers persist models chat")
    cfg |= {"llama": LLAMA, "qwen35": QWEN35}
    res = {**report.header(), "config": cfg, "cells": cells, "goals": checks}
    res["checkpoint_cost"] = cost
    mib, hit = lambda n: f"{n / 2**20:.1f} MiB", lambda c, k="p50": c["ttft"]["ttft_hit"].get(k)  # noqa: E731
    rows = [
        [
            "model",
            "prefix",
            "first",
            f"after {o.n}",
            "ratio",
            "entries",
            "hit TTFT",
            "hits",
            "not evaluated (least)",
        ]
    ]
    rows += [[m, str(c["prefix_tokens"]), mib(c["first_bytes"]), mib(c["last_bytes"]),
              f"{c[RATIO]:.1f}x", str(c["entries"]), common.fmt_s(hit(c)), f"{c['hits']}/{o.n}",
              f"{c[RESTORED] * 100:.0f} %"] for m, c in cells.items()]  # fmt: skip
    click.echo(f"\n{common.title(res, 'shared prefix')}\n{common.grid(rows)}")
    if o.persist:
        rows = [["model", "disk: first", f"after {o.n}", "ratio", "payloads written"]]
        rows += [[m, mib(c["first_persist_bytes"]), mib(c["persist_bytes"]), f"{c[DISK]:.1f}x",
                  mib(c["persisted_bytes"])] for m, c in cells.items()]  # fmt: skip
        click.echo(common.grid(rows))
    if cost:
        us = lambda t: f"{t * 1e6:.0f} us"  # noqa: E731
        rows = [["qwen35 checkpoint at", "recurrent state", "whole state", "copy: recurrent",
                 "copy: whole", "cut (publisher)", "arena beyond shared chunks"]]  # fmt: skip
        b = lambda n: f"{n / 1024:.1f} KiB"  # noqa: E731
        rows += [[str(cost["tokens"]), b(cost["recurrent_bytes"]), b(cost["state_bytes"]),
                  us(cost["copy_recurrent_s"]), us(cost["copy_state_s"]), us(cost["cut_write_s"]),
                  b(cost["arena_bytes_own"])]]  # fmt: skip
        click.echo(common.grid(rows))
    click.echo(common.goal_table(checks))
    report.write(res, [(f"{m}: hit TTFT", hit(c), hit(c, "p99")) for m, c in cells.items()])


if __name__ == "__main__":
    main()
