"""The arena: one file in /dev/shm, its byte layout, read and written.

Imported by every process, and the only module that knows the layout, in both
directions. Workers (and the supervisor, to re-check records) map the file
PROT_READ through :class:`ArenaView` and never write. The supervisor, the one
writer, writes through :class:`ArenaWriter` (``store.py`` for the index and
records, ``arenafile.py`` for the header); nothing else packs these structs.

Layout (all integers little-endian)::

    0           header (4 KiB): magic, format version, geometry, arena id,
                mutable word (state)
    4 KiB       index: ``index_slots`` slots of 64 bytes, an open-addressing
                (linear probing) hash table from 16-byte chunk-prefix digests
                to records; each slot is guarded by a seqlock word
    data_offset data region: records and chunks in 4 KiB-aligned extents

A record is ``header (128 B) | fingerprint | token ids (int32) | body``.
It carries its key (the digest of its last full chunk), the root digest its
chain started from, its publisher's uid (the supervisor's word, from the put's
connection), a model fingerprint (opaque bytes), its token ids, the payload
length, an XXH3-64 checksum of the payload and one of everything else. A whole
record's body is its payload. A chunked one's (``FLAG_CHUNKED``) is the payload's
manifest (``kvformat.py``: its skeleton and group layout, zlib-compressed), a
reference per token group (offset, generation, length) and the groups that are not
shared, inline; each shared group is a chunk, an extent of its own
(``header (64 B) | data``: magic, generation, length, XXH3-128 of the data,
publisher uid) that records of one publisher name while the supervisor keeps it
(``supervisor/chunks.py``). A reader follows a record's references only, checks
each chunk's header, assembles the payload and checks its XXH3-64 (:meth:`ArenaView.blob`).

Keys are chained: ``d1 = H(root, chunk1)``, ``dk = H(d(k-1), chunk k)`` over
fixed-length chunks of ``chunk_tokens`` token ids, H = BLAKE2b-128. A record of
n full chunks is indexed under all n digests, so the presence of a chunk
prefix is monotone (if k chunks are present, so are k-1) and the longest
cached prefix is found by binary search: O(log chunks) probes, no socket.

Nothing read from the arena is trusted: every offset is bounds-checked and a
record is only used once its magic, generation, checksums, fingerprint and
token ids all match. A torn or stale read therefore costs a miss, never a
wrong answer.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
import threading
import time
import weakref
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import xxhash

from shmkv.core.errors import ArenaCorruptError
from shmkv.core.kvformat import Manifest, assemble

MAGIC = b"SHMKVAR\x00"
FORMAT_VERSION = 3
HEADER_SIZE = 4096
SLOT_SIZE = 64
PAGE = 4096
DIGEST_SIZE = 16
MAX_TOKENS = 1 << 20
MAX_FINGERPRINT = 1024
MAX_PROBE = 128

# Header: immutable part, then its checksum, then mutable words.
_HDR = struct.Struct("<8sIIQQQQQIII16sd")
_HDR_CSUM_OFF = 128
_STATE_OFF = 144  # u32: 1 live, 2 closed
STATE_LIVE, STATE_CLOSED = 1, 2

# Index slot: seq (seqlock, odd while written), used flag, digest, record offset,
# record generation, chunk count of this digest.
_SLOT = struct.Struct("<II16sQQI")
#: an index slot as a numpy row (``_SLOT``'s fields, padded to SLOT_SIZE)
SLOT_DTYPE = np.dtype(
    {
        "names": ["seq", "used", "digest", "rec_offset", "rec_gen", "n_chunks"],
        "formats": ["<u4", "<u4", "V16", "<u8", "<u8", "<u4"],
        "offsets": [0, 4, 8, 24, 32, 40],
        "itemsize": SLOT_SIZE,
    }
)
_SEQ = struct.Struct("<I")

# Record header: magic, format version, flags, generation, key, root, token count,
# chunk count, fingerprint length, tokens offset, payload offset, payload length,
# payload checksum, metadata checksum, created, publisher uid, body length (the bytes
# after the token ids: the payload itself, or a chunked record's manifest and references).
REC_MAGIC = b"SKVR"
REC_HEADER_SIZE = 128
_REC = struct.Struct("<4sHHQ16s16sIIIIQQQQdIQ")
_U64 = struct.Struct("<Q")
#: record flag: the payload is stored as a manifest and chunk references (``Body``)
FLAG_CHUNKED = 1

# A chunked record's body: magic, stored manifest length, packed manifest length, group
# count; the packed manifest, zlib-compressed (its cell metadata is a dozen bytes per
# token, as much as a small model's KV row, and most regular); (8-aligned) a reference
# per group: offset, generation, length (generation 0: the group's data is inline, at
# that offset from the body's start); (64-aligned) the inline data (the groups that
# are not shared: a tail, a window's edge).
BODY_MAGIC = b"SKVB"
_BODY = struct.Struct("<4sIII")
#: the longest packed manifest a body may hold (a million cells' metadata, and more)
MAX_MANIFEST = 1 << 26
_REF = struct.Struct("<QQQ")
#: most groups a record may reference (a million-token state in 64-token chunks, twice)
MAX_GROUPS = 1 << 15

# A chunk (a group's data shared by records): magic, format version, flags, generation,
# data length, XXH3-128 of the data, publisher uid; the data from CHUNK_HEADER_SIZE on.
CHUNK_MAGIC = b"SKVC"
CHUNK_HEADER_SIZE = 64
_CHUNK = struct.Struct("<4sHHQQ16sI")


def align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def slot_home(digest: bytes, n_slots: int) -> int:
    """The slot a digest's linear-probing path starts at."""
    return int.from_bytes(digest[:8], "little") & (n_slots - 1)


