"""``--persist DIR``: the arena's records written behind to an LMDB store, and read back.

Runs in the supervisor, off its loop: :class:`LmdbTier` is the
:class:`~shmkv.supervisor.tiers.base.Backend` of a write-behind (its writer thread calls
``open`` and ``apply``), and the refill's reader thread (``refill.py``) calls :meth:`LmdbTier.load`.
This module owns the on-disk byte format, both ways.

Why LMDB (py-lmdb) rather than files of our own: a commit is atomic and a crash
leaves the last committed state (copy-on-write B-tree, no log to replay), readers
never block the one writer, and values are read straight from its mapping. It is
opened without ``writemap``, so a full disk is a failed commit (paused and counted
here), never a SIGBUS. LMDB does not checksum its pages; shmkv checksums every record
(metadata and payload, XXH3-64) and a refill checks both, as for any put.

Layout: DIR (0700, ours) holds ``data.mdb`` and ``lock.mdb`` (0600) and ``shmkv.lock``
(a flock: one supervisor per DIR). Two databases keyed by a record's 16-byte content
digest (``keys.content_digest``): ``meta`` holds ``header | fingerprint | token ids |
XXH3-64 of all before``, ``blob`` the payload, or for a chunked record (flag
:data:`CHUNKED`: a KV cache state ``kvformat.plan`` splits at ``chunk_tokens``, as the
arena does) ``chunk count | layout length | each full group's chunk key | its packed
layout | the data of its groups that are not full``. A third, ``chunk``, holds each full
group's data once under its key, ``publisher uid | XXH3-128 of the data`` (shared only
between records of one publisher, as in the arena): records that share a prefix share its
chunks on disk. A chunk lives while a record lists it; the counts are kept in memory,
read from the records at open. The size bound (``--persist-size``) is on the bytes
stored (records' values and chunks, each chunk once), kept by LRU (a put or a hit is a
use; pinned records go last).
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import stat
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from pathlib import Path

import lmdb
import numpy as np
import xxhash

from shmkv.core import kvformat
from shmkv.core.arena import DIGEST_SIZE, MAX_FINGERPRINT, MAX_TOKENS
from shmkv.core.config import format_size
from shmkv.core.errors import ArenaCorruptError, TierError
from shmkv.core.keys import content_digest
from shmkv.supervisor.tiers.base import (
    Accepted,
    Event,
    Forget,
    PayloadSource,
    Pinned,
    RecordMeta,
    Used,
    same_payload,
)
from shmkv.supervisor.tiers.disk import lmdbfile

log = logging.getLogger(__name__)

MAGIC, VERSION = b"SKVP", 1
# magic, version, flags (bit 0: pinned), publisher, payload length, payload XXH3,
# created, last used (wall clock), root, token count, fingerprint length
_HEAD = struct.Struct("<4sHHIQQdd16sII")
_U64 = struct.Struct("<Q")
PINNED = 1
#: flag: ``blob`` holds the record's chunk keys and layout, ``chunk`` its full groups
CHUNKED = 2
# a chunked record's ``blob`` value: chunk count, packed layout length; then the keys,
# the layout and the groups that are not full (inline)
_CHUNKED_HEAD = struct.Struct("<II")
#: a sealed chunked value begins with this and ends with the XXH3-64 of all before it:
#: with each chunk's key (its XXH3-128) it covers every byte of the record, so that a
#: refill need not hash the whole blob (``kvformat.Grouped.sealed``). Values written
#: before it have neither and are hashed whole (their first four bytes are a chunk count,
#: which cannot be this one's: it would take 16 GiB of keys)
_SEALED = b"SKC2"
_UID = struct.Struct("<I")
#: a chunk's key: publisher uid, XXH3-128 of its data
CHUNK_KEY = _UID.size + 16
#: free space under which a failed commit counts as a full disk
_LOW_SPACE = 16 << 20
#: the most seconds closing the store waits for the chunked records handed out to be
#: closed (their groups are views of its map)
_LOADS_WAIT = 30.0
_PAGE = 4096


@dataclass(slots=True)
class _Indexed:
    """What the index keeps of a stored record (its recency is its place in the LRU)."""

    pinned: bool
    #: bytes of its ``blob`` value
    own: int
    #: the chunk keys it lists (none: stored whole)
    chunks: list[bytes]


@dataclass(slots=True)
class _Chunk:
    """A stored chunk: its data's length and how many records list it."""

    size: int
    refs: int = 0


