"""Which pages of the arena's data region exist: allocated before a write, punched after a free.

Runs in the supervisor only, on its one thread (the arena's single writer). With
``--reserve false`` (the default; ``true`` reserves all of ``--size`` at start)
the arena file is sparse: only its header and index are allocated at start, so that
the memory it takes (in /dev/shm, and in the PSS of every process mapping it) follows
what the cache holds, not ``--size``.

* A write allocates first. A put allocates exactly the pages it is about to
  write (``fallocate``, mode 0) before it copies a byte into them
  (``put.py``). If the tmpfs is full (or its size limit, or a memory cgroup's,
  is reached) the put is rejected and its space given back: the worker misses,
  and nobody ever writes into a hole, which SIGBUSes on a full tmpfs. The chunks a
  put writes are allocated the same way, each before its bytes are copied.
* A free punches later. A freed record's extent (a chunk's, at its last reference)
  goes on a list of pages to
  punch (``FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE``), which :meth:`Pages.step`
  works through a few MiB at a time between the loop's other work: no eviction
  storm becomes a long pause. Space reused before its turn comes is simply taken
  off the list (its pages are still there: nothing to allocate).
* Never punch what someone may still read. A worker reads a record only under
  a lease, and a lease that ends normally (its ``release``) ends after the last
  read. But a revoked lease's holder, or one whose connection closed while it
  held a lease, may still be copying when the record is freed; and a read fault
  on a hole of a shared tmpfs mapping allocates a page, or SIGBUSes when the
  tmpfs is full. So a record that had such a lease is marked
  (``Entry.stale_readers``), and its pages are kept for the supervisor's life
  (``quarantined``): never punched, even after the space was reused by other
  records and freed again. A stale reader therefore reads old or new bytes,
  fails its checksum and misses, as it always did, and never touches a hole.
  Lease-free reads (a worker's ``policy.peek``, the tiers' writer threads) use
  ``pread`` on the file, which reads a hole as zeros without allocating it.

With ``--reserve true`` the whole file is allocated at start (``arenafile.py``) and
this class does nothing.

Python has no ``fallocate`` with modes (``os.posix_fallocate`` is mode 0 only), so
hole punching calls libc's ``fallocate`` through ctypes, in :func:`punch_hole`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import mmap
import os
import time

from sortedcontainers import SortedDict

log = logging.getLogger(__name__)

FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
#: bytes punched per call in :meth:`Pages.step`, between looks at the deadline
PUNCH_PIECE = 8 << 20
#: what allocating pages fails with when there is no room for them
NO_ROOM = (errno.ENOSPC, errno.EFBIG, errno.ENOMEM, errno.EDQUOT)

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_fallocate = _libc.fallocate
_fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
_fallocate.restype = ctypes.c_int


def punch_hole(fd: int, offset: int, length: int) -> None:
    """Give back the pages of [offset, offset + length) of ``fd``'s file; OSError on failure.

    The range must be page-aligned: a partial page would be zeroed, not freed.
    """
    if _fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def allocated_bytes(fd: int) -> int:
    """Bytes of the file ``fd`` that are allocated (st_blocks is in 512-byte units)."""
    return os.fstat(fd).st_blocks * 512


class Extents:
    """Disjoint, coalesced byte ranges [start, end), in address order."""

    def __init__(self) -> None:
        self._d: SortedDict = SortedDict()  # start -> end
        self.bytes = 0

    def __bool__(self) -> bool:
        return bool(self._d)

    def _overlapping(self, a: int, b: int) -> list[tuple[int, int]]:
        """Ranges that overlap or touch [a, b)."""
        d = self._d
        i = d.bisect_right(a) - 1
        if i < 0:
            i = 0
        out = []
        keys = d.keys()
        while i < len(keys):
            s = keys[i]
            if s > b:
                break
            e = d[s]
            if e >= a:
                out.append((s, e))
            i += 1
        return out

    def add(self, a: int, b: int) -> None:
        if b <= a:
            return
        for s, e in self._overlapping(a, b):
            del self._d[s]
            self.bytes -= e - s
            a, b = min(a, s), max(b, e)
        self._d[a] = b
        self.bytes += b - a

    def remove(self, a: int, b: int) -> None:
        if b <= a:
            return
        for s, e in self._overlapping(a, b):
            if e <= a or s >= b:
                continue  # only touching
            del self._d[s]
            self.bytes -= e - s
            if s < a:
                self._d[s] = a
                self.bytes += a - s
            if e > b:
                self._d[b] = e
                self.bytes += e - b

    def minus(self, a: int, b: int) -> list[tuple[int, int]]:
        """The parts of [a, b) that no range covers."""
        out, pos = [], a
        for s, e in self._overlapping(a, b):
            if s > pos:
                out.append((pos, min(s, b)))
            pos = max(pos, e)
        if pos < b:
            out.append((pos, b))
        return [(s, e) for s, e in out if e > s]

    def pop_piece(self, most: int) -> tuple[int, int]:
        """Take up to ``most`` bytes from the start of the first range."""
        s, e = self._d.peekitem(0)
        cut = min(e, s + most)
        del self._d[s]
        if cut < e:
            self._d[cut] = e
        self.bytes -= cut - s
        return s, cut


def data_extents(fd: int, start: int, end: int) -> Extents:
    """The runs of pages of [start, end) of ``fd``'s file that hold data, found in one walk.

    ``lseek(SEEK_HOLE)`` from an offset walks the file's pages up to the next hole, so
    asking it once per extent costs the distance from each extent to the hole after it:
    adopting a densely filled arena that way grew with records times arena size (317 s
    for 100,000 records of an 8 GiB arena). This walks the range once, alternating
    ``SEEK_DATA`` and ``SEEK_HOLE``; an extent has no hole when ``minus`` leaves nothing
    of it. The answers are ``SEEK_HOLE``'s: on tmpfs a page allocated but never written
    counts as a hole. Valid while nobody allocates or punches the file (an adopting
    supervisor, which holds the name's lock). A file allocated whole (``--reserve``) is
    one run, unwalked: none of its pages is missing, so a read of any allocates nothing.
    """
    runs, pos = Extents(), start
    if os.fstat(fd).st_blocks * 512 >= end:
        runs.add(start, end)
        return runs
    while pos < end:
        try:
            data = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as e:
            if e.errno == errno.ENXIO:  # no data after pos
                break
            raise
        if data >= end:
            break
        pos = os.lseek(fd, data, os.SEEK_HOLE)  # (the end of the file is a hole)
        runs.add(data, min(pos, end))
    return runs


class Pages:
    """Allocation and punching of the data region's pages (see the module docstring).

    ``fd`` is a writable descriptor of the arena file; ``reserve``: the file is
    allocated whole and stays so (every method is then a no-op).
    """

    def __init__(self, fd: int, reserve: bool) -> None:
        self.fd, self.reserve = fd, reserve
        #: freed ranges whose pages are still to be punched
        self.pending = Extents()
        #: ranges a stale reader may still read: never punched
        self.quarantined = Extents()
        #: allocations refused for want of room (the tmpfs or a memory limit)
        self.refused = 0
        self.punched_bytes = 0
        self._page = mmap.PAGESIZE

    def allocate(self, offset: int, length: int) -> bool:
        """Make [offset, offset + length) exist before it is written; False if there is
        no room for it (the caller gives the space back and rejects the put)."""
        if self.reserve or length <= 0:
            return True
        self.pending.remove(offset, offset + length)  # reused before its punch: keep it
        try:
            os.posix_fallocate(self.fd, offset, length)
        except OSError as e:
            if e.errno not in NO_ROOM:
                raise
            self.refused += 1
            return False
        return True

    def freed(self, offset: int, length: int, stale_readers: bool = False) -> None:
        """[offset, offset + length) is free: punch it soon, or never (``stale_readers``)."""
        if self.reserve:
            return
        if stale_readers:
            self.pending.remove(offset, offset + length)
            self.quarantined.add(offset, offset + length)
            return
        for a, b in self.quarantined.minus(offset, offset + length):
            self.pending.add(a, b)

    @property
    def busy(self) -> bool:
        """Whether pages are waiting to be punched."""
        return bool(self.pending)

    def step(self, deadline: float) -> None:
        """Punch pending pages, a piece at a time, until ``deadline`` (time.monotonic)."""
        page = self._page
        while self.pending:
            a, b = self.pending.pop_piece(PUNCH_PIECE)
            a, b = -(-a // page) * page, b // page * page  # whole pages only
            if b > a:
                try:
                    punch_hole(self.fd, a, b - a)
                    self.punched_bytes += b - a
                except OSError as e:  # (never fatal: the pages just stay)
                    log.warning("could not give back arena pages [%d, %d): %s", a, b, e)
                    self.pending = Extents()
                    return
            if time.monotonic() >= deadline:
                return

    def resident(self) -> int:
        """Bytes of the arena file that are allocated."""
        try:
            return allocated_bytes(self.fd)
        except OSError:
            return 0
