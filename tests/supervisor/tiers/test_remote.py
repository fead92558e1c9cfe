"""``--remote``: two supervisors (two "nodes", two arenas) share states through one Redis.

Real ``redis-server`` processes on loopback ports (a single one, and a three-node
Redis Cluster), real supervisors, real llama.cpp on the tiny model: a worker on node B
restores what node A published and its tokens equal a cold run's; Redis killed in the
middle of puts and restarted from its append-only file never hands out a partial
record and neither node stops serving; a record damaged in Redis is rejected.
"""

from __future__ import annotations

import re
import select
import shutil
import signal
import socket
import struct
import subprocess
import threading
import time
import uuid
from pathlib import Path

import llama_cpp
import numpy as np
import pytest
import redis
import xxhash

from shmkv.core.keys import chain_digests, remote_id
from tests.support.blobs import CHUNK, blob, each_record
from tests.support.llama_workers import SYSTEM, completion, run_worker, texts
from tests.support.redis import (
    NO_REDIS,
    REDIS,
    RedisProc,
    fetch_blob,
    key_file,
    put_written,
    received_by,
    redis_keys,
    sent_by,
    settled,
    written,
)
from tests.support.servers import free_port
from tests.support.supervisors import Sup, no_internal_errors, wait_for_socket
from tests.support.users import GROUP, publish_as, system_user
from tests.support.waiting import wait_until

pytestmark = pytest.mark.skipif(REDIS is None, reason=NO_REDIS)

PROMPT = SYSTEM + " Question: which mat does the cat on the other node sit on?"


def cross_node(make_supervisor, models, url: str, *extra: str) -> tuple[Sup, Sup, dict]:
    """Node A publishes PROMPT, a fresh worker on node B restores it: greedy equals cold."""
    cold = run_worker(None, models["seed0"], [completion(PROMPT)], mode="cold")
    a = make_supervisor("--size", "64M", "--remote", url, *extra)
    b = make_supervisor("--size", "64M", "--remote", url, *extra)
    first = run_worker(a, models["seed0"], [completion(PROMPT)])
    assert texts(first) == texts(cold)
    written(a)
    got = run_worker(b, models["seed0"], [completion(PROMPT)])
    assert texts(got) == texts(cold)
    last = got["results"][0]["last"]
    assert last["remote"] == "fetched", last
    assert last["hit"] and last["tokens_restored"] >= last["prompt_tokens"] - 1, last
    assert got["totals"]["remote_restored"] == 1
    st = b.stats()
    assert st["remote_fetched"] == 1 and st["remote_written"] == 0, st  # (not written back)
    return a, b, st


def test_node_b_restores_what_node_a_published(make_supervisor, models, redis_server):
    a, b, _ = cross_node(make_supervisor, models, redis_server.url)
    # the next worker on B hits B's arena without asking Redis again
    again = run_worker(b, models["seed0"], [completion(PROMPT)])
    assert again["results"][0]["last"]["remote"] == "" and again["results"][0]["last"]["hit"]
    no_internal_errors(a, b)


def test_node_b_restores_the_system_prompt_another_question_shares(
    make_supervisor, models, redis_server
):
    """One system prompt, a question per node, on a model without sliding windows (which
    publishes no checkpoint at the shared prefix: locally it cuts a longer state back).
    Node B's own question must restore the shared system prompt from node A's record
    (it used to be answered "none": only records that are a whole prefix were fetched)."""
    mine = SYSTEM + " Question: which mat does the second cat sit on today?"
    cold = run_worker(None, models["seed0"], [completion(mine)], mode="cold")
    a = make_supervisor("--size", "64M", "--remote", redis_server.url)
    b = make_supervisor("--size", "64M", "--remote", redis_server.url)
    run_worker(a, models["seed0"], [completion(PROMPT)])
    written(a)
    got = run_worker(b, models["seed0"], [completion(mine)])
    assert texts(got) == texts(cold)
    last = got["results"][0]["last"]
    assert last["remote"] == "fetched", last
    # (the questions part after a dozen tokens; everything before is restored)
    assert last["hit"] and last["tokens_restored"] >= last["prompt_tokens"] - 16, last
    assert got["totals"]["remote_restored"] == 1
    st = b.stats()
    assert st["remote_fetched"] == 1 and st["remote_fetch_none"] == 0, st
    no_internal_errors(a, b)


def test_node_b_takes_the_chunks_it_holds_from_its_arena_not_from_redis(
    make_supervisor, models, redis_server
):
    """Node A answers two questions on one system prompt (the second after a story of a
    few chunks); node B answers them too. B fetches A's first state whole, and for the
    second only the groups its arena lacks (the system prompt's come from its arena:
    llama.cpp's real state format), and restores it once (not the first turn's state
    first); greedy text equals cold for both."""
    story = " ".join(f"On day {i} the second cat chose mat {i % 3}." for i in range(30))
    second = SYSTEM + " Story: " + story + " Question: which mat did it choose last?"
    jobs = [completion(PROMPT), completion(second)]
    cold = run_worker(None, models["seed0"], jobs, mode="cold")
    a = make_supervisor("--size", "64M", "--remote", redis_server.url)
    b = make_supervisor("--size", "64M", "--remote", redis_server.url)
    run_worker(a, models["seed0"], jobs)
    written(a, 2)
    assert a.stats()["remote_chunks_present"] > 0  # (Redis holds the prompt's groups once)
    first = run_worker(b, models["seed0"], jobs[:1])
    got = run_worker(b, models["seed0"], jobs[1:])  # (a new worker: its context is empty)
    assert texts(first) + texts(got) == texts(cold)
    assert [r["last"]["remote"] for r in first["results"] + got["results"]] == ["fetched"] * 2
    # one restore: the fetched record, not first the shorter one B held, then it
    assert got["totals"]["hits"] == 1, got["totals"]
    st = b.stats()
    assert st["remote_fetched"] == 2 and st["remote_chunks_local"] > 0, st
    assert st["remote_chunks_pulled"] < 2 * a.stats()["remote_chunks_sent"], st
    no_internal_errors(a, b)


def arena_tokens(sup: Sup) -> list[np.ndarray]:
    """The token ids of every record in ``sup``'s arena (lease-free peeks)."""
    return each_record(sup.arena, lambda view, off, gen: view.peek(off, gen)[1].copy())


