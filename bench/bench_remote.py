"""Two nodes, one Redis: cross-node hit TTFT against cold and local hits, compression, prefill
saved (docs/guides/redis.md). Smoke run: ``--quick``."""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import common

PREFIX_TOKENS = 2000


@contextlib.contextmanager
def redis_server(workdir: Path, url: str | None) -> Iterator[str]:
    """``url``, or a redis-server of our own on a loopback port (no persistence)."""
    if url:
        yield url
        return
    exe = shutil.which("redis-server")
    if exe is None:
        raise click.ClickException("no redis-server: apt-get install redis-server, or --redis URL")
    with socket.socket() as s:  # a free port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(args + ["--dir", str(workdir)], stdout=subprocess.DEVNULL)
    try:
        import redis

        def up() -> bool:
            with contextlib.suppress(redis.RedisError), redis.Redis(port=port) as r:
                return bool(r.ping())
            return False

        common.poll(up, 15, "redis-server answering", every=0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.kill()
        proc.wait(10)


def flush(url: str) -> None:
    import redis

    with redis.Redis.from_url(url) as r:
        r.flushall()


def ttft(llm: Any, prompt: str, max_tokens: int = 4) -> tuple[float, str]:
    """Seconds to the first streamed chunk, and the whole (greedy) text."""
    r = common.first_token(llm, prompt, max_tokens=max_tokens, temperature=0.0)
    return r["ttft"], r["text"]


def caught_up(sup: common.Supervisor) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        st = sup.stats()
        done = st["remote_queue"] == 0 and st["remote_written"] + st["remote_present"]
        return st if done else None

    return common.poll(done, 60, "write-behind catch-up", every=0.1)


def prompts(model: Path, n: int) -> tuple[str, list[str]]:
    count = common.tokenizer(model)
    words = common.WORDS

    def line(i: int) -> str:
        a, b = words[i % len(words)], words[(i * 7) % len(words)]
        return f" Fact {i}: the {a} is next to the {b}."

    prefix = common.fill_to(PREFIX_TOKENS, lambda t: len(count(t)), "Context.", line)
    return prefix, [f" Question {k}: where is the {words[(k * 13) % 90]}?" for k in range(n)]


def llama(model: Path, threads: int, sup: common.Supervisor | None = None) -> Any:
    """(prompt batches on llama-cpp-python's default threads: every core)"""
    return common.llama(model, threads, sup, n_threads_batch=None)


def arm_pair(
    work: Path, url: str, model: Path, threads: int, prefix: str, sfx: list[str], n: int, codec: str
) -> dict[str, Any]:
    """Publish on A, cross-node hits and local hits on B, with ``--remote-compress codec``."""
    flush(url)
    args = ("--size", "512M", "--remote", url, "--remote-compress", codec, "--remote-wait", "10")
    out: dict[str, Any] = {"codec": codec}
    with common.supervisor(work, *args) as a, common.supervisor(work, *args) as b:
        pub = llama(model, threads, a)
        out["publish_s"] = [ttft(pub, prefix + s)[0] for s in sfx[:2]]
        pub.shmkv.flush()
        st_a = caught_up(a)
        out["written_bytes"] = st_a["remote_written_bytes"]
        out["stored_bytes"] = st_a["remote_stored_bytes"]
        node_b = llama(model, threads, b)
        cross, local, texts, statuses = [], [], [], []
        for s in sfx[2 : 2 + n]:
            with b.client(populate=False, attach=False) as c:
                c.clear()
            node_b.reset()
            t, text = ttft(node_b, prefix + s)
            cross.append(t)
            texts.append(text)
            statuses.append(node_b.shmkv.last.remote)
            node_b.shmkv.flush()
        for s in sfx[2 : 2 + n]:
            node_b.reset()
            local.append(ttft(node_b, prefix + s)[0])
        st_b = b.stats()
        out |= dict(cross_s=cross, local_s=local, cross_texts=texts, statuses=statuses)
        out["fetched_bytes"] = st_b["remote_pulled_bytes"]
        out["pull_seconds"] = st_b["remote_pull_seconds"]
        out["state_bytes"] = st_b["remote_fetched_bytes"] / max(1, st_b["remote_fetched"])
        pub.shmkv.close()
        node_b.shmkv.close()
    return out


def workload(
    work: Path, url: str | None, model: Path, threads: int, systems: list[str], per_node: int
) -> dict[str, Any]:
    """Two nodes, every system prompt asked ``per_node`` times on each: tokens prefilled."""
    if url:
        flush(url)
    args = ("--size", "512M", *(("--remote", url) if url else ()))
    with common.supervisor(work, *args) as a, common.supervisor(work, *args) as b:
        nodes = [llama(model, threads, a), llama(model, threads, b)]
        t0 = time.perf_counter()
        for k in range(per_node):
            for i, system in enumerate(systems):
                for node in nodes:  # A first, then B: B may fetch what A published
                    node.reset()
                    ttft(node, system + f" Question {k}-{i}: why?")
                    node.shmkv.flush()
                    if url and k == 0 and node is nodes[0]:
                        caught_up(a)
        wall = time.perf_counter() - t0
        totals = [dataclasses.asdict(n.shmkv.totals) for n in nodes]
        for n in nodes:
            n.shmkv.close()
    keys = ("tokens_evaluated", "tokens_restored", "remote_restored")
    return {"remote": bool(url), "wall_s": wall, **{k: sum(t[k] for t in totals) for k in keys}}


@common.command("remote", quick="Fewer requests: a smoke run.", model=True, threads=2)
@click.option("--redis", "redis_url", default=None, help="Use this Redis instead of our own.")
def main(report: common.Report, opts: Any) -> None:
    """Cross-node hits through Redis: TTFT, compression, prefill saved."""
    model = opts.model
    n = 2 if opts.quick else 5
    prefix, sfx = prompts(model, 2 + n)
    res: dict[str, Any] = report.header()
    res["config"] = {"quick": opts.quick, "prefix_tokens": PREFIX_TOKENS, "threads": opts.threads}
    with tempfile.TemporaryDirectory(prefix="bench-remote-") as tmp:
        work = Path(tmp)
        with redis_server(work, opts.redis_url) as url:
            cold_llm, cold = llama(model, opts.threads), []
            for s in sfx[2 : 2 + n]:
                cold_llm.reset()
                cold.append(ttft(cold_llm, prefix + s))
            del cold_llm
            res["cold_s"], cold_texts = [t for t, _ in cold], [x for _, x in cold]
            res["pairs"] = [
                arm_pair(work, url, model, opts.threads, prefix, sfx, n, codec)
                for codec in ("none", "zstd")
            ]
            for p in res["pairs"]:
                p["same_text_as_cold"] = p.pop("cross_texts") == cold_texts
            systems = [prefix[: len(prefix) // (2 + i)] for i in range(2 if opts.quick else 4)]
            per = 2 if opts.quick else 3
            res["workload"] = [
                workload(work, u, model, opts.threads, systems, per) for u in (None, url)
            ]
    res["load_after"] = common.loadavg()
    show(res)
    pct = lambda xs: (common.summary(xs)["p50"], common.summary(xs)["p99"])  # noqa: E731
    chart = [("cold", *pct(res["cold_s"]))]
    for p in res["pairs"]:
        chart += [(f"{k} hit ({p['codec']})", *pct(p[f"{k}_s"])) for k in ("cross", "local")]
    report.write(res, chart)


def show(res: dict[str, Any]) -> None:
    arms = [("cold", res["cold_s"])]
    for p in res["pairs"]:
        arms += [
            (f"{w} hit ({p['codec']})", p[f"{k}_s"])
            for w, k in (("cross-node", "cross"), ("local", "local"))
        ]
    rows = [[a, *(common.fmt_s(s[k]) for k in ("p50", "mean")), str(s["n"])]
            for a, xs in arms if (s := common.summary(xs))]  # fmt: skip
    click.echo(common.grid([["arm", "TTFT p50", "mean", "n"], *rows]))
    for p in res["pairs"]:
        click.echo(
            f"{p['codec']}: state {common.fmt_b(p['state_bytes'])}, sent "
            f"{common.fmt_b(p['stored_bytes'])} for {common.fmt_b(p['written_bytes'])}, "
            f"answers {p['statuses']}, text as cold: {p['same_text_as_cold']}"
        )
    for w in res["workload"]:
        click.echo(
            f"workload, remote {'on ' if w['remote'] else 'off'}: {w['tokens_evaluated']} tokens "
            f"prefilled, {w['tokens_restored']} restored ({w['remote_restored']} cross-node), "
            f"{w['wall_s']:.1f} s"
        )


if __name__ == "__main__":
    main()
