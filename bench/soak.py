"""Soak: ``shmkv serve`` under a mixed load for a fixed time, its memory, arena, hit rate,
errors and TTFT sampled (docs/benchmarks.md)."""

from __future__ import annotations

import contextlib
import logging
import random
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import click
import common
import httpx
import psutil

log = logging.getLogger("soak")
WORDS = """policy customer refund order shipping account invoice warranty support agent product
delivery return exchange payment card address email phone store""".split()


class Load:
    """A bounded request mix on its own threads; records TTFT and errors with timestamps."""

    def __init__(self, base: str, seed: int, prompts: list[str], stop_at: float) -> None:
        self.base, self.prompts, self.stop_at = base, prompts, stop_at
        self.rng, self.lock = random.Random(seed), threading.Lock()
        self.events: list[dict[str, Any]] = []
        self.chats: list[list[dict[str, str]]] = []

    def words(self, lo: int, hi: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(lo, hi)))

    def pick(self) -> dict[str, Any]:
        with self.lock:
            r = self.rng.random()
            if r < 0.6:  # a shared system prompt, a short question
                system = common.msg("system", self.rng.choice(self.prompts))
                return {"messages": [system, common.msg("user", self.words(3, 12))]}
            if r < 0.85:  # a chat that grows turn by turn
                if not self.chats or self.rng.random() < 0.2 or len(self.chats[-1]) > 12:
                    self.chats.append([common.msg("system", self.rng.choice(self.prompts))])
                chat = self.rng.choice(self.chats)
                chat.append(common.msg("user", self.words(4, 20)))
                return {"messages": list(chat), "chat": chat}
            return {"prompt": self.words(200, 900)}  # a one-off prompt: a miss

    def one(self, client: httpx.Client) -> None:
        job = self.pick()
        body = dict(max_tokens=24, temperature=0.7, stream=self.rng.random() < 0.7)
        if "prompt" in job:
            url, body["prompt"] = "/v1/completions", job["prompt"]
        else:
            url, body["messages"] = "/v1/chat/completions", job["messages"]
        t0 = time.monotonic()
        ev: dict[str, Any] = {"t": t0, "ok": False, "ttft": None, "restored": 0}
        try:
            if body["stream"]:
                r = common.stream_completion(client, self.base + url, body)
                if r["error"]:
                    raise ValueError(r["error"])
                ev["ttft"], reply = r["first_chunk"], r["text"]
                ev["restored"] = (r["shmkv"] or {}).get("restored_tokens", 0)
            else:
                resp = client.post(self.base + url, json=body)
                resp.raise_for_status()
                ev["ttft"] = time.monotonic() - t0  # the whole request: an upper bound
                ev["restored"] = int(resp.headers.get("x-shmkv-restored-tokens", 0))
                ch = resp.json()["choices"][0]
                reply = (ch.get("message") or {}).get("content") or ch.get("text") or ""
            ev["ok"] = True
            if "chat" in job:
                with self.lock:
                    job["chat"].append(common.msg("assistant", reply))
        except (httpx.HTTPError, ValueError, KeyError) as e:
            ev["error"] = f"{type(e).__name__}: {e}"[:200]
        ev["total"] = time.monotonic() - t0
        with self.lock:
            self.events.append(ev)

    def run(self) -> None:
        with common.http_client(300) as client:
            while time.monotonic() < self.stop_at:
                self.one(client)


def sample(t: float, pids: list[int], st: dict[str, Any], evs: list[Any]) -> dict[str, Any]:
    """Memory of the server processes, the arena, the cache and the requests so far."""
    rss = pss = 0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            mi = psutil.Process(pid).memory_full_info()
            rss, pss = rss + mi.rss, pss + mi.pss
    free = st.get("bytes_capacity", 0) - st.get("bytes_used", 0)
    lookups = st.get("hits", 0) + st.get("misses", 0)
    recent = [e["ttft"] for e in evs if e["ttft"] is not None and e["t"] > time.monotonic() - 30]
    window = common.summary(recent)
    out = dict(t=round(t, 1), rss=rss, pss=pss, arena_used=st.get("bytes_used", 0))
    out |= dict(entries=st.get("entries", 0), evictions=st.get("evictions", 0))
    out["fragmentation"] = round(1 - st.get("bytes_free_largest", 0) / free, 4) if free > 0 else 0.0
    out["hit_rate"] = round(st.get("hits", 0) / lookups, 4) if lookups else 0.0
    out |= dict(requests=len(evs), errors=sum(not e["ok"] for e in evs))
    return out | {f"ttft_{k}": round(window.get(k, 0.0), 3) for k in ("p50", "p90")}


