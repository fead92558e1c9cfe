"""How long an LMDB ``data.mdb`` must be, from its own meta pages, read without mapping it.

Runs in the supervisor's persist writer thread, before ``tiers/disk/lmdb_store.py`` opens the store.
LMDB maps the file and reads its pages through the mapping: a file shorter than its
last page (cut short by a failed copy, a restore, a filesystem repair) is a SIGBUS
on the first read past its end, which no ``try`` catches. LMDB itself reads only the
two meta pages with ``pread`` at open, and checks their magic, not the file's length:
this module does that check first.

Layout (LMDB 0.9, ``mdb.c``; 64-bit): pages 0 and 1 each hold a 16-byte page header
and an ``MDB_meta``: magic, version, address, map size, the two ``MDB_db`` (48 bytes
each; the first one's ``md_pad`` holds the page size), the last page number in use and
the transaction id. The meta with the larger transaction id is the current one; the
file must hold pages ``0 .. last_pg``.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

MAGIC, VERSION = 0xBEEFC0DE, 1
_PAGE_HEAD = 16
# magic, version, address, map size, page size (first MDB_db's md_pad)
_META_HEAD = struct.Struct("<IIQQI")
# last page number, transaction id: after the two MDB_db
_META_TAIL = struct.Struct("<QQ")
_TAIL_AT = _PAGE_HEAD + 4 + 4 + 8 + 8 + 2 * 48
_META_LEN = _TAIL_AT + _META_TAIL.size
#: the page sizes LMDB can write (its own bounds)
_PAGE_SIZES = range(512, (1 << 16) + 1)


def _meta(fd: int, offset: int) -> tuple[int, int, int] | None:
    """(page size, last page number, transaction id) of the meta page at ``offset``;
    None if it is not one (too short, another magic or version)."""
    buf = os.pread(fd, _META_LEN, offset)
    if len(buf) < _META_LEN:
        return None
    magic, version, _addr, _mapsize, psize = _META_HEAD.unpack_from(buf, _PAGE_HEAD)
    if magic != MAGIC or version != VERSION or psize not in _PAGE_SIZES:
        return None
    last_pg, txnid = _META_TAIL.unpack_from(buf, _TAIL_AT)
    return psize, last_pg, txnid


def problem(path: Path) -> str | None:
    """What makes the LMDB file ``path`` unsafe to map, or None (it is long enough, or
    missing or empty: LMDB then starts a new one). A file whose meta pages LMDB would
    refuse is left to LMDB to refuse (its error says why, and it reads them with
    ``pread``, never through the mapping)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return None
        first = _meta(fd, 0)
        if first is None:
            return None
        second = _meta(fd, first[0])
        metas = [m for m in (first, second) if m is not None and m[0] == first[0]]
        psize, last_pg, _txnid = max(metas, key=lambda m: m[2])
    finally:
        os.close(fd)
    need = (last_pg + 1) * psize
    if size < need:
        return (
            f"{path} is {size} bytes, shorter than the {need} bytes its LMDB meta page "
            f"says it holds (pages 0..{last_pg} of {psize} bytes): truncated"
        )
    return None
