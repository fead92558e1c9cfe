"""Time to first token on a shared ~2,000-token prefix: cold, shmkv hit, the floor, LlamaRAMCache.

One run, Gemma 3 270M Q4_K_M (from PyPI), the same context settings and threads
for every arm, a different short suffix per request, streaming
``create_completion`` timed until its first chunk (TTFT). Every arm runs in its
own subprocess (fresh memory, no shared Python state); a real ``shmkv
supervise`` subprocess owns the arena.

1. cold: a plain ``llama_cpp.Llama``, ``reset()`` before every request;
2. shmkv hit in a second process: process A (``SharedCacheLlama``) serves
   prefix + suffix 0 and flushes its publish, then prefix + one more suffix:
   Gemma 3 has sliding-window layers, whose state cannot be cut back to the
   prefix, so A's first request publishes a checkpoint 64 tokens before its
   end and the second restores that, learns where the suffixes part and
   publishes the state of exactly the prefix (what a shared prefix gets from
   its second request on; timed as its own row); process B (its own
   ``SharedCacheLlama``) serves the other suffixes, ``reset()`` before each so
   that every request restores from the arena (asserted: tokens restored >=
   prefix - 64), with publish on and off alternately;
3. the floor: ``llama_state_seq_set_data`` from a private in-process buffer
   captured after evaluating the prefix, then the same streaming completion; run
   in its own process and again inside process B, interleaved with its hits (the
   hit / floor ratio uses the latter: same context, same KV history); beside it
   llama-cpp-python's own same-process prefix reuse (no reset);
4. exact mode (``shmkv_exact=True``): a process A' publishes prefix + suffix 0
   (its states at n_batch boundaries), a process B' serves the other suffixes,
   restoring at the last boundary before each (bit for bit a cold run's numbers);
5. llama-cpp-python's ``LlamaRAMCache`` (2 GiB cap): one request warms it, then
   ``reset()`` and the same prefix with new suffixes (memory is watched).

It also measures what publishing costs a request (time inside ``capture()``,
request time with publish on vs off) and, in process B, where the time of a
restore goes (each step of ``SharedPrefixCache.restore`` timed by wrapping the
real calls). Prints tables, writes ``OUT/restore.json`` and ``OUT/restore.png``;
a committed baseline (``bench/baseline/restore.json``) of the same mode adds a
column. Waits for a quiet machine first (1-minute load below ``--max-load``).

    python bench/bench_restore.py                      # full run, ~2-3 minutes
    python bench/bench_restore.py --quick              # smoke run
    python bench/bench_restore.py --write-baseline     # also refresh bench/baseline/
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import datetime as dt
import functools
import json
import logging
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

log = logging.getLogger("bench_restore")

HERE = Path(__file__).resolve().parent
GOAL_HIT_OVER_FLOOR = 1.10
GOAL_COLD_OVER_HIT = 50.0
ARENA_SIZE = "1G"
RAMCACHE_CAPACITY = 2 << 30
MIN_FREE_MEMORY = 3 << 30  # stop the LlamaRAMCache arm before it can exhaust RAM
SEED = 7

WORDS = """apple river stone garden window silver market pencil orange rabbit candle
forest bridge yellow copper island winter summer ladder pocket helmet violin dragon
harbor meadow castle feather saddle anchor basket cotton desert engine falcon glacier
hammer jungle kettle lantern marble needle oyster pepper quartz rocket shadow tiger
velvet walnut zebra blanket canyon dolphin emerald fossil guitar horizon iceberg jacket
kitten lemon mirror nectar orchard parrot quiver ribbon saffron thunder umbrella valley
whistle yogurt badger cactus dagger ember falcon goblet hazel ivory jigsaw kayak lilac
magnet nutmeg otter pebble quill raven sparrow tulip urchin vessel wagon yarn zephyr
bamboo cobalt drizzle eagle fabric granite hollow indigo juniper kernel lobster mango
""".split()

SUFFIX_HEADS = """Apple River Stone Garden Window Silver Market Pencil Orange Rabbit Candle
Forest Bridge Yellow Copper Island Winter Summer Ladder Pocket Helmet Violin Dragon
Harbor Meadow Castle Feather Saddle Anchor Basket Cotton Desert Engine Falcon Glacier
Hammer Jungle Kettle Lantern Marble Needle Oyster Pepper Quartz Rocket Shadow Tiger
Velvet Walnut Zebra Blanket Canyon Dolphin Emerald Fossil Guitar Horizon Iceberg Jacket
Kitten Lemon Mirror Nectar Orchard Parrot Ribbon Thunder Umbrella Valley Whistle Yogurt
Badger Cactus Dagger Ember Goblet Hazel Ivory Kayak Lilac Magnet Nutmeg Otter Pebble
Raven Sparrow Tulip Vessel Wagon Bamboo Cobalt Eagle Fabric Granite Hollow Indigo Juniper
Lobster Mango Please Tell Explain Describe Summarize List Name Which What Why How When
Where Who Give Write Compare Choose Find Count Check""".split()

# ===================================================================== workers
# Everything in this section runs in an arm's subprocess (`bench_restore.py _worker SPEC`).

def _ctx_description(llm: Any) -> dict[str, Any]:
    cp = llm.context_params
    return {name: getattr(cp, name) for name, _t in cp._fields_
            if isinstance(getattr(cp, name), (int, float, bool))}


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _stream(llm: Any, prompt: str, gen: dict[str, Any],
            before: Callable[[], None] | None = None) -> dict[str, Any]:
    """One streaming completion: seconds to the first chunk, to the second, to the last.

    ``before`` runs inside the timed region, first (the floor's set_data). ``t0`` is
    the absolute perf_counter start, to place other timings (captures) against it.
    """
    t0 = time.perf_counter()
    if before is not None:
        before()
    stamps: list[float] = []
    parts = []
    for chunk in llm.create_completion(prompt, stream=True, **gen):
        if len(stamps) < 2:
            stamps.append(time.perf_counter() - t0)
        parts.append(chunk["choices"][0]["text"])
    total = time.perf_counter() - t0
    return {"ttft": stamps[0] if stamps else total, "total": total,
            "gap12": stamps[1] - stamps[0] if len(stamps) > 1 else None,
            "t0": t0, "text": "".join(parts)}


class CaptureTimer:
    """Times every ``capture()`` call of a SharedPrefixCache (instance attribute wrapper).

    Each call is kept as (start, seconds, published), start relative to the request's
    ``t0``, so a call can be placed before or after the first chunk (on the TTFT path
    or not).
    """

    def __init__(self, cache: Any) -> None:
        self.calls: list[tuple[float, float, bool]] = []
        orig = cache.capture

        def capture(*a: Any, **k: Any) -> bool:
            t = time.perf_counter()
            ok = False
            try:
                ok = orig(*a, **k)
                return ok
            finally:
                self.calls.append((t, time.perf_counter() - t, bool(ok)))

        cache.capture = capture

    def take(self, t0: float) -> list[tuple[float, float, bool]]:
        out, self.calls = self.calls, []
        return [(start - t0, dt, ok) for start, dt, ok in out]


class Probes:
    """Inclusive wall time of wrapped calls, keyed by their nesting ("restore/acquire/rtt")."""

    def __init__(self) -> None:
        self.stack: list[str] = []
        self.acc: dict[str, float] = {}
        self.undo: list[tuple[Any, str, Any]] = []

    def wrap(self, owner: Any, attr: str, label: str | Callable[..., str]) -> None:
        orig = getattr(owner, attr)
        had_own = attr in getattr(owner, "__dict__", {})
        probes = self

        def wrapper(*a: Any, **k: Any) -> Any:
            name = label(*a, **k) if callable(label) else label
            probes.stack.append(name)
            key = "/".join(probes.stack)
            probes.acc.setdefault(key, 0.0)  # keys in the order the calls start
            t = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                probes.acc[key] = probes.acc.get(key, 0.0) + time.perf_counter() - t
                probes.stack.pop()

        self.undo.append((owner, attr, orig if had_own else None))
        setattr(owner, attr, wrapper)

    def take(self) -> dict[str, float]:
        out, self.acc = self.acc, {}
        return out

    def remove(self) -> None:
        for owner, attr, orig in reversed(self.undo):
            if orig is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, orig)
        self.undo = []


def instrument_restore(cache: Any) -> Probes:
    """Wrap the real calls made by ``SharedPrefixCache.restore`` and ``capture``."""
    import llama_cpp.llama_cpp as C

    import shmkv.llama as SL
    from shmkv import arena as A
    from shmkv.client import Lease

    p = Probes()
    p.wrap(cache, "restore", "restore")
    p.wrap(cache, "capture", "capture")
    p.wrap(cache, "_coverage", "covered")
    p.wrap(SL, "chain_digests", "digests")
    p.wrap(SL, "_common_prefix", "common_prefix")
    p.wrap(cache.reader, "lookup", "lookup")
    p.wrap(cache.reader, "acquire", "acquire")
    p.wrap(cache.reader, "request", lambda msg, *a, **k: f"rtt_{msg.get('op')}")
    p.wrap(cache.writer, "prepare", "prepare_memfd")
    p.wrap(A.ArenaView, "read_record", "read_record")
    p.wrap(A.ArenaView, "verify_meta", "verify_meta")
    p.wrap(A.ArenaView, "verify_payload", "verify_payload")
    p.wrap(A.ArenaView, "tokens", "tokens")
    p.wrap(Lease, "fingerprint", "fingerprint")
    p.wrap(Lease, "finish", "finish")
    p.wrap(C, "llama_state_seq_set_data", "set_data")
    p.wrap(C, "llama_state_seq_get_data", "get_data")
    p.wrap(C, "llama_state_seq_get_size", "get_size")
    p.wrap(C, "llama_memory_seq_rm", "seq_rm")
    return p


def floor_restorer(llm: Any, prefix: str, prefix_n: int, res: dict[str, Any]
                   ) -> tuple[Callable[[], None], list[float]]:
    """Evaluate the prefix, keep its sequence state in a private buffer; return a restorer.

    The restorer is the floor: ``llama_state_seq_set_data`` from that buffer, then
    ``input_ids``/``n_tokens``/``_requires_eval`` set as shmkv sets them. The prefix is
    evaluated with ``Llama.eval`` (no ``generate``, so no shmkv hook and no publish).
    """
    import llama_cpp.llama_cpp as C

    toks = [llm.token_bos()] + llm.tokenize(prefix.encode(), add_bos=False, special=True)
    if len(toks) != prefix_n:
        raise RuntimeError(f"floor: prefix is {len(toks)} tokens here, {prefix_n} in the plan")
    llm.reset()
    t = time.perf_counter()
    llm.eval(toks)
    res["prefix_eval_seconds"] = time.perf_counter() - t
    size = C.llama_state_seq_get_size(llm.ctx, 0)
    buf = (ctypes.c_uint8 * size)()
    t = time.perf_counter()
    got = C.llama_state_seq_get_data(llm.ctx, buf, size, 0)
    res["get_data_seconds"] = time.perf_counter() - t
    if got != size:
        raise RuntimeError(f"llama_state_seq_get_data wrote {got} of {size} bytes")
    res["blob_bytes"] = size
    set_times: list[float] = []

    def restore() -> None:
        t = time.perf_counter()
        n = C.llama_state_seq_set_data(llm.ctx, buf, size, 0)
        set_times.append(time.perf_counter() - t)
        if n != size:
            raise RuntimeError(f"llama_state_seq_set_data accepted {n} of {size} bytes")
        llm.input_ids[:prefix_n] = toks
        llm.n_tokens = prefix_n
        llm._requires_eval = True

    return restore, set_times


def capture_paths(llm: Any, spec: dict[str, Any], reps: int) -> dict[str, list[float]]:
    """The same ``llama_state_seq_get_data`` of the prefix state into three kinds of memory.

    ``Client.prepare`` (what ``capture()`` uses), a memfd created, mapped and unmapped
    per blob (every page faulted in and zeroed during the copy: what a pool of warm
    memfds avoids), and a private buffer (the floor).
    """
    import mmap

    import llama_cpp.llama_cpp as C
    import numpy as np

    from shmkv import Client

    size = C.llama_state_seq_get_size(llm.ctx, 0)

    def fill(addr: int, sz: int) -> None:
        got = C.llama_state_seq_get_data(
            llm.ctx, ctypes.cast(addr, ctypes.POINTER(ctypes.c_uint8)), sz, 0)
        if got != sz:
            raise RuntimeError(f"get_data wrote {got} of {sz} bytes")

    def fresh_memfd() -> None:
        fd = os.memfd_create("bench-fresh", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
            buf = np.frombuffer(mm, dtype=np.uint8)
            fill(buf.ctypes.data, size)
            del buf
            mm.close()
        finally:
            os.close(fd)

    client = Client(name=spec["name"], socket_path=spec["socket"], populate=False)
    private = np.zeros(size, dtype=np.uint8)
    out: dict[str, list[float]] = {"client_prepare": [], "fresh_memfd": [],
                                   "private_buffer": []}
    for _ in range(reps):
        t = time.perf_counter()
        client.prepare(size, fill).close()  # close() gives the memfd back to the pool
        out["client_prepare"].append(time.perf_counter() - t)
        t = time.perf_counter()
        fresh_memfd()
        out["fresh_memfd"].append(time.perf_counter() - t)
        t = time.perf_counter()
        fill(private.ctypes.data, size)
        out["private_buffer"].append(time.perf_counter() - t)
    client.close()
    return out


def _check_restored(cache: Any, prefix_n: int, what: str) -> None:
    last = cache.last
    if last.tokens_restored < prefix_n - 64:
        raise RuntimeError(
            f"{what}: restored {last.tokens_restored} tokens, expected >= {prefix_n - 64} "
            f"(last={dataclasses.asdict(last)}, errors={cache.totals.errors})")


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one arm; returns its JSON-able result."""
    import llama_cpp

    arm = spec["arm"]
    ctx, gen, prefix = spec["ctx"], spec["gen"], spec["prefix"]
    prefix_n = spec["prefix_tokens"]
    res: dict[str, Any] = {"arm": arm, "requests": []}
    t_load = time.perf_counter()
    if arm in ("publisher", "hit", "publisher_exact", "hit_exact"):
        from shmkv.llama import SharedCacheLlama

        llm = SharedCacheLlama(model_path=spec["model"], **ctx, shmkv_name=spec["name"],
                               shmkv_socket=spec["socket"], shmkv_namespace="bench",
                               shmkv_exact=arm.endswith("_exact"))
        cache = llm.shmkv
    else:
        llm = llama_cpp.Llama(model_path=spec["model"], **ctx)
        cache = None
    res["load_seconds"] = time.perf_counter() - t_load
    res["context_params"] = _ctx_description(llm)
    if cache is not None:  # what a worker's attach costs: connect + map (MAP_POPULATE)
        from shmkv import Client

        t = time.perf_counter()
        with Client(name=spec["name"], socket_path=spec["socket"]) as c:
            c.ensure()
            res["attach_seconds"] = time.perf_counter() - t
    llm.reset()
    # first-touch of weights, KV and compute buffers, thread start: not what we time
    res["warmup"] = _stream(llm, spec["warmup"], gen)
    if cache is not None:
        cache.flush()

    def run(text: str, **extra: Any) -> dict[str, Any]:
        r = _stream(llm, prefix + text, gen, before=extra.pop("before", None))
        r.update(extra)
        res["requests"].append(r)
        return r

    if arm == "cold":
        for i, s in spec["suffixes"]:
            llm.reset()
            run(s, suffix=i, evaluated=None)
    elif arm in ("publisher", "publisher_exact"):
        timer = CaptureTimer(cache)
        for n, (i, s) in enumerate(spec["suffixes"]):
            llm.reset()
            r = run(s, suffix=i, second=n > 0)
            t = time.perf_counter()
            ok = cache.flush(60)
            r.update(flush_seconds=time.perf_counter() - t, flushed=ok,
                     captures=timer.take(r["t0"]), last=dataclasses.asdict(cache.last))
            if not ok or cache.totals.publishes < 1:
                raise RuntimeError(f"process A did not publish: "
                                   f"{dataclasses.asdict(cache.totals)}")
        res["totals"] = dataclasses.asdict(cache.totals)
        cache.close()
    elif arm == "hit":
        timer = CaptureTimer(cache)
        on, off = spec["suffixes"], spec["suffixes_off"]
        # The floor again, in this process, interleaved with the hits: the tightest
        # comparison (same process, same context, same KV history). Its requests bypass
        # the shmkv hook (Llama.generate itself), so they neither restore nor publish.
        floor_b: dict[str, Any] = {}
        floor_restore, floor_set = floor_restorer(llm, prefix, prefix_n, floor_b)
        res["floor_b"] = floor_b
        res["floor_b"]["requests"] = []
        plain_generate = functools.partial(llama_cpp.Llama.generate, llm)
        for k in range(len(on)):
            order = [("on", "off", "floor"), ("off", "floor", "on"),
                     ("floor", "on", "off")][k % 3]
            for what in order:
                if what == "floor":
                    i, s = on[k]
                    llm.reset()
                    llm.generate = plain_generate  # type: ignore[method-assign]
                    try:
                        r = _stream(llm, prefix + s, gen, before=floor_restore)
                    finally:
                        del llm.generate
                    r.update(suffix=i, set_data_seconds=floor_set[-1])
                    res["floor_b"]["requests"].append(r)
                    continue
                publish = what == "on"
                i, s = on[k] if publish else off[k]
                cache.publish_enabled = publish
                llm.reset()  # B's context must not already hold the prefix
                r = run(s, suffix=i, publish=publish)
                caps = timer.take(r["t0"])
                t = time.perf_counter()
                flushed = cache.flush(60)
                r.update(flush_seconds=time.perf_counter() - t, flushed=flushed, captures=caps,
                         last=dataclasses.asdict(cache.last))
                _check_restored(cache, prefix_n, f"hit request {i}")
        cache.publish_enabled = True
        # The breakdown: the same requests with every step of restore/capture wrapped.
        probes = instrument_restore(cache)
        res["breakdown"] = []
        for i, s in spec["suffixes_breakdown"]:
            llm.reset()
            probes.take()
            r = _stream(llm, prefix + s, gen)
            steps = probes.take()
            caps = timer.take(r["t0"])
            cache.flush(60)
            _check_restored(cache, prefix_n, f"breakdown request {i}")
            res["breakdown"].append({"suffix": i, **r, "steps": steps, "captures": caps,
                                     "last": dataclasses.asdict(cache.last)})
        probes.remove()
        res["totals"] = dataclasses.asdict(cache.totals)
        cache.close()
    elif arm == "hit_exact":
        for i, s in spec["suffixes"]:
            llm.reset()
            r = run(s, suffix=i)
            cache.flush(60)
            r["last"] = dataclasses.asdict(cache.last)
            if cache.last.tokens_restored < spec["prefix_tokens"] - spec["ctx"]["n_batch"]:
                raise RuntimeError(f"exact hit {i}: restored {cache.last.tokens_restored}")
        res["totals"] = dataclasses.asdict(cache.totals)
        cache.close()
    elif arm == "floor":
        restore, set_times = floor_restorer(llm, prefix, prefix_n, res)
        for i, s in spec["suffixes"]:
            llm.reset()
            r = run(s, suffix=i, before=restore)
            r["set_data_seconds"] = set_times[-1]
        res["capture_paths"] = capture_paths(llm, spec, max(5, 3 * len(spec["suffixes"])))
        # llama-cpp-python's own same-process prefix reuse: no reset between requests.
        res["local"] = []
        llm.reset()
        i0, s0 = spec["suffixes_local"][0]
        res["local_first"] = _stream(llm, prefix + s0, gen)
        for i, s in spec["suffixes_local"][1:]:
            r = _stream(llm, prefix + s, gen)
            r["suffix"] = i
            res["local"].append(r)
    elif arm == "ramcache":
        ramcache = llama_cpp.LlamaRAMCache(capacity_bytes=RAMCACHE_CAPACITY)
        llm.set_cache(ramcache)
        spent = {"load_state": 0.0, "save_state": 0.0}
        for name in spent:
            orig = getattr(llm, name)

            def timed(*a: Any, _orig: Any = orig, _name: str = name, **k: Any) -> Any:
                t = time.perf_counter()
                try:
                    return _orig(*a, **k)
                finally:
                    spent[_name] += time.perf_counter() - t

            setattr(llm, name, timed)
        res["aborted"] = None
        for n, (i, s) in enumerate(spec["suffixes"]):
            free = common.mem_available()
            if free and free < MIN_FREE_MEMORY:
                res["aborted"] = (f"stopped before request {n}: only {free >> 20} MiB of "
                                  f"memory available")
                break
            llm.reset()  # the cache, not the context's own prefix, must serve the prefix
            for name in spent:
                spent[name] = 0.0
            r = run(s, suffix=i, warm=n == 0)
            last_state = next(reversed(ramcache.cache_state.values()))
            r.update(load_state_seconds=spent["load_state"],
                     save_state_seconds=spent["save_state"],
                     entries=len(ramcache.cache_state), cache_size=ramcache.cache_size,
                     scores_bytes_uncounted=int(last_state.scores.nbytes),
                     rss_bytes=_rss(), mem_available=common.mem_available())
    else:
        raise ValueError(f"unknown arm {arm}")
    res["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return res


def worker_main(spec_path: str) -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")
    spec = json.loads(Path(spec_path).read_text())
    res = worker(spec)
    Path(spec["out"]).write_text(json.dumps(res))


# ================================================================ orchestrator

def summary(xs: list[float]) -> dict[str, Any]:
    if not xs:
        return {"n": 0}
    return {"n": len(xs), "p50": statistics.median(xs), "mean": statistics.fmean(xs),
            "min": min(xs), "max": max(xs),
            "stdev": statistics.stdev(xs) if len(xs) > 1 else 0.0}


def make_prompts(model: Path, prefix_target: int, suffix_target: int, n_suffixes: int
                 ) -> dict[str, Any]:
    """A ~prefix_target-token shared prefix and n_suffixes ~suffix_target-token suffixes.

    Every suffix starts with a different first token, so no two requests share more
    than the prefix, and prefix + suffix tokenizes as tokens(prefix) + tokens(suffix):
    every arm restores or reuses exactly the prefix.
    """
    import llama_cpp

    tok = llama_cpp.Llama(model_path=str(model), vocab_only=True, verbose=False)

    def tokens(text: str) -> list[int]:  # exactly as create_completion tokenizes a prompt
        return [tok.token_bos()] + tok.tokenize(text.encode(), add_bos=False, special=True)

    rng = random.Random(SEED)

    def document(head: str, line: Callable[[int, list[str]], str]) -> tuple[str, int]:
        parts = [head]
        n = 1
        while True:
            text = line(n, rng.sample(WORDS, 8))
            if len(tokens("".join(parts) + text)) > prefix_target:
                return "".join(parts) + "\n", n - 1
            parts.append(text)
            n += 1

    prefix, rules = document(
        "You are the archivist of a large museum. Below are the catalogue rules you must "
        "follow when answering visitors. Answer briefly.\n\n",
        lambda n, w: (f"Rule {n}: the {w[0]} room holds {w[1]} and {w[2]} items; visitors "
                      f"who ask about the {w[3]} must be sent to the {w[4]} desk, never to "
                      f"the {w[5]} hall.\n"))
    # the same length, nothing in common: every arm's process warms up on it (first-touch
    # of weights, KV and compute buffers) before anything is timed
    warmup, _ = document(
        "Shipping log of the cargo vessel Northern Star. Each entry lists the cargo and "
        "the weather.\n\n",
        lambda n, w: (f"Day {n}. Loaded {w[0]} crates of {w[1]} and a barrel of {w[2]}; "
                      f"the wind came from the {w[3]}, and the {w[4]} was stored below the "
                      f"{w[5]}.\n"))
    ptoks = tokens(prefix)
    firsts: set[int] = set()
    suffixes: list[str] = []
    heads = list(SUFFIX_HEADS)
    rng.shuffle(heads)
    for h in heads:
        words = f"{h}:"
        text = words + "\nAnswer:"
        while len(tokens(prefix + text)) - len(ptoks) < suffix_target:
            words += f" {rng.choice(WORDS)}"
            text = words + "?\nAnswer:"
        full = tokens(prefix + text)
        stoks = full[len(ptoks):]
        if full[: len(ptoks)] != ptoks or stoks[0] in firsts:
            continue
        firsts.add(stoks[0])
        suffixes.append(text)
        if len(suffixes) == n_suffixes:
            break
    if len(suffixes) < n_suffixes:
        raise click.ClickException(
            f"only {len(suffixes)} suffixes with distinct first tokens: lower --repeats")
    suffix_lens = [len(tokens(prefix + s)) - len(ptoks) for s in suffixes]
    return {"prefix": prefix, "prefix_tokens": len(ptoks), "suffixes": suffixes,
            "suffix_tokens": suffix_lens, "rules": rules, "warmup": warmup + "Summary:",
            "warmup_tokens": len(tokens(warmup))}


@contextlib.contextmanager
def supervisor(workdir: Path) -> Iterator[tuple[str, str, subprocess.Popen]]:
    """A `shmkv supervise` subprocess on a private name and socket; stopped and checked after."""
    name = f"benchr{uuid.uuid4().hex[:8]}"
    sock = str(workdir / f"{name}.sock")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    log_path = workdir / "supervisor.log"
    args = [sys.executable, "-m", "shmkv.cli", "supervise", "--name", name, "--socket", sock,
            "--size", ARENA_SIZE, "--log-level", "warning"]
    with common.supervisor_process(args, env, log_path, name, sock) as proc:
        yield name, sock, proc


def run_arm(spec: dict[str, Any], workdir: Path, sup_pid: int) -> dict[str, Any]:
    """Run one arm in a subprocess; returns its result plus what else used the CPU meanwhile."""
    arm = spec["arm"]
    spec = {**spec, "out": str(workdir / f"{arm}.out.json")}
    spec_path = workdir / f"{arm}.spec.json"
    spec_path.write_text(json.dumps(spec))
    err_path = workdir / f"{arm}.stderr"
    busy0, sup0 = common.cpu_busy_seconds(), common.process_cpu_seconds(sup_pid)
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    load0 = common.loadavg()
    t0 = time.monotonic()
    with open(err_path, "wb") as errf:
        rc = subprocess.run([sys.executable, __file__, "_worker", str(spec_path)],
                            stdout=errf, stderr=subprocess.STDOUT, timeout=1800).returncode
    wall = time.monotonic() - t0
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    ours = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime) + (
        common.process_cpu_seconds(sup_pid) - sup0)
    foreign = max(0.0, common.cpu_busy_seconds() - busy0 - ours)
    if rc != 0:
        raise click.ClickException(f"arm {arm} failed (exit {rc}):\n"
                                   f"{err_path.read_text()[-4000:]}")
    res = json.loads(Path(spec["out"]).read_text())
    res["process"] = {"wall_seconds": wall, "cpu_seconds": ours,
                      "foreign_cpu_seconds": foreign,
                      "foreign_cores": foreign / wall if wall else 0.0,
                      "loadavg_before": list(load0), "loadavg_after": list(common.loadavg())}
    noise = err_path.read_text().strip()
    if noise:
        log.debug("%s stderr:\n%s", arm, noise[-2000:])
    log.info("arm %-9s done in %5.1f s (other processes used %.2f cores meanwhile)", arm, wall,
             res["process"]["foreign_cores"])
    return res


def _restore_steps(b: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-step p50/mean (seconds) of the instrumented restore and first-token capture."""
    out: dict[str, Any] = {}
    first_seen: dict[str, int] = {}
    for r in b:
        for k in r["steps"]:
            first_seen.setdefault(k, len(first_seen))

    def tree_order(k: str) -> tuple[int, ...]:
        parts = k.split("/")
        return tuple(first_seen.get("/".join(parts[: i + 1]), 1 << 30)
                     for i in range(len(parts)))

    for top in ("restore", "rtt_claim", "capture"):
        keys = sorted((k for k in first_seen if k == top or k.startswith(top + "/")),
                      key=tree_order)
        if not keys:
            continue
        for k in keys:
            out[k] = summary([r["steps"].get(k, 0.0) for r in b])
        direct = [k for k in keys if k.count("/") == 1]
        if direct:  # what the call spends outside the wrapped steps (glue, numpy compares)
            out[f"{top}/(not wrapped)"] = summary(
                [r["steps"].get(top, 0.0) - sum(r["steps"].get(k, 0.0) for k in direct)
                 for r in b])
    return out


def analyse(arms: dict[str, dict[str, Any]], plan: dict[str, Any]) -> dict[str, Any]:
    cold, hit, floor, ram, pub = (arms["cold"], arms["hit"], arms["floor"], arms["ramcache"],
                                  arms["publisher"])
    on = [r for r in hit["requests"] if r["publish"]]
    off = [r for r in hit["requests"] if not r["publish"]]
    ram_hits = [r for r in ram["requests"] if not r["warm"]]
    rows = {
        "cold": ("cold: plain Llama, reset() per request", cold["requests"]),
        "hit": ("shmkv hit, 2nd process (publish on, default)", on),
        "hit_nopublish": ("shmkv hit, 2nd process (publish off)", off),
        "floor_b": ("floor, in process B between its hits", hit["floor_b"]["requests"]),
        "floor": ("floor, its own process", floor["requests"]),
        "local": ("llama-cpp-python same-process prefix reuse", floor["local"]),
        "ramcache": ("LlamaRAMCache, reset() per request", ram_hits),
        "ramcache_warm": ("LlamaRAMCache, 1st request (warms it)",
                          [r for r in ram["requests"] if r["warm"]]),
        "publisher": ("process A: miss + publish (SharedCacheLlama)",
                      [r for r in pub["requests"] if not r["second"]]),
        "publisher_second": ("process A, 2nd suffix: tail checkpoint + divergence publish",
                             [r for r in pub["requests"] if r["second"]]),
        "hit_exact": ("shmkv --exact hit, 2nd process (restores at n_batch boundaries)",
                      arms["hit_exact"]["requests"]),
        "publisher_exact": ("process A --exact: miss + publish at batch boundaries",
                            arms["publisher_exact"]["requests"]),
    }
    ttft = {k: {"label": lab, "ttft": summary([r["ttft"] for r in rs]),
                "total": summary([r["total"] for r in rs])} for k, (lab, rs) in rows.items()}

    def p50(k: str) -> float:
        return ttft[k]["ttft"].get("p50", float("nan"))

    def mean(k: str) -> float:
        return ttft[k]["ttft"].get("mean", float("nan"))

    # hit / floor against the floor run in the same process, interleaved with the hits
    # (same context and KV history); the separate-process floor is kept beside it: two
    # processes differ by a few percent in suffix-eval time alone
    ratios = {
        "hit_over_floor_p50": p50("hit") / p50("floor_b"),
        "hit_over_floor_mean": mean("hit") / mean("floor_b"),
        "hit_nopublish_over_floor_p50": p50("hit_nopublish") / p50("floor_b"),
        "hit_over_floor_separate_process_p50": p50("hit") / p50("floor"),
        "cold_over_hit_p50": p50("cold") / p50("hit"),
        "cold_over_hit_mean": mean("cold") / mean("hit"),
        "ramcache_over_cold_p50": p50("ramcache") / p50("cold") if ram_hits else None,
        "cold_over_floor_p50": p50("cold") / p50("floor"),
        "cold_over_hit_exact_p50": p50("cold") / p50("hit_exact"),
    }
    goals_met = {"hit_over_floor": ratios["hit_over_floor_p50"] <= GOAL_HIT_OVER_FLOOR,
                 "cold_over_hit": ratios["cold_over_hit_p50"] >= GOAL_COLD_OVER_HIT}

    # publishing: time inside capture() per request, and publish on vs off
    def cap_sum(r: dict[str, Any]) -> float:
        return sum(dt for _start, dt, _ok in r["captures"])

    def cap_before_first(r: dict[str, Any]) -> float:
        """Time spent in capture() calls that started before the first chunk was out."""
        return sum(dt for start, dt, _ok in r["captures"] if start < r["ttft"])

    def gaps(rs: list[dict[str, Any]]) -> dict[str, Any]:
        return summary([r["gap12"] for r in rs if r.get("gap12") is not None])

    publish = {
        "max_tokens": plan["gen"]["max_tokens"],
        "request_on": summary([r["total"] for r in on]),
        "request_off": summary([r["total"] for r in off]),
        "ttft_on": summary([r["ttft"] for r in on]),
        "ttft_off": summary([r["ttft"] for r in off]),
        "capture_per_request": summary([cap_sum(r) for r in on]),
        "capture_fraction": summary([cap_sum(r) / r["total"] for r in on]),
        "capture_before_first_chunk": summary([cap_before_first(r) for r in on]),
        "capture_after_first_chunk": summary([cap_sum(r) - cap_before_first(r) for r in on]),
        "gap12_on": gaps(on), "gap12_off": gaps(off),
        "captures_per_request": summary([float(len(r["captures"])) for r in on]),
        "captures_published": sum(ok for r in on for _s, _t, ok in r["captures"]),
        "captures_published_per_request": summary(
            [float(sum(ok for _s, _t, ok in r["captures"])) for r in on]),
        "flush_after_request": summary([r["flush_seconds"] for r in on]),
        "capture_off_calls": sum(len(r["captures"]) for r in off),
    }
    publish["request_on_over_off_p50"] = (publish["request_on"]["p50"]
                                          / publish["request_off"]["p50"])
    publish["request_on_over_off_mean"] = (publish["request_on"]["mean"]
                                           / publish["request_off"]["mean"])

    hit_restore = summary([r["last"]["restore_seconds"] for r in on + off])
    restored = sorted({r["last"]["tokens_restored"] for r in on + off})
    evaluated = sorted({r["last"]["tokens_evaluated"] for r in on + off})
    floor_set = summary([r["set_data_seconds"] for r in floor["requests"]])
    fb = hit["floor_b"]["requests"]

    # TTFT decomposition: hit = restore + capture() before the first chunk + the rest;
    # floor = set_data + the rest
    b = hit["breakdown"]
    steps = _restore_steps(b)
    decomposition = {
        "hit_ttft": summary([r["ttft"] for r in b]),
        "hit_restore": summary([r["steps"].get("restore", 0.0) for r in b]),
        "hit_capture_before_first_chunk": summary([cap_before_first(r) for r in b]),
        "hit_capture_all": summary([r["steps"].get("capture", 0.0) for r in b]),
        "floor_ttft": ttft["floor_b"]["ttft"],
        "floor_set_data": summary([r["set_data_seconds"] for r in fb]),
        "floor_rest": summary([r["ttft"] - r["set_data_seconds"] for r in fb]),
        "hit_nopublish_rest": summary([r["ttft"] - r["last"]["restore_seconds"] for r in off]),
    }

    # correctness: greedy text of every cached arm vs cold, suffix by suffix
    cold_text = {r["suffix"]: r["text"] for r in cold["requests"]}
    same = {}
    for k, rs in (("hit", on), ("hit_exact", arms["hit_exact"]["requests"]),
                  ("floor_b", fb), ("floor", floor["requests"]),
                  ("ramcache", ram_hits), ("local", floor["local"])):
        pairs = [(r["text"], cold_text[r["suffix"]]) for r in rs if r["suffix"] in cold_text]
        same[k] = f"{sum(a == c for a, c in pairs)}/{len(pairs)}"

    mem = {
        "ramcache_peak_rss_bytes": ram["peak_rss_bytes"],
        "ramcache_counted_bytes": ram["requests"][-1]["cache_size"] if ram["requests"] else 0,
        "ramcache_uncounted_scores_bytes_per_entry": (
            ram["requests"][-1]["scores_bytes_uncounted"] if ram["requests"] else 0),
        "ramcache_entries": ram["requests"][-1]["entries"] if ram["requests"] else 0,
        "ramcache_aborted": ram.get("aborted"),
        "ramcache_load_state": summary([r["load_state_seconds"] for r in ram_hits]),
        "ramcache_save_state": summary([r["save_state_seconds"] for r in ram["requests"]]),
        "hit_peak_rss_bytes": hit["peak_rss_bytes"],
        "cold_peak_rss_bytes": cold["peak_rss_bytes"],
        "floor_peak_rss_bytes": floor["peak_rss_bytes"],
        "blob_bytes": floor["blob_bytes"],
    }
    return {"ttft": ttft, "ratios": ratios, "goals_met": goals_met, "publish": publish,
            "hit": {"restore_seconds": hit_restore, "tokens_restored": restored,
                    "tokens_evaluated": evaluated, "attach_seconds": hit["attach_seconds"],
                    "totals": hit["totals"]},
            "floor": {"set_data": floor_set, "get_data_seconds": floor["get_data_seconds"],
                      "prefix_eval_seconds": floor["prefix_eval_seconds"]},
            "capture_paths": {k: summary(v) for k, v in floor["capture_paths"].items()},
            "decomposition": decomposition, "restore_steps": steps,
            "same_text_as_cold": same, "memory": mem}


# ------------------------------------------------------------------ output

def fmt_s(s: float | None) -> str:
    if s is None or s != s:
        return "-"
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.0f} µs"


def table(res: dict[str, Any], baseline: dict[str, Any] | None) -> str:
    a = res["analysis"]
    base = baseline["analysis"]["ttft"] if baseline else {}
    hdr = ["arm", "n", "TTFT p50", "TTFT mean", "min", "max", "vs cold"]
    if base:
        hdr.append("baseline p50")
    lines = [hdr]
    cold = a["ttft"]["cold"]["ttft"]["p50"]
    for k, v in a["ttft"].items():
        t = v["ttft"]
        if not t.get("n"):
            continue
        row = [v["label"], str(t["n"]), fmt_s(t["p50"]), fmt_s(t["mean"]), fmt_s(t["min"]),
               fmt_s(t["max"]), f"{cold / t['p50']:.1f}x"]
        if base:
            row.append(fmt_s(base.get(k, {}).get("ttft", {}).get("p50")))
        lines.append(row)
    out = [common.grid(lines)]
    r, g = a["ratios"], a["goals_met"]
    out.append("")
    out.append(f"hit / floor  (p50) {r['hit_over_floor_p50']:.2f}   mean "
               f"{r['hit_over_floor_mean']:.2f}   goal <= {GOAL_HIT_OVER_FLOOR:.2f}: "
               f"{'met' if g['hit_over_floor'] else 'MISSED'}")
    out.append(f"  (floor = set_data from a private buffer in process B itself, interleaved "
               f"with its hits; publish off: {r['hit_nopublish_over_floor_p50']:.2f}; against "
               f"the floor's own process: {r['hit_over_floor_separate_process_p50']:.2f})")
    out.append(f"cold / hit   (p50) {r['cold_over_hit_p50']:.1f}    mean "
               f"{r['cold_over_hit_mean']:.1f}    goal >= {GOAL_COLD_OVER_HIT:.0f}: "
               f"{'met' if g['cold_over_hit'] else 'MISSED'}")
    out.append(f"cold / exact-mode hit (p50) {r['cold_over_hit_exact_p50']:.1f}")
    if r["ramcache_over_cold_p50"] is not None:
        out.append(f"LlamaRAMCache / cold (p50) {r['ramcache_over_cold_p50']:.2f}")
    h = a["hit"]
    out.append(f"hit: tokens restored {h['tokens_restored']}, evaluated {h['tokens_evaluated']}, "
               f"restore p50 {fmt_s(h['restore_seconds']['p50'])}; floor set_data p50 "
               f"{fmt_s(a['floor']['set_data']['p50'])}; blob "
               f"{a['memory']['blob_bytes'] / 1e6:.1f} MB; attach {fmt_s(h['attach_seconds'])}")
    out.append(f"greedy text equal to cold: {a['same_text_as_cold']}")

    p = a["publish"]
    out.append("")
    out.append(f"publish cost (hit requests, {p['max_tokens']} generated tokens):")
    pl = [["", "p50", "mean"],
          ["request, publish on", fmt_s(p["request_on"]["p50"]), fmt_s(p["request_on"]["mean"])],
          ["request, publish off", fmt_s(p["request_off"]["p50"]),
           fmt_s(p["request_off"]["mean"])],
          ["on / off", f"{p['request_on_over_off_p50']:.3f}",
           f"{p['request_on_over_off_mean']:.3f}"],
          ["capture() per request", fmt_s(p["capture_per_request"]["p50"]),
           fmt_s(p["capture_per_request"]["mean"])],
          ["capture() / request time", f"{p['capture_fraction']['p50'] * 100:.1f} %",
           f"{p['capture_fraction']['mean'] * 100:.1f} %"],
          ["  of it before the 1st chunk", fmt_s(p["capture_before_first_chunk"]["p50"]),
           fmt_s(p["capture_before_first_chunk"]["mean"])],
          ["  of it after the 1st chunk", fmt_s(p["capture_after_first_chunk"]["p50"]),
           fmt_s(p["capture_after_first_chunk"]["mean"])],
          ["blobs published per request", f"{p['captures_published_per_request']['p50']:.0f}",
           f"{p['captures_published_per_request']['mean']:.2f}"],
          ["1st -> 2nd chunk, publish on", fmt_s(p["gap12_on"].get("p50")),
           fmt_s(p["gap12_on"].get("mean"))],
          ["1st -> 2nd chunk, publish off", fmt_s(p["gap12_off"].get("p50")),
           fmt_s(p["gap12_off"].get("mean"))],
          ["TTFT, publish on", fmt_s(p["ttft_on"]["p50"]), fmt_s(p["ttft_on"]["mean"])],
          ["TTFT, publish off", fmt_s(p["ttft_off"]["p50"]), fmt_s(p["ttft_off"]["mean"])],
          ["flush wait after request", fmt_s(p["flush_after_request"]["p50"]),
           fmt_s(p["flush_after_request"]["mean"])]]
    out.append(common.grid(pl))

    out.append("")
    out.append("where a hit's time goes (instrumented requests, publish on; inclusive times, "
               "nested):")
    d = a["decomposition"]
    rows = [["step", "p50", "mean"],
            ["hit TTFT", fmt_s(d["hit_ttft"]["p50"]), fmt_s(d["hit_ttft"]["mean"])],
            ["  capture() calls before the 1st chunk",
             fmt_s(d["hit_capture_before_first_chunk"]["p50"]),
             fmt_s(d["hit_capture_before_first_chunk"]["mean"])]]
    for k, v in a["restore_steps"].items():
        depth = k.count("/")
        name = k.rsplit("/", 1)[-1]
        if k == "capture":
            rows.append(["hit, rest of the request", "", ""])
            name += "() (every call, wherever it falls)"
        elif depth == 0:
            name += "()"
        rows.append(["  " * (depth + 1) + name, fmt_s(v["p50"]), fmt_s(v["mean"])])
    rows.append(["floor TTFT (process B)", fmt_s(d["floor_ttft"]["p50"]),
                 fmt_s(d["floor_ttft"]["mean"])])
    rows.append(["  set_data", fmt_s(d["floor_set_data"]["p50"]),
                 fmt_s(d["floor_set_data"]["mean"])])
    rows.append(["  rest (tokenize, suffix eval, sample)", fmt_s(d["floor_rest"]["p50"]),
                 fmt_s(d["floor_rest"]["mean"])])
    rows.append(["hit (publish off) TTFT - restore", fmt_s(d["hit_nopublish_rest"]["p50"]),
                 fmt_s(d["hit_nopublish_rest"]["mean"])])
    out.append(common.grid(rows))
    cp = a["capture_paths"]
    out.append("")
    out.append("get_data of the prefix state (p50): through Client.prepare as capture() does "
               f"{fmt_s(cp['client_prepare']['p50'])}, into a new memfd per blob "
               f"{fmt_s(cp['fresh_memfd']['p50'])}, into a private buffer "
               f"{fmt_s(cp['private_buffer']['p50'])}")
    m = a["memory"]
    out.append("")
    out.append(f"LlamaRAMCache: {m['ramcache_entries']} entries, counted "
               f"{m['ramcache_counted_bytes'] / 1e6:.0f} MB, plus an uncounted "
               f"{m['ramcache_uncounted_scores_bytes_per_entry'] / 1e6:.0f} MB scores copy per "
               f"entry; peak RSS {m['ramcache_peak_rss_bytes'] / 1e9:.2f} GB (cold arm "
               f"{m['cold_peak_rss_bytes'] / 1e9:.2f} GB); load_state p50 "
               f"{fmt_s(m['ramcache_load_state'].get('p50'))}, save_state p50 "
               f"{fmt_s(m['ramcache_save_state'].get('p50'))}"
               + (f"; ABORTED: {m['ramcache_aborted']}" if m["ramcache_aborted"] else ""))
    return "\n".join(out)


def plot(res: dict[str, Any], path: Path) -> bool:
    plt = common.pyplot()
    if plt is None:
        return False
    a = res["analysis"]
    fig, axes = plt.subplots(1, 3, figsize=(18, 5.5))
    ax = axes[0]
    keys = [k for k in ("cold", "ramcache", "hit", "hit_nopublish", "floor_b", "floor", "local")
            if a["ttft"][k]["ttft"].get("n")]
    labels = [a["ttft"][k]["label"].replace(", ", ",\n", 1) for k in keys]
    p50s = [a["ttft"][k]["ttft"]["p50"] * 1e3 for k in keys]
    means = [a["ttft"][k]["ttft"]["mean"] * 1e3 for k in keys]
    colors = ["#888", "#c96", "#3a7", "#7b9", "#37a", "#69c", "#9ac"][: len(keys)]
    ax.barh(labels, p50s, color=colors, label="p50")
    ax.scatter(means, labels, color="k", marker="|", s=200, zorder=3, label="mean")
    for y, (v, m) in enumerate(zip(p50s, means, strict=True)):
        ax.text(max(v, m) * 1.08, y, f"{v:,.0f} ms" if v >= 100 else f"{v:.1f} ms",
                va="center", fontsize=8)
    ax.set_xscale("log")
    ax.invert_yaxis()
    ax.set_xlabel("time to first token, ms (log)")
    r = a["ratios"]
    ax.set_title(f"TTFT, {res['config']['prefix_tokens']}-token shared prefix\n"
                 f"cold/hit {r['cold_over_hit_p50']:.0f}x (goal ≥{GOAL_COLD_OVER_HIT:.0f}), "
                 f"hit/floor {r['hit_over_floor_p50']:.2f} (goal ≤{GOAL_HIT_OVER_FLOOR:.2f})",
                 fontsize=10)
    ax.legend(fontsize=8, loc="lower right")

    ax = axes[1]
    d, st = a["decomposition"], a["restore_steps"]

    def step(*names: str) -> float:
        return sum(st.get(f"restore/{n}", {}).get("p50", 0.0) for n in names) * 1e3

    restore = d["hit_restore"]["p50"] * 1e3
    groups = [("restore: round trips (acquire, finish)", step("acquire", "finish"), "#e9a"),
              ("restore: verify_payload (XXH3)", step("verify_payload"), "#c6c"),
              ("restore: set_data", step("set_data"), "#37a")]
    groups.append(("restore: the rest (digests, lookup, checks)",
                   max(0.0, restore - sum(g[1] for g in groups)), "#fc6"))
    cap = d["hit_capture_before_first_chunk"]["p50"] * 1e3
    groups.append(("capture() before the 1st chunk", cap, "#d44"))
    groups.append(("the rest (tokenize, eval suffix, sample)",
                   d["hit_ttft"]["p50"] * 1e3 - restore - cap, "#bbb"))
    left = 0.0
    for name, v, color in groups:
        ax.barh(["shmkv hit"], [v], left=left, color=color, label=name)
        left += v
    fs = d["floor_set_data"]["p50"] * 1e3
    ax.barh(["floor"], [fs], color="#37a")
    ax.barh(["floor"], [d["floor_rest"]["p50"] * 1e3], left=fs, color="#bbb")
    ax.set_xlabel("ms (p50 of each part)")
    ax.set_ylim(-0.6, 2.6)
    ax.set_title("where a hit's TTFT goes", fontsize=10)
    ax.legend(fontsize=7, loc="upper right")

    ax = axes[2]
    p = a["publish"]
    names = ["publish off", "publish on"]
    vals = [p["request_off"]["p50"] * 1e3, p["request_on"]["p50"] * 1e3]
    ax.bar(names, vals, color=["#7b9", "#3a7"])
    ax.bar(["publish on"], [p["capture_per_request"]["p50"] * 1e3], color="#d44",
           label="inside capture()")
    for x, v in enumerate(vals):
        ax.text(x, v, f"{v:.0f} ms", ha="center", va="bottom", fontsize=9)
    ax.set_ylabel(f"request time, ms (p50, {p['max_tokens']} tokens generated)")
    ax.set_ylim(0, max(vals) * 1.15)
    ax.set_title(f"publish cost: request on/off {p['request_on_over_off_p50']:.3f},\n"
                 f"time in capture() {p['capture_fraction']['p50'] * 100:.1f} % of a request",
                 fontsize=10)
    ax.legend(fontsize=8)
    m = res["machine"]
    q = res["quiet"]
    fig.suptitle(f"shmkv {m['versions']['shmkv']} restore benchmark — Gemma 3 270M Q4_K_M, "
                 f"n_ctx {res['config']['ctx']['n_ctx']}, {res['config']['ctx']['n_threads']} "
                 f"threads — {m['cpu']}, {m['cores']} cores — load {q['loadavg'][0]:.2f} at start"
                 + (" (quick)" if res["config"]["quick"] else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# -------------------------------------------------------------------- main

@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--out", "out_dir", default=str(HERE / "out"), show_default=True,
              type=click.Path(file_okay=False), help="Where restore.json and restore.png go.")
@click.option("--prefix-tokens", type=int, default=None,
              help="Shared prefix length in tokens [2000; quick 600].")
@click.option("--suffix-tokens", type=int, default=10, show_default=True,
              help="Suffix length in tokens (a different suffix per request).")
@click.option("--repeats", type=int, default=None, help="Timed requests per arm [7; quick 2].")
@click.option("--max-tokens", type=int, default=16, show_default=True,
              help="Tokens generated per request (request time, publish cost).")
@click.option("--threads", type=int, default=2, show_default=True,
              help="n_threads and n_threads_batch of every context.")
@click.option("--model", type=click.Path(dir_okay=False), default=None,
              help="GGUF to use [Gemma 3 270M Q4_K_M assembled into bench/out/models/].")
@click.option("--quick", is_flag=True, help="Smoke run (short prefix, 2 repeats).")
@click.option("--max-load", type=float, default=0.5, show_default=True,
              help="Wait until the 1-minute load average is below this before timing.")
@click.option("--max-wait", type=float, default=300.0, show_default=True,
              help="Seconds to wait for --max-load; then run anyway and say so in the JSON.")
@click.option("--baseline", default=str(HERE / "baseline" / "restore.json"), show_default=True,
              help="Committed baseline to compare with (same mode only).")
@click.option("--write-baseline", is_flag=True,
              help="Also copy JSON and PNG to --baseline (only after a quiet run).")
@click.option("--force-baseline", is_flag=True, help="Write the baseline even after a busy run.")
@click.option("-v", "--verbose", is_flag=True, help="Debug logging (workers' stderr).")
def main(out_dir: str, prefix_tokens: int | None, suffix_tokens: int, repeats: int | None,
         max_tokens: int, threads: int, model: str | None, quick: bool, max_load: float,
         max_wait: float, baseline: str, write_baseline: bool, force_baseline: bool,
         verbose: bool) -> None:
    """Benchmark TTFT of a shmkv cross-process hit against cold, the floor and LlamaRAMCache."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(message)s")
    prefix_tokens = prefix_tokens or (600 if quick else 2000)
    repeats = repeats or (2 if quick else 7)
    if not quick and repeats < 5:
        raise click.BadParameter("use at least 5 repeats for a full run", param_hint="--repeats")
    if prefix_tokens + suffix_tokens + max_tokens + 64 > 4096:
        raise click.BadParameter("prefix + suffix + max tokens must fit n_ctx 4096")
    started = time.time()
    model_path = Path(model) if model else common.gemma_model()
    log.info("model %s", model_path)
    # S0..SR: cold, A (S0), B publish on, floor, local reuse, LlamaRAMCache (the same
    # texts, so outputs compare with cold); T1..TR: B publish off; U1..UR: B instrumented.
    # V: A's second request (on a sliding-window model such as Gemma 3 it publishes the
    # state at the end of the shared prefix; see the module docstring).
    n_suf = 3 * repeats + 2
    prompts = make_prompts(model_path, prefix_tokens, suffix_tokens, n_suf)
    suf = list(enumerate(prompts["suffixes"]))
    S, T, U = suf[: repeats + 1], suf[repeats + 1 : 2 * repeats + 1], suf[2 * repeats + 1 : -1]
    V = suf[-1]
    log.info("prefix %d tokens (%d rules), suffixes %s tokens", prompts["prefix_tokens"],
             prompts["rules"], sorted(set(prompts["suffix_tokens"])))
    ctx = dict(n_ctx=4096, n_threads=threads, n_threads_batch=threads, n_batch=512,
               n_ubatch=512, seed=0, verbose=False)
    gen = dict(max_tokens=max_tokens, temperature=0.0, seed=0)
    plan = {"quick": quick, "model": str(model_path),
            "model_bytes": model_path.stat().st_size, "ctx": ctx, "gen": gen,
            "prefix_tokens": prompts["prefix_tokens"], "prefix_target": prefix_tokens,
            "suffix_tokens": prompts["suffix_tokens"], "suffix_target": suffix_tokens,
            "repeats": repeats, "warmup_tokens": prompts["warmup_tokens"],
            "arena_size": ARENA_SIZE,
            "ramcache_capacity": RAMCACHE_CAPACITY}
    quiet = common.wait_until_quiet(max_load, max_wait)
    if quiet["quiet"]:
        log.info("machine quiet: load %s", quiet["loadavg"])
    else:
        log.warning("machine still busy after %.0f s (load %s): timing anyway; the JSON says so",
                    quiet["waited_s"], quiet["loadavg"])
    base_spec = {"model": str(model_path), "ctx": ctx, "gen": gen, "prefix": prompts["prefix"],
                 "prefix_tokens": prompts["prefix_tokens"], "warmup": prompts["warmup"]}
    arms: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="shmkv-bench-restore-") as tmp, \
            supervisor(Path(tmp)) as (name, sock, sup):
        sp = {**base_spec, "name": name, "socket": sock}
        specs = [
            {**sp, "arm": "cold", "suffixes": S[1:]},
            {**sp, "arm": "publisher", "suffixes": [*S[:1], V]},
            {**sp, "arm": "publisher_exact", "suffixes": S[:1]},
            {**sp, "arm": "hit_exact", "suffixes": S[1:]},
            {**sp, "arm": "hit", "suffixes": S[1:], "suffixes_off": T, "suffixes_breakdown": U},
            {**sp, "arm": "floor", "suffixes": S[1:], "suffixes_local": S},
            {**sp, "arm": "ramcache", "suffixes": S},
        ]
        for spec in specs:
            log.info("arm %s ...", spec["arm"])
            arms[spec["arm"]] = run_arm(spec, Path(tmp), sup.pid)
        from shmkv import Client

        with Client(name=name, socket_path=sock, populate=False) as c:
            sup_stats = c.stats()
    ctx_params = {k: v["context_params"] for k, v in arms.items()}
    ref = ctx_params["cold"]
    differ = {k: sorted(f for f in ref if v.get(f) != ref[f]) for k, v in ctx_params.items()}
    differ = {k: v for k, v in differ.items() if v}
    if differ:
        raise click.ClickException(f"arms ran with different context settings: {differ}")
    res: dict[str, Any] = {
        "benchmark": "restore", "schema": 1,
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "duration_s": round(time.time() - started, 1),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "machine": common.machine_info(_llama_versions()),
        "git": common.git_state(),
        "quiet": quiet, "loadavg_end": list(common.loadavg()),
        "config": {**plan, "context_params": ref},
        "goals": {"hit_over_floor_max": GOAL_HIT_OVER_FLOOR,
                  "cold_over_hit_min": GOAL_COLD_OVER_HIT},
        "noise": {k: v["process"] for k, v in arms.items()},
        "supervisor_stats": {k: sup_stats.get(k) for k in (
            "entries", "bytes_used", "hits", "misses", "tokens_restored", "tokens_evaluated",
            "restore_failures", "puts", "duplicate_puts", "rejected_puts", "evictions",
            "chunk_tokens")},
    }
    res["analysis"] = analyse(arms, plan)
    res["arms"] = arms
    noisy = {k: round(v["foreign_cores"], 2) for k, v in res["noise"].items()
             if v["foreign_cores"] > 0.25}
    res["noisy_arms"] = noisy
    bpath = Path(baseline)
    base = common.load_baseline(bpath, quick)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    jpath, ppath = out / "restore.json", out / "restore.png"
    jpath.write_text(json.dumps(res, indent=2) + "\n")
    plotted = plot(res, ppath)
    m = res["machine"]
    click.echo(f"\nshmkv {m['versions']['shmkv']} restore benchmark: Gemma 3 270M Q4_K_M, "
               f"prefix {plan['prefix_tokens']} tokens, suffix "
               f"{min(plan['suffix_tokens'])}-{max(plan['suffix_tokens'])} tokens, n_ctx 4096, "
               f"{threads} threads; {m['cpu']}, {m['cores']} cores; llama-cpp-python "
               f"{m['versions']['llama_cpp_python']}; load {quiet['loadavg'][0]:.2f} at start"
               + ("" if quiet["quiet"] else " (NOT quiet)")
               + (" (quick run: not comparable)" if quick else ""))
    click.echo(table(res, base))
    if noisy:
        click.echo(f"\nother processes used CPU during: {noisy} (cores, average)")
    click.echo(f"\nwrote {jpath}" + (f" and {ppath}" if plotted else ""))
    if write_baseline and not quiet["quiet"] and not force_baseline:
        click.echo(f"not writing the baseline: the machine was busy at the start (load "
                   f"{quiet['loadavg'][0]:.2f}); rerun when quiet or pass --force-baseline")
    elif write_baseline and noisy and not force_baseline:
        click.echo(f"not writing the baseline: other processes used CPU during {noisy}; "
                   "rerun when quiet or pass --force-baseline")
    elif write_baseline:
        bpath.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(jpath, bpath)
        if plotted:
            shutil.copyfile(ppath, bpath.with_suffix(".png"))
        click.echo(f"wrote baseline {bpath}")
    missed = [k for k, ok in res["analysis"]["goals_met"].items() if not ok]
    if missed:
        click.echo(f"goals missed: {', '.join(missed)}")


def _llama_versions() -> dict[str, str]:
    import llama_cpp

    info = llama_cpp.llama_print_system_info()
    return {"llama_cpp_python_module": llama_cpp.__version__,
            "llama_cpp_system_info": info.decode() if isinstance(info, bytes) else str(info)}


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "_worker":
        worker_main(sys.argv[2])
    else:
        main()