@dataclass(frozen=True)
class Geometry:
    """What every process must agree on; read from the arena header."""

    arena_size: int
    index_offset: int
    index_slots: int
    data_offset: int
    data_size: int
    chunk_tokens: int
    supervisor_pid: int
    created: float
    arena_id: bytes

    @classmethod
    def plan(cls, arena_size: int, chunk_tokens: int, index_slots: int = 0) -> Geometry:
        """Lay out an arena of ``arena_size`` bytes."""
        if index_slots == 0:
            index_slots = max(4096, arena_size // (16 * 1024))
        index_slots = 1 << (index_slots - 1).bit_length()
        index_bytes = align(index_slots * SLOT_SIZE, PAGE)
        data_offset = HEADER_SIZE + index_bytes
        data_size = (arena_size - data_offset) // PAGE * PAGE
        if data_size < PAGE:
            raise ValueError(
                f"arena size {arena_size} leaves no room for data after a "
                f"{index_slots}-slot index: raise --size or lower --index-slots"
            )
        return cls(
            arena_size,
            HEADER_SIZE,
            index_slots,
            data_offset,
            data_size,
            chunk_tokens,
            os.getpid(),
            0.0,
            os.urandom(16),
        )

    def pack(self) -> bytes:
        body = _HDR.pack(
            MAGIC,
            FORMAT_VERSION,
            HEADER_SIZE,
            self.arena_size,
            self.index_offset,
            self.index_slots,
            self.data_offset,
            self.data_size,
            self.chunk_tokens,
            SLOT_SIZE,
            self.supervisor_pid,
            self.arena_id,
            self.created,
        )
        return body + b"\0" * (_HDR_CSUM_OFF - len(body))

    @classmethod
    def unpack(cls, buf: mmap.mmap | bytes, file_size: int) -> Geometry:
        """Read and validate the header; raise ArenaCorruptError on any inconsistency."""
        if file_size < HEADER_SIZE:
            raise ArenaCorruptError(f"arena file is {file_size} bytes, smaller than its header")
        head = bytes(buf[:_HDR_CSUM_OFF])
        (csum,) = _U64.unpack_from(buf, _HDR_CSUM_OFF)
        if xxhash.xxh3_64_intdigest(head) != csum:
            raise ArenaCorruptError("arena header checksum mismatch: restart the supervisor")
        (magic, version, hsize, size, ioff, slots, doff, dsize, chunk, ssize, pid, aid, created) = (
            _HDR.unpack_from(head)
        )
        if magic != MAGIC:
            raise ArenaCorruptError("not a shmkv arena (bad magic)")
        if version != FORMAT_VERSION:
            raise ArenaCorruptError(
                f"arena format {version}, this shmkv reads {FORMAT_VERSION}: "
                "run the same shmkv version as the supervisor"
            )
        ok = (
            hsize == HEADER_SIZE
            and ssize == SLOT_SIZE
            and ioff == HEADER_SIZE
            and slots > 0
            and slots & (slots - 1) == 0
            and doff == align(ioff + slots * SLOT_SIZE, PAGE)
            and doff + dsize <= size <= file_size
            and 0 < chunk <= MAX_TOKENS
        )
        if not ok:
            raise ArenaCorruptError(
                f"arena geometry is inconsistent (file {file_size} bytes): restart the supervisor"
            )
        return cls(size, ioff, slots, doff, dsize, chunk, pid, created, aid)


def header_checksum(head: bytes) -> int:
    return xxhash.xxh3_64_intdigest(head)


def header_format(buf: mmap.mmap | bytes) -> tuple[bytes, int, int]:
    """(magic, format version, state) of an arena header, unchecked: what a file claims.

    Read before :meth:`Geometry.unpack` to tell another format (refused) from damage.
    """
    magic, version = struct.unpack_from("<8sI", buf, 0)
    (state,) = _SEQ.unpack_from(buf, _STATE_OFF)
    return bytes(magic), int(version), int(state)


@dataclass(frozen=True)
class Slot:
    digest: bytes
    rec_offset: int
    rec_gen: int
    n_chunks: int


@dataclass(frozen=True)
class Hit:
    """A cached chunk prefix: ``chunks`` full chunks, found at ``slot``."""

    chunks: int
    slot: Slot


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading token ids ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def probe_path(
    read_slot: Callable[[int], tuple[int, Slot | None]], digest: bytes, n_slots: int
) -> tuple[int | None, Slot | None]:
    """Walk ``digest``'s probe path; the one lookup the view and the writer share.

    ``read_slot(i)`` gives (used flag, slot or None). Returns (i, slot) for the
    slot holding ``digest``; (i, None) for the first empty slot when it is absent
    (where an insert goes); (None, None) when the walk hit ``MAX_PROBE``.
    """
    i = slot_home(digest, n_slots)
    for _ in range(min(MAX_PROBE, n_slots)):
        used, slot = read_slot(i)
        if not used:
            return i, None
        if slot is not None and slot.digest == digest:
            return i, slot
        i = (i + 1) & (n_slots - 1)
    return None, None


@dataclass(frozen=True)
class Record:
    """A validated record header: where its parts are, what it claims to be."""

    offset: int
    gen: int
    key: bytes
    root: bytes
    n_tokens: int
    n_chunks: int
    fp_off: int
    fp_len: int
    tokens_off: int
    payload_off: int
    payload_len: int
    payload_xxh3: int
    created: float
    #: uid of the process that published it (SO_PEERCRED of its put's connection)
    publisher: int
    #: record flags (``FLAG_CHUNKED``)
    flags: int = 0
    #: bytes of its body, at ``payload_off``: the payload itself for a whole record, a
    #: chunked one's manifest, references and inline groups
    body_len: int = 0

    @property
    def chunked(self) -> bool:
        """The payload is stored as chunks (read it with :meth:`ArenaView.blob`)."""
        return bool(self.flags & FLAG_CHUNKED)

    @property
    def end(self) -> int:
        return self.payload_off + self.body_len


@dataclass(frozen=True)
class ChunkRef:
    """Where one group of a chunked record's payload is: a chunk (``gen`` > 0, ``offset``
    in the arena) or inline (``gen`` 0, ``offset`` from the body's start)."""

    offset: int
    gen: int
    length: int

    @property
    def inline(self) -> bool:
        return self.gen == 0


@dataclass(frozen=True)
class ChunkInfo:
    """A chunk's validated header: where its data is, what it claims."""

    offset: int
    gen: int
    length: int
    digest: bytes
    publisher: int

    @property
    def data_off(self) -> int:
        return self.offset + CHUNK_HEADER_SIZE

    @property
    def extent(self) -> int:
        return chunk_extent(self.length)


def record_layout(n_tokens: int, fp_len: int, body_len: int) -> tuple[int, int, int, int]:
    """(fingerprint offset, tokens offset, payload (body) offset, extent size), record-relative."""
    fp_off = REC_HEADER_SIZE
    tok_off = align(fp_off + fp_len, 8)
    pay_off = align(tok_off + 4 * n_tokens, 64)
    return fp_off, tok_off, pay_off, align(pay_off + body_len, PAGE)


def chunk_extent(length: int) -> int:
    """The extent of a chunk of ``length`` data bytes (header included)."""
    return align(CHUNK_HEADER_SIZE + length, PAGE)


def chunk_digest(data: bytes | memoryview) -> bytes:
    """What a chunk's header keeps of its data: XXH3-128."""
    return xxhash.xxh3_128_digest(data)


def body_layout(manifest_len: int, inline: Sequence[int]) -> tuple[int, int, list[int], int]:
    """(manifest offset, references offset, inline offsets, body length) of a chunked
    record's body whose manifest packs to ``manifest_len`` bytes and whose groups are
    ``inline`` (a length per group: 0 for a chunk reference, else the inline data's)."""
    man_off = _BODY.size
    refs_off = align(man_off + manifest_len, 8)
    pos = align(refs_off + _REF.size * len(inline), 64)
    offs = []
    for n in inline:
        offs.append(pos if n else 0)
        pos += n
    return man_off, refs_off, offs, pos


def stored_manifest(manifest: bytes) -> bytes:
    """A packed manifest as a body stores it (compressed; :func:`pack_body_head`)."""
    return zlib.compress(manifest, 1)


def pack_body_head(manifest: bytes, stored: bytes, refs: Sequence[ChunkRef]) -> bytes:
    """A chunked record's body up to its inline data: magic, manifest (``stored``: its
    :func:`stored_manifest`), references."""
    _, refs_off, _, _ = body_layout(len(stored), [0] * len(refs))
    out = bytearray(refs_off + _REF.size * len(refs))
    _BODY.pack_into(out, 0, BODY_MAGIC, len(stored), len(manifest), len(refs))
    out[_BODY.size : _BODY.size + len(stored)] = stored
    for i, r in enumerate(refs):
        _REF.pack_into(out, refs_off + i * _REF.size, r.offset, r.gen, r.length)
    return bytes(out)


def _unpack_manifest(stored: bytes | memoryview, n: int) -> Manifest:
    """The manifest a body stores, inflated to at most its declared ``n`` bytes."""
    try:
        inflate = zlib.decompressobj()
        raw = inflate.decompress(stored, n)
        if len(raw) != n or not inflate.eof or inflate.unconsumed_tail or inflate.unused_data:
            raise ArenaCorruptError("chunked record body: its manifest is not what it says")
    except zlib.error:
        raise ArenaCorruptError("chunked record body: its manifest does not inflate") from None
    return Manifest.unpack(raw)


def parse_body(body: bytes | memoryview) -> tuple[Manifest, list[ChunkRef]]:
    """The manifest and references of a chunked record's ``body``, bounds-checked:
    ArenaCorruptError on anything inconsistent (an inline group outside the body, a
    reference whose length is not its group's)."""
    n = len(body)
    if n < _BODY.size:
        raise ArenaCorruptError("chunked record body too short")
    magic, man_len, raw_len, n_refs = _BODY.unpack_from(body, 0)
    if (
        magic != BODY_MAGIC
        or n_refs > MAX_GROUPS
        or raw_len > MAX_MANIFEST
        or _BODY.size + man_len > n
    ):
        raise ArenaCorruptError("chunked record body has a bad head")
    manifest = _unpack_manifest(body[_BODY.size : _BODY.size + man_len], raw_len)
    if len(manifest.group_sizes) != n_refs:
        raise ArenaCorruptError("chunked record body: references do not match its manifest")
    _, refs_off, _, first_inline = body_layout(man_len, [0] * n_refs)
    if first_inline > n:
        raise ArenaCorruptError("chunked record body too short for its references")
    refs = []
    for i in range(n_refs):
        off, gen, length = _REF.unpack_from(body, refs_off + i * _REF.size)
        if length != manifest.group_sizes[i]:
            raise ArenaCorruptError("chunked record: a reference's length is not its group's")
        if gen == 0 and not (first_inline <= off and off + length <= n):
            raise ArenaCorruptError("chunked record: an inline group outside its body")
        refs.append(ChunkRef(off, gen, length))
    return manifest, refs


_META_CSUM_OFF = struct.calcsize("<4sHHQ16s16sIIIIQQQ")  # the u64 before `created`


def meta_checksum(
    header: bytes, fingerprint: bytes | memoryview, tokens: bytes | memoryview
) -> int:
    h = xxhash.xxh3_64()
    h.update(header[:_META_CSUM_OFF])
    h.update(header[_META_CSUM_OFF + 8 : _REC.size])
    h.update(fingerprint)
    h.update(tokens)
    return h.intdigest()


#: an assembly buffer is a whole number of these (a transparent huge page on x86-64)
HUGE_PAGE = 2 << 20


def _assembly_buffer(n: int) -> np.ndarray:
    """Anonymous memory for at least ``n`` bytes, in transparent huge pages where the kernel
    allows: the first restore that writes it faults a few pages in, not thousands (a
    10 MiB state: ~1 ms instead of 2-20 ms on a loaded machine)."""
    size = align(max(n, 1), HUGE_PAGE)
    mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            mm.madvise(advice)
        except OSError:  # (no THP in this kernel: 4 KiB pages then)
            pass
    return np.frombuffer(mm, dtype=np.uint8)


def _release_pages(buf: np.ndarray) -> None:
    """Give the pages of an :func:`_assembly_buffer` back to the kernel (they read as
    zeros until written again)."""
    mm = buf.base.obj if isinstance(buf.base, memoryview) else buf.base
    if isinstance(mm, mmap.mmap):
        try:
            mm.madvise(mmap.MADV_DONTNEED)
        except (OSError, ValueError):  # (closed, or no madvise: the pages stay)
            pass


#: seconds the assembly buffer keeps its pages after a chunked restore: restores in a row
#: reuse them (faulting a 512 MiB state's back in cost 153 ms, three times the copy into
#: them: docs/benchmarks.md, "Scale"); an idle worker gives them back
ASSEMBLY_IDLE_S = 1.0


class _Assembly:
    """The buffer chunked payloads are assembled into (:meth:`ArenaView.assembled`): one
    per view, held under ``lock``; its pages go back to the kernel once no restore used it
    for :data:`ASSEMBLY_IDLE_S`, on a timer thread that exists only while pages are held."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.buf: np.ndarray | None = None
        self._used = 0.0
        self._timer: threading.Timer | None = None

    def take(self, n: int) -> np.ndarray:
        """The buffer, at least ``n`` bytes (``lock`` held)."""
        if self.buf is None or len(self.buf) < n:
            self.buf = None  # (the old one goes first: never two at once)
            self.buf = _assembly_buffer(n)
        return self.buf

    def done(self) -> None:
        """A restore is done with the buffer (``lock`` held): give its pages back once idle."""
        self._used = time.monotonic()
        if self._timer is None or not self._timer.is_alive():  # (none after a fork)
            self._arm(ASSEMBLY_IDLE_S)

    def _arm(self, delay: float) -> None:
        self._timer = threading.Timer(delay, self._idle)
        self._timer.daemon = True
        self._timer.start()

    def _idle(self) -> None:
        with self.lock:  # (waits out a restore in progress, which sets _used again)
            wait = self._used + ASSEMBLY_IDLE_S - time.monotonic()
            if wait > 0:
                self._arm(wait)
            elif self.buf is not None:
                _release_pages(self.buf)

    def close(self) -> None:
        """Give the buffer up now (the view is closing); while a restore holds it (this
        thread's own, maybe: the lock is not reentrant), that restore's end arms the timer."""
        if self._timer is not None:
            self._timer.cancel()
        if self.lock.acquire(blocking=False):
            try:
                self.buf = None
            finally:
                self.lock.release()


#: madvise(2): fault in the pages of a range for reading (Linux 5.14); called through
#: ctypes, which lets go of the GIL (``mmap.madvise`` holds it)
_MADV_POPULATE_READ = 22
_libc = ctypes.CDLL(None)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int
#: bytes a populate call maps at a time (a stop waits for one: about 20 ms at 16 GB/s)
_POPULATE_SLICE = 256 << 20


class _Populate:
    """Map a reserved arena's data region in a thread of its own, a slice at a time, so
    that restores find their pages mapped (no fault per page) without the attach waiting
    for all of them (``madvise(MADV_POPULATE_READ)``); a kernel without it leaves the
    pages to fault in as they are read.
    :meth:`stop` returns once no call is under way (the range is then safe to unmap)."""

    def __init__(self, mm: mmap.mmap, address: int, length: int) -> None:
        self._stopped = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(mm, address, length), name="shmkv-populate", daemon=True
        )
        self._thread.start()

    def _run(self, mm: mmap.mmap, address: int, length: int) -> None:
        # (``mm`` is held so that the mapping outlives the calls: a view collected unclosed
        # is unmapped only once this ends)
        for off in range(0, length, _POPULATE_SLICE):
            if self._stopped.is_set():
                return
            n = min(_POPULATE_SLICE, length - off)
            if _libc.madvise(address + off, n, _MADV_POPULATE_READ):
                return  # (EINVAL: an older kernel; the pages fault in when read)

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive():  # (a forked child has no such thread: nothing to wait for)
            self._thread.join()


class ArenaView:
    """A worker's read-only view of the arena: lock-free lookup and record validation.

    It holds a mapping and a descriptor of the arena file, and either pins the file's
    tmpfs pages even once a new supervisor unlinked it. :meth:`close` lets go of both;
    a view nobody closes (a Client drops its view, never closing it, while a Lease may
    still read it) lets go of both when its last reference goes.
    """

    def __init__(self, fd: int, populate: bool = True) -> None:
        st = os.fstat(fd)
        size = st.st_size
        # ``populate``: map every page at once, if every page exists (a --reserve arena).
        # The data region of an arena allocated as records are stored has holes, and a
        # read fault on a hole of a shared tmpfs mapping allocates it (or SIGBUSes when
        # the tmpfs is full): there, only the header and index are mapped at once, and
        # a record's pages when it is read, under its lease (``pages.py``).
        # A whole arena's data region is mapped by a thread after the view is made
        # (:class:`_Populate`): at 8 GiB, MAP_POPULATE held the attach for 0.55 s, which a
        # worker re-attaching to a restarted supervisor paid before its first hit.
        whole = populate and st.st_blocks * 512 >= size
        self.mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        try:
            self.geometry = Geometry.unpack(self.mm, size)
            #: our own descriptor of the file, for lease-free reads (:meth:`peek`)
            self.fd = os.dup(fd)
        except Exception:
            self.mm.close()
            raise
        # closed by close(), or when the view is collected (an int closes nothing by itself)
        self._close_fd = weakref.finalize(self, os.close, self.fd)
        if populate:
            for off in range(0, self.geometry.data_offset, mmap.PAGESIZE):
                self.mm[off]
        self.file_size = size
        #: the buffer chunked payloads are assembled into, and who holds it (:meth:`assembled`)
        self._assembly = _Assembly()
        self._np = np.frombuffer(self.mm, dtype=np.uint8)
        self.base_address: int = self._np.ctypes.data
        off = self.geometry.data_offset
        self._populate = _Populate(self.mm, self.base_address + off, size - off) if whole else None

    def close(self) -> None:
        if self._populate is not None:  # (before the unmap: it maps pages of this range)
            self._populate.stop()
        self._assembly.close()
        self._np = None  # type: ignore[assignment]
        self._close_fd()  # once only: a later collection closes nothing
        self.fd = -1
        try:
            self.mm.close()
        except BufferError:  # a numpy view is still alive somewhere; unmapped at GC
            pass

    # -- mutable header words -------------------------------------------------
    def state(self) -> int:
        return int(_SEQ.unpack_from(self.mm, _STATE_OFF)[0])

    # -- index ------------------------------------------------------------------
    def read_slot(self, i: int) -> tuple[int, Slot | None]:
        """Seqlock read of slot i: (used flag, slot or None)."""
        g = self.geometry
        off = g.index_offset + i * SLOT_SIZE
        for _ in range(64):
            seq1 = _SEQ.unpack_from(self.mm, off)[0]
            if seq1 & 1:
                continue
            seq, used, digest, roff, rgen, nch = _SLOT.unpack_from(self.mm, off)
            if _SEQ.unpack_from(self.mm, off)[0] == seq1 == seq:
                return used, (Slot(digest, roff, rgen, nch) if used else None)
        return 0, None  # writer kept it busy: treat as a miss

    def probe(self, digest: bytes) -> Slot | None:
        """Find ``digest`` in the index; None if absent."""
        return probe_path(self.read_slot, digest, self.geometry.index_slots)[1]

    def check(self) -> None:
        """Raise ArenaCorruptError if the file shrank under the mapping.

        Reading a page past the end of a truncated file is a SIGBUS, so this runs
        before every lookup and restore (one fstat). Only the arena's owner (or
        root) can truncate it; a window between this check and the copy remains.
        """
        if self.mm.size() < self.file_size:
            raise ArenaCorruptError(
                "the arena file was truncated under its mapping: restart `shmkv supervise`"
            )

    def find_longest(self, digests: Sequence[bytes]) -> tuple[int, Slot] | None:
        """Longest k such that digests[k-1] is indexed, by binary search; (k, slot)."""
        self.check()
        lo, hi, best = 1, len(digests), None
        while lo <= hi:
            mid = (lo + hi) // 2
            slot = self.probe(digests[mid - 1])
            if slot is not None:
                best, lo = (mid, slot), mid + 1
            else:
                hi = mid - 1
        return best

    # -- records ---------------------------------------------------------------
    def read_record(self, offset: int, gen: int) -> Record:
        """Parse and bounds-check the record at ``offset``; ArenaCorruptError if invalid.

        Reads the mapping: only under a lease (or as the supervisor, of a live record).
        """
        self._check_offset(offset)
        return self._parse_record(self.mm, offset, gen)

    def _check_offset(self, offset: int) -> None:
        g = self.geometry
        if not (
            g.data_offset <= offset
            and offset + REC_HEADER_SIZE <= g.data_offset + g.data_size
            and offset % PAGE == g.data_offset % PAGE
        ):
            raise ArenaCorruptError(f"record offset {offset} outside the data region")

    def _pread(self, n: int, offset: int) -> bytes:
        """``n`` bytes of the file at ``offset``, read without the mapping: a hole reads as
        zeros and stays a hole (a fault on it would allocate it, or SIGBUS)."""
        try:
            raw = os.pread(self.fd, n, offset)
        except (OSError, ValueError):
            raw = b""
        if len(raw) != n:
            raise ArenaCorruptError(f"cannot read {n} bytes of the arena at {offset}")
        return raw

    def peek(self, offset: int, gen: int) -> tuple[Record, np.ndarray]:
        """A lease-free look at the record (offset, gen): its header and token ids, read
        with ``pread`` (the record may be freed and its pages punched meanwhile: ``pages.py``).
        ArenaCorruptError if it does not parse; nothing else of it is checked."""
        self._check_offset(offset)
        rec = self._parse_record(self._pread(REC_HEADER_SIZE, offset), 0, gen, offset)
        raw = self._pread(4 * rec.n_tokens, rec.tokens_off)
        return rec, np.frombuffer(raw, dtype="<i4")

    def read_payload(self, rec: Record) -> bytes:
        """A copy of ``rec``'s payload read with ``pread`` (lease-free, as :meth:`peek`): a
        chunked record's assembled from its chunks, each read with ``pread`` too. Nothing
        is checked but bounds (the caller compares the payload's XXH3 to the record's)."""
        if not rec.chunked:
            return self._pread(rec.payload_len, rec.payload_off)
        out = bytearray(rec.payload_len)
        self._assemble(rec, self._pread, memoryview(out))
        return bytes(out)

    # -- chunks -------------------------------------------------------------------
    def peek_chunks(self, rec: Record) -> tuple[Manifest, list[ChunkRef], list[ChunkInfo | None]]:
        """:meth:`chunks` read with ``pread`` (lease-free, as :meth:`peek`): a chunked
        record's manifest, references and the header of each chunk they name."""
        manifest, refs, infos, _ = self._chunk_parts(rec, self._pread)
        return manifest, refs, infos

    def read_chunk(self, offset: int, gen: int, length: int) -> tuple[bytes, bytes]:
        """A copy of the data of the chunk (offset, gen) of ``length`` bytes, read with
        ``pread`` (lease-free, as :meth:`peek`), and the XXH3-128 its header keeps:
        ArenaCorruptError unless a chunk of that generation and length is there. The chunk
        may be freed and its space reused during the read: compare the data's XXH3-128 to
        what you expect before trusting it."""
        info = self._chunk_header(ChunkRef(offset, gen, length), self._pread)
        return self._pread(length, info.data_off), info.digest

    def _mapped(self, n: int, offset: int) -> memoryview:
        """``n`` bytes of the mapping at ``offset`` (zero copy; under a lease)."""
        return memoryview(self.mm)[offset : offset + n]

    def _chunk_parts(
        self, rec: Record, read: Callable[[int, int], bytes | memoryview]
    ) -> tuple[Manifest, list[ChunkRef], list[ChunkInfo | None], bytes | memoryview]:
        """A chunked record's manifest, references, the header of each chunk they name (None
        for an inline group) and its body, each read with ``read(n, offset)`` (``pread``, or
        the mapping) and bounds-checked; ArenaCorruptError if any does not parse."""
        body = read(rec.body_len, rec.payload_off)
        manifest, refs = parse_body(body)
        infos = [None if r.inline else self._chunk_header(r, read) for r in refs]
        return manifest, refs, infos, body

    def _assemble(
        self, rec: Record, read: Callable[[int, int], bytes | memoryview], out: memoryview
    ) -> None:
        """Assemble chunked ``rec``'s payload into ``out`` from what ``read`` reads."""
        manifest, refs, infos, body = self._chunk_parts(rec, read)
        if manifest.blob_len != rec.payload_len:
            raise ArenaCorruptError(f"record at {rec.offset}: its manifest is of another length")
        groups = [
            body[r.offset : r.offset + r.length] if i is None else read(i.length, i.data_off)
            for r, i in zip(refs, infos, strict=True)
        ]
        try:
            assemble(manifest, groups, out)
        finally:
            for v in (*groups, body):
                if isinstance(v, memoryview):
                    v.release()

    def _check_chunk_offset(self, ref: ChunkRef) -> None:
        g = self.geometry
        if not (
            g.data_offset <= ref.offset
            and ref.offset + chunk_extent(ref.length) <= g.data_offset + g.data_size
            and ref.offset % PAGE == g.data_offset % PAGE
        ):
            raise ArenaCorruptError(f"chunk offset {ref.offset} outside the data region")

    def _chunk_header(
        self, ref: ChunkRef, read: Callable[[int, int], bytes | memoryview]
    ) -> ChunkInfo:
        """The chunk ``ref`` names, its header read with ``read`` once its extent is known to
        be in the data region; ArenaCorruptError unless it has the reference's generation
        and length."""
        self._check_chunk_offset(ref)
        head = read(CHUNK_HEADER_SIZE, ref.offset)
        magic, version, flags, gen, length, digest, publisher = _CHUNK.unpack_from(head)
        if magic != CHUNK_MAGIC or version != FORMAT_VERSION or flags != 0:
            raise ArenaCorruptError(f"no chunk at offset {ref.offset}")
        if gen != ref.gen or length != ref.length:
            raise ArenaCorruptError(f"chunk at {ref.offset} is not the one its record names")
        return ChunkInfo(ref.offset, gen, length, digest, publisher)

    def body(self, rec: Record) -> memoryview:
        """A record's body in the mapping (under a lease): a chunked one's manifest,
        references and inline groups; a whole one's payload."""
        return memoryview(self.mm)[rec.payload_off : rec.payload_off + rec.body_len]

    def chunks(self, rec: Record) -> tuple[Manifest, list[ChunkRef], list[ChunkInfo | None]]:
        """A chunked record's manifest, references, and the header of each chunk they name
        (None for an inline group), read from the mapping (under a lease) and bounds-checked;
        ArenaCorruptError if any does not parse."""
        manifest, refs, infos, body = self._chunk_parts(rec, self._mapped)
        if isinstance(body, memoryview):
            body.release()
        return manifest, refs, infos

    def blob(self, rec: Record, out: memoryview | None = None) -> memoryview:
        """The payload of ``rec`` (under a lease): a whole record's bytes in the mapping
        (zero copy), a chunked one's assembled into ``out`` (default: a new buffer).
        Unchecked: compare its XXH3 to ``rec.payload_xxh3`` before trusting it."""
        if not rec.chunked:
            return self.payload(rec)
        if out is None:
            out = memoryview(bytearray(rec.payload_len))
        elif len(out) < rec.payload_len:
            raise ValueError(f"a {len(out)}-byte buffer cannot hold a {rec.payload_len}-byte blob")
        self._assemble(rec, self._mapped, out)
        return out[: rec.payload_len]

    @contextmanager
    def assembled(self, rec: Record) -> Iterator[np.ndarray]:
        """A chunked record's payload assembled into this view's reusable buffer and checked
        against its XXH3-64 (ArenaCorruptError if it fails), the caller's until the ``with``
        ends (one per view: another thread waits); what ``kvstate`` hands to llama.cpp.
        The buffer's pages go back to the kernel once no restore used them for
        :data:`ASSEMBLY_IDLE_S` (the mapping stays: the next restore faults huge pages in
        again): restores in a row reuse them, and an idle worker keeps no copy of the
        last state it restored."""
        asm = self._assembly
        with asm.lock:
            buf = asm.take(rec.payload_len)
            try:
                mv = buf.data
                try:
                    self.blob(rec, mv)
                finally:
                    mv.release()
                blob = buf[: rec.payload_len]
                if xxhash.xxh3_64_intdigest(blob.data) != rec.payload_xxh3:
                    raise ArenaCorruptError("assembled blob fails its checksum")
                yield blob
            finally:
                asm.done()

    def _parse_record(
        self, buf: mmap.mmap | bytes, at: int, gen: int, offset: int | None = None
    ) -> Record:
        """The record header found at ``buf[at:]``, which is arena offset ``offset``."""
        g = self.geometry
        offset = at if offset is None else offset
        (
            magic,
            version,
            flags,
            rgen,
            key,
            root,
            n_tok,
            n_ch,
            fp_len,
            tok_off,
            pay_off,
            pay_len,
            pay_csum,
            _meta,
            created,
            publisher,
            body_len,
        ) = _REC.unpack_from(buf, at)
        if magic != REC_MAGIC or version != FORMAT_VERSION:
            raise ArenaCorruptError(f"no record at offset {offset}")
        if rgen != gen:
            raise ArenaCorruptError(f"record at {offset} is generation {rgen}, expected {gen}")
        fp_o, tok_o, pay_o, extent = record_layout(n_tok, fp_len, body_len)
        if (
            flags & ~FLAG_CHUNKED
            or (not flags & FLAG_CHUNKED and body_len != pay_len)
            or body_len > g.data_size
            or n_tok > MAX_TOKENS
            or fp_len > MAX_FINGERPRINT
            or tok_off != tok_o
            or pay_off != pay_o
            or n_ch != n_tok // g.chunk_tokens
            or offset + extent > g.data_offset + g.data_size
        ):
            raise ArenaCorruptError(f"record at {offset} has inconsistent lengths")
        return Record(
            offset,
            rgen,
            key,
            root,
            n_tok,
            n_ch,
            offset + fp_o,
            fp_len,
            offset + tok_o,
            offset + pay_o,
            pay_len,
            pay_csum,
            created,
            publisher,
            flags,
            body_len,
        )

    def verify_meta(self, rec: Record) -> None:
        hdr = bytes(self.mm[rec.offset : rec.offset + REC_HEADER_SIZE])
        (stored,) = _U64.unpack_from(hdr, _META_CSUM_OFF)
        got = meta_checksum(hdr, self.fingerprint(rec), self.tokens(rec).data)
        if got != stored:
            raise ArenaCorruptError(f"record at {rec.offset}: metadata checksum mismatch")

    def fingerprint(self, rec: Record) -> memoryview:
        return memoryview(self.mm)[rec.fp_off : rec.fp_off + rec.fp_len]

    def tokens(self, rec: Record) -> np.ndarray:
        return np.frombuffer(self.mm, dtype="<i4", count=rec.n_tokens, offset=rec.tokens_off)

    def payload(self, rec: Record) -> memoryview:
        return memoryview(self.mm)[rec.payload_off : rec.payload_off + rec.payload_len]

    def payload_address(self, rec: Record) -> int:
        """Address of the payload in this process: what llama_state_seq_set_data reads."""
        return self.base_address + rec.payload_off

    def chunk_intact(self, info: ChunkInfo) -> bool:
        """Whether the data of the chunk ``info`` names (a header :meth:`peek_chunks` read)
        matches the XXH3-128 its header keeps; read from the mapping (the caller has checked
        that its pages exist)."""
        data = self._mapped(info.length, info.data_off)
        try:
            return bool(chunk_digest(data) == info.digest)
        finally:
            data.release()

    def verify_payload(self, rec: Record) -> bool:
        """Whether ``rec``'s payload (a chunked one's assembled) matches its XXH3-64."""
        if not rec.chunked:
            return xxhash.xxh3_64_intdigest(self.payload(rec)) == rec.payload_xxh3
        try:
            with self.assembled(rec):
                return True
        except ArenaCorruptError:
            return False

    def intact(self, offset: int, gen: int) -> bool:
        """Whether the record (offset, gen) passes every check a worker makes."""
        try:
            rec = self.read_record(offset, gen)
            self.verify_meta(rec)
            return self.verify_payload(rec)
        except ArenaCorruptError:
            return False

    def scan(self) -> list[Slot]:
        """Every used slot (for diagnostics and tests; O(index size))."""
        out = []
        for i in range(self.geometry.index_slots):
            used, slot = self.read_slot(i)
            if used and slot is not None:
                out.append(slot)
        return out


class ArenaWriter:
    """The supervisor's writable side of the layout; runs only there, on its one thread.

    Writes in an order that keeps lock-free readers safe: an index slot changes
    under its seqlock (odd while written); a record's parts are written before
    its header, and ``store.py`` points no slot at a record before that.
    """

    def __init__(self, mm: mmap.mmap, geometry: Geometry) -> None:
        self.mm = mm
        self.geometry = geometry

    # -- header -----------------------------------------------------------------
    def format(self) -> None:
        """Write a fresh header: the geometry, its checksum, state live."""
        head = self.geometry.pack()
        self.mm[: len(head)] = head
        _U64.pack_into(self.mm, _HDR_CSUM_OFF, header_checksum(head))
        self.set_state(STATE_LIVE)

    def set_state(self, state: int) -> None:
        _SEQ.pack_into(self.mm, _STATE_OFF, state)

    # -- index ------------------------------------------------------------------
    def _slot_off(self, i: int) -> int:
        return self.geometry.index_offset + i * SLOT_SIZE

    def used_slots(self) -> tuple[np.ndarray, int]:
        """Every used slot whose write completed (a copy, as :data:`SLOT_DTYPE` rows), and
        how many were caught mid-write.

        For adopting an arena a killed supervisor left: a slot whose seqlock word is
        odd was being written when it died, and names nothing reliable.
        """
        g = self.geometry
        table = np.frombuffer(self.mm, dtype=SLOT_DTYPE, count=g.index_slots, offset=g.index_offset)
        used = table["used"] != 0
        torn = used & (table["seq"] & 1 == 1)
        out = table[used & ~torn].copy()
        del table
        return out, int(torn.sum())

    def clear_index(self) -> None:
        """Empty every slot at once, each under its seqlock (odd, cleared, even again)."""
        g = self.geometry
        words = np.frombuffer(
            self.mm, dtype="<u4", count=g.index_slots * SLOT_SIZE // 4, offset=g.index_offset
        ).reshape(g.index_slots, SLOT_SIZE // 4)
        words[:, 0] |= 1
        words[:, 1:] = 0
        words[:, 0] += 1
        del words

    def read_slot(self, i: int) -> tuple[int, Slot | None]:
        """Slot i as last written (no seqlock: this is the only process writing it)."""
        _seq, used, digest, roff, rgen, nch = _SLOT.unpack_from(self.mm, self._slot_off(i))
        return used, (Slot(digest, roff, rgen, nch) if used else None)

    def _write_slot(self, i: int, slot: Slot | None) -> None:
        off = self._slot_off(i)
        seq = _SEQ.unpack_from(self.mm, off)[0]
        odd = (seq + 1) & 0xFFFFFFFF
        _SEQ.pack_into(self.mm, off, odd)
        if slot is None:
            _SLOT.pack_into(self.mm, off, odd, 0, b"\0" * DIGEST_SIZE, 0, 0, 0)
        else:
            _SLOT.pack_into(
                self.mm, off, odd, 1, slot.digest, slot.rec_offset, slot.rec_gen, slot.n_chunks
            )
        _SEQ.pack_into(self.mm, off, (seq + 2) & 0xFFFFFFFF)

    def index_set(self, slot: Slot) -> bool:
        """Point ``slot.digest`` at its record; False if its probe path has no room."""
        i, _ = probe_path(self.read_slot, slot.digest, self.geometry.index_slots)
        if i is None:
            return False
        self._write_slot(i, slot)
        return True

    def index_del(self, digest: bytes) -> None:
        """Remove ``digest``; later slots of its run move back into the hole (no tombstones)."""
        hole, found = probe_path(self.read_slot, digest, self.geometry.index_slots)
        if hole is None or found is None:
            return
        self._remove_at(hole)

    def index_get(self, digest: bytes) -> Slot | None:
        """The slot that holds ``digest`` (no seqlock: this is the only writer)."""
        return probe_path(self.read_slot, digest, self.geometry.index_slots)[1]

    def drop_torn(self) -> int:
        """Remove every slot caught mid-write (an odd seqlock word: a supervisor was
        killed while it wrote one) from its probe run, as :meth:`index_del` removes one;
        how many. Its content may be half old, half new, so it names nothing; a reader
        takes it for an empty slot, which would end the probe runs through it."""
        g, n = self.geometry, 0
        while True:
            table = np.frombuffer(self.mm, dtype=SLOT_DTYPE, count=g.index_slots,
                                  offset=g.index_offset)  # fmt: skip
            torn = np.flatnonzero(table["seq"] & 1)
            del table
            if not len(torn) or n > g.index_slots:
                return n
            i = int(torn[0])
            off = self._slot_off(i)
            # (even again first: a slot write takes the word from even to odd and back)
            _SEQ.pack_into(self.mm, off, (_SEQ.unpack_from(self.mm, off)[0] + 1) & 0xFFFFFFFF)
            self._remove_at(i)
            n += 1

    def _remove_at(self, hole: int) -> None:
        """Empty slot ``hole``; later slots of its run move back into it (no tombstones)."""
        n = self.geometry.index_slots
        self._write_slot(hole, None)
        j = (hole + 1) & (n - 1)
        while True:
            used, slot = self.read_slot(j)
            if not used or slot is None:
                return
            home = slot_home(slot.digest, n)
            # can the entry at j move into the hole? (its home is not in (hole, j])
            if (j - home) % n >= (j - hole) % n:
                self._write_slot(hole, slot)
                self._write_slot(j, None)
                hole = j
            j = (j + 1) & (n - 1)

    # -- records ----------------------------------------------------------------
    def payload(self, offset: int, n_tokens: int, fp_len: int, body_len: int) -> memoryview:
        """Where the body (a whole record's payload) of the record at ``offset`` goes;
        filled before ``write_record``."""
        _, _, pay_off, _ = record_layout(n_tokens, fp_len, body_len)
        return memoryview(self.mm)[offset + pay_off : offset + pay_off + body_len]

    # -- chunks -----------------------------------------------------------------
    def chunk_data(self, offset: int, length: int) -> memoryview:
        """Where the data of the chunk at ``offset`` is (written before its header)."""
        start = offset + CHUNK_HEADER_SIZE
        return memoryview(self.mm)[start : start + length]

    def write_chunk_header(
        self, offset: int, gen: int, length: int, digest: bytes, publisher: int
    ) -> None:
        """Write the header of a chunk whose data is in place."""
        _CHUNK.pack_into(
            self.mm, offset, CHUNK_MAGIC, FORMAT_VERSION, 0, gen, length, digest, publisher
        )

    def zap_chunk(self, offset: int) -> None:
        """Clear a freed chunk's magic: a stale reference fails at its header."""
        self.mm[offset : offset + 4] = b"\0\0\0\0"

    def write_record(
        self,
        offset: int,
        gen: int,
        key: bytes,
        root: bytes,
        n_chunks: int,
        fingerprint: bytes,
        tokens: bytes,
        payload_len: int,
        payload_xxh3: int,
        created: float,
        publisher: int,
        body_len: int | None = None,
    ) -> None:
        """Write the fingerprint, token ids and header of a record whose body is in place.

        ``tokens`` are the raw little-endian int32 ids; ``publisher`` the uid that put it;
        ``body_len``: a chunked record's body length (None: a whole record, its body the
        payload). The header goes last, with its metadata checksum over header,
        fingerprint and token ids.
        """
        n_tokens = len(tokens) // 4
        flags = 0 if body_len is None else FLAG_CHUNKED
        body_len = payload_len if body_len is None else body_len
        fp_off, tok_off, pay_off, _ = record_layout(n_tokens, len(fingerprint), body_len)
        self.mm[offset + fp_off : offset + fp_off + len(fingerprint)] = fingerprint
        self.mm[offset + tok_off : offset + tok_off + len(tokens)] = tokens
        hdr = bytearray(
            _REC.pack(
                REC_MAGIC,
                FORMAT_VERSION,
                flags,
                gen,
                key,
                root,
                n_tokens,
                n_chunks,
                len(fingerprint),
                tok_off,
                pay_off,
                payload_len,
                payload_xxh3,
                0,
                created,
                publisher,
                body_len,
            )
        )
        _U64.pack_into(hdr, _META_CSUM_OFF, meta_checksum(bytes(hdr), fingerprint, tokens))
        self.mm[offset : offset + len(hdr)] = hdr

    def zap_record(self, offset: int) -> None:
        """Clear a freed record's magic: a stale lookup fails at the header, not at a checksum."""
        self.mm[offset : offset + 4] = b"\0\0\0\0"