def test_a_sliding_window_model_fetches_no_state_it_would_have_to_cut(
    make_supervisor, models, redis_server
):
    """The same two questions on a model whose states cannot be cut back (a sliding
    window): node B may fetch a checkpoint that is a whole prefix of its prompt, never
    node A's state of the other question (it would have to cut it: unusable)."""
    mine = SYSTEM + " Question: which mat does the second cat sit on today?"
    vocab = llama_cpp.Llama(models["swa"], vocab_only=True, verbose=False)
    ids = np.asarray(vocab.tokenize(mine.encode()), dtype="<i4")
    cold = run_worker(None, models["swa"], [completion(mine)], mode="cold")
    a = make_supervisor("--size", "64M", "--remote", redis_server.url)
    b = make_supervisor("--size", "64M", "--remote", redis_server.url)
    run_worker(a, models["swa"], [completion(PROMPT)])
    written(a)
    got = run_worker(b, models["swa"], [completion(mine)])
    assert texts(got) == texts(cold)
    for toks in arena_tokens(b):  # (its own states, and what it fetched)
        n = min(len(toks), len(ids))
        assert np.array_equal(toks[:n], ids[:n]), "B fetched a state it would have to cut"
    no_internal_errors(a, b)


def test_corrupt_record_in_redis_is_rejected(make_supervisor, models, redis_server):
    cold = run_worker(None, models["seed0"], [completion(PROMPT)], mode="cold")
    a = make_supervisor("--size", "64M", "--remote", redis_server.url)
    b = make_supervisor("--size", "64M", "--remote", redis_server.url)
    run_worker(a, models["seed0"], [completion(PROMPT)])
    n = written(a)["remote_written"]
    r = redis_server.client()
    pieces = [k for k in r.scan_iter("shmkv:*:p0")]
    assert len(pieces) == n
    for k in pieces:  # one flipped byte in the middle of every record's first piece
        mid = r.strlen(k) // 2
        r.setrange(k, mid, bytes([r.getrange(k, mid, mid)[0] ^ 0x40]))
    got = run_worker(b, models["seed0"], [completion(PROMPT)])
    assert texts(got) == texts(cold)
    last = got["results"][0]["last"]
    assert last["remote"] == "corrupt" and not last["hit"], last
    st = b.stats()
    assert st["remote_corrupt"] >= 1 and st["remote_fetched"] == 0 and st["entries"] >= 1, st
    # the damaged record was deleted, and B's own good copy took its place: a third node
    # restores that
    written(b)
    c = make_supervisor("--size", "64M", "--remote", redis_server.url)
    third = run_worker(c, models["seed0"], [completion(PROMPT)])
    assert texts(third) == texts(cold) and third["results"][0]["last"]["remote"] == "fetched"
    no_internal_errors(a, b)


class HoldingProxy:
    """A TCP proxy from a node to Redis that passes everything until the node starts to
    send piece ``hold_at`` of a record, after ``after`` records' manifests went by; from
    then on it holds what that connection sends and refuses new ones until
    :meth:`release`. That record is left in Redis with its first pieces stored and
    neither its later pieces nor its manifest, as a crash between two pieces leaves it.
    ``held``: the record's id (hex) once held."""

    SET = re.compile(rb"\*\d+\r\n\$3\r\nSET\r\n\$\d+\r\nshmkv:\{([0-9a-f]{32})\}:(p\d+|m)\r\n")

    def __init__(self, upstream: int, after: int, hold_at: str = "p2") -> None:
        self.upstream, self.after, self.hold_at = upstream, after, hold_at.encode()
        self.manifests = 0
        self.held: str | None = None
        self.passing = True
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.port = self.lsock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def release(self) -> None:
        """Pass new connections again (held ones stay held)."""
        self.passing = True

    def close(self) -> None:
        self.lsock.close()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.lsock.accept()
            except OSError:
                return
            try:
                if not self.passing:
                    raise OSError("holding")
                u = socket.create_connection(("127.0.0.1", self.upstream), timeout=5)
            except OSError:
                c.close()
                continue
            threading.Thread(target=self._pump, args=(c, u), daemon=True).start()

    def _cut(self, data: bytes) -> int | None:
        """Where in ``data`` (what the node sends) to stop passing it on, if anywhere."""
        for m in self.SET.finditer(data):
            if m.group(2) == b"m":
                self.manifests += 1
            elif m.group(2) == self.hold_at and self.manifests >= self.after and not self.held:
                self.held, self.passing = m.group(1).decode(), False
                return m.start()
        return None

    def _pump(self, c: socket.socket, u: socket.socket) -> None:
        tail, held = b"", False  # (a command header split between two reads is kept back)
        try:
            while True:
                r, _, _ = select.select([u] if held else [c, u], [], [], 0.005 if tail else 1.0)
                if not r and tail:
                    u.sendall(tail)
                    tail = b""
                if u in r:
                    data = u.recv(1 << 16)
                    if not data:
                        return
                    c.sendall(data)
                if c in r and not held:
                    data = c.recv(1 << 16)
                    if not data:
                        return
                    data, tail = tail + data, b""
                    cut = self._cut(data)
                    if cut is not None:
                        u.sendall(data[:cut])
                        held = True
                        continue
                    star = data.rfind(b"*", max(0, len(data) - 128))
                    if star >= 0:
                        data, tail = data[:star], data[star:]
                    u.sendall(data)
        except OSError:
            return
        finally:
            c.close()
            u.close()


def _rid(b) -> bytes:
    return remote_id(b.root, b"fp", np.ascontiguousarray(b.tokens, dtype="<i4").tobytes())