@dataclass(frozen=True)
class DiskRecord(RecordMeta):
    """A record's metadata as stored in ``meta``."""

    #: wall-clock time of its last use (a put or a hit)
    last_used: float
    #: ``blob`` holds chunk keys and a layout (the data is in ``chunk``)
    chunked: bool = False

    def pack(self) -> bytes:
        head = _HEAD.pack(
            MAGIC,
            VERSION,
            (PINNED if self.pinned else 0) | (CHUNKED if self.chunked else 0),
            self.publisher,
            self.payload_len,
            self.payload_xxh3,
            self.created,
            self.last_used,
            self.root,
            len(self.tokens) // 4,
            len(self.fingerprint),
        )
        body = head + self.fingerprint + self.tokens
        return body + _U64.pack(xxhash.xxh3_64_intdigest(body))

    @classmethod
    def unpack(cls, content: bytes, buf: bytes) -> DiskRecord:
        """Check and read a ``meta`` value; TierError("corrupt") names what is wrong."""
        if len(buf) < _HEAD.size + 8:
            raise TierError("record metadata truncated", "corrupt")
        body, (csum,) = buf[:-8], _U64.unpack(buf[-8:])
        if xxhash.xxh3_64_intdigest(body) != csum:
            raise TierError("record metadata checksum mismatch", "corrupt")
        magic, version, flags, publisher, plen, pxxh3, created, used, root, n_tok, fp_len = (
            _HEAD.unpack_from(body)
        )
        if magic != MAGIC or version != VERSION:
            raise TierError(f"record format {magic!r} v{version}, not v{VERSION}", "corrupt")
        if not (
            0 < n_tok <= MAX_TOKENS
            and fp_len <= MAX_FINGERPRINT
            and plen > 0
            and len(body) == _HEAD.size + fp_len + 4 * n_tok
        ):
            raise TierError("record metadata has inconsistent lengths", "corrupt")
        fp = body[_HEAD.size : _HEAD.size + fp_len]
        tokens = body[_HEAD.size + fp_len :]
        if content_digest(root, fp, tokens, publisher) != content:
            raise TierError("record metadata does not match its key", "corrupt")
        pinned, chunked = bool(flags & PINNED), bool(flags & CHUNKED)
        return cls(root, fp, tokens, publisher, pinned, plen, pxxh3, created, used, chunked)

    @staticmethod
    def peek(buf: memoryview) -> tuple[int, bool, float, bool] | None:
        """(payload length, pinned, last used, chunked) from a header, unchecked; None if it
        is no header (the full check is :meth:`unpack`, at load)."""
        if len(buf) < _HEAD.size + 8:
            return None
        magic, version, flags, _pub, plen, _x, _c, used, *_ = _HEAD.unpack_from(buf)
        if magic != MAGIC or version != VERSION:
            return None
        return plen, bool(flags & PINNED), used, bool(flags & CHUNKED)


def chunk_key(publisher: int, data: bytes | memoryview) -> bytes:
    """The key of a chunk of ``data`` published by ``publisher``."""
    return _UID.pack(publisher) + xxhash.xxh3_128_digest(data)


def pack_chunked(keys: list[bytes], layout: kvformat.Manifest, inline: list[bytes]) -> bytes:
    """A chunked record's ``blob`` value (sealed)."""
    packed = layout.pack()
    head = _CHUNKED_HEAD.pack(len(keys), len(packed))
    body = b"".join([_SEALED, head, *keys, packed, *inline])
    return body + _U64.pack(xxhash.xxh3_64_intdigest(body))


