"""Scale: how cost grows with size (issue 34; docs/benchmarks.md). A generated model of an
8B model's KV geometry (32 layers, 8 KV heads of 128: 128 KiB of f16 KV a token, random
weights, small vocabulary) at 1x, 4x and 16x the load (prompt, state, arena and index all
scaled; full run: 256-4,096 tokens, 32-512 MiB states, 0.5-8 GiB arenas, 6,250-100,000
entries): lookup, put, restore against the raw ``set_data`` floor, eviction, adoption of
the full arena after a ``kill -9``, refill from ``--persist``, and each one's cost per
token. Smoke run: ``--quick``."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import math
import mmap
import os
import re
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import bench_arena
import bench_restarts
import click
import common
import numpy as np

from shmkv.core import kvformat
from shmkv.core.client import Client
from shmkv.core.config import format_size, parse_size
from shmkv.core.errors import ShmkvError
from shmkv.core.keys import chain_digests
from tests.support import tinymodel

log = logging.getLogger("bench_scale")
MIB = 1 << 20
#: the generated model: an 8B model's KV (Llama 3 8B: 32 layers, 8 KV heads of 128), a
#: narrow residual stream and a small vocabulary so that it loads and prefills quickly
MODEL = dict(n_layer=32, n_head=8, head_dim=128, n_embd=256, n_ff=512, n_vocab=512)
KV_PER_TOKEN = 2 * MODEL["n_layer"] * MODEL["n_head"] * MODEL["head_dim"] * 2  # K+V, f16
ROOT, FP = bench_arena.ROOT, bench_arena.FINGERPRINT
SMALL_EXTENT = 5 * 1024  # arena bytes an index-filling entry takes (1-4 pages, some deeper)
#: the supervisor's log line at the end of an adoption
ADOPTED = re.compile(r"adopted (\d+) entries .* in ([\d.]+) s")
#: seconds between the second and third pass of :func:`first_touch`
TOUCH_PAUSE = 20.0
FLAT = 1.25  # "flat": the largest load's cost at most this many times the smallest's
#: what is compared between the smallest and the largest load (per token, or per lookup)
FLAT_KEYS = ["lookup p99 (µs)", "put per token (µs)", "restore per token (µs)",
             "evicting put per token (µs)", "adoption check per token (ns)",
             "refill per token (µs)"]  # fmt: skip
GOALS = [("lookup p99 (µs)", "<=", 100.0), ("restore / floor", "<=", 1.10),
         ("adoption: first hit (s)", "<=", 1.0),
         *[(f"{k.split(' (')[0]}: largest / smallest load", "<=", FLAT)
           for k in FLAT_KEYS]]  # fmt: skip
#: what one run does at 1x (--set KEY=VALUE changes one); each load multiplies tokens,
#: size and entries by its factor
PLANS = {
    False: dict(tokens=256, size=512 * MIB, entries=6_250, lookups=30_000, prompts_per_depth=100,
                deep_every=200, restores=7, evict_puts=4, rounds=1, refill_percent=25),
    True: dict(tokens=64, size=64 * MIB, entries=500, lookups=3_000, prompts_per_depth=20,
               deep_every=50, restores=3, evict_puts=2, rounds=1, refill_percent=25),
}  # fmt: skip


def write_model(path: Path) -> None:
    """The generated LLaMA GGUF of MODEL (f32 weights, ~190 MB): each layer's K and V are
    ``n_head x head_dim`` wide whatever ``n_embd`` is (``key_length``/``value_length``)."""
    n_layer, n_head, head_dim, n_ff = (MODEL[k] for k in ("n_layer", "n_head", "head_dim", "n_ff"))
    m = tinymodel._Tiny(0, MODEL["n_vocab"], MODEL["n_embd"])
    for i in range(n_layer):
        tinymodel._attention(m, i, n_head, head_dim)
        m.ffn(i, n_ff)
    m.write(path, "llama", "bench-scale-8b-kv", block_count=n_layer, feed_forward_length=n_ff,
            head_count=n_head, head_count_kv=n_head, key_length=head_dim,
            value_length=head_dim, rope_dimension_count=head_dim, rope_freq_base=10000.0,
            layer_norm_rms_eps=1e-5)  # fmt: skip


def prefill(model: Path, lengths: list[int], threads: int, seed: int) -> dict[int, common.Floor]:
    """The real state of a random prompt's first ``n`` tokens for each of ``lengths``
    (:class:`common.Floor`: prefilled from empty, the state copied out)."""
    llm = common.llama(model, threads, n_ctx=max(lengths))
    ids = np.random.default_rng(seed).integers(5, MODEL["n_vocab"], max(lengths)).tolist()
    out = {}
    try:
        for n in sorted(lengths):
            llm._ctx.kv_cache_clear()
            out[n] = f = common.Floor(llm, ids[:n])
            log.info("prefilled %d tokens in %.1f s: a %s state", n, f.eval_seconds, fmt(f.size))
    finally:
        for f in out.values():
            f.llm = None  # (each cell restores into a context of its own)
        llm.close()
    return out


class Variants:
    """Distinct states of one size and layout: copies of a real state whose every KV byte
    is XORed with the copy's own nonzero byte, so that no two share a chunk."""

    def __init__(self, state: Any, chunk: int) -> None:
        self.base = np.frombuffer(state, dtype=np.uint8)
        manifest = kvformat.plan(self.base, chunk)
        if manifest is None:
            raise click.ClickException("the model's state does not split into chunks")
        self.spans = [(r.offset, r.offset + r.nrep * p.cell_count * r.unit)
                      for p in manifest.parts for r in p.regions]  # fmt: skip
        self.out, self.made = self.base.copy(), 0  # (the skeleton is the base's)

    def next(self) -> np.ndarray:
        """The next copy (valid until the next call)."""
        if (k := self.made + 1) > 255:
            raise click.ClickException("more than 255 copies of one state")
        self.made = k
        for a, b in self.spans:
            np.bitwise_xor(self.base[a:b], np.uint8(k), out=self.out[a:b])
        return self.out