def test_redis_killed_mid_puts_never_serves_a_partial_record(make_supervisor, tmp_path):
    """Redis (append-only file, fsync always) is killed while node A is between two pieces
    of a 4-piece record (A reaches it through a proxy that holds the record's third piece
    back), and restarted on the same files: the partial record is there, with two pieces
    and no manifest; node B fetches only whole records, and right; both nodes serve all
    along, never waiting past their bound."""
    from shmkv.supervisor.tiers.redis import layout as fmt

    srv = RedisProc(tmp_path / "aof", None, "--appendonly", "yes", "--appendfsync", "always")
    proxy = HoldingProxy(srv.port, after=3)
    try:
        a = make_supervisor("--size", "96M", "--remote", proxy.url, "--remote-timeout", "0.5")
        b = make_supervisor("--size", "96M", "--remote", srv.url, "--remote-timeout", "0.5")
        blobs = [blob(500 + i, (4 << 20) - 1000) for i in range(12)]
        r = srv.client()
        with a.client() as c:
            for bl in blobs:
                c.put_bytes(bl.root, bl.tokens, b"fp", bl.data)
            rid = bytes.fromhex(wait_until(lambda: proxy.held, 30, "a record's third piece"))
            wait_until(lambda: r.exists(fmt.piece_key(rid, 1)), 10, "its first two pieces")
            srv.kill()  # (what Redis answered is on disk: fsync always, before replies)
            for bl in blobs:  # node A serves its own arena all along
                assert c.lookup(bl.digests()) is not None
        # node B, Redis down: answered at once (or at the bound), never a wrong record
        t0 = time.monotonic()
        status, data = fetch_blob(b, blobs[0], wait=1.0)
        assert time.monotonic() - t0 < 1.0 + 2.5 and data is None and status != "fetched"
        srv.start()  # the same port and append-only file: what was fsynced is back
        proxy.release()
        r = srv.client()
        assert [bool(r.exists(fmt.piece_key(rid, i))) for i in range(4)] == [1, 1, 0, 0]
        assert not r.exists(fmt.manifest_key(rid)), "the partial record has a manifest"
        whole = [bl for bl in blobs if r.exists(fmt.manifest_key(_rid(bl)))]
        assert len(whole) >= 3 and rid not in {_rid(bl) for bl in whole}, len(whole)
        wait_until(lambda: b.stats()["remote_paused"] == 0 or _probe(b), 40, "B resumes")
        for bl in blobs:
            status, data = fetch_blob(b, bl)
            if bl in whole:
                assert (status, data) == ("fetched", bl.data)  # whole and right
            else:  # the partial record above all: never part of one (a miss, or whole and
                # right once A, resumed, wrote it again: A writes what it held back too)
                got = (status, data)
                assert got in (("none", None), ("fetched", bl.data)), (status, _rid(bl) == rid)
        # A resumes writing behind by itself; a new record goes across
        late = blob(600, 300_000)
        with a.client() as c:
            wait_until(lambda: _put_and_written(c, late, r), 60, "A resumes", step=1.0)
        assert fetch_blob(b, late) == ("fetched", late.data)
        st = a.stats()
        assert st["remote_errors"] and st["remote_dropped"] >= 1, st
        no_internal_errors(a, b)
    finally:
        proxy.close()
        srv.kill()


def _probe(sup: Sup) -> bool:
    with sup.client() as c:
        b = blob(999, 1000)
        return c.fetch(b.root, b.tokens, 0, 1.0, 0.0) == "none"


def _put_and_written(c, b, r) -> bool:
    """Put ``b`` through client ``c``; True once Redis (client ``r``) holds its manifest. (Not "the
    node wrote a record": a node resuming writes the records it held back too, and one of
    those counted for ``b`` while ``b`` itself was not written yet.)"""
    from shmkv.supervisor.tiers.redis import layout as fmt

    c.put_bytes(b.root, b.tokens, b"fp", b.data)
    try:
        wait_until(lambda: r.exists(fmt.manifest_key(_rid(b))), 0.5, "the record in Redis")
        return True
    except AssertionError:
        pass
    c.clear()  # (put again next time: the tier dropped it while paused)
    return False


def test_redis_down_costs_no_request(make_supervisor, models):
    """Nothing listens at --remote: workers run as without it, and say why."""
    cold = run_worker(None, models["seed0"], [completion(PROMPT)], mode="cold")
    sup = make_supervisor("--size", "64M", "--remote", f"redis://127.0.0.1:{free_port()}/0")
    t0 = time.monotonic()
    first = run_worker(sup, models["seed0"], [completion(PROMPT)])
    assert texts(first) == texts(cold)
    assert first["results"][0]["last"]["remote"] in ("down", "timeout")
    again = run_worker(sup, models["seed0"], [completion(PROMPT)])  # a fresh worker
    assert texts(again) == texts(cold)
    assert again["results"][0]["last"]["hit"]  # the local cache is unaffected
    assert time.monotonic() - t0 < 60
    st = sup.stats()
    assert st["remote_on"] == 0 and st["remote_errors"].get("down", 0) >= 1, st
    no_internal_errors(sup)


def cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is a port too."""
    while (p := free_port()) > 55000:
        pass
    return p


@pytest.fixture
def redis_cluster(tmp_path):
    """Three redis-server in cluster mode on loopback ports, joined into one cluster."""
    ports = [cluster_port() for _ in range(3)]
    nodes: list[RedisProc] = []
    try:
        for p in ports:
            nodes.append(
                RedisProc(tmp_path / f"c{p}", p, "--cluster-enabled", "yes", "--appendonly", "no")
            )
        subprocess.run(
            ["redis-cli", "--cluster", "create", *[f"127.0.0.1:{p}" for p in ports]]
            + ["--cluster-replicas", "0", "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=60,
        )
        r = redis.Redis(port=ports[0])
        wait_until(lambda: r.execute_command("CLUSTER INFO").get("cluster_state") == "ok", 30, "ok")
        yield ports
    finally:
        for n in nodes:
            n.kill()


def test_cluster_node_b_restores_what_node_a_published(make_supervisor, models, redis_cluster):
    url = f"redis+cluster://127.0.0.1:{redis_cluster[0]}"
    a, b, _ = cross_node(make_supervisor, models, url)
    # a record's pieces and manifest share a slot, and records really are spread out over
    # the cluster's nodes (each record's hash tag is its own id, not one for all)
    from redis.cluster import RedisCluster

    more = [blob(560 + i, 200_000 + i) for i in range(8)]
    with a.client() as c:
        for bl in more:
            c.put_bytes(bl.root, bl.tokens, b"fp", bl.data)
    written(a, 1 + len(more))
    rc = RedisCluster(host="127.0.0.1", port=redis_cluster[0])
    manifests_on = {}
    for node in rc.get_primaries():
        keys = [k.decode() for k in rc.scan_iter("shmkv:*", target_nodes=node)]
        for k in keys:
            if ":p" in k:
                assert rc.keyslot(k) == rc.keyslot(k.rsplit(":", 1)[0] + ":m"), k
        manifests_on[node.port] = sum(k.endswith(":m") for k in keys)
    assert sum(manifests_on.values()) >= 1 + len(more), manifests_on
    assert sum(n > 0 for n in manifests_on.values()) >= 2, manifests_on
    rc.close()
    no_internal_errors(a, b)


def test_full_redis_is_counted_and_costs_no_request(make_supervisor, tmp_path):
    """A Redis at its maxmemory (noeviction) refuses writes with OOM: the tier pauses and
    counts it; the node's own arena serves every put and read."""
    srv = RedisProc(
        tmp_path / "full", None, "--maxmemory", "3mb", "--maxmemory-policy", "noeviction"
    )
    try:
        sup = make_supervisor("--size", "64M", "--remote", srv.url)
        blobs = [blob(700 + i, 1 << 20) for i in range(8)]
        with sup.client() as c:
            for b in blobs:
                c.put_bytes(b.root, b.tokens, b"fp", b.data)
                time.sleep(0.05)
            for b in blobs:
                hit = c.lookup(b.digests())
                assert hit is not None
                with c.acquire(hit) as lease:
                    assert bytes(lease.payload) == b.data and lease.finish()
        st = wait_until(lambda: (s := sup.stats())["remote_errors"].get("full") and s, 20, "an OOM")
        assert st["remote_written"] < len(blobs) and st["puts"] == len(blobs), st
        assert "remote: paused (full)" in sup.log()
        no_internal_errors(sup)
    finally:
        srv.kill()


