"""Byte-range locks on open file descriptions (``F_OFD_SETLK``, Linux): the CPU budget's cores
and queue slots (``budget.py``, ``queue.py``), in whichever process uses them.

An OFD lock belongs to the open file, not to the process: two handles in one process
exclude each other, a forked child does not inherit its parent's, and the kernel drops
them all when the last descriptor of the file closes, whatever killed the process.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct

# struct flock on 64-bit Linux: short l_type, l_whence; off_t l_start, l_len; pid_t l_pid
_FLOCK = struct.Struct("hhqqi4x")
OFD_AVAILABLE = hasattr(fcntl, "F_OFD_SETLK") and _FLOCK.size == 32


def lock(fd: int, kind: int, start: int, wait: bool = False) -> bool:
    """One byte's OFD lock: take (F_WRLCK/F_RDLCK) or give back (F_UNLCK); False: taken."""
    cmd = fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK
    try:
        fcntl.fcntl(fd, cmd, _FLOCK.pack(kind, os.SEEK_SET, start, 1, 0))
        return True
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise


def is_held(fd: int, start: int) -> bool:
    """Whether another open file holds byte ``start`` (``F_OFD_GETLK``)."""
    res = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, start, 1, 0))
    return bool(_FLOCK.unpack(res)[0] != fcntl.F_UNLCK)
