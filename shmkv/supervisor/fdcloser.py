"""Closing what peers hand the supervisor, off its loop.

Runs in the supervisor only. A descriptor a peer passes with SCM_RIGHTS can be
anything, and closing the last reference to some things blocks the closing
thread: a TCP socket with ``SO_LINGER`` waits until its unsent data is
acknowledged or the linger time ends, a file on a hung FUSE or NFS mount waits
in its flush, and a Unix socket releases the descriptors still queued in it,
whose closes then run in the thread that closed it. A peer's own connection is
such a Unix socket (descriptors it sent that were never read). So the loop
closes none of these: it hands them to :func:`discard`, and one daemon thread
closes them (a peer's connection with nothing queued in it is closed at once,
:func:`discard_socket`). That thread first takes the descriptors out of a Unix socket's
queue (a bounded number of reads) and makes every socket close at once
(``SO_LINGER`` on with 0 s: a reset instead of a wait). What can still block it
(a file on a hung mount) holds up only that thread and the closes queued
behind it, never the loop; :func:`pending` tells how many wait.
"""

from __future__ import annotations

import array
import fcntl
import logging
import os
import queue
import socket
import struct
import termios
import threading

log = logging.getLogger(__name__)

#: the most descriptors one SCM_RIGHTS message can carry (Linux SCM_MAX_FD): an ancillary
#: buffer this size is never truncated, so the kernel never closes the excess in our thread
SCM_MAX_FD = 253
#: reads taken out of a Unix socket's queue before it is closed anyway
_DRAIN_READS = 64
_LINGER_NOW = struct.pack("ii", 1, 0)


def fds_of(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    """The descriptors in ``recvmsg``'s ancillary data."""
    out: list[int] = []
    for level, typ, data in ancillary:
        if level == socket.SOL_SOCKET and typ == socket.SCM_RIGHTS:
            a = array.array("i")
            a.frombytes(data[: len(data) - len(data) % a.itemsize])
            out.extend(a)
    return out


class Closer:
    """A queue of descriptors and the daemon thread that closes them, started on first use."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending = 0
        self._thread: threading.Thread | None = None

    def discard(self, fd: int) -> None:
        """Close ``fd`` soon, on the closer thread; never blocks."""
        with self._lock:
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="shmkv-closer", daemon=True)
                self._thread.start()
        self._queue.put(fd)

    def pending(self) -> int:
        """Descriptors handed over and not yet closed."""
        return self._pending

    def _run(self) -> None:
        while True:
            fd = self._queue.get()
            try:
                self._close(fd)
            except Exception:  # one odd descriptor must not stop the thread
                log.exception("closing a descriptor a peer passed failed")
            with self._lock:
                self._pending -= 1

    def _close(self, fd: int) -> None:
        try:
            sock = socket.socket(fileno=fd)
        except OSError:  # not a socket
            os.close(fd)
            return
        try:
            if sock.family == socket.AF_UNIX:
                for inner in _drain(sock):
                    self.discard(inner)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_NOW)
        except OSError:
            pass
        finally:
            sock.close()


def _drain(sock: socket.socket) -> list[int]:
    """The descriptors queued in a Unix socket (at most ``_DRAIN_READS`` reads)."""
    fds: list[int] = []
    for _ in range(_DRAIN_READS):
        try:
            data, anc, _flags, _addr = sock.recvmsg(
                1 << 16, socket.CMSG_SPACE(4 * SCM_MAX_FD), socket.MSG_DONTWAIT
            )
        except OSError:  # empty (EAGAIN), a listening socket, ...
            break
        fds.extend(fds_of(anc))
        if not data and not anc:
            break
    return fds


_CLOSER = Closer()


def discard(fd: int) -> None:
    """Close a descriptor a peer passed (or a peer's connection), off the loop."""
    _CLOSER.discard(fd)


def discard_socket(sock: socket.socket) -> None:
    """Hang up on a peer's Unix socket now (it sees EOF) and close it: here if nothing is
    queued in it, else off the loop.

    After the shutdown the peer can queue nothing more (its sends fail with EPIPE), and a
    descriptor always travels with at least one byte, so an empty queue holds none and
    its close cannot block.
    """
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    if _queued(sock) == 0:
        sock.close()
        return
    fd = sock.detach()
    if fd >= 0:
        discard(fd)


def _queued(sock: socket.socket) -> int:
    """Bytes waiting in a socket's receive queue (SIOCINQ); 1 when it cannot tell."""
    try:
        buf = fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0")
    except OSError:
        return 1
    return int(struct.unpack("i", buf)[0])


def pending() -> int:
    """Descriptors waiting for the closer thread."""
    return _CLOSER.pending()
