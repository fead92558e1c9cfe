"""TTFT on a shared ~2,000-token prefix: cold, shmkv hit, the floor, LlamaRAMCache and --exact
arms, each in a process of its own (docs/benchmarks.md). Smoke run: ``--quick``."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click
import common
import llama_cpp
import psutil

from shmkv.core.client import Client
from shmkv.llama import SharedCacheLlama

log = logging.getLogger("bench_restore")
opt = common.option

GOALS = [("hit_over_floor_p50", "<=", 1.10), ("cold_over_hit_p50", ">=", 50.0)]  # TTFT ratios
ARENA_SIZE = "1G"
RAMCACHE_CAPACITY = 2 << 30
MIN_FREE_MEMORY = 3 << 30  # stop the LlamaRAMCache arm before it can exhaust RAM
SEED = 7
# the word list the committed prompts were drawn from: the shared one with a second "falcon"
WORDS = [*common.WORDS[:77], "falcon", *common.WORDS[77:]]
SKIPPED = "quiver saffron jigsaw quill urchin yarn zephyr drizzle kernel".split()
SUFFIX_HEADS = [w.capitalize() for w in common.WORDS if w not in SKIPPED]  # each suffix's first
SUFFIX_HEADS += """Please Tell Explain Describe Summarize List Name Which What Why How When Where
Who Give Write Compare Choose Find Count Check""".split()


RATIOS = """hit_over_floor hit floor_b p50|hit_over_floor hit floor_b mean
hit_nopublish_over_floor hit_nopublish floor_b p50|hit_over_floor_separate_process hit floor p50
cold_over_hit cold hit p50|cold_over_hit cold hit mean|ramcache_over_cold ramcache cold p50
cold_over_floor cold floor p50|cold_over_hit_exact cold hit_exact p50""".replace("\n", "|")


def timed(calls: list[tuple[float, float, bool | None]], fn: Any) -> Any:
    """``fn``, appending (start, seconds, its result if a bool) of every call to ``calls``."""

    def wrapper(*a: Any, **k: Any) -> Any:
        t, out = time.perf_counter(), None
        try:
            return (out := fn(*a, **k))
        finally:
            calls.append((t, time.perf_counter() - t, out if isinstance(out, bool) else None))

    return wrapper


def floor(llm: Any, spec: dict[str, Any], res: dict[str, Any]) -> common.Floor:
    """The prefix's floor (:class:`common.Floor`); its state's size into ``res``."""
    toks = [llm.token_bos()] + llm.tokenize(spec["prefix"].encode(), add_bos=False, special=True)
    if len(toks) != spec["prefix_tokens"]:
        raise RuntimeError(f"floor: prefix is {len(toks)} tokens, {spec['prefix_tokens']} planned")
    res["blob_bytes"] = (f := common.Floor(llm, toks)).size
    return f


def arm(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one arm; returns its JSON-able result."""
    kind, gen, prefix, prefix_n = spec["arm"], spec["gen"], spec["prefix"], spec["prefix_tokens"]
    res: dict[str, Any] = {"arm": kind, "requests": []}
    t = time.perf_counter()
    if kind.startswith(("publisher", "hit")):  # through shmkv
        shmkv = dict(shmkv_name=spec["name"], shmkv_socket=spec["socket"], shmkv_namespace="bench")
        shmkv["shmkv_exact"] = kind.endswith("_exact")
        cache = (llm := SharedCacheLlama(model_path=spec["model"], **spec["ctx"], **shmkv)).shmkv
    else:
        llm, cache = llama_cpp.Llama(model_path=spec["model"], **spec["ctx"]), None
    res["load_seconds"], cp = time.perf_counter() - t, llm.context_params
    res["context_params"] = {n: v for n, _t in cp._fields_
                             if isinstance(v := getattr(cp, n), (int, float, bool))}  # fmt: skip
    calls: list[tuple[float, float, bool | None]] = []  # of capture()
    if cache is not None:
        t = time.perf_counter()  # what a worker's attach costs: connect + map (MAP_POPULATE)
        with Client(name=spec["name"], socket_path=spec["socket"]) as c:
            c.ensure()
            res["attach_seconds"] = time.perf_counter() - t
        cache.capture = timed(calls, cache.capture)
    llm.reset()
    res["warmup"] = common.first_token(llm, spec["warmup"], **gen)  # first touch of the weights
    if cache is not None:
        cache.flush()

    def run(text: str, before: Any = None, **extra: Any) -> dict[str, Any]:
        llm.reset()
        calls.clear()
        r = {**common.first_token(llm, prefix + text, before, **gen), **extra}
        captured = list(calls)  # (not those a flush may make)
        if cache is None or before is not None:  # the floor does not go through the cache
            return r
        t, r["flushed"] = time.perf_counter(), cache.flush(60)
        r |= dict(flush_seconds=time.perf_counter() - t, last=dataclasses.asdict(cache.last))
        r["captures"] = [(s - r["t0"], d, ok) for s, d, ok in captured]
        least = prefix_n - 64 if kind == "hit" else 0
        least = prefix_n - spec["ctx"]["n_batch"] if kind == "hit_exact" else least
        if (restored := cache.last.tokens_restored) < least:
            what = f"restored {restored} (last={r['last']}, errors={cache.totals.errors})"
            raise RuntimeError(f"{kind} request {extra.get('suffix')}: {what}")
        return r

    if kind in ("cold", "hit_exact", "publisher", "publisher_exact"):
        for n, (i, s) in enumerate(spec["suffixes"]):
            r = run(s, suffix=i, **({"second": n > 0} if kind.startswith("publisher") else {}))
            res["requests"].append(r)
            if kind.startswith("publisher") and (not r["flushed"] or not cache.totals.publishes):
                raise RuntimeError(f"process A did not publish: {cache.totals}")
    elif kind == "hit":
        on, off = spec["suffixes"], spec["suffixes_off"]
        floor_b: dict[str, Any] = {"requests": []}
        fl = floor(llm, spec, floor_b)
        res["floor_b"] = floor_b
        rotation = ("on", "off", "floor")  # the three kinds interleaved, in a rotating order
        for k in range(len(on)):
            for what in rotation[k % 3 :] + rotation[: k % 3]:
                if what == "floor":  # bypass the shmkv hook: Llama's own generate
                    llm.generate = functools.partial(llama_cpp.Llama.generate, llm)
                    try:
                        r = run(on[k][1], before=fl.restore, suffix=on[k][0])
                    finally:
                        del llm.generate
                    floor_b["requests"].append({**r, "set_data_seconds": fl.set_seconds[-1]})
                    continue
                cache.publish_enabled = what == "on"
                i, s = (on if what == "on" else off)[k]
                res["requests"].append(run(s, suffix=i, publish=what == "on"))
        cache.publish_enabled = True
    elif kind == "floor":
        fl = floor(llm, spec, res)
        for i, s in spec["suffixes"]:
            r = run(s, before=fl.restore, suffix=i)
            res["requests"].append(r | {"set_data_seconds": fl.set_seconds[-1]})
        llm.reset()  # llama-cpp-python's own same-process prefix reuse: no reset from here on
        (_, s0), *rest = spec["suffixes_local"]
        res["local_first"] = common.first_token(llm, prefix + s0, **gen)
        res["local"] = [common.first_token(llm, prefix + s, **gen) | {"suffix": i} for i, s in rest]
    elif kind == "ramcache":
        ramcache = llama_cpp.LlamaRAMCache(capacity_bytes=RAMCACHE_CAPACITY)
        llm.set_cache(ramcache)
        res["aborted"] = None
        for n, (i, s) in enumerate(spec["suffixes"]):
            if (free := common.meminfo("MemAvailable")) and free < MIN_FREE_MEMORY:
                res["aborted"] = f"stopped before request {n}: only {free >> 20} MiB available"
                break
            r = run(s, suffix=i, warm=n == 0)
            cached, rss = ramcache.cache_state, psutil.Process().memory_info().rss
            r |= dict(entries=len(cached), cache_size=ramcache.cache_size, rss_bytes=rss)
            r["scores_bytes_uncounted"] = int(next(reversed(cached.values())).scores.nbytes)
            res["requests"].append(r | {"mem_available": common.meminfo("MemAvailable")})
    else:
        raise ValueError(f"unknown arm {kind}")
    if cache is not None:
        res["totals"] = dataclasses.asdict(cache.totals)
        cache.close()
    res["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return res


def make_prompts(model: Path, prefix_target: int, suffix_target: int, n: int) -> dict[str, Any]:
    """A shared prefix and suffixes that start with different tokens (so no two requests share
    more than the prefix) and tokenize apart from it."""
    tok, rng = common.tokenizer(model), random.Random(SEED)

    def count(text: str) -> int:  # with BOS, as create_completion tokenizes a prompt
        return len(tok(text)) + 1

    def document(head: str, line: str) -> str:
        fill = lambda n: line.format(*rng.sample(WORDS, 8), n=n)  # noqa: E731
        return common.fill_to(prefix_target, count, head, fill) + "\n"

    prefix = document("You are the archivist of a large museum. Below are the catalogue rules "
                      "you must follow when answering visitors. Answer briefly.\n\n",
                      "Rule {n}: the {0} room holds {1} and {2} items; visitors who ask about "
                      "the {3} must be sent to the {4} desk, never to the {5} hall.\n")  # fmt: skip
    # as long, nothing in common: each arm warms up on it before anything is timed
    warmup = document("Shipping log of the cargo vessel Northern Star. Each entry lists the "
                      "cargo and the weather.\n\n",
                      "Day {n}. Loaded {0} crates of {1} and a barrel of {2}; the wind came "
                      "from the {3}, and the {4} was stored below the {5}.\n")  # fmt: skip
    ptoks, firsts, suffixes, heads = tok(prefix), set(), [], list(SUFFIX_HEADS)
    rng.shuffle(heads)
    for h in heads:
        text = (words := f"{h}:") + "\nAnswer:"
        while len(tok(prefix + text)) - len(ptoks) < suffix_target:
            words += f" {rng.choice(WORDS)}"
            text = words + "?\nAnswer:"
        full = tok(prefix + text)
        if full[: len(ptoks)] != ptoks or full[len(ptoks)] in firsts:
            continue
        firsts.add(full[len(ptoks)])
        suffixes.append(text)
        if len(suffixes) == n:
            break
    else:
        raise click.ClickException(f"only {len(suffixes)} distinct suffixes: lower --repeats")
    out = dict(prefix=prefix, prefix_tokens=len(ptoks) + 1, suffixes=suffixes)
    out["suffix_tokens"] = [len(tok(prefix + s)) - len(ptoks) for s in suffixes]
    return out | dict(warmup=warmup + "Summary:", warmup_tokens=count(warmup))


def run_arm(spec: dict[str, Any], workdir: Path, sup: common.Supervisor) -> dict[str, Any]:
    """Run one arm in a process of its own; its result plus what else used the CPU meanwhile."""
    name, spec = spec["arm"], {**spec, "out": str(workdir / f"{spec['arm']}.out.json")}
    (spec_path := workdir / f"{name}.spec.json").write_text(json.dumps(spec))
    noise = common.Noise((sup.child.pid,))
    with open(err_path := workdir / f"{name}.stderr", "wb") as f:
        args = [sys.executable, __file__, "_arm", str(spec_path)]
        out = dict(stdout=f, stderr=subprocess.STDOUT, timeout=1800)
        if rc := subprocess.run(args, env=common.child_env(), **out).returncode:  # type: ignore[call-overload]
            raise click.ClickException(f"arm {name} failed ({rc}):\n{err_path.read_text()[-4000:]}")
    res = json.loads(Path(spec["out"]).read_text())
    p = res["process"] = noise.result()
    done = "arm %-15s done in %5.1f s (other processes used %.2f cores meanwhile)"
    log.info(done, name, p["wall_seconds"], p["foreign_cores"])
    return res


def analyse(arms: dict[str, dict[str, Any]], plan: dict[str, Any]) -> dict[str, Any]:
    cold, hit, floor, ram, pub = (arms[k] for k in "cold hit floor ramcache publisher".split())
    S = common.summary

    def split(rs: list[dict[str, Any]], key: str) -> tuple[list[Any], list[Any]]:
        return [r for r in rs if r[key]], [r for r in rs if not r[key]]

    (on, off), fb = split(hit["requests"], "publish"), hit["floor_b"]["requests"]
    ram_warm, ram_hits = split(ram["requests"], "warm")
    p2, pub_first = split(pub["requests"], "second")  # (A's second request, its first)
    exact, pub_exact = arms["hit_exact"]["requests"], arms["publisher_exact"]["requests"]
    rows = {  # fmt: skip
        "cold": ("cold: plain Llama, reset() per request", cold["requests"]),
        "hit": ("shmkv hit, 2nd process (publish on, default)", on),
        "hit_nopublish": ("shmkv hit, 2nd process (publish off)", off),
        "floor_b": ("floor, in process B between its hits", fb),
        "floor": ("floor, its own process", floor["requests"]),
        "local": ("llama-cpp-python same-process prefix reuse", floor["local"]),
        "ramcache": ("LlamaRAMCache, reset() per request", ram_hits),
        "ramcache_warm": ("LlamaRAMCache, 1st request (warms it)", ram_warm),
        "publisher": ("process A: miss + publish (SharedCacheLlama)", pub_first),
        "publisher_second": ("process A, 2nd suffix: tail checkpoint + divergence publish", p2),
        "hit_exact": ("shmkv --exact hit, 2nd process (restores at n_batch boundaries)", exact),
        "publisher_exact": ("process A --exact: miss + publish at batch boundaries", pub_exact),
    }
    ttft = {k: {"label": lab, **{x: S([r[x] for r in rs]) for x in ("ttft", "total")}}
            for k, (lab, rs) in rows.items()}  # fmt: skip

    def ratio(a: str, b: str, stat: str = "p50") -> float | None:
        x, y = ttft[a]["ttft"].get(stat), ttft[b]["ttft"].get(stat)
        return x / y if x is not None and y else None

    # hit / floor against the floor in the same process, interleaved with the hits (same
    # context and KV history); two processes differ by a few percent in suffix-eval alone
    ratios = {f"{name}_{stat}": ratio(a, b, stat) for name, a, b, stat in
              map(str.split, RATIOS.split("|"))}  # fmt: skip

    def cap(r: dict[str, Any], before_first: bool = False) -> float:
        """Seconds in capture() calls (only those that started before the first chunk)."""
        return sum(d for start, d, _ok in r["captures"] if not before_first or start < r["ttft"])

    publish = {"max_tokens": plan["gen"]["max_tokens"]}
    publish |= {f"request_{k}": S([r["total"] for r in rs]) for k, rs in (("on", on), ("off", off))}
    publish |= {f"ttft_{k}": S([r["ttft"] for r in rs]) for k, rs in (("on", on), ("off", off))}
    publish |= {"capture_per_request": S([cap(r) for r in on])}
    publish |= {"capture_fraction": S([cap(r) / r["total"] for r in on])}
    publish |= {"capture_before_first_chunk": S([cap(r, True) for r in on])}
    publish |= {"capture_after_first_chunk": S([cap(r) - cap(r, True) for r in on])}
    publish |= {"captures_published_per_request": S([sum(c[2] for c in r["captures"]) for r in on])}
    req_on, req_off = publish["request_on"], publish["request_off"]
    publish |= {f"request_on_over_off_{s}": req_on[s] / req_off[s] for s in ("p50", "mean")}
    same = {}  # greedy text of every cached arm vs the cold arm's, suffix by suffix
    cold_text = {r["suffix"]: r["text"] for r in rows["cold"][1]}
    for k in "hit hit_exact floor_b floor ramcache local".split():
        pairs = [(r["text"], cold_text[s]) for r in rows[k][1] if (s := r["suffix"]) in cold_text]
        same[k] = f"{sum(a == c for a, c in pairs)}/{len(pairs)}"
    last_ram, lasts = (ram["requests"] or [{}])[-1], [r["last"] for r in on + off]
    hit_out = {"restore_seconds": S([x["restore_seconds"] for x in lasts])}
    for k in ("restored", "evaluated"):
        hit_out[f"tokens_{k}"] = sorted({x[f"tokens_{k}"] for x in lasts})
    mem = dict(ramcache_peak_rss_bytes=ram["peak_rss_bytes"], ramcache_aborted=ram.get("aborted"),
               ramcache_counted_bytes=last_ram.get("cache_size", 0),
               ramcache_entries=last_ram.get("entries", 0),
               ramcache_uncounted_scores_bytes_per_entry=last_ram.get("scores_bytes_uncounted", 0),
               cold_peak_rss_bytes=cold["peak_rss_bytes"],
               blob_bytes=floor["blob_bytes"])  # fmt: skip
    out = dict(ttft=ttft, ratios=ratios, publish=publish)
    out["goals"] = common.check_goals(GOALS, {"": ratios})
    out["hit"] = hit_out | {"attach_seconds": hit["attach_seconds"], "totals": hit["totals"]}
    out["floor_set_data"] = S([r["set_data_seconds"] for r in floor["requests"]])
    return out | {"same_text_as_cold": same, "memory": mem}


def table(res: dict[str, Any], baseline: dict[str, Any] | None) -> str:
    a, f = res["analysis"], common.fmt_s
    b = (baseline or {}).get("analysis", {})
    counts = ("capture_fraction", "captures_published_per_request")
    rows: list[tuple[str, Any, Any]] = [("[TTFT]", None, None)]
    rows += [(v["label"], v["ttft"], b.get("ttft", {}).get(k, {}).get("ttft"))
             for k, v in a["ttft"].items()]  # fmt: skip
    publish = {k: v for k, v in a["publish"].items() if k not in counts}
    rows += [("[publish]", None, None), *common.walk(publish, b.get("publish"))]
    r, h, m, p = (a[k] for k in "ratios hit memory publish".split())
    mb = lambda n: f"{n / 1e6:.1f} MB"  # noqa: E731
    aborted = f"; ABORTED: {m['ramcache_aborted']}" if m["ramcache_aborted"] else ""
    lines = [
        common.summary_table(rows),
        "ratios of TTFT p50: " + ", ".join(f"{k} {v:.2f}" for k, v in r.items() if v),
        f"hit: restore p50 {f(h['restore_seconds'].get('p50'))}, tokens restored "
        f"{h['tokens_restored']}, evaluated {h['tokens_evaluated']}; blob "
        f"{mb(m['blob_bytes'])}; attach {f(h['attach_seconds'])}; capture() "
        f"{p['capture_fraction'].get('p50', 0) * 100:.1f} % of a request; blobs published per "
        f"request {p['captures_published_per_request'].get('mean', 0):.2f}",
        f"greedy text equal to cold: {a['same_text_as_cold']}",
        f"LlamaRAMCache: {m['ramcache_entries']} entries, counted "
        f"{mb(m['ramcache_counted_bytes'])} + uncounted "
        f"{mb(m['ramcache_uncounted_scores_bytes_per_entry'])} of scores per entry; peak RSS "
        f"{m['ramcache_peak_rss_bytes'] / 1e9:.2f} GB (cold "
        f"{m['cold_peak_rss_bytes'] / 1e9:.2f} GB){aborted}",
        common.goal_table(a["goals"]),
    ]
    return "\n".join(lines)


@common.command("restore", "Smoke run (short prefix, 2 repeats).", True, 2, 0.5, 300.0)
@opt("--prefix-tokens", type=int, help="Shared prefix length in tokens [2000; quick 600].")
@opt("--suffix-tokens", default=10, help="Suffix length in tokens (one suffix per request).")
@opt("--repeats", type=int, help="Timed requests per arm [7; quick 2].")
@opt("--max-tokens", default=16, help="Tokens generated per request (publish cost).")
@opt("--force-baseline", is_flag=True, help="--write-baseline even after a busy run.")
def main(report: common.Report, o: Any) -> None:
    """Benchmark TTFT of a shmkv cross-process hit against cold, the floor and LlamaRAMCache."""
    quick, threads, suffix_tokens, max_tokens = o.quick, o.threads, o.suffix_tokens, o.max_tokens
    prefix_tokens = o.prefix_tokens or (600 if quick else 2000)
    repeats = o.repeats or (2 if quick else 7)
    if not quick and repeats < 5:
        raise click.BadParameter("use at least 5 repeats for a full run", param_hint="--repeats")
    if prefix_tokens + suffix_tokens + max_tokens + 64 > 4096:
        raise click.BadParameter("prefix + suffix + max tokens must fit n_ctx 4096")
    # S0..SR: cold, A (S0), B publish on, floor, local reuse, LlamaRAMCache (the same texts,
    # so outputs compare with cold); T1..TR: B publish off; V: A's second request (the last
    # of 3R+2, as when R more were drawn for a restore breakdown, since retired)
    prompts = make_prompts(o.model, prefix_tokens, suffix_tokens, 3 * repeats + 2)
    suf = list(enumerate(prompts["suffixes"]))
    S, T, V = suf[: repeats + 1], suf[repeats + 1 : 2 * repeats + 1], suf[-1]
    ptoks, stoks = prompts["prefix_tokens"], sorted(set(prompts["suffix_tokens"]))
    log.info("prefix %d tokens, suffixes %s tokens", ptoks, stoks)
    ctx = dict(n_ctx=4096, n_threads=threads, n_threads_batch=threads, n_batch=512, n_ubatch=512)
    ctx |= dict(seed=0, verbose=False)
    gen = dict(max_tokens=max_tokens, temperature=0.0, seed=0)
    plan = dict(quick=quick, model=str(o.model), model_bytes=o.model.stat().st_size, ctx=ctx)
    plan |= dict(gen=gen, prefix_target=prefix_tokens, suffix_target=suffix_tokens, repeats=repeats)
    plan |= common.pick(prompts, "prefix_tokens suffix_tokens warmup_tokens")
    plan |= dict(arena_size=ARENA_SIZE, ramcache_capacity=RAMCACHE_CAPACITY)
    quiet = common.wait_until_quiet(o.max_load, o.max_wait)
    arms: dict[str, dict[str, Any]] = {}
    with (tempfile.TemporaryDirectory(prefix="shmkv-bench-restore-") as tmp,
          common.supervisor(Path(tmp), "--size", ARENA_SIZE) as sup):  # fmt: skip
        sp = dict(model=str(o.model), ctx=ctx, gen=gen, name=sup.name, socket=sup.socket)
        sp |= common.pick(prompts, "prefix prefix_tokens warmup")
        for spec in ({"arm": "cold", "suffixes": S[1:]},
                     {"arm": "publisher", "suffixes": [*S[:1], V]},
                     {"arm": "publisher_exact", "suffixes": S[:1]},
                     {"arm": "hit_exact", "suffixes": S[1:]},
                     {"arm": "hit", "suffixes": S[1:], "suffixes_off": T},
                     {"arm": "floor", "suffixes": S[1:], "suffixes_local": S},
                     {"arm": "ramcache", "suffixes": S}):  # fmt: skip
            arms[spec["arm"]] = run_arm({**sp, **spec}, Path(tmp), sup)
        sup_stats = sup.stats()
    ref = arms["cold"]["context_params"]
    differ = {k: [f for f in ref if v["context_params"].get(f) != ref[f]] for k, v in arms.items()}
    if differ := {k: d for k, d in differ.items() if d}:
        raise click.ClickException(f"arms ran with different context settings: {differ}")
    res = {**report.header(), "quiet": quiet, "config": {**plan, "context_params": ref}}
    res["noise"] = {k: v["process"] for k, v in arms.items()}
    res |= dict(supervisor_stats=sup_stats, analysis=analyse(arms, plan), arms=arms)
    noisy = {k: round(v["foreign_cores"], 2) for k, v in res["noise"].items()}
    res["noisy_arms"] = noisy = {k: v for k, v in noisy.items() if v > 0.25}
    load = f"{threads} threads; load {quiet['loadavg'][0]:.2f} at start"
    load += " (NOT quiet)" * (not quiet["quiet"])
    click.echo(f"\n{common.title(res, 'restore')}; prefix {ptoks} tokens, {load}")
    click.echo(table(res, report.baseline(quick)))
    if noisy:
        click.echo(f"\nother processes used CPU during: {noisy} (cores, average)")
    busy = (not quiet["quiet"] or noisy) and not o.force_baseline
    refuse = "the machine was busy; rerun when quiet or pass --force-baseline" if busy else ""
    chart = [(v["label"], v["ttft"].get("p50"), v["ttft"].get("p99"))
             for v in res["analysis"]["ttft"].values()]  # fmt: skip
    report.write(res, chart, refuse)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "_arm":
        fmt = "%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"
        logging.basicConfig(level=logging.WARNING, format=fmt)
        spec = json.loads(Path(sys.argv[2]).read_text())
        Path(spec["out"]).write_text(json.dumps(arm(spec)))
    else:
        main()