def put_state(client: Client, variants: Variants, rng: Any, n: int) -> tuple[dict[str, Any], Any]:
    """One put of a new state of ``n`` tokens (``Client.prepare`` + ``put_blob``, as
    ``Client.put``): its times, the arena before and after; and its tokens."""
    src, tokens = variants.next(), bench_arena.random_tokens(rng, n)

    def fill(address: int, size: int) -> None:
        np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(address))[:] = src

    before, t0 = client.stats(), time.perf_counter()
    blob = client.prepare(len(src), fill)
    t1 = time.perf_counter()
    reply = client.put_blob(ROOT, tokens, FP, blob)
    t2, after = time.perf_counter(), client.stats()
    if reply.get("n_tokens") != n:
        raise click.ClickException(f"unexpected put reply {reply}")
    out = dict(total_s=t2 - t0, put_blob_s=t2 - t1, used_before=before["bytes_used"],
               used_after=after["bytes_used"], evictions=after["evictions"] - before["evictions"],
               chunked=after["chunked_puts"] - before["chunked_puts"])  # fmt: skip
    return out, tokens


def restore(llm: Any, client: Client, floor: common.Floor, repeats: int) -> dict[str, Any]:
    """The real state put as the cache would find it, then restored through shmkv
    (``SharedPrefixCache.restore``: lookup, lease, assembly and XXH3 of the chunks,
    ``set_data`` from the buffer) and by the floor (``set_data`` from a private buffer),
    in turns, in one context; the first of each (cold pages) apart."""
    cache, tokens = llm.shmkv, floor.tokens
    data = memoryview(floor.buf)  # type: ignore[arg-type]
    client.put_bytes(cache.root, np.asarray(tokens, dtype="<i4"), cache.fingerprint, data)
    prompt, shm = [*tokens, tokens[0]], []  # (one more token: the whole state is restored)
    floor.llm, floor.set_seconds = llm, []
    for _ in range(repeats + 1):
        llm.reset()
        floor.restore()
        llm.reset()
        with cache.guard:
            t = time.perf_counter()
            got = cache.restore(prompt)
            shm.append(time.perf_counter() - t)
        if got != len(tokens):
            raise click.ClickException(f"restored {got} of {len(tokens)} tokens: {cache.totals}")
    floor.llm = None
    s, f = common.summary(shm[1:]), common.summary(floor.set_seconds[1:])
    return dict(bytes=floor.size, shmkv=s, floor=f, first_s=shm[0],
                first_floor_s=floor.set_seconds[0], over_floor=s["p50"] / f["p50"],
                cold_prefill_s=floor.eval_seconds)  # fmt: skip


