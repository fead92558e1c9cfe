"""Arena benchmark against a real supervisor: lookups, 16 MiB puts, lookup to a verified
pointer, a huge put into a fragmented arena (docs/benchmarks.md). Smoke run: ``--quick``."""

from __future__ import annotations

import ctypes
import gc
import json
import logging
import random
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

import click
import common
import numpy as np

from shmkv.core import arena
from shmkv.core.client import Client
from shmkv.core.config import format_size, parse_size
from shmkv.core.keys import chain_digests

log = logging.getLogger("bench_arena")
MIB = 1 << 20
BLOB = 16 * MIB
PROMPT_CHUNKS = 32
SMALL_PAYLOAD = 256
FINGERPRINT = b"bench-arena-model-fingerprint"
ROOT = bytes(16)  # one namespace: every entry chains from the same root
GOALS = [("lookup p50 (µs)", "<=", 50.0), ("put (GB/s)", ">=", 1.0),
         ("ping max during a huge put (ms)", "<=", 100.0)]  # fmt: skip
#: the fragmented case: arena size, payload of each small record, size of the huge put
FRAGMENTED = {False: dict(size=2 << 30, record=28 * 1024, put=400 * MIB),
              True: dict(size=256 << 20, record=28 * 1024, put=50 * MIB)}  # fmt: skip
PLANS = {  # what one run does (--set KEY=VALUE changes one); --quick shrinks every count
    False: dict(entries=100_000, deep_every=200, index_slots=524_288, size=4 << 30, lookups=30_000,
                prompts_per_depth=100, put_warmup=4, puts=64, reads=300, ramcache_lookups=10),
    True: dict(entries=5_000, deep_every=50, index_slots=32_768, size=512 << 20, lookups=3_000,
               prompts_per_depth=20, put_warmup=1, puts=8, reads=40, ramcache_lookups=3),
}  # fmt: skip


