"""Soak: `shmkv serve` under mixed load for a fixed time, recording health over time.

Runs the real serving setup (supervisor + gunicorn workers, Gemma 3 270M unless
--model) on 127.0.0.1 and drives it with a bounded mix of requests: shared system
prompts with short suffixes (hits), multi-turn chats that grow, one-off prompts
(misses), streaming and not. Every --interval seconds it records total RSS and
PSS of all server processes, arena usage and fragmentation, hit rate, request
and error counts, and time to first token; it writes bench/out/soak.json and a
PNG chart. Not a CI test: run it by hand, e.g.

    .venv/bin/python bench/soak.py --duration 600 --concurrency 4
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import click
import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import gemma_model, machine_info  # noqa: E402

log = logging.getLogger("soak")
WORDS = ("policy customer refund order shipping account invoice warranty support agent "
         "product delivery return exchange payment card address email phone store").split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def system_prompt(rng: random.Random, n_words: int) -> str:
    return "You are a support assistant. " + " ".join(rng.choice(WORDS) for _ in range(n_words))


def tree_pids(root: int) -> list[int]:
    """root and all its descendants."""
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                kids = Path(f"/proc/{pid}/task/{tid}/children").read_text().split()
                todo.extend(int(k) for k in kids)
        except OSError:
            pass
    return out


def rss_pss(pids: list[int]) -> tuple[int, int]:
    rss = pss = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Rss:"):
                    rss += int(line.split()[1]) * 1024
                elif line.startswith("Pss:"):
                    pss += int(line.split()[1]) * 1024
        except OSError:
            pass
    return rss, pss


class Load:
    """Bounded request mix on its own threads; records TTFT and errors with timestamps."""

    def __init__(self, base: str, seed: int, prompts: list[str], stop_at: float) -> None:
        self.base, self.prompts, self.stop_at = base, prompts, stop_at
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.events: list[dict[str, Any]] = []
        self.chats: list[list[dict[str, str]]] = []

    def pick(self) -> dict[str, Any]:
        with self.lock:
            r = self.rng.random()
            if r < 0.6:  # shared system prompt, short question
                sp = self.rng.choice(self.prompts)
                q = " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(3, 12)))
                return {"kind": "chat", "messages": [{"role": "system", "content": sp},
                                                     {"role": "user", "content": q}]}
            if r < 0.85:  # a chat that grows turn by turn
                if not self.chats or self.rng.random() < 0.2 or len(self.chats[-1]) > 12:
                    self.chats.append([{"role": "system", "content": self.rng.choice(
                        self.prompts)}])
                chat = self.rng.choice(self.chats)
                chat.append({"role": "user", "content": " ".join(
                    self.rng.choice(WORDS) for _ in range(self.rng.randint(4, 20)))})
                return {"kind": "chat", "messages": list(chat), "chat": chat}
            n = self.rng.randint(200, 900)  # a one-off prompt: a miss
            return {"kind": "completion", "prompt": " ".join(
                self.rng.choice(WORDS) for _ in range(n))}

    def one(self, client: httpx.Client) -> None:
        job = self.pick()
        stream = self.rng.random() < 0.7
        body: dict[str, Any] = {"max_tokens": 24, "temperature": 0.7, "stream": stream}
        if job["kind"] == "chat":
            url, body["messages"] = "/v1/chat/completions", job["messages"]
        else:
            url, body["prompt"] = "/v1/completions", job["prompt"]
        t0 = time.monotonic()
        ev: dict[str, Any] = {"t": t0, "ok": False, "ttft": None, "restored": 0}
        try:
            if stream:
                with client.stream("POST", self.base + url, json=body, timeout=300) as r:
                    r.raise_for_status()
                    text = []
                    for line in r.iter_lines():
                        if not line.startswith("data: {"):
                            continue
                        chunk = json.loads(line[6:])
                        if ev["ttft"] is None:
                            ev["ttft"] = time.monotonic() - t0
                            ev["restored"] = chunk.get("shmkv", {}).get("restored_tokens", 0)
                        ch = chunk["choices"][0] if chunk.get("choices") else {}
                        text.append((ch.get("delta") or {}).get("content") or ch.get("text")
                                    or "")
                    reply = "".join(text)
            else:
                r = client.post(self.base + url, json=body, timeout=300)
                r.raise_for_status()
                ev["ttft"] = time.monotonic() - t0  # whole request: upper bound
                ev["restored"] = int(r.headers.get("x-shmkv-restored-tokens", 0))
                data = r.json()
                ch = data["choices"][0]
                reply = (ch.get("message") or {}).get("content") or ch.get("text") or ""
            ev["ok"] = True
            if "chat" in job:
                with self.lock:
                    job["chat"].append({"role": "assistant", "content": reply})
        except (httpx.HTTPError, ValueError, KeyError) as e:
            ev["error"] = f"{type(e).__name__}: {e}"[:200]
        ev["total"] = time.monotonic() - t0
        with self.lock:
            self.events.append(ev)

    def run(self) -> None:
        with httpx.Client(limits=httpx.Limits(max_keepalive_connections=0)) as client:
            while time.monotonic() < self.stop_at:
                self.one(client)


def shmkv_stats(env: dict[str, str]) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "shmkv.cli", "stats", "--json"], env=env,
                         capture_output=True, text=True, timeout=30)
    return json.loads(out.stdout) if out.returncode == 0 else {}


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = res["samples"]
    t = [x["t"] for x in s]
    fig, ax = plt.subplots(2, 2, figsize=(12, 7))
    ax[0][0].plot(t, [x["rss"] / 2**30 for x in s], label="RSS (sum)")
    ax[0][0].plot(t, [x["pss"] / 2**30 for x in s], label="PSS (sum, arena once)")
    ax[0][0].set_ylabel("GiB")
    ax[0][0].set_title("server memory")
    ax[0][0].legend()
    ax[0][1].plot(t, [x["arena_used"] / 2**20 for x in s], label="arena used (MiB)")
    ax2 = ax[0][1].twinx()
    ax2.plot(t, [100 * x["fragmentation"] for x in s], color="tab:red", label="fragmentation %")
    ax[0][1].set_title("arena")
    ax[0][1].legend(loc="upper left")
    ax2.legend(loc="lower right")
    ax[1][0].plot(t, [100 * x["hit_rate"] for x in s], label="hit rate % (cumulative)")
    ax[1][0].plot(t, [x["errors"] for x in s], label="errors (cumulative)")
    ax[1][0].set_title("cache hits and errors")
    ax[1][0].legend()
    ax[1][1].plot(t, [x["ttft_p50"] for x in s], label="TTFT p50 (window)")
    ax[1][1].plot(t, [x["ttft_p90"] for x in s], label="TTFT p90 (window)")
    ax[1][1].set_ylabel("s")
    ax[1][1].set_title("time to first token")
    ax[1][1].legend()
    for a in ax.flat:
        a.set_xlabel("seconds")
    fig.suptitle(f"shmkv soak: {res['config']['duration']} s, {res['config']['workers']} "
                 f"workers, concurrency {res['config']['concurrency']}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


@click.command()
@click.option("--duration", default=300.0, show_default=True, help="Seconds of load.")
@click.option("--concurrency", default=4, show_default=True)
@click.option("--workers", default=4, show_default=True)
@click.option("--size", default="512M", show_default=True, help="Arena size (small on purpose"
              ": the soak should evict).")
@click.option("--prompts", default=8, show_default=True, help="Shared system prompts.")
@click.option("--interval", default=5.0, show_default=True, help="Seconds between samples.")
@click.option("--model", default=None, help="GGUF [default: Gemma 3 270M].")
@click.option("--out", default=str(HERE / "out"), show_default=True)
def main(duration: float, concurrency: int, workers: int, size: str, prompts: int,
         interval: float, model: str | None, out: str) -> None:
    """Run `shmkv serve` under mixed load and record its health over time."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    model = model or str(gemma_model())
    name = f"soak{os.getpid()}"
    port = free_port()
    env = {**os.environ, "SHMKV_NAME": name, "SHMKV_SOCKET": f"/tmp/{name}.sock",
           "SHMKV_MODEL": model, "SHMKV_WORKERS": str(workers), "SHMKV_PORT": str(port),
           "SHMKV_THREADS": "1", "SHMKV_SIZE": size, "SHMKV_LOG_LEVEL": "warning"}
    outdir = Path(out)
    outdir.mkdir(parents=True, exist_ok=True)
    logf = open(outdir / "soak-server.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "shmkv.cli", "serve"], env=env,
                            stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        else:
            raise click.ClickException("server did not come up; see soak-server.log")
        rng = random.Random(1)
        sps = [system_prompt(rng, rng.randint(500, 900)) for _ in range(prompts)]
        t_start = time.monotonic()
        load = Load(base, 2, sps, t_start + duration)
        threads = [threading.Thread(target=load.run, daemon=True) for _ in range(concurrency)]
        for th in threads:
            th.start()
        samples = []
        while any(th.is_alive() for th in threads):
            time.sleep(interval)
            now = time.monotonic()
            pids = tree_pids(proc.pid)
            rss, pss = rss_pss(pids)
            st = shmkv_stats(env)
            with load.lock:
                evs = list(load.events)
            window = [e["ttft"] for e in evs if e["ttft"] is not None and e["t"] > now - 30]
            free = st.get("bytes_capacity", 0) - st.get("bytes_used", 0)
            lookups = st.get("hits", 0) + st.get("misses", 0)
            sample = {
                "t": round(now - t_start, 1), "rss": rss, "pss": pss,
                "arena_used": st.get("bytes_used", 0), "entries": st.get("entries", 0),
                "fragmentation": round(1 - st.get("bytes_free_largest", 0) / free, 4)
                if free > 0 else 0.0,
                "hit_rate": round(st.get("hits", 0) / lookups, 4) if lookups else 0.0,
                "evictions": st.get("evictions", 0),
                "requests": len(evs), "errors": sum(1 for e in evs if not e["ok"]),
                "ttft_p50": round(pct(window, 0.5), 3), "ttft_p90": round(pct(window, 0.9), 3),
            }
            samples.append(sample)
            log.info("t=%5.0fs req=%d err=%d hit=%.0f%% arena=%.0fMiB frag=%.0f%% "
                     "PSS=%.2fGiB TTFT p50=%.2fs", sample["t"], sample["requests"],
                     sample["errors"], 100 * sample["hit_rate"], sample["arena_used"] / 2**20,
                     100 * sample["fragmentation"], pss / 2**30, sample["ttft_p50"])
        for th in threads:
            th.join()
        evs = load.events
        ttfts = [e["ttft"] for e in evs if e["ttft"] is not None]
        res = {
            "config": {"duration": duration, "concurrency": concurrency, "workers": workers,
                       "size": size, "prompts": prompts, "model": Path(model).name},
            "machine": machine_info(),
            "summary": {"requests": len(evs), "errors": sum(1 for e in evs if not e["ok"]),
                        "error_examples": [e["error"] for e in evs if not e["ok"]][:5],
                        "ttft_p50": round(pct(ttfts, 0.5), 3),
                        "ttft_p99": round(pct(ttfts, 0.99), 3),
                        "rss_first": samples[0]["rss"] if samples else 0,
                        "rss_last": samples[-1]["rss"] if samples else 0,
                        "final_stats": shmkv_stats(env)},
            "samples": samples,
        }
        (outdir / "soak.json").write_text(json.dumps(res, indent=2))
        plot(res, outdir / "soak.png")
        s = res["summary"]
        click.echo(f"{s['requests']} requests, {s['errors']} errors, TTFT p50 "
                   f"{s['ttft_p50']} s p99 {s['ttft_p99']} s, RSS {s['rss_first'] / 2**30:.2f}"
                   f" -> {s['rss_last'] / 2**30:.2f} GiB; wrote {outdir / 'soak.json'}")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        logf.close()


if __name__ == "__main__":
    main()
