"""Benchmark the arena: lookup latency, put throughput, time from lookup to a usable pointer.

Starts a real ``shmkv supervise`` subprocess on a private name and socket, then,
from this process acting as a worker (a :class:`shmkv.Client`), measures in one run:

1. lookup latency at N entries (default 100,000 small entries of 1-4 chunks plus a
   few deep ones) for 32-chunk prompts whose longest cached prefix varies from a
   miss to all 32 chunks, with the index probes each lookup makes; compared with
   the same binary search over a private ``set`` (the floor for any Python
   structure) and with llama-cpp-python's ``LlamaRAMCache`` linear prefix scan
   (what users have today);
2. ``Client.put`` throughput for 16 MiB blobs, broken down into worker fill,
   worker checksum and the supervisor round trip, next to the memcpy, xxh3 and
   memfd-to-arena copy floors;
3. the time from lookup to a usable, verified pointer into a 16 MiB blob (lookup,
   lease round trip, record and metadata check, payload checksum), with and
   without the payload checksum, as a ratio to a plain memcpy of the blob out of
   the mapping (and to a copy through a Unix socket, what a cache server costs).

Prints a table and writes ``OUT/arena.json`` and ``OUT/arena.png``; a committed
baseline (``bench/baseline/arena.json``) of the same mode adds a ratio column.

    python bench/bench_arena.py            # full run, ~1 minute
    python bench/bench_arena.py --quick    # smoke run, a few seconds
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime as dt
import gc
import json
import logging
import os
import platform
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import numpy as np
import xxhash

import shmkv

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from shmkv import Client
from shmkv import arena as A
from shmkv.config import format_size, parse_size

log = logging.getLogger("bench_arena")

HERE = Path(__file__).resolve().parent
MIB = 1 << 20
BLOB = 16 * MIB
PROMPT_CHUNKS = 32
SMALL_PAYLOAD = 256
FINGERPRINT = b"bench-arena-model-fingerprint"
ROOT = bytes(16)  # one namespace: every entry chains from the same root
GOAL_LOOKUP_P50_US = 50.0
GOAL_PUT_GBPS = 1.0


@dataclass(frozen=True)
class Plan:
    """What one run does; ``--quick`` shrinks every count."""

    quick: bool
    entries: int
    deep_every: int
    index_slots: int
    size: int
    lookups: int
    prompts_per_depth: int
    put_warmup: int
    puts: int
    reads: int
    ramcache_lookups: int
    seed: int

    @classmethod
    def make(cls, quick: bool, **over: Any) -> Plan:
        if quick:
            base = dict(entries=5_000, deep_every=50, index_slots=32_768, size=512 << 20,
                        lookups=3_000, prompts_per_depth=20, put_warmup=1, puts=8, reads=40,
                        ramcache_lookups=3)
        else:
            base = dict(entries=100_000, deep_every=200, index_slots=524_288, size=4 << 30,
                        lookups=30_000, prompts_per_depth=100, put_warmup=4, puts=64,
                        reads=300, ramcache_lookups=10)
        base.update({"seed": 1}, **{k: v for k, v in over.items() if v is not None})
        return cls(quick=quick, **base)

    def depth(self, i: int) -> int:
        """Chunks of small entry ``i``: mostly 1-4, every ``deep_every``-th one 5-32."""
        if i % self.deep_every == self.deep_every - 1:
            return 5 + (i // self.deep_every) % (PROMPT_CHUNKS - 4)
        return 1 + i % 4

    def digests_needed(self) -> int:
        return sum(self.depth(i) for i in range(self.entries)) + (
            self.put_warmup + self.puts) * PROMPT_CHUNKS


# ------------------------------------------------------------------ machine
def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = 0
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    import msgpack

    return {
        "cpu": cpu, "cores": os.cpu_count(), "memory_bytes": mem,
        "kernel": platform.release(), "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "versions": {"shmkv": shmkv.__version__, "numpy": np.__version__,
                     "xxhash": xxhash.VERSION, "msgpack": ".".join(map(str, msgpack.version)),
                     "click": _dist_version("click")},
    }


def _dist_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "?"


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def preflight(plan: Plan, shm_dir: str) -> None:
    """Refuse to start when /dev/shm or RAM cannot hold the arena, or the index is too small."""
    st = os.statvfs(shm_dir)
    free = st.f_bavail * st.f_frsize
    if plan.size > free:
        raise click.ClickException(
            f"--size {format_size(plan.size)} does not fit in {shm_dir} "
            f"({format_size(free)} free): lower --size")
    avail = mem_available()
    if avail and plan.size + (1 << 30) > avail:
        raise click.ClickException(
            f"--size {format_size(plan.size)} plus 1 GiB headroom exceeds available memory "
            f"({format_size(avail)}): lower --size")
    need = plan.digests_needed()
    if need > plan.index_slots // 2:
        raise click.ClickException(
            f"{plan.entries} entries need {need} index slots in use but --index-slots "
            f"{plan.index_slots} allows {plan.index_slots // 2} (half): raise --index-slots")
    blobs = plan.put_warmup + plan.puts * 2 + 6
    need_bytes = plan.entries * 12 * 1024 + blobs * (BLOB + 64 * 1024)
    if need_bytes > plan.size:
        raise click.ClickException(
            f"the run stores about {format_size(need_bytes)}: raise --size")


# --------------------------------------------------------------- supervisor
@contextlib.contextmanager
def supervisor(plan: Plan, workdir: Path) -> Iterator[tuple[str, str, subprocess.Popen]]:
    """A `shmkv supervise` subprocess on a private name and socket; stopped and checked after."""
    name = f"bench{uuid.uuid4().hex[:8]}"
    sock = str(workdir / f"{name}.sock")
    env = {**os.environ, "SHMKV_NAME": name, "SHMKV_SOCKET": sock, "PYTHONUNBUFFERED": "1",
           "SHMKV_LOG_LEVEL": "warning"}
    log_path = workdir / "supervisor.log"
    args = [sys.executable, "-m", "shmkv.cli", "supervise", "--size", str(plan.size),
            "--index-slots", str(plan.index_slots)]
    log.info("starting supervisor %s: %s", name, " ".join(args[3:]))
    with common.supervisor_process(args, env, log_path, name, sock) as proc:
        yield name, sock, proc


# ------------------------------------------------------------------ helpers
def summary(ns: Sequence[int] | np.ndarray, nbytes: int = 0) -> dict[str, Any]:
    """p50/p99/mean (µs) of a list of nanosecond timings; GB/s if ``nbytes`` per op."""
    a = np.asarray(ns, dtype=np.float64) / 1e3
    p50, p99 = np.percentile(a, [50, 99])
    out: dict[str, Any] = {"n": int(a.size), "p50_us": round(float(p50), 3),
                           "p99_us": round(float(p99), 3), "mean_us": round(float(a.mean()), 3),
                           "min_us": round(float(a.min()), 3)}
    if nbytes:
        out["gbps_p50"] = round(nbytes / (p50 * 1e3), 3)
        out["gbps_mean"] = round(nbytes / (a.mean() * 1e3), 3)
    return out


def array_at(address: int, size: int) -> np.ndarray:
    """A writable uint8 array over ``size`` bytes at ``address`` (a put's memfd mapping)."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(address))


def random_tokens(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, 256_000, n, dtype=np.int32)


def timed(fn: Callable[[], Any], reps: int) -> list[int]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        fn()
        out.append(time.perf_counter_ns() - t0)
    return out


class CountingDigests(list):
    """A digest list that records which positions a lookup reads (one per index probe)."""

    def __init__(self, items: Sequence[bytes]) -> None:
        super().__init__(items)
        self.seen: list[int] = []

    def __getitem__(self, i):  # type: ignore[override]
        self.seen.append(i)
        return super().__getitem__(i)


def slots_touched(view: A.ArenaView, digest: bytes) -> int:
    """Index slots a linear-probing search for ``digest`` reads (to a match or an empty slot)."""
    n = view.geometry.index_slots
    i = A.slot_home(digest, n)
    for k in range(1, min(A.MAX_PROBE, n) + 1):
        used, slot = view.read_slot(i)
        if not used or (slot is not None and slot.digest == digest):
            return k
        i = (i + 1) & (n - 1)
    return A.MAX_PROBE


# ------------------------------------------------------------ 1. lookups
def fill_small(client: Client, plan: Plan, rng: np.random.Generator, chunk: int
               ) -> dict[int, list[np.ndarray]]:
    """Put ``plan.entries`` small entries; returns token ids of some entries of each depth."""
    keep: dict[int, list[np.ndarray]] = {}
    payload = bytearray(rng.bytes(SMALL_PAYLOAD))
    t0 = time.perf_counter()
    for i in range(plan.entries):
        d = plan.depth(i)
        tokens = random_tokens(rng, d * chunk)
        payload[:8] = i.to_bytes(8, "little")
        client.put_bytes(ROOT, tokens, FINGERPRINT, bytes(payload))
        bucket = keep.setdefault(d, [])
        if len(bucket) < plan.prompts_per_depth:
            bucket.append(tokens)
        if (i + 1) % 10_000 == 0 or i + 1 == plan.entries:
            el = time.perf_counter() - t0
            log.info("filled %d/%d entries (%.1f s, %.0f puts/s)", i + 1, plan.entries, el,
                     (i + 1) / el)
    return keep


def bench_lookup(client: Client, plan: Plan, rng: np.random.Generator, chunk: int,
                 keep: dict[int, list[np.ndarray]]) -> dict[str, Any]:
    """Time ``client.lookup`` for 32-chunk prompts with cached prefixes of 0-32 chunks."""
    prompts: list[tuple[int, list[bytes], np.ndarray]] = []
    for _ in range(plan.prompts_per_depth):  # misses: nothing of it is cached
        toks = random_tokens(rng, PROMPT_CHUNKS * chunk)
        prompts.append((0, A.chain_digests(ROOT, toks, chunk), toks))
    for d, bucket in sorted(keep.items()):
        for toks in bucket:
            full = np.concatenate([toks, random_tokens(rng, (PROMPT_CHUNKS - d) * chunk)])
            prompts.append((d, A.chain_digests(ROOT, full, chunk), full))
    view = client.view
    # correctness and probe counts, untimed
    probes, slots = [], []
    for d, digests, _ in prompts:
        counting = CountingDigests(digests)
        hit = client.lookup(counting)
        got = 0 if hit is None else hit.chunks
        if got != d:
            raise click.ClickException(f"lookup found {got} chunks, expected {d}")
        probes.append(len(counting.seen))
        slots.append(sum(slots_touched(view, digests[i]) for i in counting.seen))
    # timed: random order over all prompts, GC frozen out of the setup's objects
    rnd = random.Random(plan.seed)
    order = [rnd.randrange(len(prompts)) for _ in range(plan.lookups)]
    lookup = client.lookup
    for i in order[:1000]:  # warm-up
        lookup(prompts[i][1])
    times = np.empty(len(order), dtype=np.int64)
    pc = time.perf_counter_ns
    for k, i in enumerate(order):
        digests = prompts[i][1]
        t0 = pc()
        lookup(digests)
        times[k] = pc() - t0
    depths = np.array([prompts[i][0] for i in order])
    classes = {"miss": depths == 0, "1-4": (depths >= 1) & (depths <= 4),
               "5-16": (depths >= 5) & (depths <= 16), "17-32": depths >= 17}
    res: dict[str, Any] = {
        "all": summary(times),
        "by_depth": {k: summary(times[m]) for k, m in classes.items() if m.any()},
        "probes_per_lookup": {"mean": round(float(np.mean(probes)), 2), "max": int(max(probes)),
                              "log2_chunks": round(float(np.log2(PROMPT_CHUNKS)), 2)},
        "slots_read_per_lookup": {"mean": round(float(np.mean(slots)), 2),
                                  "max": int(max(slots))},
        "prompts": len(prompts),
    }
    # the caller's side: chaining 32 digests from token ids
    toks = prompts[-1][2]
    res["chain_digests"] = summary(timed(lambda: A.chain_digests(ROOT, toks, chunk), 2000))
    # floor: the same binary search over a private Python set of every digest
    private = set()
    for s in view.scan():
        private.add(s.digest)

    def set_lookup(digests: Sequence[bytes]) -> int:
        lo, hi, best = 1, len(digests), 0
        while lo <= hi:
            mid = (lo + hi) // 2
            if digests[mid - 1] in private:
                best, lo = mid, mid + 1
            else:
                hi = mid - 1
        return best

    st = np.empty(len(order), dtype=np.int64)
    for k, i in enumerate(order):
        digests = prompts[i][1]
        t0 = pc()
        set_lookup(digests)
        st[k] = pc() - t0
    res["private_set"] = summary(st)
    res["ramcache"] = bench_ramcache(plan, rng, chunk, prompts)
    return res


def bench_ramcache(plan: Plan, rng: np.random.Generator, chunk: int,
                   prompts: list[tuple[int, list[bytes], np.ndarray]]) -> dict[str, Any] | None:
    """llama-cpp-python's LlamaRAMCache prefix search over as many keys (what users have)."""
    try:
        from llama_cpp.llama_cache import LlamaRAMCache
    except Exception as e:  # pragma: no cover - llama_cpp is a dependency, but optional here
        log.warning("LlamaRAMCache comparison skipped: %s", e)
        return None
    cache = LlamaRAMCache(capacity_bytes=1 << 40)
    for i in range(plan.entries):  # keys only: its search never looks at the states
        cache.cache_state[tuple(random_tokens(rng, plan.depth(i) * chunk).tolist())] = None
    keys = [tuple(p[2].tolist()) for p in prompts[:: max(1, len(prompts) // 50)]]
    times = []
    for k in range(plan.ramcache_lookups):
        key = keys[k % len(keys)]
        t0 = time.perf_counter_ns()
        cache._find_longest_prefix_key(key)
        times.append(time.perf_counter_ns() - t0)
    del cache
    return summary(times)


# --------------------------------------------------------------- 2. puts
def bench_put(client: Client, plan: Plan, rng: np.random.Generator, chunk: int
              ) -> tuple[dict[str, Any], list[np.ndarray]]:
    """``Client.put`` of 16 MiB blobs, end to end, split at the client's own call boundaries.

    ``Client.put`` is ``prepare`` (a warm pooled memfd, ``fill``) then ``put_blob`` (xxh3,
    then the ``put`` request, then the memfd goes back to the pool); wrapping ``put_blob``
    and ``request`` on this instance and timing inside ``fill`` marks each phase without
    changing the client.
    """
    src = np.frombuffer(rng.bytes(BLOB), dtype=np.uint8).copy()
    marks: dict[str, int] = {}
    real_put_blob, real_request = client.put_blob, client.request

    def put_blob(*args: Any, **kw: Any) -> dict[str, Any]:
        marks["put_blob"] = time.perf_counter_ns()
        return real_put_blob(*args, **kw)

    def request(msg: dict[str, Any], fds: list[int] | None = None) -> dict[str, Any]:
        marks["request"] = time.perf_counter_ns()
        try:
            return real_request(msg, fds)
        finally:
            marks["reply"] = time.perf_counter_ns()

    def fill(address: int, size: int) -> None:
        marks["fill0"] = time.perf_counter_ns()
        array_at(address, size)[:] = src
        marks["fill1"] = time.perf_counter_ns()

    client.put_blob = put_blob  # type: ignore[method-assign]
    client.request = request  # type: ignore[method-assign]
    stored: list[np.ndarray] = []
    rows: dict[str, list[int]] = {k: [] for k in PUT_PHASES}
    try:
        for k in range(plan.put_warmup + plan.puts):
            tokens = random_tokens(rng, PROMPT_CHUNKS * chunk)
            src[:8] = np.frombuffer(k.to_bytes(8, "little"), dtype=np.uint8)
            t0 = time.perf_counter_ns()
            reply = client.put(ROOT, tokens, FINGERPRINT, BLOB, fill)
            t1 = time.perf_counter_ns()
            if reply.get("n_tokens") != len(tokens):
                raise click.ClickException(f"unexpected put reply {reply}")
            stored.append(tokens)
            if k < plan.put_warmup:
                continue
            m = marks
            for key, v in zip(PUT_PHASES, (t1 - t0, m["fill0"] - t0, m["fill1"] - m["fill0"],
                                           m["put_blob"] - m["fill1"],
                                           m["request"] - m["put_blob"],
                                           m["reply"] - m["request"], t1 - m["reply"]),
                              strict=True):
                rows[key].append(v)
    finally:
        del client.put_blob, client.request
    res: dict[str, Any] = {k: summary(v, BLOB) for k, v in rows.items()}
    total_s = sum(rows["total"]) / 1e9
    res["throughput_gbps"] = round(plan.puts * BLOB / total_s / 1e9, 3)
    res["floors"] = put_floors(src)
    return res, stored


PUT_PHASES = ("total", "memfd", "fill", "unmap", "checksum", "roundtrip", "free")


def put_floors(src: np.ndarray) -> dict[str, Any]:
    """What the put path is made of, measured alone: memcpy, xxh3, memfd -> /dev/shm copy."""
    dst = np.empty_like(src)
    dst[:] = 1
    out = {"memcpy": summary(timed(lambda: np.copyto(dst, src), 30), BLOB),
           "xxh3": summary(timed(lambda: xxhash.xxh3_64_intdigest(src), 30), BLOB)}
    fd = os.memfd_create("bench-floor", os.MFD_CLOEXEC)
    shm = tempfile.NamedTemporaryFile(dir="/dev/shm", prefix="shmkv-benchfloor-")
    try:
        os.ftruncate(fd, BLOB)
        os.pwrite(fd, src.data, 0)
        os.posix_fallocate(shm.fileno(), 0, BLOB)
        import mmap

        mm = mmap.mmap(shm.fileno(), BLOB, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        view = memoryview(mm)
        out["preadv_memfd_to_shm"] = summary(timed(lambda: os.preadv(fd, [view], 0), 30), BLOB)
        view.release()
        mm.close()
    finally:
        os.close(fd)
        shm.close()
    return out


# ------------------------------------------------------ 3. lookup -> pointer
def bench_read(client: Client, plan: Plan, chunk: int, blobs: list[np.ndarray]
               ) -> dict[str, Any]:
    """Lookup + lease + record/meta check (+ payload checksum) of a 16 MiB blob, vs memcpy."""
    digests = [A.chain_digests(ROOT, t, chunk) for t in blobs[-8:]]
    view = client.view
    # warm the pages and check every target once
    for d in digests:
        hit = client.lookup(d)
        if hit is None or hit.chunks != PROMPT_CHUNKS:
            raise click.ClickException("a stored 16 MiB blob was not found")
        with client.acquire(hit) as lease:
            if not view.verify_payload(lease.record) or lease.record.payload_len != BLOB:
                raise click.ClickException("a stored 16 MiB blob failed its checksum")
    pc = time.perf_counter_ns
    full, bare, fin = [], [], []
    parts: dict[str, list[int]] = {k: [] for k in ("lookup", "acquire_roundtrip",
                                                   "read_record", "verify_meta",
                                                   "verify_payload", "release")}
    for k in range(plan.reads):
        d = digests[k % len(digests)]
        # the public API, as a worker uses it
        t0 = pc()
        hit = client.lookup(d)
        lease = client.acquire(hit)  # type: ignore[arg-type]
        ok = view.verify_payload(lease.record)
        address = lease.address
        t1 = pc()
        ok = lease.finish(PROMPT_CHUNKS * chunk) and ok and address > 0
        t2 = pc()
        if not ok:
            raise click.ClickException("a read was invalid")
        full.append(t1 - t0)
        fin.append(t2 - t1)
        # without the payload checksum
        t0 = pc()
        hit = client.lookup(d)
        lease = client.acquire(hit)  # type: ignore[arg-type]
        address = lease.address
        t1 = pc()
        lease.finish(PROMPT_CHUNKS * chunk)
        bare.append(t1 - t0)
        # step by step, the same work as Client.acquire does
        t0 = pc()
        hit = client.lookup(d)
        t1 = pc()
        reply = client.request({"op": "acquire", "offset": hit.slot.rec_offset,
                                "gen": hit.slot.rec_gen})
        t2 = pc()
        rec = view.read_record(hit.slot.rec_offset, hit.slot.rec_gen)
        t3 = pc()
        view.verify_meta(rec)
        t4 = pc()
        view.verify_payload(rec)
        t5 = pc()
        client.request({"op": "release", "lease": reply["lease"], "tokens_restored": 0})
        t6 = pc()
        for key, v in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5),
                          strict=True):
            parts[key].append(v)
    res: dict[str, Any] = {"pointer_verified": summary(full, BLOB),
                           "pointer_unverified": summary(bare, BLOB),
                           "finish": summary(fin),
                           "steps": {k: summary(v) for k, v in parts.items()}}
    # floors: copy the payload out of the mapping; push it through a Unix socket
    rec = view.read_record(hit.slot.rec_offset, hit.slot.rec_gen)  # type: ignore[union-attr]
    dst = np.empty(rec.payload_len, dtype=np.uint8)
    dst[:] = 1
    res["memcpy"] = summary(memcpy_out(view, rec, dst, max(30, plan.reads // 2)), BLOB)
    payload = view.payload(rec)
    try:
        res["unix_socket"] = summary(socket_copy(payload, dst, max(10, plan.reads // 10)), BLOB)
    finally:
        payload.release()
    return res


def memcpy_out(view: A.ArenaView, rec: A.Record, dst: np.ndarray, reps: int) -> list[int]:
    """Time a plain numpy copy of the payload out of the read-only mapping (the floor)."""
    src = np.frombuffer(view.mm, dtype=np.uint8, count=rec.payload_len, offset=rec.payload_off)
    return timed(lambda: np.copyto(dst, src), reps)


def socket_copy(payload: memoryview, dst: np.ndarray, reps: int) -> list[int]:
    """Time moving ``payload`` through a Unix socket into ``dst`` (a cache server's floor)."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    for s in (a, b):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 * MIB)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * MIB)
    go = threading.Semaphore(0)

    def sender() -> None:
        for _ in range(reps):
            go.acquire()
            a.sendall(payload)

    th = threading.Thread(target=sender, daemon=True)
    th.start()
    buf = memoryview(dst)
    out = []
    try:
        for _ in range(reps):
            t0 = time.perf_counter_ns()
            go.release()
            got = 0
            while got < len(buf):
                got += b.recv_into(buf[got:])
            out.append(time.perf_counter_ns() - t0)
    finally:
        th.join(10)
        a.close()
        b.close()
    return out


# -------------------------------------------------------------- reporting
def rows_of(res: dict[str, Any]) -> list[dict[str, Any]]:
    """Flatten the results into table rows: key, label, figures, reference ratio, goal."""
    L, P, R = res["lookup"], res["put"], res["read"]
    rows: list[dict[str, Any]] = []

    def row(key: str, section: str, label: str, s: dict[str, Any] | None, ref: str = "",
            ref_p50: float | None = None, goal: str = "", met: bool | None = None,
            gbps: float | None = None, note: str = "") -> None:
        if s is None:
            return
        ratio = round(s["p50_us"] / ref_p50, 2) if ref_p50 else None
        rows.append({"key": key, "section": section, "label": label, "p50_us": s["p50_us"],
                     "p99_us": s["p99_us"], "gbps": gbps, "ratio": ratio, "ratio_to": ref,
                     "goal": goal, "met": met, "note": note})

    n = f"{res['config']['entries']:,} entries"
    sec1 = f"1. lookup, {PROMPT_CHUNKS}-chunk prompts, {n}"
    floor = L["private_set"]["p50_us"]
    pr = L["probes_per_lookup"]
    row("lookup.all", sec1, "client.lookup (all depths)", L["all"], "set", floor,
        f"p50 <= {GOAL_LOOKUP_P50_US:.0f} us", L["all"]["p50_us"] <= GOAL_LOOKUP_P50_US,
        note=f"{pr['mean']} probes (max {pr['max']}), "
             f"{L['slots_read_per_lookup']['mean']} slots read")
    for k, s in L["by_depth"].items():
        row(f"lookup.depth_{k}", sec1, f"  cached prefix {k} chunks", s, "set", floor)
    row("lookup.private_set", sec1, "floor: binary search, private set", L["private_set"])
    row("lookup.chain_digests", sec1, f"caller: chain_digests({PROMPT_CHUNKS} chunks)",
        L["chain_digests"], "set", floor)
    if L["ramcache"]:
        row("lookup.ramcache", sec1, "LlamaRAMCache prefix scan (users today)", L["ramcache"],
            "set", floor, note=f"{L['ramcache']['p50_us'] / L['all']['p50_us']:,.0f}x "
                               "slower than client.lookup")
    sec2 = "2. put, 16 MiB blobs, end to end"
    mc = P["floors"]["memcpy"]["p50_us"]
    row("put.total", sec2, "Client.put", P["total"], "memcpy", mc,
        f">= {GOAL_PUT_GBPS:g} GB/s", P["throughput_gbps"] >= GOAL_PUT_GBPS,
        gbps=P["throughput_gbps"], note="GB/s = total bytes / total time")
    for k, label, rate in (("memfd", "worker: take a warm memfd from the pool", False),
                           ("fill", "worker: fill (memcpy into the memfd)", True),
                           ("unmap", "worker: prepare -> put_blob", False),
                           ("checksum", "worker: xxh3 of the blob", True),
                           ("roundtrip", "put request (supervisor copy+verify+index)", True),
                           ("free", "worker: give the memfd back to the pool", False)):
        row(f"put.{k}", sec2, f"  {label}", P[k], "memcpy", mc,
            gbps=P[k]["gbps_p50"] if rate else None)
    for k, label in (("memcpy", "floor: numpy memcpy"), ("xxh3", "floor: xxh3_64"),
                     ("preadv_memfd_to_shm", "floor: preadv memfd -> /dev/shm")):
        s = P["floors"][k]
        row(f"put.floor_{k}", sec2, label, s, "memcpy", mc, gbps=s["gbps_p50"])
    sec3 = "3. lookup to usable pointer, 16 MiB blob"
    mc = R["memcpy"]["p50_us"]
    row("read.verified", sec3, "lookup+acquire+verify_payload", R["pointer_verified"],
        "memcpy", mc)
    row("read.unverified", sec3, "lookup+acquire (no payload checksum)",
        R["pointer_unverified"], "memcpy", mc)
    for k, s in R["steps"].items():
        row(f"read.step_{k}", sec3, f"  {k}", s, "memcpy", mc)
    row("read.finish", sec3, "then: lease.finish (release round trip)", R["finish"],
        "memcpy", mc)
    row("read.memcpy", sec3, "floor: numpy memcpy out of the mapping", R["memcpy"], "memcpy",
        mc, gbps=R["memcpy"]["gbps_p50"])
    row("read.unix_socket", sec3, "ref: 16 MiB through a Unix socket", R["unix_socket"],
        "memcpy", mc, gbps=R["unix_socket"]["gbps_p50"])
    return rows


def fmt_us(us: float) -> str:
    if us >= 10_000:
        return f"{us / 1e3:,.1f} ms"
    if us >= 1_000:
        return f"{us / 1e3:,.2f} ms"
    return f"{us:,.1f} us" if us >= 10 else f"{us:,.2f} us"


def table(rows: list[dict[str, Any]], baseline: dict[str, Any] | None) -> str:
    base = {r["key"]: r for r in (baseline or {}).get("rows", [])}
    head = ["what", "p50", "p99", "GB/s", "p50 vs ref", "goal", "vs baseline", "note"]
    lines: list[list[str]] = []
    section = None
    out = []
    for r in rows:
        if r["section"] != section:
            section = r["section"]
            lines.append([f"[{section}]"] + [""] * (len(head) - 1))
        goal = f"{r['goal']}: {'MET' if r['met'] else 'MISSED'}" if r["goal"] else ""
        b = base.get(r["key"])
        vs = f"{r['p50_us'] / b['p50_us']:.2f}x" if b and b.get("p50_us") else ""
        lines.append([r["label"], fmt_us(r["p50_us"]), fmt_us(r["p99_us"]),
                      f"{r['gbps']:.2f}" if r["gbps"] else "",
                      f"{r['ratio']:,.2f}x {r['ratio_to']}" if r["ratio"] is not None else "",
                      goal, vs, r["note"]])
    widths = [max(len(h), *(len(line[i]) for line in lines if not line[0].startswith("[")))
              for i, h in enumerate(head)]
    sep = "  "
    out.append(sep.join(h.ljust(w) for h, w in zip(head, widths, strict=True)).rstrip())
    out.append(sep.join("-" * w for w in widths))
    for line in lines:
        if line[0].startswith("["):
            out.append(line[0])
            continue
        cells = [c.rjust(w) if 0 < i < 5 else c.ljust(w)
                 for i, (c, w) in enumerate(zip(line, widths, strict=True))]
        out.append(sep.join(cells).rstrip())
    return "\n".join(out)


def plot(res: dict[str, Any], path: Path) -> bool:
    plt = common.pyplot()
    if plt is None:
        return False
    L, P, R = res["lookup"], res["put"], res["read"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))

    def bars(ax: Any, names: list[str], p50: list[float], p99: list[float] | None,
             unit: str, log_scale: bool) -> None:
        ax.barh(names, p50, label="p50")
        if p99 is not None:
            ax.barh(names, [b - a for a, b in zip(p50, p99, strict=True)], left=p50,
                    alpha=0.4, label="p99")
        for y, v in enumerate(p50):
            text = fmt_us(v * 1e3 if unit == "ms" else v) if unit != "GB/s" else f"{v:.3g} GB/s"
            ax.annotate(text, (p99[y] if p99 else v, y), xytext=(3, 0),
                        textcoords="offset points", va="center", fontsize=8)
        if log_scale:
            ax.set_xscale("log")
            ax.set_xlim(left=min(p50) / 3, right=max(p99 or p50) * 8)
        else:
            ax.set_xlim(right=max(p99 or p50) * 1.3)

    names = ["private set (floor)", *[f"shmkv, prefix {k}" for k in L["by_depth"]],
             "shmkv, all"]
    vals = [L["private_set"], *L["by_depth"].values(), L["all"]]
    if L["ramcache"]:
        names.append("LlamaRAMCache")
        vals.append(L["ramcache"])
    ax = axes[0]
    bars(ax, names, [v["p50_us"] for v in vals], [v["p99_us"] for v in vals], "µs", True)
    ax.axvline(GOAL_LOOKUP_P50_US, color="red", ls="--", label="goal p50")
    ax.set_xlabel("µs per lookup (log)")
    ax.set_title(f"lookup, {PROMPT_CHUNKS}-chunk prompts, {res['config']['entries']:,} entries")
    ax.legend(fontsize=8, loc="lower right")
    ax = axes[1]
    names = ["Client.put", "memcpy", "xxh3", "preadv memfd→/dev/shm"]
    vals = [P["throughput_gbps"],
            P["floors"]["memcpy"]["gbps_p50"], P["floors"]["xxh3"]["gbps_p50"],
            P["floors"]["preadv_memfd_to_shm"]["gbps_p50"]]
    bars(ax, names, vals, None, "GB/s", True)
    ax.axvline(GOAL_PUT_GBPS, color="red", ls="--", label="goal")
    ax.set_xlabel("GB/s (log)")
    ax.set_title("put, 16 MiB blobs")
    ax.legend(fontsize=8, loc="lower right")
    ax = axes[2]
    names = ["memcpy out (floor)", "pointer, no checksum", "pointer, verified", "Unix socket"]
    vals = [R["memcpy"], R["pointer_unverified"], R["pointer_verified"], R["unix_socket"]]
    bars(ax, names, [v["p50_us"] / 1e3 for v in vals], [v["p99_us"] / 1e3 for v in vals], "ms",
         False)
    ax.set_xlabel("ms")
    ax.set_title("lookup to usable pointer, 16 MiB blob")
    ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(f"shmkv {res['machine']['versions']['shmkv']} arena benchmark — "
                 f"{res['machine']['cpu']}, {res['machine']['cores']} cores"
                 + (" (quick)" if res["config"]["quick"] else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# -------------------------------------------------------------------- main
def run(plan: Plan) -> dict[str, Any]:
    rng = np.random.default_rng(plan.seed)
    with tempfile.TemporaryDirectory(prefix="shmkv-bench-") as tmp, \
            supervisor(plan, Path(tmp)) as (name, sock, _proc):
        client = Client(name=name, socket_path=sock, timeout=60)
        try:
            t0 = time.perf_counter()
            view = client.ensure()
            log.info("attached (%.2f s, %s mapping)", time.perf_counter() - t0,
                     format_size(view.file_size))
            chunk = view.geometry.chunk_tokens
            keep = fill_small(client, plan, rng, chunk)
            st = client.stats()
            if st["entries"] != plan.entries or st["evictions"]:
                raise click.ClickException(f"fill did not keep every entry: {st}")
            gc.collect()
            gc.freeze()  # the fill's objects are not what a worker's GC would scan
            log.info("1/3 lookups (%d timed)", plan.lookups)
            lookup = bench_lookup(client, plan, rng, chunk, keep)
            log.info("2/3 puts (%d x 16 MiB)", plan.puts)
            put, blobs = bench_put(client, plan, rng, chunk)
            log.info("3/3 lookup to pointer (%d reads)", plan.reads)
            read = bench_read(client, plan, chunk, blobs)
            stats = client.stats()
        finally:
            client.close()
            gc.unfreeze()
    keep_keys = ("entries", "bytes_used", "bytes_capacity", "index_used", "index_capacity",
                 "puts", "evictions", "hits", "rejected_puts", "chunk_tokens")
    return {"lookup": lookup, "put": put, "read": read,
            "supervisor_stats": {k: stats.get(k) for k in keep_keys}}


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--out", "out_dir", default=str(HERE / "out"), show_default=True,
              type=click.Path(file_okay=False), help="Where arena.json and arena.png go.")
@click.option("--quick", is_flag=True, help="Smoke run of a few seconds (small counts).")
@click.option("--entries", type=int, default=None, help="Small entries to fill [100000].")
@click.option("--size", default=None, help="Arena --size [4G; quick 512M].")
@click.option("--index-slots", type=int, default=None, help="Arena --index-slots [524288].")
@click.option("--puts", type=int, default=None, help="Timed 16 MiB puts [64].")
@click.option("--reads", type=int, default=None, help="Timed lookup-to-pointer reads [300].")
@click.option("--lookups", type=int, default=None, help="Timed lookups [30000].")
@click.option("--seed", type=int, default=1, show_default=True)
@click.option("--baseline", default=str(HERE / "baseline" / "arena.json"), show_default=True,
              help="Committed baseline to compare with (same mode only).")
@click.option("--write-baseline", is_flag=True, help="Also copy the result to --baseline.")
def main(out_dir: str, quick: bool, entries: int | None, size: str | None,
         index_slots: int | None, puts: int | None, reads: int | None, lookups: int | None,
         seed: int, baseline: str, write_baseline: bool) -> None:
    """Benchmark shmkv's arena against a real supervisor; print a table, write JSON and PNG."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    plan = Plan.make(quick, entries=entries, index_slots=index_slots, puts=puts, reads=reads,
                     lookups=lookups, seed=seed, size=parse_size(size) if size else None)
    preflight(plan, "/dev/shm")
    started = time.time()
    load_before = os.getloadavg()
    res = run(plan)
    res["load_average"] = {"before": [round(x, 2) for x in load_before],
                           "after": [round(x, 2) for x in os.getloadavg()]}
    res = {"benchmark": "arena", "schema": 1,
           "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
           "duration_s": round(time.time() - started, 1),
           "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
           "machine": machine_info(),
           "config": {**plan.__dict__, "blob_bytes": BLOB, "small_payload": SMALL_PAYLOAD,
                      "prompt_chunks": PROMPT_CHUNKS,
                      "chunk_tokens": res["supervisor_stats"]["chunk_tokens"]},
           "goals": {"lookup_p50_us": GOAL_LOOKUP_P50_US, "put_gbps": GOAL_PUT_GBPS},
           **res}
    res["rows"] = rows_of(res)
    res["goals_met"] = {r["key"]: r["met"] for r in res["rows"] if r["goal"]}
    bpath = Path(baseline)
    base = common.load_baseline(bpath, quick)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    jpath = out / "arena.json"
    jpath.write_text(json.dumps(res, indent=2) + "\n")
    plotted = plot(res, out / "arena.png")
    m = res["machine"]
    click.echo(f"\nshmkv {m['versions']['shmkv']} arena benchmark: {m['cpu']}, {m['cores']} "
               f"cores, Python {m['python']}, numpy {m['versions']['numpy']}, "
               f"xxhash {m['versions']['xxhash']}; load average {res['load_average']['before'][0]}"
               f" before, {res['load_average']['after'][0]} after"
               + (" (quick run: small counts, figures are not comparable)" if quick else ""))
    click.echo(table(res["rows"], base))
    click.echo(f"\nwrote {jpath}" + (f" and {out / 'arena.png'}" if plotted else ""))
    if write_baseline:
        bpath.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(jpath, bpath)
        click.echo(f"wrote baseline {bpath}")
    missed = [k for k, ok in res["goals_met"].items() if not ok]
    if missed:
        click.echo(f"goals missed: {', '.join(missed)}")


if __name__ == "__main__":
    main()