class Plan(types.SimpleNamespace):
    """One of PLANS, with the command line's overrides, ``quick`` and ``seed``."""

    def depth(self, i: int) -> int:
        """Chunks of small entry ``i``: mostly 1-4, every ``deep_every``-th one 5-32."""
        if i % self.deep_every == self.deep_every - 1:
            return 5 + (i // self.deep_every) % (PROMPT_CHUNKS - 4)
        return 1 + i % 4


def us(ns: Any, nbytes: int = 0) -> dict[str, Any]:
    """The summary of nanosecond timings in µs (``p50_us``...), GB/s if ``nbytes`` per op."""
    s = common.summary(ns, 1e-3)
    out = {"n": s["n"], **{f"{k}_us": round(v, 3) for k, v in s.items() if k != "n"}}
    return out | ({"gbps_p50": round(nbytes / (s["p50"] * 1e3), 3)} if nbytes else {})


def timed(fn: Any, reps: int) -> list[int]:
    """Nanoseconds of ``reps`` calls of ``fn``."""
    out = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        fn()
        out.append(time.perf_counter_ns() - t0)
    return out


def random_tokens(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, 256_000, n, dtype=np.int32)


class CountingDigests(list):
    """A digest list that counts the positions a lookup reads (one per index probe)."""

    reads = 0

    def __getitem__(self, i):  # type: ignore[override]
        self.reads += 1
        return super().__getitem__(i)


def fill_small(client: Client, plan: Plan, rng: Any, chunk: int) -> dict[int, list[np.ndarray]]:
    """Put ``plan.entries`` small entries; returns the tokens of some entries of each depth."""
    keep: dict[int, list[np.ndarray]] = {}
    payload, t0 = bytearray(rng.bytes(SMALL_PAYLOAD)), time.perf_counter()
    for i in range(plan.entries):
        tokens = random_tokens(rng, (d := plan.depth(i)) * chunk)
        payload[:8] = i.to_bytes(8, "little")
        client.put_bytes(ROOT, tokens, FINGERPRINT, bytes(payload))
        if len(bucket := keep.setdefault(d, [])) < plan.prompts_per_depth:
            bucket.append(tokens)
        if (i + 1) % 10_000 == 0 or i + 1 == plan.entries:
            rate = (i + 1) / (time.perf_counter() - t0)
            log.info("filled %d/%d entries (%.0f puts/s)", i + 1, plan.entries, rate)
    return keep


def bench_lookup(client: Client, plan: Plan, rng: Any, chunk: int, keep: Any) -> dict[str, Any]:
    """Time ``client.lookup`` for 32-chunk prompts with cached prefixes of 0-32 chunks."""
    prompts: list[tuple[int, list[bytes], np.ndarray]] = []
    for _ in range(plan.prompts_per_depth):  # misses: nothing of it is cached
        toks = random_tokens(rng, PROMPT_CHUNKS * chunk)
        prompts.append((0, chain_digests(ROOT, toks, chunk), toks))
    for d, bucket in sorted(keep.items()):
        for toks in bucket:
            full = np.concatenate([toks, random_tokens(rng, (PROMPT_CHUNKS - d) * chunk)])
            prompts.append((d, chain_digests(ROOT, full, chunk), full))
    probes = []  # correctness and probe counts, untimed
    for d, digests, _ in prompts:
        hit = client.lookup(counting := CountingDigests(digests))
        if (got := 0 if hit is None else hit.chunks) != d:
            raise click.ClickException(f"lookup found {got} chunks, expected {d}")
        probes.append(counting.reads)
    rnd = random.Random(plan.seed)
    order = [rnd.randrange(len(prompts)) for _ in range(plan.lookups)]
    lookup, pc, times = client.lookup, time.perf_counter_ns, np.empty(len(order), dtype=np.int64)
    for i in order[:1000]:  # a warm-up, then the timed lookups in a random order
        lookup(prompts[i][1])
    for k, i in enumerate(order):
        digests, t0 = prompts[i][1], pc()
        lookup(digests)
        times[k] = pc() - t0
    depths = np.array([prompts[i][0] for i in order])
    bounds = {"miss": (0, 0), "1-4": (1, 4), "5-16": (5, 16), "17-32": (17, PROMPT_CHUNKS)}
    classes = {k: (depths >= lo) & (depths <= hi) for k, (lo, hi) in bounds.items()}
    out = {"all": us(times), "by_depth": {k: us(times[m]) for k, m in classes.items() if m.any()}}
    out["probes_per_lookup"] = {"mean": round(float(np.mean(probes)), 2), "max": int(max(probes))}
    return out | {"prompts": len(prompts), "ramcache": bench_ramcache(plan, rng, chunk, prompts)}


def bench_ramcache(plan: Plan, rng: Any, chunk: int, prompts: list[Any]) -> dict[str, Any] | None:
    """llama-cpp-python's LlamaRAMCache prefix search (``key in cache``) over as many keys."""
    try:
        from llama_cpp.llama_cache import LlamaRAMCache
    except Exception as e:  # llama_cpp is a dependency, but the arena needs none of it
        log.warning("LlamaRAMCache comparison skipped: %s", e)
        return None
    cache = LlamaRAMCache(capacity_bytes=1 << 40)
    for i in range(plan.entries):  # keys only: its search never looks at the states
        cache.cache_state[tuple(random_tokens(rng, plan.depth(i) * chunk).tolist())] = None
    keys = [tuple(p[2].tolist()) for p in prompts[:: max(1, len(prompts) // 50)]]
    it = iter(range(plan.ramcache_lookups))
    return us(timed(lambda: keys[next(it) % len(keys)] in cache, plan.ramcache_lookups))


def bench_put(client: Client, plan: Plan, rng: Any, chunk: int) -> tuple[dict[str, Any], list[Any]]:
    """``Client.prepare`` + ``Client.put_blob`` of 16 MiB blobs (what ``Client.put`` does): a
    memfd filled in place and checksummed, its fd handed over, copied and verified."""
    src = np.frombuffer(rng.bytes(BLOB), dtype=np.uint8).copy()

    def fill(address: int, size: int) -> None:
        np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(address))[:] = src

    stored, times = [], []
    for k in range(plan.put_warmup + plan.puts):
        tokens = random_tokens(rng, PROMPT_CHUNKS * chunk)
        src[:8] = np.frombuffer(k.to_bytes(8, "little"), dtype=np.uint8)
        t0 = time.perf_counter_ns()
        reply = client.put_blob(ROOT, tokens, FINGERPRINT, client.prepare(BLOB, fill))
        if k >= plan.put_warmup:
            times.append(time.perf_counter_ns() - t0)
        if reply.get("n_tokens") != len(tokens):
            raise click.ClickException(f"unexpected put reply {reply}")
        stored.append(tokens)
    gbps = round(plan.puts * BLOB / (sum(times) / 1e9) / 1e9, 3)
    return {"total": us(times, BLOB), "throughput_gbps": gbps}, stored


def bench_read(client: Client, plan: Plan, chunk: int, blobs: list[np.ndarray]) -> dict[str, Any]:
    """Lookup + lease + record/meta check (+ payload checksum) of a 16 MiB blob, vs memcpy."""
    digests, view = [chain_digests(ROOT, t, chunk) for t in blobs[-8:]], client.view
    for d in digests:  # warm the pages and check every target once
        if (hit := client.lookup(d)) is None or hit.chunks != PROMPT_CHUNKS:
            raise click.ClickException("a stored 16 MiB blob was not found")
        with client.acquire(hit) as lease:
            if not view.verify_payload(lease.record) or lease.record.payload_len != BLOB:
                raise click.ClickException("a stored 16 MiB blob failed its checksum")
    pc, full, bare = time.perf_counter_ns, [], []
    for k in range(plan.reads):
        d = digests[k % len(digests)]
        t0 = pc()  # the public API, as a worker uses it
        lease = client.acquire(client.lookup(d))  # type: ignore[arg-type]
        ok = view.verify_payload(lease.record) and lease.address > 0
        full.append(pc() - t0)
        if not lease.finish(PROMPT_CHUNKS * chunk) or not ok:
            raise click.ClickException("a read was invalid")
        t0 = pc()  # without the payload checksum
        lease = client.acquire(client.lookup(d))  # type: ignore[arg-type]
        _ = lease.address
        bare.append(pc() - t0)
        lease.finish(PROMPT_CHUNKS * chunk)
    rec = lease.record  # the floor: a copy of the payload out of the mapping
    src = np.frombuffer(view.mm, dtype=np.uint8, count=rec.payload_len, offset=rec.payload_off)
    dst = np.ones_like(src)
    memcpy = us(timed(lambda: np.copyto(dst, src), max(30, plan.reads // 2)), BLOB)
    out = {"pointer_verified": us(full, BLOB), "pointer_unverified": us(bare, BLOB)}
    return out | {"memcpy": memcpy}


# Another process pings the supervisor every 5 ms (this one's GIL would otherwise be in
# the measurement) until a line arrives on its stdin; it prints [[sent at, ms], ...].
PINGER = r"""
import json, select, socket, sys, time
from shmkv.core.protocol import recv_msg, send_msg
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(600)
s.connect(sys.argv[1])
print("ready", flush=True)
out, i = [], 0
while not select.select([sys.stdin], [], [], 0.005)[0]:
    i += 1
    w, t0 = time.time(), time.perf_counter()
    send_msg(s, {"op": "ping", "id": i})
    assert recv_msg(s)[0]["ok"]
    out.append([w, (time.perf_counter() - t0) * 1e3])
print(json.dumps(out), flush=True)
"""


def bench_fragmented(quick: bool, seed: int) -> dict[str, Any]:
    """Fill an arena with small records, use half of them in random order, then put one
    huge blob while another process pings."""
    size, record, big = (int(FRAGMENTED[quick][k]) for k in ("size", "record", "put"))
    rng = np.random.default_rng(seed)
    slots = 1 << (size // (16 * 1024)).bit_length()  # room for every small record
    args = ["--size", str(size), "--index-slots", str(slots)]
    with (tempfile.TemporaryDirectory(prefix="shmkv-bench-") as tmp,
          common.supervisor(Path(tmp), *args) as sup):  # fmt: skip
        client = sup.client(timeout=600)
        try:
            chunk, cap = client.ensure().geometry.chunk_tokens, client.stats()["bytes_capacity"]
            *_, extent = arena.record_layout(chunk, len(FINGERPRINT), record)
            n, payload, keys, t0 = cap // extent, rng.bytes(record), [], time.perf_counter()
            for i in range(n):
                root, tokens = i.to_bytes(16, "little"), random_tokens(rng, chunk)
                client.put_bytes(root, tokens, FINGERPRINT, payload)
                keys.append(chain_digests(root, tokens, chunk))
            t_fill, used = time.perf_counter() - t0, keys[1::2]
            rng.shuffle(used)  # type: ignore[arg-type]
            for digests in used:
                if (hit := client.lookup(digests)) is None:
                    raise click.ClickException("a small record was not found")
                client.acquire(hit).finish()
            before = client.stats()
            log.info("fragmented: %d records of %s in %.1f s", n, format_size(extent), t_fill)
            src = b"\x5a" * big
            blob = client.prepare(big, lambda addr, sz: ctypes.memmove(addr, src, sz))
            pipes = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            cmd = [sys.executable, "-c", PINGER, sup.socket]
            pinger = subprocess.Popen(cmd, env=common.child_env(), **pipes)  # type: ignore[call-overload]
            if pinger.stdout.readline().strip() != "ready":
                raise click.ClickException("the pinger did not start")
            time.sleep(0.2)
            w0, t0 = time.time(), time.perf_counter()
            client.put_blob(bytes(16), random_tokens(rng, 4 * chunk), FINGERPRINT, blob)
            secs, w1 = time.perf_counter() - t0, time.time()
            time.sleep(0.2)
            out, _ = pinger.communicate("stop\n", timeout=120)
            after = client.stats()
        finally:
            client.close()
    timeline = [(round(t - w0, 4), round(ms, 3)) for t, ms in json.loads(out)]
    # the pings whose round trip overlaps the put
    during = [ms for t, ms in timeline if t <= w1 - w0 and t + ms / 1e3 >= 0]
    if not during:
        raise click.ClickException("no ping overlapped the put (did the pinger run?)")
    ping = {k: round(v, 3) for k, v in common.pick(common.summary(during), "p50 p99 max").items()}
    return dict(arena_bytes=size, records=n, record_extent=extent, put_bytes=big,
                evictions=after["evictions"] - before["evictions"], put_seconds=round(secs, 4),
                puts_sliced=after.get("puts_sliced"), pings_during_put=len(during), ping_ms=ping,
                timeline=timeline)  # fmt: skip


def run(plan: Plan) -> dict[str, Any]:
    rng = np.random.default_rng(plan.seed)
    args = ["--size", str(plan.size), "--index-slots", str(plan.index_slots)]
    with (tempfile.TemporaryDirectory(prefix="shmkv-bench-") as tmp,
          common.supervisor(Path(tmp), *args) as sup):  # fmt: skip
        client = sup.client(timeout=60)
        try:
            t0, view = time.perf_counter(), client.ensure()
            secs, chunk = time.perf_counter() - t0, view.geometry.chunk_tokens
            log.info("attached (%.2f s, %s mapping)", secs, format_size(view.file_size))
            keep = fill_small(client, plan, rng, chunk)
            if (st := client.stats())["entries"] != plan.entries or st["evictions"]:
                what = "the arena did not keep every entry (raise --size or --index-slots)"
                raise click.ClickException(f"{what}: {st}")
            gc.collect()
            gc.freeze()  # the fill's objects are not what a worker's GC would scan
            log.info("1/4 lookups (%d timed)", plan.lookups)
            lookup = bench_lookup(client, plan, rng, chunk, keep)
            log.info("2/4 puts (%d x 16 MiB)", plan.puts)
            put, blobs = bench_put(client, plan, rng, chunk)
            log.info("3/4 lookup to pointer (%d reads)", plan.reads)
            read, stats = bench_read(client, plan, chunk, blobs), client.stats()
        finally:
            client.close()
            gc.unfreeze()
    return dict(lookup=lookup, put=put, read=read, supervisor_stats=stats)


@common.command("arena", quick="Smoke run of a few seconds (small counts).")
@click.option("--set", "sets", multiple=True, help=f"KEY=VALUE of the plan: {', '.join(PLANS[0])}.")
@click.option("--seed", type=int, default=1, show_default=True)
def main(report: common.Report, o: Any) -> None:
    """Benchmark shmkv's arena against a real supervisor; print a table, write JSON and PNG."""
    quick, over = o.quick, dict(kv.split("=", 1) for kv in o.sets)
    if unknown := set(over) - set(keys := list(PLANS[quick])):
        raise click.BadParameter(f"{unknown}: the plan has {keys}", param_hint="--set")
    over = {k: parse_size(v) if k == "size" else int(v) for k, v in over.items()}
    plan = Plan(quick=quick, **{**PLANS[quick], **over, "seed": o.seed})
    load_before, res = common.loadavg(), run(plan)
    log.info("4/4 fragmented arena")
    res["fragmented"] = bench_fragmented(quick, plan.seed)
    res = {**report.header(), **res, "loadavg_before": load_before}
    res["config"] = vars(plan) | dict(blob_bytes=BLOB, small_payload=SMALL_PAYLOAD)
    res["config"] |= dict(prompt_chunks=PROMPT_CHUNKS, fragmented=FRAGMENTED[quick],
                          chunk_tokens=res["supervisor_stats"]["chunk_tokens"])  # fmt: skip
    base, rows = report.baseline(quick) or {}, []
    for part in ("lookup", "put", "read"):
        rows += [(f"[{part}]", None, None), *common.walk(res[part], base.get(part))]
    pr, after = res["lookup"]["probes_per_lookup"], res["loadavg_end"][0]
    click.echo(f"\n{common.title(res, 'arena')}; load {load_before[0]} before, {after} after")
    click.echo(common.summary_table(rows, 1e-6, "_us"))
    click.echo(f"lookup: {pr['mean']} probes (max {pr['max']})")
    values = {"lookup p50 (µs)": res["lookup"]["all"]["p50_us"]}
    values["put (GB/s)"] = res["put"]["throughput_gbps"]
    values["ping max during a huge put (ms)"] = res["fragmented"]["ping_ms"]["max"]
    res["goals"] = common.check_goals(GOALS, {"": values})
    r, p, z = res["fragmented"], res["fragmented"]["ping_ms"], format_size
    lines = [["evictions", "put s", "ping p50 ms", "ping p99 ms", "ping max ms", "pings"]]
    lines.append([f"{r['evictions']:,}", f"{r['put_seconds']:.3f}", f"{p['p50']:.2f}"])
    lines[-1] += [f"{p['p99']:.2f}", f"{p['max']:.1f}", str(r["pings_during_put"])]
    click.echo(f"\nfragmented arena: {z(r['arena_bytes'])} full of {r['records']:,} records of "
               f"{z(r['record_extent'])}, every other one used since (random order), then one "
               f"{z(r['put_bytes'])} put\n{common.grid(lines)}\n")  # fmt: skip
    click.echo(common.goal_table(res["goals"]))
    lookup = res["lookup"]  # the chart: lookups and reads, pings during the huge put
    parts = [("lookup: ", lookup), ("lookup: prefix ", lookup["by_depth"]), ("read: ", res["read"])]
    rows = [(f"{w}{k}", v["p50_us"] / 1e6, v["p99_us"] / 1e6) for w, tree in parts
            for k, v in tree.items() if isinstance(v, dict) and "p50_us" in v]  # fmt: skip
    report.write(res, rows + [("ping during the put", p["p50"] / 1e3, p["p99"] / 1e3)])


if __name__ == "__main__":
    main()
