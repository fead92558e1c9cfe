"""Soak of the whole system (docs/benchmarks.md, Soak): two ``shmkv serve`` nodes, each its own
supervisor, arena, port and ``--persist`` tmpfs, sharing one ``--remote`` redis-server, under a
mixed load (completions, chats, two tenants by ``cache_salt``, streams cut at random) while the
faults of SCHEDULE run. Judged: greedy spot checks against a cold run, failed requests against
MAY_FAIL, descriptors and memory against SLACK, leases, ``/metrics`` against ``shmkv stats``;
exits 1 on a problem. tests/chaos/test_soak_system.py runs it for a minute on a tiny model."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import click
import common
import httpx
import psutil
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families as parse

from shmkv.core.config import resolve
from shmkv.core.errors import ShmkvError
from shmkv.core.metrics import StatsCollector
from shmkv.serving.model_settings import load_llama

log = logging.getLogger("soak")
#: (fault, node, start as a share of --duration); each waits for the one before to heal
SCHEDULE = [("kill_worker", 0, 0.08), ("kill_supervisor", 0, 0.18), ("sigstop_worker", 1, 0.3),
            ("restart_redis", -1, 0.42), ("fill_persist", 0, 0.54), ("reboot", 1, 0.66),
            ("sighup", 0, 0.8)]  # fmt: skip
#: The rule: a request may fail only if it was in flight on the node one of these faults hit,
#: from the fault's start to GRACE s after it healed: any request for a killed worker and a
#: rebooted node. The other faults are promised to cost no request (a reload's old workers
#: send their streams to the end: workers/compat.streams_run_through_a_graceful_stop).
MAY_FAIL, GRACE = {"kill_worker": "any", "reboot": "any"}, 5.0
#: growth allowed from start to end, per node and role (its largest process): descriptors
#: + SLACK_FDS; RssAnon (what a leak grows; arena and model are shared pages) x 1.25 + 64 MiB
SLACK_FDS, SLACK_MEM = 16, (1.25, 64 << 20)
WAIT = 120.0  #: seconds a fault may take to show its effect and to heal
SALTS, QUESTIONS = ("tenant-a", "tenant-b"), ["Who sits where?", "Summarise.", "Why?", "Next?"]


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(common.WORDS) for _ in range(n))


class Node(common.Server):
    """One ``shmkv serve`` (its supervisor, gunicorn, workers); booted again by a reboot."""

    def __init__(self, tag: str, work: Path, o: Any, remote: str) -> None:
        super().__init__("", work, o.workers)
        self.tag, self.persist, self.starts = tag, work / f"persist-{tag}", 0
        name = f"soak{tag}{uuid.uuid4().hex[:6]}"
        sock = str(work / f"{name}.sock")  # (serve starts the supervisor: no child of ours)
        self.sup = common.Supervisor(name, sock, None)  # type: ignore[arg-type]
        env = dict(NAME=name, SOCKET=sock, PORT=self.port, MODEL=o.model, THREADS=1,
                   WORKERS=o.workers, N_CTX=o.n_ctx, SIZE=o.size, PERSIST=self.persist,
                   PERSIST_SIZE=o.persist_size, REMOTE=remote, EXACT=str(o.exact).lower(),
                   LOG_LEVEL="info")  # fmt: skip
        self.env = common.child_env({f"SHMKV_{k}": str(v) for k, v in env.items()})

    def boot(self) -> None:
        self.starts += 1
        self.name = f"node-{self.tag}-{self.starts}"  # (its log's name)
        self.start([sys.executable, "-m", "shmkv", "serve"], self.env)
        self.wait_up()

    def procs(self) -> dict[str, list[psutil.Process]]:
        out: dict[str, list[psutil.Process]] = {"supervisor": [], "worker": []}
        for p in self.child.children():
            with contextlib.suppress(psutil.Error):
                if "supervise" in (cmd := " ".join(p.cmdline())):
                    out["supervisor"].append(p)
                elif "gunicorn" in cmd:
                    out["worker"] += p.children()
        return out

    def wait_up(self, gone: int = 0) -> None:
        """One supervisor answering, each worker (``gone`` not one) loaded, /v1/models up."""

        def ready() -> bool:
            ps, text = self.procs(), self.child.log_tail(1 << 26)
            pids = [p.pid for p in ps["worker"]]
            if len(ps["supervisor"]) != 1 or len(pids) != self.workers or gone in pids:
                return False
            if not all(f"worker {p} loaded" in text for p in pids) or not self.sup.answers():
                return False
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(self.base + "/v1/models", timeout=10).status_code == 200
            return False

        self.child.wait_for(ready, 300)

    def stats(self) -> dict[str, Any]:
        with contextlib.suppress(ShmkvError):
            return self.sup.stats()
        return {}

    def sample(self) -> dict[str, dict[str, int]]:
        """Per role, the largest descriptor count, RSS and RssAnon among its processes."""
        out = {}
        for role, ps in self.procs().items():
            rows = [(0, 0, 0)]
            for p in ps:
                with contextlib.suppress(psutil.Error, KeyError):
                    anon = common.status_rss(p.pid)["RssAnon:"]
                    rows.append((p.num_fds(), p.memory_info().rss, anon))
            out[role] = {k: max(r[i] for r in rows) for i, k in enumerate(("fds", "rss", "anon"))}
        return out


def request(client: httpx.Client, url: str, body: dict[str, Any], cut: int) -> tuple[str, str]:
    """The text and the error ("" if none; "cut": a stream we closed after ``cut`` chunks)."""
    if body.get("stream"):
        r = common.stream_completion(client, url, body, cut)
        return r["text"], (r["error"] or "")[:200]
    try:
        r = client.post(url, json=body)
        if r.status_code != 200:
            return "", f"HTTP {r.status_code}: {r.text[:200]}"
        ch = r.json()["choices"][0]
        return ch.get("text") or (ch.get("message") or {}).get("content") or "", ""
    except (httpx.HTTPError, ValueError, KeyError, IndexError, OSError) as e:
        return "", f"{type(e).__name__}: {e}"[:200]


class Load:
    """The mixed load, each client thread on one node, with greedy spot checks."""

    def __init__(self, nodes: list[Node], o: Any, systems: list[str], spots: list[Any]) -> None:
        self.nodes, self.o, self.systems, self.spots = nodes, o, systems, spots
        self.events, self.lock, self.stop = [], threading.Lock(), threading.Event()

    def one(self, client: httpx.Client, node: Node, rng: random.Random, chat: list[Any],
            spot: int | None = None) -> None:  # fmt: skip
        r, stream = rng.random(), rng.random() < 0.6
        body = dict(max_tokens=self.o.max_tokens, cache_salt=rng.choice(SALTS), stream=stream)
        body["temperature"], cut = 0.7, rng.randint(1, 4) if stream and rng.random() < 0.3 else 0
        if spot is not None or r < 0.15:  # a spot check: greedy, never cut
            spot, cut = rng.randrange(len(self.spots)) if spot is None else spot, 0
            body |= {**self.spots[spot][0], "temperature": 0.0, "top_k": 1, "repeat_penalty": 1.0}
        elif r < 0.55:
            body["prompt"] = rng.choice(self.systems) + " " + rng.choice(QUESTIONS)
        elif r < 0.8:  # a chat that grows turn by turn
            if len(chat) > 8 or not chat:
                chat[:] = [{"role": "system", "content": rng.choice(self.systems)}]
            body["messages"] = [*chat, {"role": "user", "content": words(rng, 6)}]
        else:  # a one-off prompt: a miss, a new state for both tiers
            body["prompt"] = words(rng, self.o.system_words // 2)
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        ev = {"node": node.tag, "t0": time.monotonic(), "stream": stream, "path": path}
        text, err = request(client, node.base + path, body, cut)
        ev |= {"t1": time.monotonic(), "cut": err == "cut", "error": "" if err == "cut" else err}
        if spot is not None and not err:
            ev |= {"wrong": text != self.spots[spot][1], "spot": spot, "got": text}
        if "messages" in body and not err:
            chat[:] = [*body["messages"], {"role": "assistant", "content": text}]
        with self.lock:
            self.events.append(ev)
        time.sleep(0.2 if ev["error"] else 0)  # (a node that is down refuses at once)

    def run(self, i: int) -> None:
        rng, chat, node = random.Random(i), [], self.nodes[i % len(self.nodes)]
        with common.http_client(600) as client:
            while not self.stop.is_set():
                self.one(client, node, rng, chat)


class Faults:
    """The faults of SCHEDULE, each with its start, its end (healed) and its evidence."""

    def __init__(self, nodes: list[Node], port: int, work: Path, o: Any, tmpfs: bool) -> None:
        self.nodes, self.port, self.work, self.o, self.tmpfs = nodes, port, work, o, tmpfs
        self.redis = common.redis_server(port, work)
        self.rng, self.log, count = random.Random(7), [], common.tokenizer(Path(o.model))
        more = lambda _: " " + words(self.rng, 8)  # noqa: E731
        self.long = lambda: common.fill_to(int(o.n_ctx * 0.8), lambda t: len(count(t)), "", more)

    def run(self, t0: float, round_: int = 0) -> None:
        for kind, n, share in SCHEDULE:
            time.sleep(max(0.0, t0 + share * self.o.duration - time.monotonic()))
            ev = {"fault": kind, "node": "ab"[n] if n >= 0 else "*", "round": round_}
            ev["start"] = time.monotonic()
            log.info("fault: %s on node %s", kind, ev["node"])
            try:
                ev |= getattr(self, kind)(self.nodes[n])
            except Exception as e:  # a problem: the soak goes on
                log.exception("fault %s", kind)
                ev["error"] = f"{type(e).__name__}: {e}"[:300]
            self.log.append(ev | {"end": time.monotonic()})

    def kill_worker(self, node: Node) -> dict[str, Any]:
        os.kill(pid := self.rng.choice(node.procs()["worker"]).pid, signal.SIGKILL)
        node.wait_up(gone=pid)
        return {"ok": True, "killed": pid}

    def kill_supervisor(self, node: Node) -> dict[str, Any]:
        os.kill(pid := node.procs()["supervisor"][0].pid, signal.SIGKILL)
        node.wait_up(gone=pid)  # serve starts another; the workers reattach
        n = node.workers
        new = lambda: (st := node.stats()).get("pid", pid) != pid and st["workers_attached"] >= n  # noqa: E731
        common.poll(new, WAIT, "workers reattached")
        return {"ok": True, "killed": pid, "new": node.stats()["pid"]}

    def sigstop_worker(self, node: Node) -> dict[str, Any]:
        """A long prompt sent: the worker whose CPU time moves first is stopped a while."""
        cpu, got = {p.pid: p for p in node.procs()["worker"]}, []
        t0 = {pid: sum(p.cpu_times()[:2]) for pid, p in cpu.items()}
        with common.http_client(600) as client:
            url, body = node.base + "/v1/completions", {"prompt": self.long(), "max_tokens": 4}
            th = threading.Thread(target=lambda: got.append(request(client, url, body, 0)))
            th.start()
            busy = lambda: next((q for q, p in cpu.items() if sum(p.cpu_times()[:2]) > t0[q]), 0)  # noqa: E731
            os.kill(pid := common.poll(busy, WAIT, "a busy worker", every=0.005), signal.SIGSTOP)
            time.sleep(self.o.hold)  # the fault itself: a worker stopped this long
            os.kill(pid, signal.SIGCONT)
            th.join(600)
        return {"ok": not got[0][1], "stopped": pid, "long_request": got[0][1] or "answered"}

    def restart_redis(self, _: Node) -> dict[str, Any]:
        self.redis.stop(kill=True)
        time.sleep(self.o.hold)  # the fault itself: Redis down this long
        self.redis = common.redis_server(self.port, self.work)
        for n in self.nodes:
            common.poll(lambda n=n: n.stats().get("remote_on") == 1, WAIT, "the remote back")
        return {"ok": True, "remote_errors": [n.stats()["remote_errors"] for n in self.nodes]}

    def fill_persist(self, node: Node) -> dict[str, Any]:
        """Full until a commit fails, then emptied until one is written (long one-off
        prompts meanwhile: new states, too big for the pages LMDB freed)."""
        if not self.tmpfs:
            return {"ok": True, "skipped": "no tmpfs (needs root)"}
        errors = lambda: sum(node.stats()["persist_errors"].values())  # noqa: E731
        before, filler = errors(), node.persist / "filler"
        with open(filler, "wb") as f, contextlib.suppress(OSError):
            while f.write(b"\0" * (1 << 20)):
                f.flush()

        def push(until: Any) -> bool:
            deadline = time.monotonic() + WAIT
            with common.http_client(600) as client:
                while not until() and time.monotonic() < deadline:
                    request(client, node.base + "/v1/completions", {"prompt": self.long()}, 0)
            return bool(until())

        full = push(lambda: errors() > before)
        filler.unlink()
        n = node.stats()["persisted"]
        wrote = push(lambda: node.stats()["persisted"] > n)
        return {"ok": full and wrote, "persist_errors": node.stats()["persist_errors"]}

    def reboot(self, node: Node) -> dict[str, Any]:
        rc, left = node.child.stop(), list(common.SHM.glob(f"shmkv-{node.sup.name}*"))
        for p in left:  # (a reboot empties /dev/shm)
            p.unlink()
        node.boot()
        refilled = lambda: (st := node.stats()) and not st["refilling"] and st  # noqa: E731
        st = common.poll(refilled, WAIT, "refill")
        return {"ok": rc == 0 and not left, "rc": rc, "refilled": st["refilled"]}

    def sighup(self, node: Node) -> dict[str, Any]:
        """systemd's reload: gunicorn replaces its workers, the supervisor logs its stats."""
        old = {p.pid for p in node.procs()["worker"]}
        os.kill(node.child.pid, signal.SIGHUP)
        common.poll(lambda: not old & {p.pid for p in node.procs()["worker"]}, WAIT, "reload")
        node.wait_up()
        return {"ok": node.child.proc.poll() is None, "old_workers": sorted(old)}