def test_longer_records_of_other_suffixes_do_not_hide_the_shared_prefix(
    make_supervisor, redis_server
):
    """Many prompts share a system prompt and differ only in their question: node A has
    stored states of several such prompts, each at least as long as node B's shared-prefix
    record would need, under the same index hash as the prefix itself. B's new question
    must still fetch the record of the shared prefix (it used to look only at the longest
    few candidates, all other questions, and answer "none")."""
    url = redis_server.url
    a = make_supervisor("--size", "64M", "--remote", url)
    b = make_supervisor("--size", "64M", "--remote", url)
    shared = blob(700, 200_000, n_tokens=2 * CHUNK + 10)
    rng = np.random.default_rng(700)
    others = [
        np.concatenate([shared.tokens, rng.integers(0, 30_000, 5).astype("<i4")]) for _ in range(8)
    ]
    with a.client() as c:
        c.put_bytes(shared.root, shared.tokens, b"fp", shared.data)
        for i, toks in enumerate(others):
            c.put_bytes(shared.root, toks, b"fp", blob(710 + i, 100_000).data)
    written(a, 1 + len(others))
    wait_until(lambda: b.stats()["remote_on"], 10, "node B to reach Redis")
    question = np.concatenate([shared.tokens, rng.integers(0, 30_000, 5).astype("<i4")])
    with b.client() as c:
        assert c.fetch(shared.root, question, 0, 5.0, 0.0) == "fetched"
        hit = c.lookup(chain_digests(shared.root, question, CHUNK))
        assert hit is not None
        with c.acquire(hit) as lease:
            assert bytes(lease.payload) == shared.data
            assert lease.finish()
    no_internal_errors(a, b)


# ------------------------------------------------------- what the guide promises (issue 22)
def test_two_nodes_publishing_one_prompt_share_one_copy_and_every_key_expires(
    make_supervisor, redis_server
):
    """Node A writes P's state (three pieces); node B, which publishes P too, finds A's
    manifest and sends nothing (``remote_present``): one set of keys, every one of them
    with a TTL of at most --remote-ttl (pieces a minute more: they outlive their manifest;
    the chunk-prefix pointers at most the record's)."""
    args = ("--size", "64M", "--remote", redis_server.url, "--remote-ttl", "600")
    a, b = make_supervisor(*args), make_supervisor(*args)
    p = blob(860, (5 << 19) + 1000)
    put_written(a, p)
    r = redis_server.client()
    keys = redis_keys(r)
    pointers = [k for k in keys if ":y64:" in k]  # (one per chunk prefix of P)
    kinds = sorted(k.rsplit(":", 1)[1] if ":x" not in k else "x" for k in keys if ":y" not in k)
    assert kinds == ["m", "p0", "p1", "p2", "x"] and pointers, keys
    received = received_by(r)
    with b.client() as c:
        c.put_bytes(p.root, p.tokens, b"fp", p.data)
    st = settled(b, 1)
    assert st["remote_present"] == 1 and st["remote_written"] == 0, st
    assert received_by(r) - received < 64 << 10, "node B sent the record again"
    after = redis_keys(r)
    assert after.keys() == keys.keys()
    manifest = next(ms for k, ms in after.items() if k.endswith(":m"))
    for k, ms in after.items():
        limit = 660_000 if ":p" in k else 600_000
        assert 0 < ms <= limit, (k, ms)
        if ":p" in k:
            assert ms > manifest, (k, ms, manifest)
    no_internal_errors(a, b)


def test_a_fetch_slower_than_prefilling_is_not_taken(make_supervisor, redis_server):
    """The worker's measured prefill speed decides: at a speed that prefills P's tokens in
    a quarter of the time reading P would take, the fetch is answered ``not_worth`` and no
    piece is read; at one that takes twenty times as long, P is fetched."""
    from shmkv.supervisor.tiers.redis.backend import DEFAULT_BANDWIDTH

    a = make_supervisor("--size", "64M", "--remote", redis_server.url)
    b = make_supervisor("--size", "64M", "--remote", redis_server.url)
    p = blob(861, 8 << 20)
    put_written(a, p)
    wait_until(lambda: b.stats()["remote_on"], 10, "node B up")
    transfer = len(p.data) / DEFAULT_BANDWIDTH  # (what B expects before it measured one)
    fast, slow = len(p.tokens) / (transfer / 4), len(p.tokens) / (transfer * 20)
    r = redis_server.client()
    sent = sent_by(r)
    with b.client() as c:
        assert c.fetch(p.root, p.tokens, 0, 5.0, fast) == "not_worth"
        assert c.lookup(p.digests()) is None
        assert sent_by(r) - sent < 64 << 10, "B read pieces of a record it did not take"
        st = b.stats()
        assert st["remote_fetch_not_worth"] == 1 and st["remote_pulled_bytes"] == 0, st
        assert c.fetch(p.root, p.tokens, 0, 5.0, slow) == "fetched"
        hit = c.lookup(p.digests())
        assert hit is not None
        with c.acquire(hit) as lease:
            assert bytes(lease.payload) == p.data and lease.finish()
    no_internal_errors(a, b)


def test_a_fetch_past_its_deadline_still_warms_the_arena(make_supervisor, redis_server):
    """A worker that stops waiting (its deadline before the record is read) is answered
    ``timeout`` and prefills; the fetch goes on and the next lookup hits."""
    a = make_supervisor("--size", "64M", "--remote", redis_server.url)
    b = make_supervisor("--size", "64M", "--remote", redis_server.url)
    big = blob(862, 24 << 20)
    put_written(a, big)
    wait_until(lambda: b.stats()["remote_on"], 10, "node B up")
    with b.client() as c:
        assert c.fetch(big.root, big.tokens, 0, 0.0, 0.0) == "timeout"
        hit = wait_until(lambda: c.lookup(big.digests()), 30, "the late fetch to land")
        with c.acquire(hit) as lease:
            assert bytes(lease.payload) == big.data and lease.finish()
    st = b.stats()
    assert st["remote_fetch_late"] == 1 and st["remote_fetched"] == 1, st
    no_internal_errors(a, b)