def first_hit(sup: common.Supervisor, digests: list[bytes]) -> float:
    """Poll (a new client each time, as a restarted worker's) until ``digests`` find a
    record that a lease is granted on; the monotonic time it was."""

    def hit() -> float | None:
        with contextlib.suppress(ShmkvError), sup.client(timeout=2.0) as c:
            c._backoff = 0.0
            if (h := c.lookup(digests)) is not None:
                with c.acquire(h) as lease:
                    if lease.finish():
                        return time.monotonic()
        return None

    return float(common.poll(hit, 120, "hit", sup.child))


def answers(sup: common.Supervisor) -> float:
    """``bench_restarts.answers`` with room for a slow adoption (minutes at 100,000 entries)."""
    up = common.poll(lambda: sup.answers() and time.monotonic(), 1800, "answer", sup.child, 0.01)
    return float(up)


def adopt(workdir: Path, sup: common.Supervisor, args: list[str], digests: list[bytes],
          rounds: int) -> tuple[common.Supervisor, dict[str, Any]]:  # fmt: skip
    """``rounds`` times: ``kill -9`` the supervisor and start another on its name, which
    adopts the arena; returns the last one and the rounds' times."""
    rows = []
    for r in range(rounds):
        sup.child.stop(kill=True)
        t0 = time.monotonic()
        sup = common.start_supervisor(workdir, sup.name, *args)
        row: dict[str, Any] = {"ready_s": answers(sup) - t0}
        row["first_hit_s"] = first_hit(sup, digests) - t0

        m = common.poll(
            lambda s=sup: ADOPTED.search(s.child.log_tail(1 << 16)),
            1800,
            "the adoption's end",
            sup.child,
            0.05,
        )  # (it goes on past the hit)
        row["adopted"], row["check_s"] = int(m[1]), float(m[2])
        rows.append(row)
        log.info("adoption round %d: %s", r, row)
    out = {k: common.summary([x[k] for x in rows if x[k] is not None])
           for k in ("ready_s", "first_hit_s", "check_s")}  # fmt: skip
    return sup, out | {"adopted": rows[-1]["adopted"], "rounds": rows}