def _unsealed(mv: memoryview) -> tuple[memoryview, bool]:
    """A chunked value without its seal (magic and checksum, unchecked), and whether it
    had one."""
    if len(mv) >= len(_SEALED) + _CHUNKED_HEAD.size + _U64.size and mv[: len(_SEALED)] == _SEALED:
        return mv[len(_SEALED) : -_U64.size], True
    return mv, False


def chunk_keys(value: bytes | memoryview) -> list[bytes]:
    """The chunk keys a chunked record's ``blob`` value lists (unchecked beyond its length:
    for the counts at open; :func:`parse_chunked` checks the rest)."""
    return _keys(_unsealed(memoryview(value))[0])


def _keys(mv: memoryview) -> list[bytes]:
    """The chunk keys of a chunked value without its seal."""
    if len(mv) < _CHUNKED_HEAD.size:
        return []
    n, _ = _CHUNKED_HEAD.unpack_from(mv)
    end = _CHUNKED_HEAD.size + n * CHUNK_KEY
    if end > len(mv):
        return []
    return [bytes(mv[i : i + CHUNK_KEY]) for i in range(_CHUNKED_HEAD.size, end, CHUNK_KEY)]


def parse_chunked(
    value: bytes | memoryview, rec: DiskRecord
) -> tuple[list[bytes], kvformat.Manifest, list[memoryview], bool]:
    """A chunked record's chunk keys, group layout, the data of its groups that are not
    full, and whether it is sealed (its checksum checked here), checked against ``rec``
    (the payload's length, one key per full group, the publisher's keys, the lengths
    adding up); TierError("corrupt") if anything disagrees."""
    whole = memoryview(value)
    mv, sealed = _unsealed(whole)
    if sealed:
        (want,) = _U64.unpack(whole[-_U64.size :])
        if xxhash.xxh3_64_intdigest(whole[: -_U64.size]) != want:
            raise TierError("chunked record fails its checksum", "corrupt")
    if len(mv) < _CHUNKED_HEAD.size:
        raise TierError("chunked record shorter than its header", "corrupt")
    n, n_layout = _CHUNKED_HEAD.unpack_from(mv)
    pos = _CHUNKED_HEAD.size + n * CHUNK_KEY
    if pos + n_layout > len(mv):
        raise TierError("chunked record's keys or layout run past its end", "corrupt")
    keys = _keys(mv)
    try:
        layout = kvformat.Manifest.unpack(mv[pos : pos + n_layout])
    except ArenaCorruptError as e:
        raise TierError(f"chunked record's layout is unreadable: {e}", "corrupt") from None
    uid = _UID.pack(rec.publisher)
    if (
        layout.blob_len != rec.payload_len
        or sum(layout.group_full) != n
        or any(k[: _UID.size] != uid for k in keys)
    ):
        raise TierError("chunked record's layout does not match its metadata", "corrupt")
    inline = layout.partial_groups(mv, pos + n_layout)
    if inline is None:
        raise TierError("chunked record's groups do not add up to its value", "corrupt")
    return keys, layout, inline, sealed


class ChunkedLoad:
    """A chunked record's payload as it lies in the store: its manifest and each group's
    data (:attr:`grouped`, for ``Store.put_record``), views of LMDB's map under a read
    transaction of their own, valid until :meth:`close` (which any one thread may call,
    once the put that reads them is over; the store is not closed before)."""

    def __init__(self, tier: LmdbTier, txn: lmdb.Transaction, grouped: kvformat.Grouped) -> None:
        self.grouped = grouped
        self._tier = tier
        self._txn: lmdb.Transaction | None = txn

    def close(self) -> None:
        """End the read transaction: the views are void from now on. May run twice."""
        txn, self._txn = self._txn, None
        if txn is not None:
            try:
                txn.abort()
            except lmdb.Error:
                pass
            self._tier.load_closed()


def _touch(view: memoryview) -> None:
    """Read one byte of each page of ``view``: the page faults (a disk read after a reboot)
    happen on the calling thread, not on the loop that reads it next."""
    if len(view):
        np.frombuffer(view, dtype=np.uint8)[::_PAGE].max()


