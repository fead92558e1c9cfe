"""One peer cannot take what every peer shares: bounded resources, each counted.

Each test is a reproducer against a real ``shmkv supervise``: pinned bytes, read leases
and prefill claims per connection, unread replies per connection and in total, what one
msgpack frame may decode into, and a put that must evict thousands of records from a
fragmented arena while another peer pings. Settings the tests lower go through
``SHMKV_*`` variables.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import select
import subprocess
import sys
import time

import msgpack
import numpy as np
import pytest

from shmkv import ShmkvError
from shmkv.core import arena as A
from shmkv.core.keys import chain_digests
from shmkv.supervisor.put import STAGE_BUDGET
from tests.support import MiB
from tests.support.blobs import CHUNK, blob
from tests.support.kvblobs import kv_state
from tests.support.peer import Raw, put_msg
from tests.support.supervisors import Sup
from tests.support.waiting import cpu_seconds, fd_count, mapped_kib, wait_until

pytestmark = pytest.mark.timeout(300)


def vm(pid: int, field: str) -> int:
    """A VmRSS/VmHWM-style line of /proc/PID/status, in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def ping_ms(raw: Raw, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        assert raw.call({"op": "ping"})["ok"]
        out.append((time.perf_counter() - t0) * 1e3)
    return out


PINGER = r"""
import json, select, sys, time
from tests.support.peer import Raw
raw = Raw(sys.argv[1], timeout=60)
print("ready", flush=True)
out = []
while True:
    t0 = time.monotonic()
    assert raw.call({"op": "ping"})["ok"]
    out.append((t0, time.monotonic()))
    if select.select([sys.stdin], [], [], 0.005)[0]:  # a line on stdin: stop
        break
print(json.dumps(out), flush=True)
"""


class Pinger:
    """Another process that pings the supervisor every 5 ms; ``pings``: when each was sent
    and answered (CLOCK_MONOTONIC, the test's clock too)."""

    def __init__(self, sup: Sup) -> None:
        self.sup = sup
        self.pings: list[tuple[float, float]] = []

    def __enter__(self) -> Pinger:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", PINGER, self.sup.socket],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "ready"
        return self

    def __exit__(self, *exc: object) -> None:
        out, _ = self.proc.communicate("stop\n", timeout=60)
        self.pings = [(a, b) for a, b in json.loads(out)]


def fill_small(sup: Sup, n: int, size: int, seed: int = 0) -> list[tuple[bytes, np.ndarray]]:
    """Put ``n`` small one-chunk records; returns their (root, tokens)."""
    rng = np.random.default_rng(seed)
    keys = []
    with sup.client(timeout=30) as c:
        data = rng.bytes(size)
        for i in range(n):
            root = hashlib.blake2b(b"small-%d-%d" % (seed, i), digest_size=16).digest()
            tokens = rng.integers(0, 30_000, CHUNK).astype("<i4")
            c.put_bytes(root, tokens, b"fp", data)
            keys.append((root, tokens))
    return keys


# -------------------------------------------------------------------------- 8a: pins
def test_a_pinned_put_of_the_whole_region_cannot_lock_every_later_put_out(make_supervisor):
    sup = make_supervisor("--size", "16M")
    st = sup.stats()
    _, _, pay_off, _ = A.record_layout(2 * CHUNK, 2, 1)
    whole = blob(1, st["bytes_capacity"] - pay_off)
    with sup.client() as c:
        for i in range(4):  # something to evict
            b = blob(10 + i, MiB)
            c.put_bytes(b.root, b.tokens, b"fp", b.data)
        try:
            c.put_bytes(whole.root, whole.tokens, b"fp", whole.data, pin=True)
        except ShmkvError as e:  # refused before it evicts anything
            assert e.code == "limit" and "--max-pinned-percent" in str(e), e
        after = sup.stats()
        assert after["entries"] == 4 and after["evictions"] == 0, after
        # later puts are never locked out
        for i in range(8):
            b = blob(20 + i, 3 * MiB)
            c.put_bytes(b.root, b.tokens, b"fp", b.data)
        # a pin within the limit (half the data region by default) works; one past it is
        # refused, and unpinning makes room for it
        half = blob(2, st["bytes_capacity"] // 2 - pay_off - A.PAGE)
        c.put_bytes(half.root, half.tokens, b"fp", half.data, pin=True)
        small = blob(3, 2 * MiB)
        with pytest.raises(ShmkvError, match="--max-pinned-percent") as exc:
            c.put_bytes(small.root, small.tokens, b"fp", small.data, pin=True)
        assert exc.value.code == "limit"
        c.put_bytes(small.root, small.tokens, b"fp", small.data)  # unpinned: fine
        key = chain_digests(small.root, small.tokens, CHUNK)[-1]
        with pytest.raises(ShmkvError, match="--max-pinned-percent"):
            c.pin(key)  # the pin op has the same limit
        c.pin(chain_digests(half.root, half.tokens, CHUNK)[-1], False)
        assert c.pin(key) == 1
    st = sup.stats()
    assert st["pins_refused"] == 3, st
    assert st["pinned_bytes"] <= st["bytes_capacity"] // 2, st


def test_max_pinned_percent_sets_the_pin_limit(make_supervisor):
    """``--max-pinned-percent 10``: a pinned put of a fifth of the data region (which the
    default, half, takes) is refused with the setting's name; one of a twentieth is not."""
    sup = make_supervisor("--size", "16M", "--max-pinned-percent", "10")
    cap = sup.stats()["bytes_capacity"]
    fifth, twentieth = blob(30, cap // 5), blob(31, cap // 20)
    with sup.client() as c:
        with pytest.raises(ShmkvError, match="--max-pinned-percent") as exc:
            c.put_bytes(fifth.root, fifth.tokens, b"fp", fifth.data, pin=True)
        assert exc.value.code == "limit"
        c.put_bytes(twentieth.root, twentieth.tokens, b"fp", twentieth.data, pin=True)
    st = sup.stats()
    assert st["pins_refused"] == 1 and 0 < st["pinned_bytes"] <= cap // 10, st


# ------------------------------------------------------------------------ 8b: leases
def test_one_connection_cannot_hold_unbounded_leases(make_supervisor):
    """A peer that acquires and never releases: today 300,000 leases were granted."""
    sup = make_supervisor("--size", "16M", env_extra={"SHMKV_MAX_LEASES": "100"})
    b = blob(1, 10_000)
    with sup.client() as c:
        c.put_bytes(b.root, b.tokens, b"fp", b.data)
        hit = c.lookup(b.digests())
        assert hit is not None
    raw = Raw(sup.socket)
    raw.attach()
    want = 2_000
    for _ in range(want):  # pipelined: send all, then read all
        raw.send({"op": "acquire", "offset": hit.slot.rec_offset, "gen": hit.slot.rec_gen})
    replies = [raw.recv() for _ in range(want)]
    granted = [r for r in replies if r["ok"]]
    refused = [r for r in replies if not r["ok"]]
    assert len(granted) == 100, len(granted)
    assert {r["error"]["code"] for r in refused} == {"limit"}
    assert "--max-leases" in refused[0]["error"]["message"]
    st = sup.stats()
    assert st["leases_active"] == 100 and st["leases_refused"] == want - 100, st
    # releasing one makes room for one more; another connection has its own allowance
    assert raw.call({"op": "release", "lease": granted[0]["lease"]})["ok"]
    assert raw.call({"op": "acquire", "offset": hit.slot.rec_offset, "gen": hit.slot.rec_gen})["ok"]
    with sup.client() as c, c.acquire(hit) as lease:
        assert bytes(lease.payload) == b.data
    raw.close()
    wait_until(lambda: sup.stats()["leases_active"] == 0, what="the leases to go with the peer")


# ------------------------------------------------------------------------ 8c: replies
def ls_flood(sup: Sup, conns: int, requests: int) -> list[Raw]:
    """``conns`` connections that each ask for ``requests`` big ls replies and read none."""
    peers = [Raw(sup.socket, timeout=2) for _ in range(conns)]
    for p in peers:
        for _ in range(requests):
            p.send({"op": "ls", "limit": 100_000})
    return peers


def test_unread_replies_are_bounded_per_connection_and_in_total(make_supervisor):
    """Peers that ask and never read: today each could leave 16 MiB queued, 256 of them."""
    sup = make_supervisor(
        "--size",
        "64M",
        "--index-slots",
        "16384",
        env_extra={"SHMKV_MAX_UNREAD": "2M", "SHMKV_MAX_UNREAD_TOTAL": "8M"},
    )
    fill_small(sup, 2_000, 1000)
    with sup.client() as c:
        one = len(msgpack.packb(c.ls(100_000)))
    assert one > 200_000  # each ls reply is ~0.3 MiB
    pid = sup.proc.pid
    rss0 = vm(pid, "VmRSS")

    # one connection: closed once it leaves more than --max-unread unread
    (hog,) = ls_flood(sup, 1, 40)  # ~12 MiB of replies
    wait_until(lambda: hog.closed_by_peer(), 10, "the supervisor to drop the peer")
    hog.close()

    # many connections, each under its own limit: together past --max-unread-total
    peers = ls_flood(sup, 16, 5)  # ~1.5 MiB each, 24 MiB in all
    last: list[tuple[int, int] | None] = [None]

    def answered_all() -> dict | None:  # (two stats alike: a turn of its loop changed nothing)
        st = sup.stats()
        before, last[0] = last[0], (st["unread_bytes"], st["unread_dropped"])
        return st if last[0] == before else None

    st = wait_until(answered_all, 20, "the supervisor to answer every request it read", 0.05)
    rss = vm(pid, "VmRSS")
    assert st["unread_bytes"] <= 8 * MiB + one, st
    assert rss - rss0 < 32 * MiB, (rss - rss0) / MiB
    closed = sum(p.closed_by_peer() for p in peers)
    assert 8 <= closed < 16, closed
    for p in peers:
        p.close()
    st = sup.stats()
    assert st["unread_dropped"] == 1 + closed, st
    with sup.client() as c:  # a peer that reads its replies is served throughout
        assert c.ls(100_000)["total"] == 2_000


def test_a_reply_past_the_frame_cap_is_an_error_not_a_crash(make_supervisor):
    """`ls` of every entry of a big arena encodes to more than a frame (4 MiB)."""
    sup = make_supervisor("--size", "256M", "--index-slots", "131072")
    fill_small(sup, 30_000, 100)
    with sup.client(timeout=30) as c:
        with pytest.raises(ShmkvError, match="limit"):
            c.ls(100_000)
        assert c.ls(1000)["total"] == 30_000
    assert sup.proc.poll() is None, sup.log()[-3000:]


# ---------------------------------------------------------------------- 8d: msgpack
def test_a_frame_of_empty_maps_costs_neither_memory_nor_time(supervisor):
    """4 MiB of `{}`: today it decoded into 288 MiB of dicts in 0.35 s, loop stalled."""
    body = msgpack.packb({f"k{i}": [{}] * 65_536 for i in range(63)})
    assert len(body) <= 4 << 20
    pid = supervisor.proc.pid
    raw = Raw(supervisor.socket)
    raw.call({"op": "ping"})
    hwm0, cpu0 = vm(pid, "VmHWM"), cpu_seconds(pid)
    raw.send_body(body)
    reply = raw.recv()
    took = cpu_seconds(pid) - cpu0  # (CPU time, not wall: a loaded machine does not add to it)
    grew = vm(pid, "VmHWM") - hwm0
    assert grew < 16 * MiB and took < 0.1, (grew / MiB, took)
    assert reply is not None and reply["error"]["code"] == "protocol", reply
    assert raw.call({"op": "ping"})["ok"]
    assert supervisor.stats()["frames_refused"] == 1
    raw.close()


# ------------------------------------------------------------------------- 8e: claims
def test_many_claims_do_not_slow_every_ping(make_supervisor):
    """64 connections x 4,096 claims: today every turn of the loop scanned them all."""
    sup = make_supervisor("--size", "16M")
    probe = Raw(sup.socket)
    ping_ms(probe, 50)
    # the supervisor's CPU time for 200 pings, not their wall time (the machine is loaded)
    cpu0 = cpu_seconds(sup.proc.pid)
    ping_ms(probe, 200)
    before = cpu_seconds(sup.proc.pid) - cpu0
    peers = []
    for k in range(64):
        p = Raw(sup.socket)
        p.attach()
        digests = b"".join(
            hashlib.blake2b(b"claim-%d-%d" % (k, i), digest_size=16).digest() for i in range(4096)
        )
        assert p.call({"op": "claim", "digests": digests, "wait": 0})["status"] == "go"
        peers.append(p)
    cpu0 = cpu_seconds(sup.proc.pid)
    ping_ms(probe, 200)
    after = cpu_seconds(sup.proc.pid) - cpu0
    st = sup.stats()
    for p in peers:
        p.close()
    probe.close()
    assert after < 5 * before + 0.2, (before, after)  # (scanning every claim: seconds)
    assert st["claims_held"] == 64 * 1024, st
    assert st["claims_refused"] == 64 * (4096 - 1024), st


def test_max_claims_caps_the_claims_of_one_connection(make_supervisor):
    """``--max-claims 3``: of a claim of 8 digests, the first 3 are held (another peer
    waits on them), the other 5 are refused and counted (another peer just goes)."""
    sup = make_supervisor("--size", "16M", "--max-claims", "3")
    ds = blob(40, 0, n_tokens=8 * CHUNK).digests()
    with sup.client() as a, sup.client() as b:
        assert a.claim(ds, wait=0) == "go"
        st = sup.stats()
        assert st["claims_held"] == 3 and st["claims_refused"] == 5, st
        assert b.claim(ds[2:], wait=0.2) == "timeout"  # a holds ds[2]
        assert b.claim(ds[3:], wait=30) == "go"  # nobody holds ds[3]


# ------------------------------------------------------------- 9: eviction, slices
def test_a_huge_put_into_a_fragmented_arena_keeps_answering_pings(make_supervisor):
    """A fragmented arena and one put that must evict nearly all of it: today 40,082
    evictions took 14.6 s in one go, and every worker timed out. Done in slices, the
    loop answers another peer's pings all along the put: many within it, and none waits
    for a good part of it (wall-time bounds relative to the put's own time: a loaded
    machine stretches both)."""
    sup = make_supervisor("--size", "512M")
    cap = sup.stats()["bytes_capacity"]
    _, _, pay_off, extent = A.record_layout(CHUNK, 2, 60 * 1024)
    n = cap // extent
    keys = fill_small(sup, n, 60 * 1024)
    # touch every other record: the LRU order is no longer the address order, so eviction
    # leaves holes that do not merge until late (the fragmentation of a long-running arena)
    touched = keys[1::2]
    np.random.default_rng(1).shuffle(touched)
    with sup.client(timeout=30) as c:
        for root, tokens in touched:
            hit = c.lookup(chain_digests(root, tokens, CHUNK))
            with c.acquire(hit) as lease:
                lease.finish()
    big = b"\x5a" * (cap * 3 // 10)
    root = hashlib.blake2b(b"huge", digest_size=16).digest()
    tokens = np.arange(4 * CHUNK, dtype="<i4")
    with sup.client(timeout=120) as c:
        blob_ = c.prepare(len(big), lambda addr, size: ctypes.memmove(addr, big, size))
        with Pinger(sup) as pinger:  # another process: this one's GIL is not the loop
            t0 = time.monotonic()
            c.put_blob(root, tokens, b"fp", blob_)
            t1 = time.monotonic()
    st = sup.stats()
    assert st["evictions"] > n // 2, st
    during = [(a, b) for a, b in pinger.pings if t0 < b < t1]  # answered during the put
    slowest = max(b - a for a, b in pinger.pings)
    # (in one go: none answered during the put, and one waits for all of it)
    assert len(during) >= 5 and slowest < (t1 - t0) / 2, (len(during), slowest, t1 - t0)
    assert st["puts_sliced"] == 1, st
    with sup.client() as c:
        hit = c.lookup(chain_digests(root, tokens, CHUNK))
        assert hit is not None and hit.chunks == 4
        with c.acquire(hit) as lease:
            assert lease.record.payload_len == len(big)
            assert bytes(lease.payload) == big
            assert lease.finish()  # read under a lease nobody revoked


def test_a_sliced_put_answers_in_order_and_a_closed_peer_gives_its_space_back(
    make_supervisor,
):
    """A put done over many turns: the same connection's next requests wait for its reply
    (replies stay in order), other connections are served meanwhile, and a peer that goes
    away mid-put leaves neither its space nor its memfd behind."""
    sup = make_supervisor("--size", "256M", env_extra={"SHMKV_PUT_SLICE": "0.0001"})
    data = b"\x33" * (64 * MiB)
    tokens = np.arange(2 * CHUNK, dtype="<i4")
    raw = Raw(sup.socket, timeout=30)
    raw.attach()
    other = Raw(sup.socket)
    fd = os.memfd_create("test-put", os.MFD_CLOEXEC)
    try:
        os.write(fd, data)
        raw.send(put_msg(tokens, data), [fd])
        for _ in range(3):
            raw.send({"op": "ping"})
        assert other.call({"op": "ping"})["ok"]  # served while the put goes on
        replies = [raw.recv() for _ in range(4)]
    finally:
        os.close(fd)
    assert [r["id"] for r in replies] == [2, 3, 4, 5], replies  # (1 was the attach)
    assert "gen" in replies[0] and all(r["ok"] for r in replies), replies
    st = sup.stats()
    assert st["puts_sliced"] == 1 and st["entries"] == 1, st
    used, fds = st["bytes_used"], fd_count(sup.proc.pid)

    # a peer that closes its connection in the middle of a sliced put
    fd = os.memfd_create("test-put", os.MFD_CLOEXEC)
    try:
        os.write(fd, data)
        raw.send(put_msg(tokens + 1, data), [fd])
    finally:
        os.close(fd)
    raw.close()
    # (the stats request is a connection too)
    wait_until(lambda: sup.stats()["connections"] == 2, what="the peer to be gone")
    st = sup.stats()
    assert st["bytes_used"] == used and st["entries"] == 1, st
    assert fd_count(sup.proc.pid) <= fds, (fd_count(sup.proc.pid), fds)
    other.close()


def test_a_burst_of_puts_holds_a_bounded_share_of_the_supervisor_memory(make_supervisor):
    """Six workers publish a 24 MiB state each at once. Each put staged its whole payload
    in the supervisor's heap and split it into a second copy, every put in progress at
    the same time: 6 x 48 MiB of anonymous memory at the peak, kept by the heap after.
    Now the puts in progress stage at most ``STAGE_BUDGET`` bytes (two of these), each
    group goes from the staged payload straight to its place, and the staging is given
    back to the kernel when the put ends."""
    sup = make_supervisor("--size", "512M", env_extra={"SHMKV_PUT_SLICE": "0.001"})
    n_tok, row = 4096, 1536  # 4,096 cells x 2 layers x (K + V) x 1,536 bytes: 24 MiB
    states = [kv_state(np.arange(n_tok) + 100_000 * i, row=row) for i in range(6)]
    size = len(states[0])
    assert size > 24 * MiB
    pid = sup.proc.pid
    raws, fds = [], []
    try:
        for data in states:
            raw = Raw(sup.socket, timeout=120)
            raw.attach()
            fd = os.memfd_create("test-put", os.MFD_CLOEXEC)
            os.write(fd, data)
            raws.append(raw)
            fds.append(fd)
        base = vm(pid, "RssAnon")
        for i, (raw, fd, data) in enumerate(zip(raws, fds, states, strict=True)):
            raw.send(put_msg(np.arange(n_tok, dtype="<i4") + 100_000 * i, data), [fd])
        peak, replies = base, []
        for raw in raws:
            while not select.select([raw.sock], [], [], 0.001)[0]:  # (sampled till it replies)
                peak = max(peak, vm(pid, "RssAnon"))
            replies.append(raw.recv())
        after = vm(pid, "RssAnon")
    finally:
        for fd in fds:
            os.close(fd)
        for raw in raws:
            raw.close()
    assert all("gen" in r for r in replies), replies
    st = sup.stats()
    assert st["entries"] == 6 and st["chunked_puts"] == 6, st
    grown = (peak - base) / MiB
    # at most the budget staged (two 24 MiB payloads), a group's scratch and the loop's own
    assert grown < STAGE_BUDGET / MiB + 16, f"{grown:.0f} MiB of anonymous memory at the peak"
    assert (after - base) / MiB < 16, f"{(after - base) / MiB:.0f} MiB kept after the puts"


def test_a_worker_keeps_no_copy_of_the_states_it_published(make_supervisor):
    """A worker's memfds stayed warm between puts, each holding the last state handed over
    in it: on a large model hundreds of MiB per worker, idle. The pool keeps the memfds
    and their mappings, and gives their pages back after each put."""
    sup = make_supervisor("--size", "128M")
    data = os.urandom(8 * MiB)
    with sup.client() as c:
        for i in range(3):
            root = hashlib.blake2b(b"kept %d" % i, digest_size=16).digest()
            c.put_bytes(root, np.arange(2 * CHUNK, dtype="<i4"), b"fp", data)
            held = mapped_kib("/memfd:shmkv-put (deleted)")  # (resident kB of each)
            assert len(held) == 1, held  # one memfd, made once and reused
            assert held[0] == 0, f"{held[0] / 1024:.1f} MiB of the last state kept"
        assert sup.stats()["entries"] == 3


def test_records_sharing_a_prefix_do_not_slow_puts_and_evictions(make_supervisor):
    """Thousands of prompts behind one system prompt: each put and each eviction re-chose
    the record every shared chunk prefix points at by scanning all of its owners, so a put
    cost more with every record (9 ms each at 4,000)."""
    sup = make_supervisor("--size", "64M", "--index-slots", "65536")
    rng = np.random.default_rng(0)
    system = rng.integers(0, 30_000, 16 * CHUNK).astype("<i4")
    root = hashlib.blake2b(b"system", digest_size=16).digest()
    data = rng.bytes(2000)
    pid = sup.proc.pid
    cpu = []  # the supervisor's CPU time at each put (not wall time: the machine is loaded)
    with sup.client(timeout=60) as c:
        for _ in range(3_000):
            tokens = np.concatenate([system, rng.integers(0, 30_000, CHUNK).astype("<i4")])
            cpu.append(cpu_seconds(pid))
            c.put_bytes(root, tokens, b"fp", data)
        cpu.append(cpu_seconds(pid))
        first, last = cpu[300] - cpu[0], cpu[-1] - cpu[-301]  # 300 puts each
        assert last < 3 * first + 0.1, (first, last)
        # a put that evicts most of them is as quick per eviction
        st = sup.stats()
        big = b"\x44" * (st["bytes_capacity"] * 8 // 10)
        cpu0 = cpu_seconds(pid)
        c.put_bytes(root, np.arange(2 * CHUNK, dtype="<i4"), b"fp", big)
        took = cpu_seconds(pid) - cpu0
    evictions = sup.stats()["evictions"] - st["evictions"]
    assert evictions > 2_000 and took / evictions < 0.001, (evictions, took)
