"""The supervisor's connection I/O: frames and descriptors in, replies out, closes.

Runs in the supervisor only, on its loop's thread. :class:`ConnIO` keeps the open
connections (``listener.Conn``) and does what each one's socket needs: reads its
frames and the descriptors sent with them (``SCM_RIGHTS``), keeps the frames that
wait while a request of the connection is worked on over several turns (a backlog,
bounded), hands each frame in order to the supervisor's dispatch, queues and
flushes replies (with descriptors), bounds the bytes of replies a peer leaves
unread (``--max-unread`` per connection, ``--max-unread-total`` in all), and closes
a connection: its socket and the descriptors no put took go to the closer thread
(``fdcloser.py``). What a request does is the supervisor's (``loop.py``) and
the ops' (``ops.py``); a close tells the supervisor through ``closed``.
"""

from __future__ import annotations

import selectors
import socket
import struct
from collections.abc import Callable
from typing import Any

from shmkv.core.config import Settings
from shmkv.core.errors import ProtocolError, ShmkvError
from shmkv.core.protocol import MAX_FRAME, encode
from shmkv.core.stats import ArenaCounters, LimitCounters
from shmkv.supervisor.fdcloser import SCM_MAX_FD, discard, discard_socket, fds_of
from shmkv.supervisor.listener import Conn

__all__ = ["MAX_BACKLOG", "MAX_PENDING_FDS", "ConnIO"]

#: descriptors a peer may have in flight (one per put)
MAX_PENDING_FDS = 4
#: bytes of requests read from a busy connection (see ``Conn.busy``) before the loop
#: stops reading it until its request is answered
MAX_BACKLOG = 2 * (MAX_FRAME + 4)