def cell(workdir: Path, model: Path, floor: common.Floor, factor: int, plan: Any,
         threads: int, n_ctx: int, keep_pages: bool) -> dict[str, Any]:  # fmt: skip
    """Everything at one load: ``plan``'s tokens, size and entries times ``factor``
    (``keep_pages``: the supervisor runs with ``--reserve true``)."""
    n, size, entries = plan.tokens * factor, plan.size * factor, plan.entries * factor
    slots = 1 << (8 * entries - 1).bit_length()  # (half usable: a third to a half used)
    args = ["--size", str(size), "--index-slots", str(slots), "--reserve", str(keep_pages).lower()]
    rng, name = np.random.default_rng(plan.seed + factor), f"benchscale{uuid.uuid4().hex[:8]}"
    out: dict[str, Any] = dict(factor=factor, tokens=n, arena_bytes=size, entries=entries,
                               index_slots=slots)  # fmt: skip
    sup = common.start_supervisor(workdir, name, *args)
    try:
        bench_restarts.answers(sup)
        with sup.client(timeout=600) as client:
            chunk = client.ensure().geometry.chunk_tokens
            log.info("%dx: restores of the %d-token state", factor, n)
            llm = common.llama(model, threads, sup, n_ctx=n_ctx)
            try:
                out["restore"] = restore(llm, client, floor, plan.restores)
            finally:
                llm.shmkv.close()
                llm.close()
            variants, reserve, plain = Variants(floor.buf, chunk), entries * SMALL_EXTENT, []
            while client.stats()["bytes_free"] - reserve >= 1.05 * floor.size or not plain:
                plain.append(put_state(client, variants, rng, n)[0])
            log.info("%dx: %d puts of %s", factor, len(plain), fmt(floor.size))
            ev0 = client.stats()["evictions"]
            small = bench_arena.Plan(**{**vars(plan), "entries": entries, "ramcache_lookups": 1})
            keep = bench_arena.fill_small(client, small, rng, chunk)
            if (evicted := client.stats()["evictions"] - ev0) > 0:
                log.warning("%dx: the small entries evicted %d states", factor, evicted)
            gc.collect()
            gc.freeze()  # (as bench_arena: the fill's objects are not a worker's)
            try:  # bench_arena's lookups (its LlamaRAMCache comparison given no keys)
                lookup = bench_arena.bench_lookup(client, bench_arena.Plan(**{
                    **vars(small), "entries": 0}), rng, chunk, keep)  # fmt: skip
            finally:
                gc.unfreeze()
            lookup.pop("ramcache", None)
            evicting: list[dict[str, Any]] = []
            for _ in range(plan.evict_puts + 4):  # (the first may still find room)
                p, tokens = put_state(client, variants, rng, n)
                (evicting if p["evictions"] else plain).append(p)
                if len(evicting) == plan.evict_puts:
                    break
            probe = chain_digests(ROOT, tokens, chunk)  # the newest state, for the restarts
            longer = chain_digests(ROOT, np.concatenate([tokens, tokens[:chunk]]), chunk)
            lookup["state_prompt"] = bench_arena.us(
                bench_arena.timed(lambda: client.lookup(longer), min(plan.lookups, 3000))
            )
            lookup["state_prompt_chunks"] = len(longer)
            out |= dict(lookup=lookup, put=puts(plain, floor.size), stats=client.stats())
            out["evict"] = evictions(evicting, plain)
        t = time.perf_counter()
        with sup.client() as c:
            c.ensure()
            out["attach_s"] = time.perf_counter() - t
        log.info("%dx: %d kill -9 and adoptions of %s", factor, plan.rounds,
                 fmt(out["stats"]["bytes_used"]))  # fmt: skip
        sup, out["adopt"] = adopt(workdir, sup, args, probe, plan.rounds)
    finally:
        sup.child.stop()
        for p in common.SHM.glob(f"shmkv-{name}*"):
            p.unlink(missing_ok=True)
    k = max(2, round(size * plan.refill_percent / 100 / floor.size))
    log.info("%dx: refill of %d states from --persist", factor, k)
    states = [dict(tokens=bench_arena.random_tokens(rng, n), data=bytes(variants.next()),
                   cold_s=floor.eval_seconds) for _ in range(k)]  # fmt: skip
    (tmp := workdir / f"refill-{factor}").mkdir()
    try:
        out["refill"] = bench_restarts.refill_case(tmp, states, k, False)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def puts(plain: list[dict[str, Any]], size: int) -> dict[str, Any]:
    """The puts that evicted nothing: their times and what each added to the arena."""
    total, blob = (common.summary([p[k] for p in plain]) for k in ("total_s", "put_blob_s"))
    added = float(np.median([p["used_after"] - p["used_before"] for p in plain]))
    return dict(n=len(plain), total=total, put_blob=blob, gbps=size / total["p50"] / 1e9,
                put_blob_gbps=size / blob["p50"] / 1e9, added_bytes=added,
                chunked=sum(p["chunked"] for p in plain))  # fmt: skip


