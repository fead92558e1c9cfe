"""Two nodes, one Redis: cross-node hit TTFT against cold and local hits, fetch throughput,
compression, prefill saved (docs/benchmarks.md). Smoke run: ``--quick``."""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # the harness, and the shmkv of this checkout
import common  # noqa: E402

N_CTX = 4096
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
    import llama_cpp

    from shmkv.llama import SharedCacheLlama

    kw = dict(model_path=str(model), n_ctx=N_CTX, n_threads=threads, verbose=False)
    if sup is None:
        return llama_cpp.Llama(**kw)
    return SharedCacheLlama(**kw, shmkv_name=sup.name, shmkv_socket=sup.socket)


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


def throughput(work: Path, url: str, size: int, count: int) -> dict[str, Any]:
    """Blobs put on A, written behind, each fetched by B: end-to-end MB/s of a fetch."""
    import hashlib

    import numpy as np

    flush(url)
    times = []
    with (
        common.supervisor(work, "--size", "1G", "--remote", url) as a,
        common.supervisor(work, "--size", "1G", "--remote", url, "--remote-wait", "30") as b,
    ):
        blobs = []
        for i in range(count):
            root = hashlib.blake2b(b"bench-%d" % i, digest_size=16).digest()
            toks = np.random.default_rng(i).integers(0, 30000, 2048).astype("<i4")
            blobs.append((root, toks, np.random.default_rng(i).bytes(size)))
        t0 = time.perf_counter()
        with a.client() as c:
            for root, toks, data in blobs:
                c.put_bytes(root, toks, b"fp", data)
        common.poll(lambda: a.stats()["remote_written"] >= count, 600, "write-behind", every=0.02)
        write_s = time.perf_counter() - t0
        with b.client() as c:
            for root, toks, _ in blobs:
                t1 = time.perf_counter()
                status = c.fetch(root, toks, 0, 30.0, 0.0)
                times.append(time.perf_counter() - t1)
                assert status == "fetched", status
        st = b.stats()
    return {
        "blob_bytes": size,
        "count": count,
        "write_behind_MBps": size * count / write_s / 1e6,
        "fetch_s": common.summary(times),
        "fetch_end_to_end_MBps": size * count / sum(times) / 1e6,
        "pull_MBps": st["remote_pulled_bytes"] / max(st["remote_pull_seconds"], 1e-9) / 1e6,
    }


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
    """Cross-node hits through Redis: TTFT, throughput, compression, prefill saved."""
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
            res["throughput"] = throughput(work, url, 14 << 20, 4 if opts.quick else 12)
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
    t = res["throughput"]
    click.echo(
        f"throughput ({t['count']} x {common.fmt_b(t['blob_bytes'])}): write-behind "
        f"{t['write_behind_MBps']:.0f} MB/s, fetch into the arena {t['fetch_end_to_end_MBps']:.0f}"
        f" MB/s end to end, piece reads {t['pull_MBps']:.0f} MB/s"
    )
    for w in res["workload"]:
        click.echo(
            f"workload, remote {'on ' if w['remote'] else 'off'}: {w['tokens_evaluated']} tokens "
            f"prefilled, {w['tokens_restored']} restored ({w['remote_restored']} cross-node), "
            f"{w['wall_s']:.1f} s"
        )


if __name__ == "__main__":
    main()