def greedy_refs(o: Any, env: dict[str, str], bodies: list[Any]) -> list[str]:
    """Each spot check's text from a cold plain Llama loaded as a served worker loads it."""
    out, kw = [], dict(max_tokens=o.max_tokens, temperature=0.0, top_k=1, repeat_penalty=1.0)
    for body in bodies:
        llm = load_llama(resolve("serve", env=env), o.model, threads=1)
        if "messages" in body:
            msg = llm.create_chat_completion(body["messages"], **kw)["choices"][0]["message"]
            out.append(msg["content"] or "")
        else:
            out.append(llm.create_completion(body["prompt"], **kw)["choices"][0]["text"])
        llm.close()
    return out


def metrics_vs_stats(node: Node) -> list[Any]:
    """The counters of a /metrics scrape that differ from `shmkv stats --json`'s, read before
    and after it (again until both agree: nothing moved meanwhile)."""

    def counters(text: str) -> dict[str, float]:
        fams = [f for f in parse(text) if f.type in ("counter", "histogram")]
        return {f"{s.name}{sorted(s.labels.items())}": s.value for f in fams for s in f.samples}

    def expected() -> dict[str, float]:
        cmd = [sys.executable, "-m", "shmkv", "stats", "--json"]
        st = json.loads(subprocess.run(cmd, env=node.env, capture_output=True, check=True).stdout)
        (reg := CollectorRegistry()).register(StatsCollector(lambda: st))
        return counters(generate_latest(reg).decode()) | {"puts (by hand)": st["puts"]}

    for _ in range(20):
        want, text = expected(), httpx.get(node.base + "/metrics", timeout=60).text
        if want == expected():
            break
    got = counters(text)
    got["puts (by hand)"] = got.get("shmkv_puts_total[]")  # (not only through the collector)
    return [(k, got.get(k), want.get(k)) for k in {*got, *want} if got.get(k) != want.get(k)]