def _prepare_dir(path: Path) -> None:
    """Create DIR (0700) if missing; TierError unless it is a directory only we can write."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(path)
    except OSError as e:
        raise TierError(
            f"cannot create --persist {path}: {e.strerror}: fix the path or its permissions",
            "unwritable",
        ) from None
    problem = None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        problem = "is not a directory (or is a symbolic link)"
    elif st.st_uid != os.geteuid():
        problem = f"is owned by uid {st.st_uid}, not by us (uid {os.geteuid()})"
    elif st.st_mode & 0o022:
        problem = "is writable by group or others (anyone who can write it can plant states)"
    if problem:
        raise TierError(f"--persist {path} {problem}: use a directory of ours, mode 0700", "unsafe")
    if not os.access(path, os.W_OK | os.X_OK):
        raise TierError(f"--persist {path} is not writable: fix its permissions", "unwritable")


class LmdbTier:
    """The LMDB store of ``--persist``: the write-behind's backend, and the refill's source."""

    name = "persist"

    def __init__(self, path: str | Path, size: int, chunk_tokens: int = 0) -> None:
        self.path = Path(path)
        #: most bytes kept (records' values and chunks, each chunk once)
        self.size = size
        #: tokens per chunk of a chunked record (the arena's); 0: every record whole
        self.chunk_tokens = chunk_tokens
        self.env: lmdb.Environment | None = None
        self._lock_fd = -1
        #: content -> what the index keeps of it, least recently used first
        self.lru: OrderedDict[bytes, _Indexed] = OrderedDict()
        #: chunk key -> the chunk
        self.chunks: dict[bytes, _Chunk] = {}
        #: bytes stored: records' values and chunks
        self.bytes = 0
        #: what a refill loads, in its order (pinned, then most recently used first)
        self.order: list[bytes] = []
        self.written = self.written_bytes = self.gone = self.evicted = 0
        #: records skipped without pausing, by kind
        self.errors: dict[str, int] = {}
        self._new: list[int] = []
        #: the records stored pinned when the store was opened (an adopted arena takes
        #: its pins from here: the arena file keeps none)
        self.pinned_at_open: frozenset[bytes] = frozenset()
        #: chunked records handed out (:class:`ChunkedLoad`) and not closed yet: the map
        #: they view is not closed under them
        self._loads = 0
        self._loads_cv = threading.Condition()

    # ------------------------------------------------------------------- open
    def open(self) -> None:
        _prepare_dir(self.path)
        if self._lock_fd < 0:
            self._lock_fd = self._lock()
        try:  # (a short file is mapped past its end: a SIGBUS at the first read there)
            unsafe = lmdbfile.problem(self.path / "data.mdb")
        except OSError as e:
            raise TierError(f"cannot read {self.path / 'data.mdb'}: {e}", "io") from None
        if unsafe is None:
            try:
                self.env = self._open_env()
            except lmdb.Error as e:
                unreadable = lmdb.InvalidError | lmdb.CorruptedError | lmdb.VersionMismatchError
                if not isinstance(e, unreadable):
                    raise self._classify(e) from None
                unsafe = str(e)
        if unsafe is not None:
            self._start_anew(unsafe)
        self._load_index()
        self.pinned_at_open = frozenset(c for c, v in self.lru.items() if v.pinned)
        self.order = [c for c, v in reversed(self.lru.items()) if v.pinned]
        self.order += [c for c, v in reversed(self.lru.items()) if not v.pinned]
        log.info(
            "persist %s: %d states, %s of %s",
            self.path,
            len(self.lru),
            format_size(self.bytes),
            format_size(self.size),
        )

    def _start_anew(self, problem: str) -> None:
        """Move an unreadable ``data.mdb`` aside (``data.mdb.corrupt-TIME``), count it, and
        open a new, empty one."""
        aside = self.path / f"data.mdb.corrupt-{int(time.time())}"
        log.warning("%s is unreadable (%s): moved to %s, starting empty", self.path, problem, aside)
        self.errors["corrupt"] = self.errors.get("corrupt", 0) + 1
        try:
            os.replace(self.path / "data.mdb", aside)
            (self.path / "lock.mdb").unlink(missing_ok=True)
            self.env = self._open_env()
        except (OSError, lmdb.Error) as e:
            raise TierError(f"cannot recreate {self.path}: {e}", "corrupt") from None

    def _lock(self) -> int:
        p = self.path / "shmkv.lock"
        try:
            fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise TierError(f"cannot open {p}: {e.strerror}", "unwritable") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise TierError(
                f"--persist {self.path} is in use by another supervisor: give each arena "
                f"its own directory",
                "in_use",
            ) from None
        return fd

    def _open_env(self) -> lmdb.Environment:
        # room for copy-on-write and for freed pages a reader may still see
        return lmdb.open(
            str(self.path),
            map_size=2 * self.size + (64 << 20),
            max_dbs=3,
            mode=0o600,
            readahead=False,
            meminit=False,
            max_readers=16,
        )

    def _load_index(self) -> None:
        """The records' LRU order and sizes, and each chunk's length and count of records,
        read from the store (no payload is read); records whose header is unreadable and
        chunks no record lists are deleted."""
        assert self.env is not None
        self.meta = self.env.open_db(b"meta")
        self.blob = self.env.open_db(b"blob")
        self.chunk = self.env.open_db(b"chunk")
        rows, bad = [], []
        self.chunks = {}
        with self.env.begin(buffers=True) as txn:
            for key, val in txn.cursor(db=self.meta):
                got = DiskRecord.peek(val) if len(key) == DIGEST_SIZE else None
                value = txn.get(key, db=self.blob) if got is not None else None
                if got is None or value is None:
                    bad.append(bytes(key))
                    continue
                _plen, pinned, used, chunked = got
                keys = chunk_keys(value) if chunked else []
                for k in keys:
                    self.chunks.setdefault(k, _Chunk(0)).refs += 1
                rows.append((used, bytes(key), _Indexed(pinned, len(value), keys)))
            orphans = []
            for key, val in txn.cursor(db=self.chunk):
                chunk = self.chunks.get(bytes(key))
                if chunk is None:
                    orphans.append(bytes(key))
                else:
                    chunk.size = len(val)
        rows.sort(key=lambda r: (r[0], r[1]))
        self.lru = OrderedDict((c, row) for _, c, row in rows)
        self.bytes = sum(r.own for _, _, r in rows) + sum(c.size for c in self.chunks.values())
        if bad or orphans:
            self.errors["corrupt"] = self.errors.get("corrupt", 0) + len(bad)
            with self.env.begin(write=True) as txn:
                for c in bad:
                    self._delete(txn, c)
                for k in orphans:
                    txn.delete(k, db=self.chunk)

    # ------------------------------------------------------------------ write
    def apply(self, batch: list[Event], source: PayloadSource) -> None:
        if self.env is None:
            self.open()
        env = self.env
        assert env is not None
        used: dict[bytes, float] = {}
        self._new = []
        try:
            with env.begin(write=True, buffers=True) as txn:
                for ev in batch:
                    if isinstance(ev, Accepted):
                        self._accepted(txn, ev, source)
                    elif isinstance(ev, Used):
                        used[ev.content] = ev.when
                    elif isinstance(ev, Pinned):
                        self._update(txn, ev.content, pinned=ev.pinned)
                    elif isinstance(ev, Forget) and ev.content in self.lru:
                        self._delete(txn, ev.content)
                for content, when in used.items():
                    self._update(txn, content, last_used=when)
                self._evict(txn)
        except lmdb.Error as e:
            err = self._classify(e)
            try:
                self._load_index()  # what the failed transaction did to the index is undone
            except lmdb.Error:
                self._close_env(env)
                self.env = None  # reopened by the write-behind after its pause
            raise err from None
        self.written += len(self._new)
        self.written_bytes += sum(self._new)

    def _accepted(self, txn: lmdb.Transaction, ev: Accepted, source: PayloadSource) -> None:
        rec = DiskRecord(
            ev.root,
            ev.fingerprint,
            ev.tokens,
            ev.publisher,
            ev.pinned,
            ev.payload_len,
            ev.payload_xxh3,
            ev.created,
            ev.when,
        )
        row = self.lru.get(ev.content)
        if row is None:
            if ev.payload_len > self.size:
                self.errors["too_large"] = self.errors.get("too_large", 0) + 1
                return
            data = source.payload(ev)
            if data is None or not same_payload(data, ev):  # (evicted and reused meanwhile)
                self.gone += 1
                return
            layout = kvformat.plan(data, self.chunk_tokens) if self.chunk_tokens else None
            if layout is None:
                row = _Indexed(ev.pinned, len(data), [])
                txn.put(ev.content, data, db=self.blob)
            else:
                row = self._put_chunked(txn, ev, layout, data)
            del data
            self.bytes += row.own
            self._new.append(ev.payload_len)
        else:
            row.pinned = ev.pinned
        txn.put(ev.content, replace(rec, chunked=bool(row.chunks)).pack(), db=self.meta)
        self.lru[ev.content] = row
        self.lru.move_to_end(ev.content)

    def _put_chunked(
        self, txn: lmdb.Transaction, ev: Accepted, layout: kvformat.Manifest, data: bytes
    ) -> _Indexed:
        """Store ``data`` (planned as ``layout``) as a chunked record: each full group as a
        chunk unless the store holds it already, the rest in its ``blob`` value. Returns
        its index row. One group's scratch at a time."""
        keys: list[bytes] = []
        inline: list[bytes] = []
        for i, view in kvformat.gathered(layout, data):
            if not layout.group_full[i]:
                inline.append(bytes(view))
                continue
            key = chunk_key(ev.publisher, view)
            chunk = self.chunks.get(key)
            if chunk is None:
                txn.put(key, view, db=self.chunk)
                chunk = self.chunks[key] = _Chunk(len(view))
                self.bytes += chunk.size
            chunk.refs += 1
            keys.append(key)
        value = pack_chunked(keys, layout, inline)
        txn.put(ev.content, value, db=self.blob)
        return _Indexed(ev.pinned, len(value), keys)

    def _update(
        self,
        txn: lmdb.Transaction,
        content: bytes,
        pinned: bool | None = None,
        last_used: float | None = None,
    ) -> None:
        row = self.lru.get(content)
        raw = txn.get(content, db=self.meta) if row is not None else None
        if row is None or raw is None:
            return
        try:
            rec = DiskRecord.unpack(content, bytes(raw))
        except TierError:
            self.errors["corrupt"] = self.errors.get("corrupt", 0) + 1
            self._delete(txn, content)
            return
        if pinned is not None:
            rec, row.pinned = replace(rec, pinned=pinned), pinned  # (the flag CHUNKED kept)
        if last_used is not None:
            rec = replace(rec, last_used=last_used)
            self.lru.move_to_end(content)
        txn.put(content, rec.pack(), db=self.meta)

    def _delete(self, txn: lmdb.Transaction, content: bytes) -> None:
        """Delete a record, and each chunk no other record lists."""
        txn.delete(content, db=self.meta)
        txn.delete(content, db=self.blob)
        row = self.lru.pop(content, None)
        if row is None:
            return
        self.bytes -= row.own
        for key in row.chunks:
            chunk = self.chunks.get(key)
            if chunk is None:
                continue
            chunk.refs -= 1
            if chunk.refs <= 0:
                del self.chunks[key]
                txn.delete(key, db=self.chunk)
                self.bytes -= chunk.size

    def _evict(self, txn: lmdb.Transaction) -> None:
        """Least recently used first, unpinned before pinned, until within ``size``."""
        for pinned in (False, True):
            if self.bytes <= self.size:
                return
            for content in [c for c, row in self.lru.items() if row.pinned == pinned]:
                if self.bytes <= self.size:
                    return
                self._delete(txn, content)
                self.evicted += 1

    def _classify(self, e: lmdb.Error) -> TierError:
        if isinstance(e, lmdb.MapFullError):
            return TierError(f"{self.path}: LMDB map full ({e}); lower --persist-size", "map_full")
        try:
            free = shutil.disk_usage(self.path).free
        except OSError:
            free = -1
        if 0 <= free < _LOW_SPACE:
            return TierError(
                f"{self.path}: disk full ({format_size(free)} free): free space there or "
                f"lower --persist-size",
                "disk_full",
            )
        if not os.access(self.path, os.W_OK):
            return TierError(f"{self.path} is not writable: fix its permissions", "unwritable")
        return TierError(f"{self.path}: {e}", "io")

    # ------------------------------------------------------------------- read
    def load(self, content: bytes) -> tuple[DiskRecord, bytes | ChunkedLoad] | None:
        """A record and its payload (refill thread); None if it is gone. A whole record's
        payload is a private copy; a chunked one's is a :class:`ChunkedLoad`: its groups
        as they lie in the store, nothing assembled or copied (the caller closes it).
        Every page they span is read here, off the loop.

        TierError("corrupt") if its metadata fails its checks, or a chunk is missing or of
        the wrong length; the data's checksums (each chunk's XXH3-128, the payload's
        XXH3-64) are checked by the put that takes it into the arena.
        """
        assert self.env is not None
        txn = self.env.begin(buffers=True)
        handed = False  # (the transaction goes with a chunked record's views)
        try:
            raw = txn.get(content, db=self.meta)
            if raw is None:
                return None
            rec = DiskRecord.unpack(content, bytes(raw))
            blob = txn.get(content, db=self.blob)
            if blob is None:
                raise TierError("record payload missing", "corrupt")
            if rec.chunked:
                grouped = self._grouped(txn, blob, rec)
                with self._loads_cv:
                    self._loads += 1
                handed = True
                return rec, ChunkedLoad(self, txn, grouped)
            if len(blob) != rec.payload_len:
                raise TierError("record payload of the wrong length", "corrupt")
            return rec, bytes(blob)
        finally:
            if not handed:
                txn.abort()

    def _grouped(
        self, txn: lmdb.Transaction, value: memoryview, rec: DiskRecord
    ) -> kvformat.Grouped:
        """A chunked record's groups: the inline ones in its value, the full ones its
        chunks (each with the XXH3-128 its key holds), views of the map; TierError("corrupt")
        if a chunk is missing or of the wrong length."""
        keys, layout, inline, sealed = parse_chunked(value, rec)
        groups: list[memoryview] = []
        digests: list[bytes | None] = []
        it, k = iter(inline), iter(keys)
        for size, full in zip(layout.group_sizes, layout.group_full, strict=True):
            if not full:
                groups.append(next(it))
                digests.append(None)
                continue
            key = next(k)
            got = txn.get(key, db=self.chunk)
            if got is None or len(got) != size:
                raise TierError("chunk of a record missing or of the wrong length", "corrupt")
            data = memoryview(got)
            _touch(data)
            groups.append(data)
            digests.append(key[_UID.size :])
        _touch(value)
        return kvformat.Grouped(layout, groups, digests, sealed)

    def load_closed(self) -> None:
        """A :class:`ChunkedLoad` was closed."""
        with self._loads_cv:
            self._loads -= 1
            self._loads_cv.notify_all()

    def _close_env(self, env: lmdb.Environment) -> None:
        """Close the store once no chunked record handed out views its map (or after
        :data:`_LOADS_WAIT` seconds: the refill closes each within a put's time)."""
        with self._loads_cv:
            if not self._loads_cv.wait_for(lambda: self._loads <= 0, _LOADS_WAIT):
                log.error("persist %s: closed with %d records still read", self.path, self._loads)
        try:
            env.close()
        except lmdb.Error:
            pass

    def close(self) -> None:
        if self.env is not None:
            self._close_env(self.env)
            self.env = None
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
