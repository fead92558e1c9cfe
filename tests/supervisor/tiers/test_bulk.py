"""The fetcher's reads of pieces and chunks (``tiers/redis/bulk.py``): values written
straight into our buffers, against a real ``redis-server`` (read raw on a connection of
their own, and through redis-py's pipeline as for a cluster, whatever RESP the URL asks),
and against a peer that answers what Redis never would."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator

import pytest
import redis

from shmkv.core.errors import TierError
from shmkv.supervisor.tiers.redis.backend import classify
from shmkv.supervisor.tiers.redis.bulk import BulkReader
from tests.support.redis import NO_REDIS, REDIS

pytestmark = pytest.mark.skipif(REDIS is None, reason=NO_REDIS)


@pytest.fixture(
    params=[(True, 2), (True, 3), (False, 2), (False, 3)],
    ids=["raw-resp2", "raw-resp3", "redis-py-resp2", "redis-py-resp3"],
)
def reader(request, redis_server) -> Iterator[tuple[BulkReader, redis.Redis]]:
    raw, protocol = request.param
    client = redis.Redis.from_url(f"{redis_server.url}?protocol={protocol}", socket_timeout=5)
    r = BulkReader(client, raw=raw)
    assert BulkReader(client).raw  # (one pool: read raw unless told otherwise)
    yield r, client
    r.close()
    client.close()


def bufs(*sizes: int) -> list[bytearray]:
    return [bytearray(b"\xee" * n) for n in sizes]


def test_values_land_in_the_callers_buffers(reader):
    r, client = reader
    big = bytes(range(256)) * 40_000  # 10 MiB: many socket reads
    client.set("big", big)
    client.set("small", b"abc")
    client.set("empty", b"")
    client.rpush("list", b"x")
    out = bufs(len(big) + 1, 8, 8, 8, 8)
    reads = [
        ("big", memoryview(out[0])),
        ("small", memoryview(out[1])),
        ("missing", memoryview(out[2])),
        ("list", memoryview(out[3])),  # (another type: that key's miss, not an error)
        ("empty", memoryview(out[4])),
    ]
    assert r.read(reads) == [len(big), 3, 0, None, 0]
    assert out[0][: len(big)] == big and out[0][len(big)] == 0xEE
    assert out[1] == b"abc" + b"\xee" * 5
    assert out[2] == out[3] == out[4] == b"\xee" * 8
    # a value longer than asked for: no more than asked is read, and the rest of the
    # stream is where it should be (the next read on the connection is right)
    out = bufs(16, 4)
    assert r.read([("big", memoryview(out[0])), ("small", memoryview(out[1]))]) == [16, 3]
    assert out[0] == big[:16] and out[1] == b"abc\xee"


def test_a_server_error_is_raised_and_the_next_read_works(reader):
    r, client = reader
    client.set("k", b"value")
    client.execute_command("ACL", "SETUSER", "default", "-getrange")
    try:
        with pytest.raises((TierError, redis.RedisError)) as e:
            r.read([("k", memoryview(bytearray(8)))])
        assert classify(e.value).kind == "error"
    finally:
        client.execute_command("ACL", "SETUSER", "default", "+getrange")
    out = bytearray(8)
    assert r.read([("k", memoryview(out))]) == [5] and out[:5] == b"value"


class Liar:
    """A peer on a loopback port that answers every command ``+OK`` (redis-py's hello
    and client info) and GETRANGE with ``reply``, or not at all (None)."""

    def __init__(self, reply: Callable[[int], bytes] | None) -> None:
        self.reply = reply
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.conns = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.conns += 1
            threading.Thread(target=self._talk, args=(c,), daemon=True).start()

    def _talk(self, c: socket.socket) -> None:
        buf = b""
        with c:
            while True:
                while (cmd := self._command(buf)) is None:
                    got = c.recv(65536)
                    if not got:
                        return
                    buf += got
                args, buf = cmd
                if args[0].upper() != b"GETRANGE":
                    c.sendall(b"+OK\r\n")
                elif self.reply is not None:
                    c.sendall(self.reply(int(args[3]) + 1))

    @staticmethod
    def _command(buf: bytes) -> tuple[list[bytes], bytes] | None:
        """One RESP array of bulk strings from the front of ``buf``, and the rest."""
        if b"\r\n" not in buf:
            return None
        head, rest = buf.split(b"\r\n", 1)
        args = []
        for _ in range(int(head[1:])):
            if b"\r\n" not in rest:
                return None
            n, rest = rest.split(b"\r\n", 1)
            size = int(n[1:])
            if len(rest) < size + 2:
                return None
            args.append(rest[:size])
            rest = rest[size + 2 :]
        return args, rest

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize(
    "reply",
    [
        pytest.param(lambda n: b"$%d\r\n" % (n + 8) + b"x" * (n + 8) + b"\r\n", id="longer"),
        pytest.param(lambda n: b"$3\r\nabcXY", id="no-end"),
        pytest.param(lambda n: b"*1\r\n$1\r\nx\r\n", id="an-array"),
        pytest.param(lambda n: b"$" + b"9" * 2000, id="endless-header"),
        pytest.param(lambda n: b"$%d\r\nab" % n, id="cut"),
    ],
)
def test_a_reply_getrange_never_gives_is_refused_and_nothing_past_the_buffer_written(reply):
    liar = Liar(reply)
    client = redis.Redis(port=liar.port, socket_timeout=0.5)
    r = BulkReader(client)
    out = bytearray(b"\xee" * 24)
    try:
        for attempt in (1, 2):
            with pytest.raises((TierError, ConnectionError, OSError)) as e:
                r.read([("k", memoryview(out)[:16])])
            assert classify(e.value).kind in ("error", "down", "timeout")
            assert out[16:] == b"\xee" * 8
            # (the connection was dropped, its stream in an unknown state: a new one)
            assert liar.conns == attempt
    finally:
        r.close()
        client.close()
        liar.close()


def test_a_peer_that_never_answers_costs_the_timeout(redis_server):
    liar = Liar(None)
    client = redis.Redis(port=liar.port, socket_timeout=0.3)
    r = BulkReader(client)
    try:
        with pytest.raises((TimeoutError, socket.timeout)) as e:
            r.read([("k", memoryview(bytearray(16)))])
        assert classify(e.value).kind == "timeout"
    finally:
        r.close()
        client.close()
        liar.close()