def test_a_connection_has_at_most_two_fetches_outstanding(make_supervisor, redis_server):
    """Three fetches sent at once on one connection: the third is answered ``busy`` at
    once, the first two when the fetcher is done with them; then there is room again."""
    import msgpack

    from tests.support.peer import Raw

    sup = make_supervisor("--size", "16M", "--remote", redis_server.url)
    wait_until(lambda: sup.stats()["remote_on"], 10, "the node up")
    peer = Raw(sup.socket, timeout=10)
    try:
        peer.attach()

        def fetch(rid: int) -> bytes:
            b = blob(870 + rid, 10)
            body = msgpack.packb(
                {"op": "fetch", "id": rid, "root": b.root, "tokens": b.tokens.tobytes()}
                | {"have": 0, "wait": 5.0, "prefill_tps": 0.0}
            )
            return struct.pack(">I", len(body)) + body

        peer.send_raw(b"".join(fetch(rid) for rid in (11, 12, 13)))  # (one read: one turn)
        replies = [peer.recv() for _ in range(3)]
        assert (replies[0]["id"], replies[0]["status"]) == (13, "busy"), replies
        assert sorted(m["id"] for m in replies[1:]) == [11, 12], replies
        assert all(m["status"] == "none" for m in replies[1:]), replies
        peer.send_raw(fetch(14))
        assert peer.recv()["status"] == "none"
    finally:
        peer.close()
    st = sup.stats()
    assert st["remote_fetch_busy"] == 1 and st["remote_fetch_none"] == 3, st
    no_internal_errors(sup)


def test_only_a_worker_that_can_cut_fetches_a_record_that_goes_on_past_its_prompt(
    make_supervisor, redis_server
):
    """Node A holds only the state of a system prompt and question 1. For question 2 on
    node B, a worker that can cut a state back gets it fetched (the arena's index then
    finds it by the shared chunk prefixes, and the worker cuts it back); one that cannot
    (a sliding window, a recurrent layer) is answered "none" and nothing is read. Redis
    holds one boundary pointer per chunk of the record, with its TTL, and a second
    question through the same system prompt adds none."""
    url = redis_server.url
    a = make_supervisor("--size", "64M", "--remote", url)
    b = make_supervisor("--size", "64M", "--remote", url)
    shared = blob(720, 200_000, n_tokens=3 * CHUNK + 10)
    rng = np.random.default_rng(720)
    theirs, other, mine = (
        np.concatenate([shared.tokens, rng.integers(0, 30_000, 20).astype("<i4")]) for _ in range(3)
    )
    with a.client() as c:
        c.put_bytes(shared.root, theirs, b"fp", shared.data)
    written(a)
    r = redis_server.client()
    pointers = sorted(r.scan_iter("shmkv:*:y*"))
    assert len(pointers) == len(theirs) // CHUNK, pointers
    ttl = r.pttl(f"shmkv:{{{remote_id(shared.root, b'fp', theirs.tobytes()).hex()}}}:m")
    assert all(0 < r.pttl(k) <= ttl + 1000 for k in pointers)
    wait_until(lambda: b.stats()["remote_on"], 10, "node B to reach Redis")
    with b.client() as c:
        assert c.fetch(shared.root, mine, 0, 5.0, 0.0, cut=False) == "none"
        assert b.stats()["remote_pulled_bytes"] == 0
        assert c.fetch(shared.root, mine, 0, 5.0, 0.0, cut=True) == "fetched"
        hit = c.lookup(chain_digests(shared.root, mine, CHUNK))
        assert hit is not None and hit.chunks == len(shared.tokens) // CHUNK
        with c.acquire(hit) as lease:
            assert bytes(lease.payload) == shared.data
            assert lease.finish()
    with a.client() as c:
        c.put_bytes(shared.root, other, b"fp", blob(721, 100_000).data)
    written(a, 2)
    assert sorted(r.scan_iter("shmkv:*:y*")) == pointers
    r.close()
    no_internal_errors(a, b)