opt = common.option


@common.command("soak", model=True)
@opt("--duration", default=300.0, help="Seconds of load.")
@opt("--concurrency", default=4)
@opt("--workers", default=4)
@opt("--size", default="512M", help="Arena size (small on purpose: the soak should evict).")
@opt("--prompts", default=8, help="Shared system prompts.")
@opt("--interval", default=5.0, help="Seconds between samples.")
def main(report: common.Report, o: Any) -> None:
    """Run `shmkv serve` under a mixed load and record its health over time."""
    rng, samples = random.Random(1), []
    words = lambda: " ".join(rng.choice(WORDS) for _ in range(rng.randint(500, 900)))  # noqa: E731
    with (
        tempfile.TemporaryDirectory(prefix="shmkv-soak-") as tmp,
        common.supervisor(Path(tmp), "--size", o.size) as sup,
    ):
        env = {"SHMKV_MODEL": str(o.model), "SHMKV_THREADS": "1", "SHMKV_LOG_LEVEL": "warning"}
        srv = common.Server.shmkv(sup, env, Path(tmp), o.workers)
        try:
            srv.wait_ready()
            sps = ["You are a support assistant. " + words() for _ in range(o.prompts)]
            load = Load(srv.base, 2, sps, (t_start := time.monotonic()) + o.duration)
            threads = [threading.Thread(target=load.run, daemon=True) for _ in range(o.concurrency)]
            for th in threads:
                th.start()
            while any(th.is_alive() for th in threads):
                time.sleep(o.interval)
                pids = [sup.child.pid, srv.child.pid, *(p.pid for p in srv.child.children(True))]
                with load.lock:
                    evs = list(load.events)
                samples.append(s := sample(time.monotonic() - t_start, pids, sup.stats(), evs))
                fmt = "t=%5.0fs req=%d err=%d hit=%.0f%% arena=%.0fMiB frag=%.0f%% PSS=%.2fGiB"
                log.info(fmt + " TTFT p50=%.2fs", s["t"], s["requests"], s["errors"],
                         100 * s["hit_rate"], s["arena_used"] / 2**20, 100 * s["fragmentation"],
                         s["pss"] / 2**30, s["ttft_p50"])  # fmt: skip
            final = sup.stats()
        finally:
            srv.stop()
    evs, first, last = load.events, (samples or [{}])[0], (samples or [{}])[-1]
    ttft = common.summary([e["ttft"] for e in evs if e["ttft"] is not None])
    s = {"requests": len(evs), "errors": sum(not e["ok"] for e in evs)}
    s |= {"error_examples": [e["error"] for e in evs if not e["ok"]][:5]}
    s |= {f"ttft_{k}": round(ttft.get(k, 0.0), 3) for k in ("p50", "p99")}
    s |= {
        f"{k}_{w}": x.get(k, 0)
        for k in ("rss", "pss")
        for w, x in (("first", first), ("last", last))
    }
    res = {**report.header(), "config": {**vars(o), "model": o.model.name}, "summary": s}
    res |= {"final_stats": final, "samples": samples}
    keys = "hits misses tokens_restored restore_failures puts evictions rejected_puts"
    counters = ", ".join(f"{k} {v}" for k, v in common.pick(final, keys).items())
    click.echo(
        f"\n{s['requests']} requests, {s['errors']} errors; TTFT p50 {s['ttft_p50']} s, p99 "
        f"{s['ttft_p99']} s; server PSS {common.fmt_b(s['pss_first'])} at the first sample, "
        f"{common.fmt_b(s['pss_last'])} at the last; {counters}"
    )
    report.write(res, [("TTFT, all requests", ttft.get("p50"), ttft.get("p99"))])


if __name__ == "__main__":
    main()
