"""Descriptors a hostile peer passes with SCM_RIGHTS must never stall the supervisor's loop.

Closing the last reference to a TCP socket with ``SO_LINGER`` on and unacknowledged data
blocks for the linger time (20 s here). A peer passes such sockets every way the protocol
lets it: as a put's memfd, as extra descriptors, more than allowed in one message, with a
frame it never completes, queued behind a request that gets its connection closed, inside
a Unix socket's queue, and on a connection the supervisor refuses at accept. Meanwhile a
victim on its own connection pings the supervisor: every ping must answer within 100 ms.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest

from tests.support.peer import Raw, memfd_with, put_msg
from tests.support.supervisors import Sup, assert_healthy
from tests.support.waiting import fd_count, wait_until

log = logging.getLogger(__name__)

pytestmark = pytest.mark.timeout(120)

#: what the hostile sockets linger for (a close of one blocks this long)
LINGER_S = 20
#: the longest a ping may take while the peer does its worst: a close on the loop stalls
#: it LINGER_S; this leaves a loaded machine's scheduling delays far below that alone
PING_MAX = LINGER_S / 4

# A victim on its own connection: pings until its stdin closes (and 5 times more), then
# prints every ping's start (CLOCK_MONOTONIC, the same clock as the test's) and round trip.
PINGER = r"""
import json, select, socket, struct, sys, time
import msgpack
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(120)
s.connect(sys.argv[1])
def recv_exact(n):
    buf = b""
    while len(buf) < n:
        got = s.recv(n - len(buf))
        if not got:
            raise SystemExit("supervisor closed the victim's connection")
        buf += got
    return buf
pings, i, last = [], 0, None
print("ready", flush=True)
while last is None or i < last:
    if last is None and select.select([sys.stdin], [], [], 0)[0]:
        last = i + 5
    i += 1
    body = msgpack.packb({"op": "ping", "id": i})
    t0 = time.monotonic()
    s.sendall(struct.pack(">I", len(body)) + body)
    (n,) = struct.unpack(">I", recv_exact(4))
    reply = msgpack.unpackb(recv_exact(n))
    pings.append((t0, time.monotonic() - t0))
    assert reply["ok"] and reply["id"] == i, reply
    time.sleep(0.005)
print(json.dumps(pings), flush=True)
"""


class Pinger:
    """The victim process; :meth:`stop` returns its pings as (start, seconds)."""

    def __init__(self, sup: Sup) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", PINGER, sup.socket],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().strip() == "ready"

    def stop(self) -> list[tuple[float, float]]:
        out, _ = self.proc.communicate("", timeout=LINGER_S * 4)
        assert self.proc.returncode == 0, out
        return [tuple(p) for p in json.loads(out)]


def slow_pings(
    pings: list[tuple[float, float]], paused: list[tuple[float, float]] = ()
) -> list[tuple[float, float]]:
    """Pings over PING_MAX, leaving out those that overlap a window the test paused the
    supervisor in (SIGSTOP) on purpose."""
    out = []
    for t0, dt in pings:
        if any(t0 < b and t0 + dt > a for a, b in paused):
            continue
        if dt > PING_MAX:
            out.append((t0, dt))
    return out


def slowest(pings: list[tuple[float, float]], paused: list[tuple[float, float]]) -> float:
    """The slowest ping outside the pause windows, in ms."""
    kept = [dt for t0, dt in pings if not any(t0 < b and t0 + dt > a for a, b in paused)]
    return 1000 * max(kept, default=0.0)


class Lingering:
    """TCP connections whose last close blocks for LINGER_S: SO_LINGER on, and a send
    queue the receiver (kept open here, never reading) does not acknowledge."""

    def __init__(self) -> None:
        self.srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.srv.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.srv.bind(("127.0.0.1", 0))
        self.srv.listen(64)
        self.receivers: list[socket.socket] = []

    def make(self) -> socket.socket:
        c = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        c.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        c.connect(self.srv.getsockname())
        r, _ = self.srv.accept()
        self.receivers.append(r)
        c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, LINGER_S))
        c.setblocking(False)
        try:
            while True:
                c.send(b"x" * 65536)
        except BlockingIOError:
            pass
        return c

    def close(self) -> None:
        for r in self.receivers:
            r.close()
        self.srv.close()


@contextmanager
def lingering() -> Iterator[Lingering]:
    ling = Lingering()
    try:
        yield ling
    finally:
        ling.close()


def pass_and_drop(r: Raw, msg: dict | None, socks: list[socket.socket], extra: list[int] = ()):
    """Send ``socks`` (and ``extra`` fds) with ``msg`` and close our copies. Run it while
    the supervisor is paused: a descriptor in flight is not closed by our close, so the
    supervisor ends up holding the last reference to each (else our close would block)."""
    fds = [*extra, *(s.fileno() for s in socks)]
    if msg is None:
        r.send_raw(struct.pack(">I", 500) + b"\x85", fds)  # a frame that never completes
    else:
        r.send(msg, fds)
    for s in socks:
        s.close()


@contextmanager
def paused(sup: Sup, windows: list[tuple[float, float]]) -> Iterator[None]:
    """Stop the supervisor (SIGSTOP) while the body queues data, so that it is all there
    when the loop next reads; records the window (pings overlapping it do not count)."""
    t0 = time.monotonic()
    os.kill(sup.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(sup.proc.pid, signal.SIGCONT)
        windows.append((t0, time.monotonic()))


def answer(r: Raw) -> dict | None:
    """The supervisor's next reply (None: it hung up); fails if its loop is stalled."""
    try:
        return r.recv()
    except TimeoutError:
        raise AssertionError(
            "the supervisor did not answer within 5 s: its loop is stalled"
        ) from None