class ConnIO:
    """The open connections and their I/O: reading, backlog, replies, unread limits, close.

    ``handle(conn, body)`` dispatches one frame; ``closed(conn, reason)`` runs after a
    connection's I/O state is gone (its leases, claims and deferred work are the
    supervisor's); ``counters()`` are the store's, which count the descriptors no put took.
    """

    def __init__(
        self,
        settings: Settings,
        sel: selectors.BaseSelector,
        limits: LimitCounters,
        handle: Callable[[Conn, bytes], None],
        closed: Callable[[Conn, str], None],
        counters: Callable[[], ArenaCounters],
    ) -> None:
        self.settings = settings
        self.sel = sel
        self.limits = limits
        self.conns: dict[int, Conn] = {}
        #: bytes of replies queued (not yet taken by the kernel) on all connections
        self.unread = 0
        self._handle = handle
        self._closed = closed
        self._counters = counters

    def add(self, conn: Conn) -> None:
        """Keep an accepted connection and read from it."""
        self.conns[conn.id] = conn
        self.sel.register(conn.sock, selectors.EVENT_READ, conn)
        conn.events = selectors.EVENT_READ

    def close(self, conn: Conn, reason: str = "") -> None:
        if conn.id not in self.conns:
            return
        del self.conns[conn.id]
        conn.closing = True
        if conn.events:
            try:
                self.sel.unregister(conn.sock)
            except (KeyError, ValueError):
                pass
        # (its receive queue may still hold descriptors the peer sent: closing it may block)
        discard_socket(conn.sock)
        self.discard_fds(conn)
        self.unread -= conn.out_bytes
        conn.out.clear()
        conn.out_bytes = 0
        conn.backlog.clear()
        conn.backlog_bytes = 0
        self._closed(conn, reason)

    def discard_fds(self, conn: Conn, upto: int | None = None) -> None:
        """Close (off the loop) the descriptors a peer sent that no put took: all of them,
        or those that came with frames handled already (their read ended at or before
        stream offset ``upto``: the frame they came with was one of those, and took none)."""
        n = len(conn.fds)
        if upto is not None:
            n = next((i for i, end in enumerate(conn.fd_ends) if end > upto), n)
        for fd in conn.fds[:n]:
            self._counters().foreign_fds += 1
            discard(fd)
        del conn.fds[:n], conn.fd_ends[:n]

    def on_readable(self, conn: Conn) -> None:
        try:
            # room for every descriptor a message can carry: the kernel would close the ones
            # that do not fit, here, in the loop (a close that may block)
            data, anc, flags, _ = conn.sock.recvmsg(1 << 16, socket.CMSG_SPACE(4 * SCM_MAX_FD))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self.close(conn, str(e))
            return
        conn.fed += len(data)
        new = fds_of(anc)
        conn.fds.extend(new)
        conn.fd_ends.extend([conn.fed] * len(new))
        if flags & socket.MSG_CTRUNC or len(conn.fds) > MAX_PENDING_FDS:
            self.reply_error(
                conn, 0, ProtocolError(f"more than {MAX_PENDING_FDS} file descriptors sent at once")
            )
            self.flush(conn)  # the reason, before the close (as for a framing error)
            self.close(conn, "too many fds")
            return
        if not data:
            self.close(conn, "peer closed")
            return
        conn.frames.feed(data)
        try:
            bodies = conn.frames.frames()
        except ProtocolError as e:
            self.limits.frames_refused += 1
            self.reply_error(conn, 0, e)
            self.flush(conn)
            self.close(conn, str(e))
            return
        conn.backlog.extend(bodies)
        conn.backlog_bytes += sum(len(b) for b in bodies)
        self.drain(conn)

    def drain(self, conn: Conn) -> None:
        """Handle the connection's waiting frames, in order, until one is deferred."""
        while conn.backlog and not conn.busy and not conn.closing:
            body = conn.backlog.popleft()
            conn.backlog_bytes -= len(body)
            self._handle(conn, body)
            conn.handled += 4 + len(body)
            if conn.fds and not conn.closing:  # (a put took its own at once)
                self.discard_fds(conn, upto=conn.handled)  # fds no later frame can own
        if conn.closing:
            return
        if not conn.backlog and conn.frames.pending() == 0 and conn.fds:
            self.discard_fds(conn)  # fds that belonged to no put
        self.flush(conn)

    def reply(
        self, conn: Conn, rid: int, reply: dict[str, Any], fds: list[int] | None = None
    ) -> None:
        reply["ok"], reply["id"] = True, rid
        try:
            data = encode(reply)
        except ProtocolError as e:  # e.g. `ls` rows past the frame cap
            self.reply_error(conn, rid, ProtocolError(f"{e}: ask for less (e.g. ls --limit)"))
            return
        self._queue(conn, data, fds)

    def reply_error(self, conn: Conn, rid: int, err: ShmkvError) -> None:
        self._queue(conn, encode({"ok": False, "id": rid, "error": err.to_wire()}), None)

    def _queue(self, conn: Conn, data: bytes, fds: list[int] | None) -> None:
        if conn.closing:
            return
        conn.out.append([memoryview(data), fds])
        conn.out_bytes += len(data)
        self.unread += len(data)
        # one reply (up to a frame) is always let through; past that, a peer that does
        # not read what it asked for is dropped, before it holds more than its share
        if conn.out_bytes > self.settings.max_unread and len(conn.out) > 1:
            self.limits.unread_dropped += 1
            self.close(conn, f"left more than --max-unread={conn.out_bytes} bytes unread")
        while self.unread > self.settings.max_unread_total:
            hog = max(self.conns.values(), key=lambda c: c.out_bytes, default=None)
            if hog is None or not hog.out_bytes:
                break
            self.limits.unread_dropped += 1
            self.close(hog, "the most replies unread, past --max-unread-total")

    def flush(self, conn: Conn) -> None:
        while conn.out and not conn.closing:
            item = conn.out[0]
            data, fds = item
            try:
                if fds:
                    sent = conn.sock.sendmsg(
                        [data],
                        [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))],
                    )
                    item[1] = None
                else:
                    sent = conn.sock.send(data)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:
                self.close(conn, str(e))
                return
            conn.out_bytes -= sent
            self.unread -= sent
            if sent < len(data):
                item[0] = data[sent:]
                break
            conn.out.popleft()
        if not conn.closing:
            self._interest(conn)

    def _interest(self, conn: Conn) -> None:
        """Register for what the connection needs: replies to send; requests to read,
        unless it is busy and has sent a backlog's worth already."""
        want = selectors.EVENT_WRITE if conn.out else 0
        if not conn.busy or conn.backlog_bytes + conn.frames.pending() < MAX_BACKLOG:
            want |= selectors.EVENT_READ
        if want == conn.events:
            return
        try:
            if not want:
                self.sel.unregister(conn.sock)
            elif not conn.events:
                self.sel.register(conn.sock, want, conn)
            else:
                self.sel.modify(conn.sock, want, conn)
        except (KeyError, ValueError):
            return
        conn.events = want
