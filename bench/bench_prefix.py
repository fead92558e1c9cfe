"""One shared prefix in the arena (issue 21 item 1): N completions on one ~1,000-token prefix,
each with its own question, one after another to a fresh ``shmkv serve``: the arena's bytes
after all N over the first conversation's, on Gemma 3 and on a model without sliding windows
(a LLaMA-architecture GGUF written here). Smoke run: ``--quick``."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import bench_serve
import click
import common

from tests.support.tinymodel import write_tiny_llama

RATIO = "arena used after N / after the first"
GOALS = {"gemma3": [(RATIO, "<=", 4.0)], "llama": [(RATIO, "<=", 2.0)]}  # (from 7.0x and ~12x)
KEYS = "entries bytes_used puts duplicate_puts rejected_puts"
LLAMA = dict(n_vocab=512, n_embd=256, n_layer=4, n_head=4, n_ctx_train=4096)  # 4 KiB/token f16


def run_model(model: Path, o: Any, work: Path) -> dict[str, Any]:
    """``o.n`` completions on one prefix to a fresh ``shmkv serve``, each after an aside (a short
    unrelated prompt, so that its worker's context holds none of the prefix: an arena hit)."""
    tok, w, after, rs = common.tokenizer(model), common.WORDS, [], []
    line = lambda i: f" Fact {i}: the {w[i % len(w)]} is next to the {w[i * 7 % len(w)]}."  # noqa: E731
    prefix = common.fill_to(o.prefix_tokens, lambda t: len(tok(t)), "Context.", line)
    cfg = dict(model=str(model), threads=1, n_ctx=4096, workers=o.workers, budget_threads=0)
    with common.supervisor(work, "--size", o.arena_size) as sup:
        srv = bench_serve.start_server("shmkv", cfg, work, sup)
        try:
            srv.wait_ready(logged="Application startup complete")
            bench_serve.warm_up(srv)
            look = lambda: common.pick(sup.stats(), KEYS)  # noqa: E731
            same = lambda: (a := look()) == (time.sleep(0.5) or look()) and a  # noqa: E731
            for i in range(o.n):
                with common.http_client(600) as client:
                    bench_serve.send(client, srv, 1, prompt=f"Aside {i}: name a colour.")
                    q = f"\nQuestion {i}: where is the {w[i * 13 % 90]}, and what is beside it?"
                    rs.append(r := bench_serve.send(client, srv, 4, prompt=prefix + q))
                if r["error"] or r["ttft"] is None or not r["shmkv"]:
                    raise click.ClickException(f"request {i} failed: {r['error']}")
                after.append(common.poll(same, 60, "the arena settled (the stream's puts in)"))
        finally:
            srv.stop()
    for r in rs:  # (what the JSON keeps of each)
        r |= {"kind": bench_serve.cache_class(r, len(tok(prefix))), "after": after.pop(0)}
    rs = [common.pick(r, "ttft total text kind after shmkv") for r in rs]
    first, last = rs[0]["after"]["bytes_used"], rs[-1]["after"]["bytes_used"]
    ttft = {k: common.summary([r["ttft"] for r in rs if r["kind"] == k]) for k in ("hit", "local")}
    out = dict(path=str(model), prefix_tokens=len(tok(prefix)), first_bytes=first, last_bytes=last)
    out |= dict(entries=rs[-1]["after"]["entries"], ttft=ttft, hits=ttft["hit"]["n"])
    return out | {RATIO: last / first if first else None, "requests": rs}


@common.command("prefix", quick="4 completions, a 400-token prefix.", model=True)
@common.option("--n", type=int, help="Completions on the one prefix [12; quick 4].")
@common.option("--prefix-tokens", type=int, help="Tokens of the prefix [1000; quick 400].")
@common.option("--workers", default=4, help="shmkv serve's workers (its default).")
@common.option("--arena-size", default="1G")
@common.option("--models", default="gemma3,llama", help="Of gemma3 (--model), llama.")
def main(report: common.Report, o: Any) -> None:
    """N completions on one shared prefix: arena bytes after all N over the first's."""
    o.n = o.n or (4 if o.quick else 12)
    o.prefix_tokens = o.prefix_tokens or (400 if o.quick else 1000)
    with tempfile.TemporaryDirectory(prefix="bench-prefix-") as tmp:
        write_tiny_llama(llama := Path(tmp) / "tiny-llama.gguf", **LLAMA)  # type: ignore[arg-type]
        models = {"gemma3": o.model, "llama": llama}
        cells = {m: run_model(models[m], o, Path(tmp)) for m in o.models.split(",")}
    checks = [g for m, c in cells.items() for g in common.check_goals(GOALS[m], {m: c})]
    cfg = common.pick(vars(o), "quick n prefix_tokens workers arena_size") | {"llama": LLAMA}
    res = {**report.header(), "config": cfg, "cells": cells, "goals": checks}
    mib, hit = lambda n: f"{n / 2**20:.1f} MiB", lambda c, k="p50": c["ttft"]["hit"].get(k)  # noqa: E731
    rows = [["model", "prefix", "first", f"after {o.n}", "ratio", "entries", "hit TTFT", "hits"]]
    rows += [[m, str(c["prefix_tokens"]), mib(c["first_bytes"]), mib(c["last_bytes"]),
              f"{c[RATIO]:.1f}x", str(c["entries"]), common.fmt_s(hit(c)), f"{c['hits']}/{o.n}"]
             for m, c in cells.items()]  # fmt: skip
    click.echo(f"\n{common.title(res, 'shared prefix')}\n{common.grid(rows)}")
    click.echo(common.goal_table(checks))
    report.write(res, [(f"{m}: hit TTFT", hit(c), hit(c, "p99")) for m, c in cells.items()])


if __name__ == "__main__":
    main()