def hung_up(r: Raw) -> bool:
    if r.closed_by_peer():
        return True
    raise AssertionError("the supervisor did not hang up within 5 s: its loop is stalled")


# Each way a peer can get descriptors to the supervisor: (sup, lingering sockets, the
# attached hostile peer, the pause windows); each returns how many descriptors it passed.
def as_a_puts_memfd(sup: Sup, ling: Lingering, r: Raw, stopped: list) -> int:
    tokens = np.arange(r.geometry.chunk_tokens, dtype=np.int32)
    with paused(sup, stopped):
        pass_and_drop(r, put_msg(tokens, b"x" * 64), [ling.make()])
    assert answer(r)["error"]["code"] == "bad_request"
    return 1


def beside_a_request_that_takes_none(sup: Sup, ling: Lingering, r: Raw, stopped: list) -> int:
    with paused(sup, stopped):
        pass_and_drop(r, {"op": "ping"}, [ling.make(), ling.make()])
    assert answer(r)["ok"]
    return 2


def more_than_allowed_in_one_message(sup: Sup, ling: Lingering, r: Raw, stopped: list) -> int:
    with paused(sup, stopped):
        m = Raw(sup.socket)
        pass_and_drop(m, {"op": "ping"}, [ling.make() for _ in range(6)])
    assert hung_up(m)
    m.close()
    return 6


def with_a_frame_never_completed(sup: Sup, ling: Lingering, r: Raw, stopped: list) -> int:
    with paused(sup, stopped):
        t = Raw(sup.socket)
        pass_and_drop(t, None, [ling.make()])
        t.sock.shutdown(socket.SHUT_WR)
    assert hung_up(t)
    t.close()
    return 1


def unread_when_the_connection_closes(sup: Sup, ling: Lingering, r: Raw, stopped: list) -> int:
    """Queued behind a message that gets the connection closed (too many fds)."""
    with paused(sup, stopped):
        q = Raw(sup.socket)
        too_many = [memfd_with(b"y") for _ in range(5)]
        pass_and_drop(q, {"op": "ping"}, [], extra=too_many)
        for fd in too_many:
            os.close(fd)
        pass_and_drop(q, {"op": "ping"}, [ling.make()])
    assert hung_up(q)
    q.close()
    return 5


def inside_a_unix_sockets_queue(sup: Sup, ling: Lingering, r: Raw, stopped: list) -> int:
    with paused(sup, stopped):
        a, b = socket.socketpair()
        inner = ling.make()
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", inner.fileno()))]
        b.sendmsg([b"z"], rights)
        inner.close()
        pass_and_drop(r, {"op": "ping"}, [a])
        b.close()
    assert answer(r)["ok"]
    return 1


@pytest.mark.parametrize(
    "how",
    [
        as_a_puts_memfd,
        beside_a_request_that_takes_none,
        more_than_allowed_in_one_message,
        with_a_frame_never_completed,
        unread_when_the_connection_closes,
        inside_a_unix_sockets_queue,
    ],
    ids=lambda f: f.__name__,
)
def test_lingering_sockets_passed_as_fds_never_stall_the_loop(make_supervisor, how) -> None:
    sup = make_supervisor("--size", "16M")
    with sup.client() as c:  # warm up: what a first client costs
        c.stats()
    base = fd_count(sup.proc.pid)
    stopped: list[tuple[float, float]] = []
    victim = Pinger(sup)
    with lingering() as ling:
        r = Raw(sup.socket)
        r.attach()
        passed = how(sup, ling, r, stopped)
        passed += how(sup, ling, r, stopped)  # (and again, with the first still closing)
        # the passed descriptors closed (the victim and r still connected), then a reply
        # to r: the victim pinged all through the closes
        wait_until(lambda: fd_count(sup.proc.pid) <= base + 2, 10, "the descriptors' close")
        assert r.call({"op": "ping"})["ok"]
        pings = victim.stop()
        assert len(pings) >= 5
        assert not slow_pings(pings, stopped), slow_pings(pings, stopped)
        log.info("%s: %d pings, slowest %.1f ms", how.__name__, len(pings), slowest(pings, stopped))
        r.close()
        assert sup.stats()["foreign_fds"] == passed
        wait_until(lambda: fd_count(sup.proc.pid) <= base, 10, "the connections' close")
    assert_healthy(sup)


def test_refused_connection_carrying_lingering_sockets_never_stalls_the_loop(
    make_supervisor,
) -> None:
    """A connection over --max-connections is refused at accept and closed: whatever it
    queued before is released with it."""
    sup = make_supervisor("--size", "16M", "--max-connections", "1")
    stopped: list[tuple[float, float]] = []
    base = fd_count(sup.proc.pid)
    victim = Pinger(sup)  # the one connection allowed
    with lingering() as ling:
        peers = []
        for _ in range(3):
            with paused(sup, stopped):
                p = Raw(sup.socket)
                pass_and_drop(p, {"op": "ping"}, [ling.make(), ling.make()])
                peers.append(p)
            reply = answer(p)
            assert reply is not None and reply["error"]["code"] == "busy", reply
        # the refused connections' descriptors closed while the victim pinged
        wait_until(lambda: fd_count(sup.proc.pid) <= base + 1, 10, "the descriptors' close")
        pings = victim.stop()
        for p in peers:
            p.close()
    assert len(pings) >= 5
    assert not slow_pings(pings, stopped), slow_pings(pings, stopped)
    log.info("refused connections: %d pings, slowest %.1f ms", len(pings), slowest(pings, stopped))
    assert_healthy(sup)
