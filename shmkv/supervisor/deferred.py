"""Requests the supervisor answers over several turns of its loop, a slice per turn.

Runs in the supervisor, on its loop's thread. A request that needs more than
``--put-slice`` of work (a put that evicts thousands of records or copies hundreds
of MiB) is deferred here: one slice of one deferred request per turn, round robin,
and that connection's later frames wait (``conn.busy``) until its reply is sent.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from shmkv.core.errors import ShmkvError
from shmkv.supervisor.connection import ConnIO
from shmkv.supervisor.listener import Conn
from shmkv.supervisor.ops import Work

log = logging.getLogger("shmkv.supervisor.loop")

#: what a request that failed with a bug gets (the supervisor's log says more)
INTERNAL = "internal supervisor error (see its log)"


class Deferred:
    """conn id -> (conn, request id, work) of the requests worked on over several turns."""

    def __init__(self, io: ConnIO, check: Callable[[], None], slice_seconds: float) -> None:
        self.io, self.check, self.slice_seconds = io, check, slice_seconds
        self.jobs: dict[int, tuple[Conn, int, Work]] = {}

    def __bool__(self) -> bool:
        return bool(self.jobs)

    def defer(self, conn: Conn, rid: int, work: Work) -> None:
        """Go on with ``work`` in later turns; the connection's next frames wait for it."""
        assert conn.id not in self.jobs
        self.jobs[conn.id] = (conn, rid, work)
        conn.busy = True

    def abort(self, conn_id: int) -> None:
        """The connection closed: its deferred request, if any, ends unanswered."""
        pending = self.jobs.pop(conn_id, None)
        if pending is not None:
            pending[2].abort()  # (its memfd goes to the closer thread)

    def step(self) -> None:
        """One slice of one deferred request (round robin), then back to the loop."""
        cid = next(iter(self.jobs))
        conn, rid, work = self.jobs[cid]
        error: ShmkvError | None = None
        try:
            self.check()
            reply = work.step(time.monotonic() + self.slice_seconds)
        except ShmkvError as e:
            reply, error = None, e
        except Exception:
            log.exception("internal error handling a request from pid %d", conn.pid)
            reply, error = None, ShmkvError(INTERNAL)
        else:
            if reply is None:
                if self.jobs.pop(cid, None) is not None:  # (gone if its peer closed)
                    self.jobs[cid] = (conn, rid, work)  # to the back of the line
                return
        self.jobs.pop(cid, None)
        if error is not None:
            work.abort()
            self.io.reply_error(conn, rid, error)
        else:
            assert reply is not None
            self.io.reply(conn, rid, reply)
        conn.busy = False
        if not conn.closing:
            self.io.drain(conn)
