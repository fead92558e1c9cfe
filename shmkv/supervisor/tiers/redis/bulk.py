"""Values of MiBs read from Redis straight into the fetcher's buffers.

redis-py reads a reply 64 KiB at a time, joins the parts and copies the value out: on
this project's 2-core machine 0.4-0.8 GB/s for values of a few MiB over loopback, where
the socket gives 2 GB/s to ``recv_into`` (docs/guides/redis.md). A fetch is MiBs of pieces
and chunks, so the fetcher reads them on a connection of its own: redis-py opens it
(address, TLS, AUTH, SELECT, client name: whatever the URL says), then :class:`BulkReader`
sends pipelined ``GETRANGE`` commands on it and reads each bulk reply into the caller's
buffer. Nothing else is ever sent on that connection, so no reply of it is buffered in
redis-py's parser.

That connection speaks RESP2 whatever the URL asks (redis-py 8 speaks RESP3 by default,
and RESP3 may push a message between replies; a GETRANGE reply is the same in both).
Redis Cluster (a key's node is redis-py's to find) is read through a redis-py pipeline
instead, at its speed.

A reply that is not what ``GETRANGE`` answers, one longer than was asked for, a
timeout, a closed socket: the connection is dropped (the next read opens a new one) and
the error raised, for the fetcher to count as the tier's failure.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any

from shmkv.core.errors import TierError

#: a reply's header is read this much at a time (the rest of a value goes straight in)
_HEADER_READ = 64 << 10
#: a header line longer than this is not one Redis sends
_MAX_LINE = 1024

#: one read: (key, where its value goes: at most that many bytes of it are read)
Read = tuple[str, memoryview]


def is_wrongtype(e: BaseException) -> bool:
    """A reply about one key (of another type, or moved), not about the server."""
    import redis.exceptions as rex

    return isinstance(e, rex.ResponseError) and str(e).startswith("WRONGTYPE")


class BulkReader:
    """``GETRANGE key 0 n-1`` for many keys, each value written into a buffer of ours of
    ``n`` bytes."""

    def __init__(self, client: Any, raw: bool | None = None) -> None:
        self.client = client
        #: False: through a redis-py pipeline (a cluster's client has no one pool)
        self.raw = hasattr(client, "connection_pool") if raw is None else raw
        self._conn: Any = None
        self._pending = bytearray()

    def read(self, reads: Sequence[Read]) -> list[int | None]:
        """For each read, the value's length (its bytes at the start of its buffer; 0:
        no such key), or None: the key holds another type (``WRONGTYPE``)."""
        if not reads:
            return []
        if not self.raw:
            return self._piped(reads)
        try:
            return self._read(reads)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Drop the connection (a read in an unknown state, or the fetcher's end)."""
        conn, self._conn = self._conn, None
        self._pending.clear()
        if conn is not None:
            try:
                conn.disconnect()
            except Exception:  # closing: nothing to do about it
                pass

    # ------------------------------------------------------------ the raw path
    def _socket(self) -> socket.socket:
        if self._conn is None:
            pool = self.client.connection_pool
            # (RESP2; redis-py's maintenance notifications, RESP3 pushes, are not for it)
            kwargs = {
                k: v
                for k, v in pool.connection_kwargs.items()
                if not k.startswith("maint_notifications")
            }
            self._conn = pool.connection_class(**{**kwargs, "protocol": 2})
        self._conn.connect()  # (a no-op once connected)
        sock = getattr(self._conn, "_sock", None)
        if sock is None:
            raise TierError("remote tier: connection has no socket", "down")
        return sock  # type: ignore[no-any-return]

    def _read(self, reads: Sequence[Read]) -> list[int | None]:
        sock = self._socket()
        conn = self._conn
        packed = conn.pack_commands([("GETRANGE", key, 0, len(into) - 1) for key, into in reads])
        conn.send_packed_command(packed, check_health=False)
        out: list[int | None] = []
        for _key, into in reads:
            line = self._line(sock)
            if line[:1] == b"-":
                if line.startswith(b"-WRONGTYPE"):
                    out.append(None)
                    continue
                text = line[1:200].decode("utf-8", "replace")
                raise TierError(f"remote tier error: {text}", "error")
            if line[:1] != b"$" or not line[1:].isdigit():
                raise TierError(f"remote tier: not a GETRANGE reply: {line[:40]!r}", "error")
            length = int(line[1:])
            if length > len(into):
                raise TierError("remote tier: a GETRANGE reply longer than asked", "error")
            self._exact(sock, into[:length])
            if self._take(sock, 2) != b"\r\n":
                raise TierError("remote tier: a bulk reply without its end", "error")
            out.append(length)
        return out

    def _fill(self, sock: socket.socket) -> None:
        got = sock.recv(_HEADER_READ)
        if not got:
            raise ConnectionError("remote tier closed the connection")
        self._pending += got

    def _line(self, sock: socket.socket) -> bytes:
        while (end := self._pending.find(b"\r\n")) < 0:
            if len(self._pending) > _MAX_LINE:
                raise TierError("remote tier: a reply header too long", "error")
            self._fill(sock)
        line = bytes(self._pending[:end])
        del self._pending[: end + 2]
        return line

    def _take(self, sock: socket.socket, n: int) -> bytes:
        while len(self._pending) < n:
            self._fill(sock)
        got = bytes(self._pending[:n])
        del self._pending[:n]
        return got

    def _exact(self, sock: socket.socket, into: memoryview) -> None:
        """Fill ``into``: first with what the header's read took past it, then from the
        socket, straight in."""
        have = min(len(self._pending), len(into))
        into[:have] = self._pending[:have]
        del self._pending[:have]
        pos = have
        while pos < len(into):
            k = sock.recv_into(into[pos:], len(into) - pos)
            if k == 0:
                raise ConnectionError("remote tier closed the connection")
            pos += k

    # ------------------------------------------------------- redis-py's path
    def _piped(self, reads: Sequence[Read]) -> list[int | None]:
        pipe = self.client.pipeline(transaction=False)
        for key, into in reads:
            pipe.getrange(key, 0, len(into) - 1)
        out: list[int | None] = []
        for (_, into), got in zip(reads, pipe.execute(raise_on_error=False), strict=True):
            if isinstance(got, Exception):
                if not is_wrongtype(got):
                    raise got
                out.append(None)
                continue
            if len(got) > len(into):
                raise TierError("remote tier: a GETRANGE reply longer than asked", "error")
            into[: len(got)] = got
            out.append(len(got))
        return out