def evictions(evicting: list[dict[str, Any]], plain: list[dict[str, Any]]) -> dict[str, Any]:
    """Puts that had to evict: their time past a plain put's (put_blob p50), per byte
    they evicted (what they freed: the arena's bytes before, plus a plain put's, less
    after)."""
    if not evicting:
        return {"n": 0}
    base = float(np.median([p["put_blob_s"] for p in plain]))
    added = float(np.median([p["used_after"] - p["used_before"] for p in plain]))
    freed = [p["used_before"] + added - p["used_after"] for p in evicting]
    extra = [p["put_blob_s"] - base for p in evicting]
    gbps = [f / e / 1e9 for f, e in zip(freed, extra, strict=True) if e > 0]
    return dict(n=len(evicting), put_blob=common.summary([p["put_blob_s"] for p in evicting]),
                states_evicted=[p["evictions"] for p in evicting], bytes_evicted=freed,
                extra_s=common.summary(extra), gbps=float(np.median(gbps)) if gbps else None,
                ns_per_byte=1e9 * sum(extra) / sum(freed) if sum(freed) > 0 else None)  # fmt: skip


def values(c: dict[str, Any]) -> dict[str, Any]:
    """A cell's figures as the table and the goals name them."""
    r, p, e, a, f, lk = (c[k] for k in ("restore", "put", "evict", "adopt", "refill", "lookup"))
    per_token = r["bytes"] / c["tokens"]  # state bytes a token
    kv_tokens = c["stats"]["bytes_used"] / per_token  # the arena's content, in tokens
    out = {"prompt tokens": c["tokens"], "state": r["bytes"], "arena --size": c["arena_bytes"],
           "entries": c["stats"]["entries"], "index slots used": c["stats"]["index_used"],
           "lookup p50 (µs)": lk["all"]["p50_us"], "lookup p90 (µs)": lk["all"]["p90_us"],
           "lookup p99 (µs)": lk["all"]["p99_us"],
           "lookup probes (mean)": lk["probes_per_lookup"]["mean"],
           "state prompt lookup p99 (µs)": lk["state_prompt"]["p99_us"],
           "put p50 (s)": p["total"]["p50"], "put (GB/s)": p["gbps"],
           "put_blob only (GB/s)": p["put_blob_gbps"],
           "put per token (µs)": 1e6 * p["total"]["p50"] / c["tokens"],
           "restore p50 (s)": r["shmkv"]["p50"], "floor p50 (s)": r["floor"]["p50"],
           "restore (GB/s)": r["bytes"] / r["shmkv"]["p50"] / 1e9,
           "floor (GB/s)": r["bytes"] / r["floor"]["p50"] / 1e9,
           "restore / floor": r["over_floor"], "first restore (s)": r["first_s"],
           "restore per token (µs)": 1e6 * r["shmkv"]["p50"] / c["tokens"],
           "cold prefill (s)": r["cold_prefill_s"]}  # fmt: skip
    if e["n"]:
        evicted = float(np.median(e["bytes_evicted"]))
        out |= {
            "evicting put p50 (s)": e["put_blob"]["p50"],
            "evicting / plain put_blob": e["put_blob"]["p50"] / p["put_blob"]["p50"],
            "evicting put per token (µs)": 1e6 * e["put_blob"]["p50"] / c["tokens"],
            "evicted per put": evicted,
            "states evicted per put": float(np.median(e["states_evicted"])),
            "eviction: extra time (s)": e["extra_s"]["p50"],
            "eviction (GB/s)": e["gbps"],
            "extra per evicted token (µs)": 1e6 * e["extra_s"]["p50"] / (evicted / per_token),
        }
    out |= {"arena used": c["stats"]["bytes_used"], "attach (s)": c["attach_s"],
            "adopted entries": a["adopted"], "adoption: ready (s)": a["ready_s"].get("p50"),
            "adoption: check (s)": a["check_s"].get("p50"),
            "adoption: first hit (s)": a["first_hit_s"].get("p50")}  # fmt: skip
    if a["check_s"].get("p50") is not None:
        out["adoption check per token (ns)"] = 1e9 * a["check_s"]["p50"] / kv_tokens
        out["adoption check per entry (µs)"] = 1e6 * a["check_s"]["p50"] / c["stats"]["entries"]
    out |= {"refilled": f["bytes"], "refill (s)": f["refill_s"], "refill (GB/s)": f["refill_gb_s"],
            "refill: first hit (s)": f["first_hit_s"]}  # fmt: skip
    if f["refill_s"]:
        out["refill per token (µs)"] = 1e6 * f["refill_s"] / (f["bytes"] / per_token)
    return out