def judge(res: dict[str, Any], evs: list[dict[str, Any]]) -> list[str]:
    """The summary, and the problems: wrong outputs, failures no fault explains, faults
    without their effect, growth, leases held, /metrics != stats, files left."""
    windows = [(f["node"], f["start"], f["end"] + GRACE, MAY_FAIL[f["fault"]])
               for f in res["faults"] if f["fault"] in MAY_FAIL]  # fmt: skip
    failed, wrong = [e for e in evs if e["error"]], [e for e in evs if e.get("wrong")]
    loose = [e for e in failed if not any(n == e["node"] and e["t0"] <= b and e["t1"] >= a
             and (what == "any" or e["stream"]) for n, a, b, what in windows)]  # fmt: skip
    res["summary"] = dict(requests=len(evs), served=len(evs) - len(failed), failed=len(failed),
                          failed_unexplained=len(loose), cut=sum(e["cut"] for e in evs),
                          spot_checks=sum("wrong" in e for e in evs), wrong=len(wrong),
                          examples=(loose + wrong)[:5])  # fmt: skip
    problems = [f"{len(wrong)} wrong outputs"] * bool(wrong)
    problems += [f"{len(loose)} failed requests no fault explains"] * bool(loose)
    problems += [f"fault {f['fault']}: {f}" for f in res["faults"] if not f.get("ok")]
    for n, role, (a, b) in ((n, r, v.values()) for n, rs in res["resources"].items()
                            for r, v in rs.items()):  # fmt: skip
        if b["fds"] > a["fds"] + SLACK_FDS or b["anon"] > a["anon"] * SLACK_MEM[0] + SLACK_MEM[1]:
            problems.append(f"node {n} {role} grew: {a} -> {b}")
    for n, st in res["final_stats"].items():
        if st["leases_active"] or st["claims_held"]:
            problems.append(f"node {n}: {st['leases_active']} leases, {st['claims_held']} claims")
    problems += [f"node {n}: /metrics != stats: {m}" for n, m in res["metrics"].items() if m]
    return problems + [f"left behind: {p}" for p in res["leftovers"]]