def test_two_fetches_of_one_record_at_once_read_it_once(make_supervisor, redis_server):
    """Two workers on node B miss at once on two questions that share node A's record:
    both are answered "fetched", the record is read from Redis and put once. Once it is
    gone from B's arena, a fetch reads it again (it is not answered from memory)."""
    url = redis_server.url
    a = make_supervisor("--size", "64M", "--remote", url)
    b = make_supervisor("--size", "64M", "--remote", url)
    shared = blob(730, 6 << 20, n_tokens=4 * CHUNK)
    rng = np.random.default_rng(730)
    theirs, q1, q2 = (
        np.concatenate([shared.tokens, rng.integers(0, 30_000, 20).astype("<i4")]) for _ in range(3)
    )
    with a.client() as c:
        c.put_bytes(shared.root, theirs, b"fp", shared.data)
    written(a)
    wait_until(lambda: b.stats()["remote_on"], 10, "node B to reach Redis")
    answers: dict[int, str] = {}
    gate = threading.Barrier(2)

    def ask(i: int, prompt: np.ndarray) -> None:
        with b.client() as c:
            c.stats()  # (connected before the gate)
            gate.wait(10)
            answers[i] = c.fetch(shared.root, prompt, 0, 10.0, 0.0, cut=True)

    threads = [threading.Thread(target=ask, args=(i, p)) for i, p in enumerate((q1, q2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert answers == {0: "fetched", 1: "fetched"}
    st = b.stats()
    assert st["remote_fetched"] == 1 and st["remote_fetch_joined"] == 1, st
    assert st["remote_pulled_bytes"] == len(shared.data), st
    # the record evicted from B's arena since: the next fetch reads it again
    with b.client() as c:
        c.clear()
        assert c.fetch(shared.root, q1, 0, 10.0, 0.0, cut=True) == "fetched"
        assert c.lookup(chain_digests(shared.root, q1, CHUNK)) is not None
    assert b.stats()["remote_pulled_bytes"] == 2 * len(shared.data)
    no_internal_errors(a, b)


# ------------------------------------------------------------------ trust (issue 18)
def forge(
    r: redis.Redis,
    b,
    payload: bytes,
    uid: int,
    key: bytes | None = None,
    fp: bytes = b"fp",
    **over,
) -> bytes:
    """What a hostile writer to Redis can store: a record of ``b``'s prompt with any
    payload and publisher uid, checksums right, MACed under ``key`` if it has one (it
    has not). Returns the record id."""
    from shmkv.supervisor.tiers.redis import layout as fmt

    tok = np.ascontiguousarray(b.tokens, dtype="<i4").tobytes()
    rid = remote_id(b.root, fp, tok)
    parts = fmt.split(payload)
    fields = dict(
        root=b.root,
        fingerprint=fp,
        tokens=tok,
        payload_len=len(payload),
        payload_xxh3=xxhash.xxh3_64_intdigest(payload),
        codec="none",
        stored_len=len(payload),
        created=time.time(),
        publisher="evil/4242",
        uid=uid,
        digests=b"".join(fmt.piece_digest(p) for p in parts),
    )
    fields.update(over)
    for i, part in enumerate(parts):
        r.set(fmt.piece_key(rid, i), bytes(part))
    r.set(fmt.manifest_key(rid), fmt.Manifest(**fields).pack(key))
    last = chain_digests(b.root, b.tokens, CHUNK)[-1]
    r.hset(fmt.index_key(b.root, CHUNK, last), rid.hex(), fmt.index_value(tok))
    return rid


def stored_manifest(r: redis.Redis, b, keys=(), fp: bytes = b"fp"):
    from shmkv.supervisor.tiers.redis import layout as fmt

    tok = np.ascontiguousarray(b.tokens, dtype="<i4").tobytes()
    rid = remote_id(b.root, fp, tok)
    raw = r.get(fmt.manifest_key(rid))
    return None if raw is None else fmt.unpack_manifest(rid, raw, keys)


def publisher_in(sup: Sup, b) -> int:
    with sup.client() as c:
        hit = c.lookup(b.digests())
        assert hit is not None
        rows = [e for e in c.ls()["entries"] if e["root"] == b.root.hex()]
    assert len(rows) == 1, rows
    return rows[0]["publisher"]


def test_untrusted_members_state_never_leaves_the_machine(make_supervisor, redis_server, tmp_path):
    """Node A shares its arena with --group G and trusts one member (friend): the other
    member's (evil's) state is never written to Redis, whatever its key; A's own state of
    the same prompt is; the friend's record keeps the friend's uid through Redis into a
    node that trusts the friend, and a node that does not refuses it."""
    evil = system_user("shmkv-test-evil", GROUP)
    friend = system_user("shmkv-test-friend", GROUP)
    d = Path(f"/tmp/shmkv-rem-{uuid.uuid4().hex[:10]}")
    sock = d / "a.sock"
    a = make_supervisor(
        "--size", "64M", "--group", GROUP, "--remote", redis_server.url,
        "--trust-publishers", "shmkv-test-friend",
        env_extra={"SHMKV_SOCKET": str(sock)}, wait=False,
    )  # fmt: skip
    a.socket = str(sock)
    try:
        wait_for_socket(str(sock), a.proc)
        p, q = blob(800, 300_000), blob(801, 300_000)
        garbage = blob(802, 300_000).data
        publish_as(evil, a, tmp_path, p.root, p.tokens, b"fp", garbage)
        publish_as(friend, a, tmp_path, q.root, q.tokens, b"fp", q.data)
        st = settled(a, 2)
        r = redis_server.client()
        assert stored_manifest(r, p) is None, "a --group member's state went to Redis"
        assert st["remote_untrusted"] == 1 and st["remote_written"] == 1, st
        assert stored_manifest(r, q).uid == friend[0]
        with a.client() as c:  # A's own state of evil's prompt does go
            c.put_bytes(p.root, p.tokens, b"fp", p.data)
        settled(a, 3)
        assert stored_manifest(r, p).uid == 0
        b = make_supervisor("--size", "64M", "--remote", redis_server.url)  # default trust
        c_ = make_supervisor(
            "--size", "64M", "--remote", redis_server.url, "--trust-publishers", str(friend[0])
        )
        wait_until(lambda: b.stats()["remote_on"] and c_.stats()["remote_on"], 10, "nodes up")
        assert fetch_blob(b, p) == ("fetched", p.data)
        assert fetch_blob(b, q) == ("none", None)  # the friend of A is nobody to B
        assert b.stats()["remote_fetch_untrusted"] == 1
        assert fetch_blob(c_, q) == ("fetched", q.data)
        assert publisher_in(c_, q) == friend[0]  # never re-labelled as C's own
        assert publisher_in(b, p) == 0
        no_internal_errors(a, b, c_)
    finally:
        a.stop()
        shutil.rmtree(d, ignore_errors=True)


def test_a_legitimate_writer_replaces_what_an_untrusted_writer_put_first(
    make_supervisor, redis_server
):
    """A hostile writer to Redis stored a record of prompt P first (checksums right,
    publisher a uid nobody trusts): node A's own state of P replaces it rather than
    counting it as present, and node B fetches A's."""
    p = blob(810, 200_000)
    r = redis_server.client()
    forge(r, p, blob(811, 200_000).data, uid=4242)
    a = make_supervisor("--size", "64M", "--remote", redis_server.url)
    b = make_supervisor("--size", "64M", "--remote", redis_server.url)
    wait_until(lambda: b.stats()["remote_on"], 10, "node B up")
    assert fetch_blob(b, p) == ("none", None)  # (not a uid B trusts: a miss)
    assert b.stats()["remote_fetch_untrusted"] == 1
    with a.client() as c:
        c.put_bytes(p.root, p.tokens, b"fp", p.data)
    st = settled(a, 1)
    assert st["remote_written"] == 1 and st["remote_present"] == 0, st
    man = stored_manifest(r, p)
    assert man.uid == 0 and man.payload_xxh3 == xxhash.xxh3_64_intdigest(p.data)
    c2 = make_supervisor("--size", "64M", "--remote", redis_server.url)
    wait_until(lambda: c2.stats()["remote_on"], 10, "node C up")
    assert fetch_blob(c2, p) == ("fetched", p.data)
    no_internal_errors(a, b, c2)


# --------------------------------------------------------- bounded fetches (issue 18)
def vm_hwm(pid: int) -> int:
    """Peak resident bytes of process ``pid`` (VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def test_a_record_larger_than_the_arena_is_refused_unread(make_supervisor, redis_server):
    """Node A (256 MiB arena) stores a 160 MiB state; node B (64 MiB) misses on it three
    times: B reads no piece of it (Redis sends B next to nothing), asks for its manifest
    once, and B's peak memory does not grow by the state's size. A forged zstd record of
    one small piece claiming 256 MiB of zeros (checksums right) is refused the same way."""
    import zstandard

    from shmkv.supervisor.tiers.redis import layout as fmt

    big = blob(820, 160 << 20)
    a = make_supervisor("--size", "256M", "--remote", redis_server.url)
    b = make_supervisor("--size", "64M", "--remote", redis_server.url)
    with a.client() as c:
        c.put_bytes(big.root, big.tokens, b"fp", big.data)
    written(a)
    wait_until(lambda: b.stats()["remote_on"], 10, "node B up")
    r = redis_server.client()
    bomb = blob(821, 1000)
    zeros = 256 << 20
    h = xxhash.xxh3_64()
    for _ in range(zeros >> 24):
        h.update(bytes(1 << 24))
    frame = zstandard.ZstdCompressor(level=19).compress(bytes(zeros))
    forge(
        r, bomb, frame, uid=0, codec="zstd", payload_len=zeros, payload_xxh3=h.intdigest(),
        stored_len=len(frame), digests=fmt.piece_digest(frame),
    )  # fmt: skip
    hwm, sent = vm_hwm(b.proc.pid), sent_by(r)
    for _ in range(3):
        assert fetch_blob(b, big) == ("none", None)
        assert fetch_blob(b, bomb) == ("none", None)
    assert sent_by(r) - sent < 1 << 20, "B read pieces of a record that can never fit"
    assert vm_hwm(b.proc.pid) - hwm < 48 << 20
    st = b.stats()
    assert st["remote_fetch_too_big"] == 2 and st["remote_refused_skipped"] == 4, st
    assert st["remote_pulled_bytes"] == 0 and st["remote_paused"] == 0, st
    no_internal_errors(a, b)


def test_a_key_of_the_wrong_type_is_a_miss_not_an_outage(make_supervisor, redis_server):
    """A plain string at the index key of prompt X: B's fetch of X is a miss (counted),
    an unrelated prompt Y is fetched, the tier never pauses; a node that stores X again
    replaces the bad key, and X is fetched."""
    from shmkv.supervisor.tiers.redis import layout as fmt

    x, y = blob(830, 100_000), blob(831, 100_000)
    a = make_supervisor("--size", "64M", "--remote", redis_server.url)
    b = make_supervisor("--size", "64M", "--remote", redis_server.url)
    with a.client() as c:
        c.put_bytes(x.root, x.tokens, b"fp", x.data)
        c.put_bytes(y.root, y.tokens, b"fp", y.data)
    written(a, 2)
    r = redis_server.client()
    r.set(fmt.index_key(x.root, CHUNK, x.digests()[-1]), b"not a hash")
    wait_until(lambda: b.stats()["remote_on"], 10, "node B up")
    for _ in range(2):
        assert fetch_blob(b, x)[0] == "none"
    assert fetch_blob(b, y) == ("fetched", y.data)
    st = b.stats()
    assert st["remote_bad_keys"] == 2 and st["remote_paused"] == 0, st
    assert not st["remote_errors"] and st["remote_fetch_down"] == 0, st
    c2 = make_supervisor("--size", "64M", "--remote", redis_server.url)
    with c2.client() as c:
        c.put_bytes(x.root, x.tokens, b"fp", x.data)
    st = settled(c2, 1)
    assert st["remote_bad_keys"] == 1 and not st["remote_errors"], st
    assert fetch_blob(b, x) == ("fetched", x.data)
    no_internal_errors(a, b, c2)


# ------------------------------------------------------- signed records (issue 18)
K1, K2 = b"k1-" + b"a" * 40, b"k2-" + b"b" * 40


def test_a_key_file_must_be_ours_closed_and_long_enough(make_supervisor, redis_server, tmp_path):
    for args, rc, says in [
        (key_file(tmp_path, "open", K1, mode=0o644), 8, "chmod 600"),
        (key_file(tmp_path, "short", b"x" * 31), 2, "at least 32 bytes"),
        (key_file(tmp_path, "three", K1, K2, K1), 2, "previous one second"),
    ]:
        sup = make_supervisor(
            "--size", "64M", "--remote", redis_server.url, "--remote-key-file", args, wait=False
        )
        assert sup.proc.wait(30) == rc, sup.log()
        assert says in sup.log() and "Traceback" not in sup.log(), sup.log()


def test_a_node_with_a_key_restores_only_records_signed_with_it(
    make_supervisor, redis_server, tmp_path
):
    """Records written by a node without the key, by a node with another key, an
    unsigned forgery with every checksum right, and a signed manifest rewritten are
    misses on a node with the key (counted, not deleted); records signed with the key
    are fetched, by keyless nodes too; during a rotation (current key first, previous
    second) both are accepted and only the current one signs."""
    import msgpack

    from shmkv.supervisor.tiers.redis import layout as fmt

    url = redis_server.url
    k1 = key_file(tmp_path, "k1", K1)
    rot = key_file(tmp_path, "rot", b"  " + K2 + b"  ", K1)  # (whitespace at the ends)
    keyless = make_supervisor("--size", "64M", "--remote", url)
    other = make_supervisor("--size", "64M", "--remote", url, "--remote-key-file",
                            key_file(tmp_path, "k2", K2))  # fmt: skip
    a = make_supervisor("--size", "64M", "--remote", url, "--remote-key-file", k1)
    a2 = make_supervisor("--size", "64M", "--remote", url, "--remote-key-file", k1)
    bs = [blob(840 + i, 150_000) for i in range(8)]
    put_written(keyless, bs[0])
    put_written(other, bs[1])
    put_written(a, bs[2], bs[3], bs[5])
    r = redis_server.client()
    forge(r, bs[4], blob(850, 150_000).data, uid=0)  # an unsigned forgery, checksums right
    # a signed manifest rewritten: another payload's checksums, the MAC kept
    rid = remote_id(bs[3].root, b"fp", bs[3].tokens.astype("<i4").tobytes())
    env = msgpack.unpackb(r.get(fmt.manifest_key(rid)))
    body = msgpack.unpackb(env["m"])
    evil = blob(851, 150_000).data
    body["xxh3"] = xxhash.xxh3_64_intdigest(evil)
    body["digests"] = fmt.piece_digest(evil)
    r.set(fmt.piece_key(rid, 0), evil)
    r.set(fmt.manifest_key(rid), msgpack.packb({**env, "m": msgpack.packb(body)}))
    wait_until(lambda: a2.stats()["remote_on"], 10, "node A2 up")
    for b in (bs[0], bs[1], bs[4], bs[3]):
        assert fetch_blob(a2, b) == ("none", None)
    assert fetch_blob(a2, bs[2]) == ("fetched", bs[2].data)
    st = a2.stats()
    assert st["remote_fetch_unverified"] == 4 and st["remote_corrupt"] == 0, st
    assert stored_manifest(r, bs[0]) is not None  # (not ours to delete)
    assert fetch_blob(keyless, bs[5]) == ("fetched", bs[5].data)
    # rotation: K2 current, K1 previous
    r1 = make_supervisor("--size", "64M", "--remote", url, "--remote-key-file", rot)
    r2 = make_supervisor("--size", "64M", "--remote", url, "--remote-key-file", rot)
    wait_until(lambda: r1.stats()["remote_on"] and r2.stats()["remote_on"], 10, "nodes up")
    assert fetch_blob(r1, bs[5]) == ("fetched", bs[5].data)  # signed with K1
    assert fetch_blob(r1, bs[1]) == ("fetched", bs[1].data)  # signed with K2
    put_written(r1, bs[6])
    assert stored_manifest(r, bs[6], (K2,)) is not None  # signed with the current key
    assert fetch_blob(r2, bs[6]) == ("fetched", bs[6].data)
    assert fetch_blob(a2, bs[6]) == ("none", None)  # K1 alone: not yet rotated
    no_internal_errors(keyless, other, a, a2, r1, r2)


# ----------------------------------------------------- settings of the tier (issue 22)
def test_remote_ttl_setting_bounds_every_key_it_writes(make_supervisor, redis_server):
    """``--remote-ttl 100``: the manifest, pieces and index of a written record all carry
    a TTL of at most 100 s (+60 s for pieces); the default (a day) would be far above."""
    from shmkv.supervisor.tiers.redis import layout as fmt

    sup = make_supervisor("--size", "16M", "--remote", redis_server.url, "--remote-ttl", "100")
    b = blob(900, 300_000)
    put_written(sup, b)
    r = redis_server.client()
    rid = remote_id(b.root, b"fp", np.ascontiguousarray(b.tokens, dtype="<i4").tobytes())
    assert 0 < r.pttl(fmt.manifest_key(rid)) <= 100_000
    assert 0 < r.pttl(fmt.piece_key(rid, 0)) <= 160_000
    assert 0 < r.pttl(fmt.index_key(b.root, CHUNK, b.digests()[-1])) <= 100_000
    r.close()


def test_remote_compress_setting_sends_zstd_and_falls_back_per_record(
    make_supervisor, redis_server
):
    """``--remote-compress zstd`` (as SHMKV_REMOTE_COMPRESS): a compressible payload is
    stored zstd (fewer bytes sent), a random one as is; node B gets both back whole."""
    env = {"SHMKV_REMOTE_COMPRESS": "zstd"}
    a = make_supervisor("--size", "16M", "--remote", redis_server.url, env_extra=env)
    b = make_supervisor("--size", "16M", "--remote", redis_server.url)
    text, noise = blob(901, 0), blob(902, 300_000)
    text = text._replace(data=b"the cat sits on the mat. " * 12_000)
    put_written(a, text, noise)
    r = redis_server.client()
    assert stored_manifest(r, text).codec == "zstd"
    assert stored_manifest(r, noise).codec == "none"
    st = a.stats()
    assert st["remote_stored_bytes"] < len(text.data) // 10 + len(noise.data), st
    r.close()
    wait_until(lambda: b.stats()["remote_on"], 10, "node B to reach Redis")
    assert fetch_blob(b, text) == ("fetched", text.data)
    assert fetch_blob(b, noise) == ("fetched", noise.data)
    no_internal_errors(a, b)


def test_remote_cluster_flag_makes_a_plain_url_a_cluster(make_supervisor, redis_cluster):
    """``--remote redis://ONE-NODE --remote-cluster``: records go to the node that owns
    their slot, across the cluster (a plain client on one node would get MOVED for most of
    them and count errors), and node B fetches them all."""
    from redis.cluster import RedisCluster

    url = f"redis://127.0.0.1:{redis_cluster[0]}/0"
    a = make_supervisor("--size", "16M", "--remote", url, "--remote-cluster")
    b = make_supervisor("--size", "16M", "--remote", url, env_extra={"SHMKV_REMOTE_CLUSTER": "1"})
    blobs = [blob(910 + i, 100_000) for i in range(6)]
    put_written(a, *blobs)
    assert not a.stats()["remote_errors"]
    rc = RedisCluster(host="127.0.0.1", port=redis_cluster[0])
    owners = {
        rc.get_node_from_key(k).port
        for k in rc.scan_iter("shmkv:*", target_nodes=RedisCluster.ALL_NODES)
    }
    rc.close()
    assert len(owners) > 1, owners  # (the records really live on several nodes)
    wait_until(lambda: b.stats()["remote_on"], 10, "node B to reach Redis")
    for bl in blobs:
        assert fetch_blob(b, bl) == ("fetched", bl.data)
    no_internal_errors(a, b)


def _fetch_after_stop(sup: Sup, srv: RedisProc, wait: float) -> tuple[str, float]:
    """``sup`` reaches Redis (its fetcher connected: one miss), then Redis is stopped
    (SIGSTOP: a server that takes the request and never answers); a fetch of ``wait``
    seconds: its status and how long it took."""
    wait_until(lambda: sup.stats()["remote_on"], 10, "the node to reach Redis")
    b = blob(920, 1000)
    assert fetch_blob(sup, b) == ("none", None)
    srv.proc.send_signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        status, data = fetch_blob(sup, b, wait=wait)
        took = time.monotonic() - t0
    finally:
        srv.proc.send_signal(signal.SIGCONT)
    assert data is None  # a miss
    return status, took


def test_remote_timeout_gives_up_on_a_server_that_never_answers(make_supervisor, redis_server):
    """``--remote-timeout 2.5`` with a Redis that never answers: the fetch gives up after
    the timeout (not before it, not at the worker's 60 s wait) and is a miss; the tier
    counts a timeout."""
    sup = make_supervisor(
        "--size", "16M", "--remote", redis_server.url, "--remote-timeout", "2.5",
        "--remote-wait", "60",
    )  # fmt: skip
    status, took = _fetch_after_stop(sup, redis_server, wait=60)
    assert status == "down" and 2.4 <= took < 40, (status, took)
    assert sup.stats()["remote_errors"].get("timeout", 0) >= 1
    no_internal_errors(sup)


def test_remote_wait_caps_a_workers_wait_and_zero_never_asks(make_supervisor, redis_server, models):
    """The supervisor's ``--remote-wait 0.5`` caps a worker that asks to wait 60 s (Redis
    stopped, --remote-timeout far off): "timeout" after the cap. A worker with
    SHMKV_REMOTE_WAIT=0 never asks at all."""
    sup = make_supervisor(
        "--size", "64M", "--remote", redis_server.url, "--remote-wait", "0.5",
        "--remote-timeout", "60",
    )  # fmt: skip
    status, took = _fetch_after_stop(sup, redis_server, wait=60)
    assert status == "timeout" and 0.45 <= took < 30, (status, took)
    asked = sup.stats()["remote_fetches"]
    got = run_worker(sup, models["seed0"], [completion(PROMPT)], env={"SHMKV_REMOTE_WAIT": "0"})
    assert got["results"][0]["last"]["remote"] in ("", None), got["results"][0]["last"]
    assert got["totals"]["remote_asked"] == 0 and sup.stats()["remote_fetches"] == asked