def fmt(n: float) -> str:
    return format_size(int(n))


def show(key: str, v: Any) -> str:
    """One table cell."""
    if v is None:
        return "-"
    if key in ("state", "arena --size", "arena used", "evicted per put", "refilled"):
        return fmt(v)
    if key.endswith("(s)"):
        return common.fmt_s(v)
    if isinstance(v, int):
        return f"{v:,}"
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"


def table(cells: dict[str, dict[str, Any]], flat: dict[str, float]) -> str:
    sections = {"prompt tokens": "[size]", "lookup p50 (µs)": "[lookup]", "put p50 (s)": "[put]",
                "restore p50 (s)": "[restore]", "evicting put p50 (s)": "[eviction]",
                "arena used": "[adoption]", "refilled": "[refill]"}  # fmt: skip
    keys = list(dict.fromkeys(k for v in cells.values() for k in v))
    rows = [["", *cells, "largest / smallest"]]
    for k in keys:
        if k in sections:
            rows.append([sections[k]])
        vs = [show(k, v[k]) if k in v else "-" for v in cells.values()]
        rows.append([k, *vs, f"{flat[k]:.2f}" if k in flat else ""])
    return common.grid(rows)


def svg_chart(path: Path, cells: dict[str, dict[str, Any]], factors: list[int]) -> None:
    """Cost per token (and a lookup's cost) at each load against the smallest load's, on a
    log scale: a flat cost is a horizontal line at 1."""
    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]
    first = cells[f"{factors[0]}x"]
    series = {k: [v[k] / first[k] if v.get(k) is not None else None for v in cells.values()]
              for k in FLAT_KEYS if first.get(k)}  # fmt: skip
    w, h, left, right, top, bottom = 840, 380, 60, 340, 40, 50
    span = max(math.log2(factors[-1] / factors[0]), 1)
    vals = [v for s in series.values() for v in s if v is not None and v > 0]
    lo2 = math.floor(math.log2(min(0.5, *vals)))  # the y axis: powers of 2, 1 in it
    hi2 = math.ceil(math.log2(max(2.0, *vals)))

    def x(f: int) -> float:
        return left + math.log2(f / factors[0]) / span * (w - left - right)

    def y(v: float) -> float:
        return top + (hi2 - math.log2(v)) / (hi2 - lo2) * (h - top - bottom)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
           'font-family="sans-serif" font-size="12">', '<rect width="100%" height="100%" '
           'fill="white"/>', f'<text x="{left}" y="22" font-size="14">shmkv scale: cost at '
           'each load / at the smallest (8B KV geometry; log scales)</text>']  # fmt: skip
    for e in range(lo2, hi2 + 1):
        v = 2.0**e
        out.append(f'<line x1="{left}" x2="{w - right}" y1="{y(v):.1f}" y2="{y(v):.1f}" '
                   'stroke="#ddd"/>')  # fmt: skip
        out.append(f'<text x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:g}</text>')
    for v, dash in ((1.0, "4 3"), (FLAT, "2 4")):
        out.append(f'<line x1="{left}" x2="{w - right}" y1="{y(v):.1f}" y2="{y(v):.1f}" '
                   f'stroke="#555" stroke-dasharray="{dash}"/>')  # fmt: skip
    for f in factors:
        out.append(f'<text x="{x(f):.1f}" y="{h - bottom + 18}" text-anchor="middle">{f}x '
                   f'({cells[f"{f}x"]["prompt tokens"]} tokens)</text>')  # fmt: skip
    out.append(
        f'<text x="{(left + w - right) / 2}" y="{h - 10}" text-anchor="middle">load '
        "(prompt, state, arena and entries times the factor)</text>"
    )
    for i, (k, s) in enumerate(series.items()):
        color = colors[i % len(colors)]
        pts = [(x(f), y(v)) for f, v in zip(factors, s, strict=True) if v and v > 0]
        line = " ".join(f"{a:.1f},{b:.1f}" for a, b in pts)
        out.append(f'<polyline points="{line}" fill="none" stroke="{color}" stroke-width="2"/>')
        out += [f'<circle cx="{a:.1f}" cy="{b:.1f}" r="3" fill="{color}"/>' for a, b in pts]
        ly = top + 18 * i + 10
        out.append(f'<line x1="{w - right + 15}" x2="{w - right + 35}" y1="{ly}" y2="{ly}" '
                   f'stroke="{color}" stroke-width="2"/>')  # fmt: skip
        label = f"{k} (1x: {first[k]:.3g})".replace("&", "&amp;")
        out.append(f'<text x="{w - right + 40}" y="{ly + 4}">{label}</text>')
    path.write_text("\n".join([*out, "</svg>"]) + "\n")