@common.command("soak_system", model=True)
@common.option("--duration", default=600.0, help="Seconds of load; the faults spread over it.")
@common.option(
    "--rounds",
    default=1,
    help="Soaks in a row, each --duration with every fault "
    "(resources sampled at each one's end: is memory flat from one to the next).",
)
@common.option("--workers", default=2, help="Workers per node.")
@common.option("--concurrency", default=2, help="Client threads per node.")
@common.option("--size", default="256M", help="Arena size per node.")
@common.option("--persist-tmpfs", default="384m", help="Each node's --persist tmpfs.")
@common.option("--persist-size", default="128M")
@common.option("--n-ctx", default=4096)
@common.option("--system-words", default=500, help="Words per shared system prompt.")
@common.option("--max-tokens", default=16)
@common.option("--hold", default=8.0, help="Seconds a worker stays stopped, Redis down.")
@common.option("--exact/--no-exact", default=True, help="Serve --exact: hits bit for bit cold.")
def main(report: common.Report, o: Any) -> None:
    """Two `shmkv serve` nodes, one Redis, a mixed load and faults on a schedule."""
    o.model, rng = str(o.model), random.Random(1)
    logging.getLogger("shmkv.core.client").setLevel(logging.ERROR)  # (our polls in faults)
    systems = [f"Rules of house {i}: " + words(rng, o.system_words) for i in range(4)]
    bodies = [{"prompt": f"{s} {q}"} for s in systems[:2] for q in QUESTIONS[:2]]
    bodies += [{"messages": [{"role": "system", "content": s}, {"role": "user", "content": q}]}
               for s in systems[2:] for q in QUESTIONS[:2]]  # fmt: skip
    res: dict[str, Any] = {"config": {**vars(o), "model": Path(o.model).name}}
    with contextlib.ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="shmkv-soak-")))
        logs = report.out / "soak_system-logs"  # (the nodes' and Redis's logs, kept)
        shutil.rmtree(logs, ignore_errors=True)
        keep = shutil.ignore_patterns("*.sock", "*.mdb", "filler")
        stack.callback(lambda: shutil.copytree(work, logs, ignore=keep))
        tmpfs = []  # each node's --persist: a tmpfs of --persist-tmpfs, a plain directory where
        for path in (work / f"persist-{t}" for t in "ab"):  # we cannot mount one (not root)
            path.mkdir()
            mount = ["mount", "-t", "tmpfs", "-o", f"size={o.persist_tmpfs},mode=0700", "tmpfs"]
            if ok := subprocess.run([*mount, str(path)], capture_output=True).returncode == 0:
                stack.callback(subprocess.run, ["umount", "-l", str(path)], capture_output=True)
            tmpfs.append(ok)
        faults = Faults([], common.free_port(), work, o, all(tmpfs))  # (Redis keeps its port)
        stack.callback(lambda: faults.redis.stop(kill=True))
        remote = f"redis://127.0.0.1:{faults.port}/0"
        faults.nodes = nodes = [Node(t, work, o, remote) for t in "ab"]
        spots = list(zip(bodies, greedy_refs(o, nodes[0].env, bodies), strict=True))
        for node in nodes:
            stack.callback(node.stop)
            node.boot()
        load = Load(nodes, o, systems, spots)
        for node, i in ((n, i) for n in nodes for i in range(len(spots))):  # warm-up: every
            with common.http_client(600) as client:  # spot check once on each node
                load.one(client, node, random.Random(i), [], spot=i)
        start, t0 = {n.tag: n.sample() for n in nodes}, time.monotonic()
        n = o.concurrency * len(nodes)  # client threads, each on one node
        clients = threading.Thread(target=common.in_threads, args=(n, load.run), daemon=True)
        clients.start()
        rounds = []  # each round: SCHEDULE's faults over --duration, then its resources
        for r in range(o.rounds):
            t_r = t0 if r == 0 else time.monotonic()
            faults.run(t_r, r)
            while time.monotonic() < max(t_r + o.duration, faults.log[-1]["end"] + o.duration / 10):
                time.sleep(0.5)  # (traffic on after the last fault)
            rounds.append({n.tag: n.sample() for n in nodes})
            log.info("round %d of %d ended: %s", r + 1, o.rounds, rounds[-1])
        load.stop.set()
        clients.join(900)
        for n in nodes:  # the tiers' queues written, no lease held
            idle = ("persist_queue", "remote_queue", "leases_active")
            common.poll(lambda n=n, k=idle: not any(map(n.stats().get, k)), WAIT, "idle")
        res |= {"wall_s": round(time.monotonic() - t0, 1), "faults": faults.log}
        res["resources"] = {n.tag: {r: {"start": start[n.tag][r], "end": v}
                                    for r, v in n.sample().items()} for n in nodes}  # fmt: skip
        res["rounds"] = rounds
        res["metrics"] = {n.tag: metrics_vs_stats(n) for n in nodes}
        keys = "leases_active claims_held calls hits misses puts evictions persisted "
        keys += "persist_errors refilled remote_written remote_fetched remote_errors"
        res["final_stats"] = {n.tag: common.pick(n.stats(), keys) for n in nodes}
        for node in nodes:
            node.stop()
        res["leftovers"] = [str(p) for n in nodes for p in common.SHM.glob(f"shmkv-{n.sup.name}*")]
    res["problems"] = judge(res, load.events)
    report.write({**report.header(), **res, "events": load.events}, None)
    s = res["summary"]
    click.echo(f"{s['requests']} requests: {s['served']} served, {s['failed']} failed "
               f"({s['failed_unexplained']} unexplained), {s['cut']} streams cut by us; "
               f"{s['spot_checks']} spot checks, {s['wrong']} wrong")  # fmt: skip
    for f in res["faults"]:
        rest = {k: v for k, v in f.items() if k not in ("fault", "node", "start", "end")}
        click.echo(f"  {f['fault']:<16} node {f['node']} {f['end'] - f['start']:6.1f} s  {rest}")
    for n, rs in res["resources"].items():
        click.echo("\n".join(f"  node {n} {r}: {v['start']} -> {v['end']}" for r, v in rs.items()))
    for n, rs in res["resources"].items():  # RssAnon: a process's own memory (not the arena's
        for role, v in rs.items():  # nor the model's pages, which are shared)
            ends = [v["start"]["anon"], *(x[n][role]["anon"] for x in res["rounds"])]
            click.echo(f"  node {n} {role} RssAnon at start, each round's end: "
                       + ", ".join(map(common.fmt_b, ends)))  # fmt: skip
    if res["problems"]:
        raise click.ClickException("problems:\n" + "\n".join(res["problems"]))
    click.echo("no problems")


if __name__ == "__main__":
    main()