def first_touch(nbytes: int) -> dict[str, Any]:
    """Write ``nbytes`` of a new /dev/shm file GiB by GiB, three times (a new file each
    time: the second at once, the third :data:`TOUCH_PAUSE` seconds later), and return each
    pass's GB/s per GiB. On a KVM guest with free page reporting (virtio-balloon) the first
    write of guest memory the host does not back costs far more than a write of memory the
    guest freed a moment ago, and memory freed for some seconds is handed back to the host
    again: so a put into never-written arena pages pays the host's backing whenever it runs,
    and the larger the arena, the more of its pages do. The passes show it on the machine
    the cells run on."""
    src, passes = np.random.default_rng(0).integers(0, 255, 64 * MIB, dtype=np.uint8), []
    path = common.SHM / f"shmkv-bench-scale-touch-{uuid.uuid4().hex[:8]}"
    for pause in (0.0, 0.0, TOUCH_PAUSE):
        time.sleep(pause)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            with mmap.mmap(fd, nbytes) as mm:
                a, rates = np.frombuffer(mm, dtype=np.uint8), []
                for off in range(0, nbytes, 1 << 30):
                    end, t = min(off + (1 << 30), nbytes), time.perf_counter()
                    for o in range(off, end, src.size):
                        a[o : min(o + src.size, end)] = src[: min(src.size, end - o)]
                    rates.append((end - off) / (time.perf_counter() - t) / 1e9)
                del a
        finally:
            os.close(fd)
            path.unlink()
        passes.append(rates)
        log.info("first touch of %s of /dev/shm: %s GB/s per GiB", fmt(nbytes),
                 " ".join(f"{r:.2f}" for r in rates))  # fmt: skip
    return dict(bytes=nbytes, gbps_per_gib=passes)


@common.command("scale", quick="Smoke run (64-1,024 tokens, 64 MiB-1 GiB arenas).", threads=2)
@click.option("--set", "sets", multiple=True, help=f"KEY=VALUE of the plan: {', '.join(PLANS[0])}.")
@click.option("--factors", default="1,4,16", show_default=True, help="Loads, times the plan.")
@click.option("--seed", type=int, default=1, show_default=True)
@click.option("--reserve/--no-reserve", default=True, show_default=True,
              help="Run each cell's supervisor with --reserve true (its arena's pages "
              "allocated at start and kept), as on a VM that returns freed memory to its "
              "host (see first_touch); --no-reserve: puts into a new arena write fresh "
              "pages.")  # fmt: skip
def main(report: common.Report, o: Any) -> None:
    """Benchmark how shmkv's costs grow with the load on an 8B model's KV geometry."""
    quick, over = o.quick, dict(kv.split("=", 1) for kv in o.sets)
    if unknown := set(over) - set(keys := list(PLANS[quick])):
        raise click.BadParameter(f"{unknown}: the plan has {keys}", param_hint="--set")
    over = {k: parse_size(v) if k == "size" else int(v) for k, v in over.items()}
    plan = bench_arena.Plan(quick=quick, **{**PLANS[quick], **over, "seed": o.seed})
    factors = sorted({int(f) for f in o.factors.split(",")})
    n_ctx, largest = plan.tokens * factors[-1], plan.size * factors[-1]
    state = KV_PER_TOKEN * n_ctx
    if (free := shutil.disk_usage(common.SHM).free) < largest + state * 4:
        raise click.ClickException(
            f"/dev/shm has {fmt(free)} free, the largest load needs "
            f"{fmt(largest + state * 4)}: lower --set size or --factors"
        )
    if (avail := common.meminfo("MemAvailable")) < largest + state * 10:
        log.warning("%s of memory available for a %s arena and %s states: it may swap or fail",
                    fmt(avail), fmt(largest), fmt(state))  # fmt: skip
    load_before, cells = common.loadavg(), {}
    touch = first_touch(largest + state * 4)
    with tempfile.TemporaryDirectory(prefix="shmkv-bench-scale-") as tmp:
        write_model(model := Path(tmp) / "scale-8b-kv.gguf")
        floors = prefill(model, [plan.tokens * f for f in factors], o.threads, o.seed)
        logging.getLogger("shmkv.core.client").setLevel(logging.ERROR)  # (refused at restarts)
        for f in factors:
            cells[f"{f}x"] = cell(Path(tmp), model, floors[plan.tokens * f], f, plan, o.threads,
                                  n_ctx, o.reserve)  # fmt: skip
    figures = {k: values(c) for k, c in cells.items()}
    lo, hi = figures[f"{factors[0]}x"], figures[f"{factors[-1]}x"]
    flat = {k: hi[k] / lo[k] for k in FLAT_KEYS if lo.get(k) and hi.get(k) is not None}
    res = {**report.header("gguf"), "loadavg_before": load_before}
    res["config"] = vars(plan) | dict(factors=factors, model=MODEL, kv_bytes_per_token=KV_PER_TOKEN,
                                      small_extent=SMALL_EXTENT, flat_bound=FLAT,
                                      reserve=o.reserve)  # fmt: skip
    res["first_touch"] = touch
    res |= {"cells": cells, "figures": figures, "flat": flat}
    where = {"": {f"{k.split(' (')[0]}: largest / smallest load": v for k, v in flat.items()}}
    res["goals"] = common.check_goals(GOALS, where | figures)
    after = res["loadavg_end"][0]
    click.echo(f"\n{common.title(res, 'scale')}; load {load_before[0]} before, {after} after")
    m = MODEL
    click.echo(f"model: {m['n_layer']} layers, {m['n_head']} KV heads of {m['head_dim']} "
               f"(f16 KV {KV_PER_TOKEN // 1024} KiB a token), n_embd {m['n_embd']}, vocabulary "
               f"{m['n_vocab']}, random weights; {o.threads} threads")  # fmt: skip
    click.echo(
        f"supervisors with --reserve {str(o.reserve).lower()}; first touch of "
        f"{fmt(touch['bytes'])} of /dev/shm before the cells, GB/s per GiB (pass 1; pass 2, "
        f"at once; pass 3, {TOUCH_PAUSE:g} s later): "
        + "; ".join(" ".join(f"{r:.2f}" for r in p) for p in touch["gbps_per_gib"])
    )
    click.echo(table(figures, flat))
    click.echo(common.goal_table(res["goals"]))
    chart = [(f"{k} @{c}", v[k] / 1e6, None) for k in FLAT_KEYS if "µs" in k
             for c, v in figures.items() if k in v]  # fmt: skip
    report.write(res, chart)
    svg_chart(svg := report.out / "scale.svg", figures, factors)
    click.echo(f"wrote {svg}")


if __name__ == "__main__":
    main()
