"""llama.cpp's sequence-state blob cut into token groups, and put back together.

Runs in the supervisor (``plan`` and ``gather`` when a put lands) and in every reader of a chunked
record (``Manifest.unpack`` and ``assemble``). No llama_cpp import: the format below is
read from llama.cpp's source (``llama_kv_cache::state_write`` in
``src/llama-kv-cache.cpp`` as vendored by llama-cpp-python 0.3.36), and the tests check
it against real blobs.

A blob (``llama_state_seq_get_data``) starts with ``u32 magic (0xaf143cd8), i32 seq_id``
(``llama_context::state_seq_get_data``), then the memory's state. One KV cache's state (a
**part**), little-endian::

    u32 n_stream
    per stream:
      u32 cell_count                (0: nothing more for this stream)
      cell_count x { i32 pos, u32 n_seq_id, [12-byte llama_kv_cell_ext], i32 seq_id x n_seq_id }
      u32 v_trans, u32 n_layer
      per layer: i32 k_type, u64 k_size_row, cell_count * k_size_row bytes
      not v_trans: per layer with V: i32 v_type, u64 v_size_row, cell_count * v_size_row
      v_trans:     per layer with V: i32 v_type, u32 v_size_el, u32 n_embd_v_gqa,
                   n_embd_v_gqa x (cell_count * v_size_el)       (dimension-major)

An iSWA model's blob is two parts back to back (the base cache's, then the window's);
the only way to find where one ends is to parse it, so the parser tries each reading
(with and without the cell extension, fewer V layers) and keeps the one that covers the
blob exactly. A hybrid model's blob (Qwen 3.5, Jamba, ...: ``llama_memory_hybrid``) is its
attention cache's part, then its recurrent cache's state (``llama_memory_recurrent::
state_write``), which has no ``n_stream`` and one cell per sequence::

    u32 cell_count
    cell_count x { i32 pos, u32 n_seq_id, i32 seq_id x n_seq_id }
    u32 s_trans (0), u32 n_layer
    per recurrent layer: i32 r_type, u64 r_size_row, cell_count * r_size_row bytes
    per recurrent layer: i32 s_type, u64 s_size_row, cell_count * s_size_row bytes

That state sums up every token so far: nothing of it is shared between two prefixes, so
it stays in the skeleton (it is what a hybrid's checkpoint at a position holds beyond the
attention cells it shares). A recurrent model's blob (Mamba) has no attention part and
stays whole.

Each part's cells (in blob order) are cut into **groups**: maximal runs of cells with
consecutive positions inside one aligned range ``[k*C, (k+1)*C)``. A group covering its
whole range is **full**: equal prefixes give equal full groups, which is what the arena
stores once. A group's **data** is, per layer, its K rows, then per layer with V its V
rows (or, transposed, its ``n_embd_v_gqa x (n * v_size_el)`` block, dimension-major).
Everything else (counts, cell metadata, type and size headers) is the **skeleton**, kept
in the manifest. ``assemble`` puts skeleton and groups back byte for byte; the record's
whole-blob XXH3-64 still guards the result.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import xxhash

from shmkv.core.errors import ArenaCorruptError

__all__ = [
    "Manifest",
    "Region",
    "PartLayout",
    "plan",
    "gather",
    "gather_into",
    "group_digests",
    "split",
    "assemble",
    "Grouped",
    "blob_pieces",
    "blob_xxh3_64",
    "HybridLayout",
    "HybridCut",
    "hybrid_layout",
    "cut_hybrid",
    "KIND_K",
    "KIND_V",
    "KIND_VT",
]

#: region kinds: K rows, V rows, transposed V (one run of cells per dimension)
KIND_K, KIND_V, KIND_VT = 0, 1, 2

#: size of llama.cpp's llama_kv_cell_ext (i32 x, i32 y, i32 tok), written per cell when the
#: model has M-RoPE or per-layer embeddings (``has_cell_ext``)
CELL_EXT_BYTES = 12

#: the largest blob a manifest may describe (a reader sizes its buffer from it)
MAX_BLOB = 1 << 40
#: most parts a blob may have (iSWA has 2)
MAX_PARTS = 4
#: most layers a part may declare
MAX_LAYERS = 4096
#: ggml type ids are small (GGML_TYPE_COUNT is ~40)
MAX_GGML_TYPE = 256
#: groups a part may have beyond its positions' aligned ranges (seams of a ring, holes
#: left by cuts); more means a fragmented cache, which stays whole
EXTRA_GROUPS = 64
#: how many part readings split tries before it gives up on a blob (bounds the search
#: over cell-extension and V-layer-count readings against a crafted blob)
PARSE_BUDGET = 256

_MAGIC = b"SKVM"
_VERSION = 1
_HEADER = struct.Struct("<4sHHIQQIII")  # magic, version, 0, chunk_tokens, blob_len,
#                                          skeleton_len, n_parts, n_regions, n_groups
_PART = struct.Struct("<IIII")  # cell_count, v_trans, n_regions, n_groups
_REGION = struct.Struct("<QIiII")  # offset, kind, ggml type, unit, nrep
_GROUP = struct.Struct("<II")  # n cells, flags (bit 0: full)
_FULL = 1

#: what a blob may be read from (the supervisor stages a put's payload in a mapping)
BlobBuffer = bytes | bytearray | memoryview | mmap.mmap

#: what llama_context::state_seq_get_data writes first: io_magic, then the seq_id
_BLOB_HEAD = struct.Struct("<Ii")
_IO_MAGIC = 0xAF143CD8
_KHDR = struct.Struct("<iQ")
_VTHDR = struct.Struct("<iII")
_SIG = struct.Struct("<IIII")
_SIG_REGION = struct.Struct("<IiII")


class Region(NamedTuple):
    """One tensor's data in the blob: ``nrep`` runs of ``cell_count * unit`` bytes from
    ``offset`` (nrep is 1 but for transposed V, where it is n_embd_v_gqa)."""

    offset: int
    kind: int
    ggml_type: int
    unit: int
    nrep: int


class PartLayout(NamedTuple):
    """One KV cache's state: its cells, their data regions and its groups' cell counts
    (in blob order; they add up to cell_count)."""

    cell_count: int
    v_trans: int
    regions: tuple[Region, ...]
    group_cells: tuple[int, ...]


class Manifest:
    """Everything ``assemble`` needs except the groups' data: the skeleton bytes and where
    each group's rows go. Built by ``split`` or read back by ``unpack``; validated on
    construction (ArenaCorruptError), so a Manifest is always self-consistent."""

    __slots__ = (
        "blob_len",
        "chunk_tokens",
        "skeleton",
        "parts",
        "group_full",
        "group_sizes",
        "group_sigs",
        "gaps",
        "spans",
    )

    def __init__(
        self,
        blob_len: int,
        chunk_tokens: int,
        skeleton: bytes,
        parts: Sequence[PartLayout],
        group_full: Sequence[bool],
    ) -> None:
        self.blob_len = blob_len
        self.chunk_tokens = chunk_tokens
        self.skeleton = skeleton
        self.parts = tuple(parts)
        self.group_full = list(group_full)
        #: data length of each group, in blob order
        self.group_sizes: list[int] = []
        #: a layout signature per group (part, cells, per-region kind/type/sizes, v_trans)
        self.group_sigs: list[bytes] = []
        #: skeleton pieces: (blob offset, skeleton offset, length)
        self.gaps: list[tuple[int, int, int]] = []
        self._validate()
        #: (part, first cell, cells) of each group, in blob order
        self.spans: list[tuple[PartLayout, int, int]] = []
        for part in self.parts:
            a = 0
            for n in part.group_cells:
                self.spans.append((part, a, n))
                a += n

    def _validate(self) -> None:
        def bad(why: str) -> ArenaCorruptError:
            return ArenaCorruptError(
                f"chunked record's manifest is inconsistent ({why}); the record is dropped "
                "as a miss (a stray writer or a bug in the supervisor: report it)"
            )

        if not 0 < self.blob_len <= MAX_BLOB:
            raise bad(f"blob length {self.blob_len}")
        if not 0 < self.chunk_tokens < 1 << 32:
            raise bad(f"chunk_tokens {self.chunk_tokens}")
        if not 0 < len(self.parts) <= MAX_PARTS:
            raise bad(f"{len(self.parts)} parts")
        n_groups = sum(len(p.group_cells) for p in self.parts)
        if len(self.group_full) != n_groups:
            raise bad(f"{len(self.group_full)} full flags for {n_groups} groups")
        end = 0  # end of the previous region in the blob
        skel = 0
        gi = 0
        for pi, part in enumerate(self.parts):
            cc = part.cell_count
            if not 0 < cc < 1 << 32 or part.v_trans not in (0, 1):
                raise bad(f"part {pi}: {cc} cells, v_trans {part.v_trans}")
            if not part.regions or not part.group_cells:
                raise bad(f"part {pi}: no regions or no groups")
            if any(n <= 0 for n in part.group_cells) or sum(part.group_cells) != cc:
                raise bad(f"part {pi}: group cell counts do not add up to {cc}")
            for r in part.regions:
                if r.kind not in (KIND_K, KIND_V, KIND_VT) or (r.kind == KIND_VT) != (
                    part.v_trans and r.kind != KIND_K
                ):
                    raise bad(f"part {pi}: region kind {r.kind} with v_trans {part.v_trans}")
                if not 0 < r.unit < 1 << 32 or not 0 < r.nrep < 1 << 32:
                    raise bad(f"part {pi}: unit {r.unit}, nrep {r.nrep}")
                if r.kind != KIND_VT and r.nrep != 1:
                    raise bad(f"part {pi}: {r.nrep} runs in an untransposed region")
                if not 0 <= r.ggml_type < MAX_GGML_TYPE:
                    raise bad(f"part {pi}: ggml type {r.ggml_type}")
                if r.offset < end:
                    raise bad(f"part {pi}: region at {r.offset} overlaps the one before")
                size = r.nrep * cc * r.unit
                if r.offset + size > self.blob_len:
                    raise bad(f"part {pi}: region at {r.offset} ends past the blob")
                if r.offset > end:
                    self.gaps.append((end, skel, r.offset - end))
                    skel += r.offset - end
                end = r.offset + size
            head = _SIG.pack(pi, 0, part.v_trans, len(part.regions)) + b"".join(
                _SIG_REGION.pack(r.kind, r.ggml_type, r.unit, r.nrep) for r in part.regions
            )
            per_cell = sum(r.nrep * r.unit for r in part.regions)
            for n in part.group_cells:
                if self.group_full[gi] and n != self.chunk_tokens:
                    raise bad(f"group {gi} of {n} cells marked full")
                self.group_sizes.append(n * per_cell)
                sig = _SIG.pack(pi, n, part.v_trans, len(part.regions)) + head[_SIG.size :]
                self.group_sigs.append(xxhash.xxh3_64_digest(sig))
                gi += 1
        if end < self.blob_len:
            self.gaps.append((end, skel, self.blob_len - end))
            skel += self.blob_len - end
        if skel != len(self.skeleton):
            raise bad(f"skeleton of {len(self.skeleton)} bytes where the layout leaves {skel}")

    def partial_groups(self, buf: memoryview, pos: int) -> list[memoryview] | None:
        """Views of the data of the groups that are not full, laid end to end in ``buf``
        from ``pos`` (in blob order, as a tier stores them beside a chunked record's chunk
        list); None unless they end exactly at the end of ``buf``."""
        out = []
        for size, full in zip(self.group_sizes, self.group_full, strict=True):
            if not full:
                out.append(buf[pos : pos + size])
                pos += size
        return out if pos == len(buf) else None

    def pack(self) -> bytes:
        """The manifest as bytes (``unpack`` reads them back)."""
        out = [
            _HEADER.pack(
                _MAGIC,
                _VERSION,
                0,
                self.chunk_tokens,
                self.blob_len,
                len(self.skeleton),
                len(self.parts),
                sum(len(p.regions) for p in self.parts),
                len(self.group_full),
            )
        ]
        out += [
            _PART.pack(p.cell_count, p.v_trans, len(p.regions), len(p.group_cells))
            for p in self.parts
        ]
        out += [_REGION.pack(*r) for p in self.parts for r in p.regions]
        full = iter(self.group_full)
        out += [
            _GROUP.pack(n, _FULL if next(full) else 0) for p in self.parts for n in p.group_cells
        ]
        out.append(self.skeleton)
        return b"".join(out)

    @classmethod
    def unpack(cls, buf: bytes | bytearray | memoryview) -> Manifest:
        """Read a packed manifest back; everything is checked (counts against the buffer's
        length, regions inside the blob and apart, sums), so nothing in ``buf`` can make it
        allocate more than a small multiple of ``len(buf)``. ArenaCorruptError if not."""
        mv = memoryview(buf).cast("B")
        n = len(mv)

        def bad(why: str) -> ArenaCorruptError:
            return ArenaCorruptError(
                f"chunked record's manifest is unreadable ({why}); the record is dropped as "
                "a miss (a stray writer or a bug in the supervisor: report it)"
            )

        if n < _HEADER.size:
            raise bad(f"{n} bytes, shorter than its header")
        magic, version, zero, chunk_tokens, blob_len, skel_len, n_parts, n_regions, n_groups = (
            _HEADER.unpack_from(mv, 0)
        )
        if magic != _MAGIC or version != _VERSION or zero != 0:
            raise bad(f"magic {bytes(magic)!r}, version {version}")
        want = (
            _HEADER.size
            + n_parts * _PART.size
            + n_regions * _REGION.size
            + n_groups * _GROUP.size
            + skel_len
        )
        if want != n:
            raise bad(f"{n} bytes where its counts say {want}")
        if not 0 < n_parts <= MAX_PARTS:
            raise bad(f"{n_parts} parts")
        off = _HEADER.size
        heads = list(_PART.iter_unpack(mv[off : off + n_parts * _PART.size]))
        off += n_parts * _PART.size
        regions = [
            Region(*r) for r in _REGION.iter_unpack(mv[off : off + n_regions * _REGION.size])
        ]
        off += n_regions * _REGION.size
        groups = list(_GROUP.iter_unpack(mv[off : off + n_groups * _GROUP.size]))
        off += n_groups * _GROUP.size
        if sum(h[2] for h in heads) != n_regions or sum(h[3] for h in heads) != n_groups:
            raise bad("its parts' region or group counts do not add up")
        if any(flags & ~_FULL for _, flags in groups):
            raise bad("unknown group flags")
        parts = []
        ri = gi = 0
        for cell_count, v_trans, nr, ng in heads:
            parts.append(
                PartLayout(
                    cell_count,
                    v_trans,
                    tuple(regions[ri : ri + nr]),
                    tuple(g[0] for g in groups[gi : gi + ng]),
                )
            )
            ri += nr
            gi += ng
        return cls(
            blob_len,
            chunk_tokens,
            bytes(mv[off:]),
            parts,
            [bool(flags & _FULL) for _, flags in groups],
        )


class _Parsed(NamedTuple):
    layout: PartLayout
    pos: np.ndarray  # the cells' positions, in blob order


def _read_part(
    mv: memoryview, off: int, n: int
) -> Iterator[tuple[tuple[int, np.ndarray, int, list[Region]] | None, int]]:
    """Each reading of a part that starts at ``off``: (cells, positions, v_trans, regions)
    or None for an empty stream, and where the reading ends. Most likely first."""
    if off + 8 > n:
        return
    n_stream, cell_count = struct.unpack_from("<II", mv, off)
    if n_stream != 1:
        return
    off += 8
    if cell_count == 0:
        yield None, off
        return
    for ext in (0, CELL_EXT_BYTES):
        stride = 12 + ext
        meta_end = off + cell_count * stride
        if meta_end + 8 > n:
            continue
        cells = np.frombuffer(mv, dtype="<u4", count=cell_count * stride // 4, offset=off)
        cells = cells.reshape(cell_count, stride // 4)
        if not np.all(cells[:, 1] == 1):  # n_seq_id: one sequence per cell
            continue
        pos = cells[:, 0].view("<i4").astype(np.int64)
        v_trans, n_layer = struct.unpack_from("<II", mv, meta_end)
        if v_trans not in (0, 1) or not 0 < n_layer <= MAX_LAYERS:
            continue
        p = meta_end + 8
        regions: list[Region] = []
        for _ in range(n_layer):
            if p + _KHDR.size > n:
                break
            k_type, row = _KHDR.unpack_from(mv, p)
            p += _KHDR.size
            if not 0 <= k_type < MAX_GGML_TYPE or not 0 < row < 1 << 32:
                break
            if p + cell_count * row > n:
                break
            regions.append(Region(p, KIND_K, k_type, row, 1))
            p += cell_count * row
        if len(regions) != n_layer:
            continue
        # V: layers without V are skipped and their count is not written, so every count
        # from n_layer down is a reading (n_layer first: the usual case)
        ends = [p]
        for _ in range(n_layer):
            if not v_trans:
                if p + _KHDR.size > n:
                    break
                v_type, unit = _KHDR.unpack_from(mv, p)
                p += _KHDR.size
                nrep = 1
                kind = KIND_V
            else:
                if p + _VTHDR.size > n:
                    break
                v_type, unit, nrep = _VTHDR.unpack_from(mv, p)
                p += _VTHDR.size
                kind = KIND_VT
            if not 0 <= v_type < MAX_GGML_TYPE or not 0 < unit < 1 << 32 or not 0 < nrep:
                break
            if p + nrep * cell_count * unit > n:
                break
            regions.append(Region(p, kind, v_type, unit, nrep))
            p += nrep * cell_count * unit
            ends.append(p)
        for n_v in range(len(ends) - 1, -1, -1):
            yield (cell_count, pos, v_trans, regions[: n_layer + n_v]), ends[n_v]


#: most cells a hybrid's recurrent state may declare (one per sequence: llama.cpp's
#: LLAMA_MAX_SEQ is 256), and most sequence ids a cell may list
MAX_RECURRENT_CELLS = 256


def _recurrent_tail(mv: memoryview, off: int) -> bool:
    """Whether the bytes from ``off`` to the end of ``mv`` read exactly as a recurrent
    cache's state (the layout above: cells, ``s_trans`` 0, then pairs of layer blocks)."""
    n = len(mv)
    if off + 4 > n:
        return False
    (cells,) = struct.unpack_from("<I", mv, off)
    if not 0 < cells <= MAX_RECURRENT_CELLS:
        return False
    p = off + 4
    for _ in range(cells):
        if p + 8 > n:
            return False
        _, n_seq = struct.unpack_from("<iI", mv, p)
        if n_seq > MAX_RECURRENT_CELLS:
            return False
        p += 8 + 4 * n_seq
    if p + 8 > n:
        return False
    s_trans, n_layer = struct.unpack_from("<II", mv, p)
    if s_trans != 0 or not 0 < n_layer <= MAX_LAYERS:
        return False
    p += 8
    blocks = 0
    while p < n:
        if p + _KHDR.size > n or blocks == 2 * n_layer:
            return False
        r_type, row = _KHDR.unpack_from(mv, p)
        if not 0 <= r_type < MAX_GGML_TYPE or not 0 < row < 1 << 32:
            return False
        p += _KHDR.size + cells * row
        blocks += 1
    return p == n and blocks > 0 and blocks % 2 == 0


def _parse(mv: memoryview) -> list[tuple[int, np.ndarray, int, list[Region]]] | None:
    """The blob's parts (empty streams left out), or None unless one reading of up to
    MAX_PARTS parts covers it exactly."""
    if len(mv) < _BLOB_HEAD.size or _BLOB_HEAD.unpack_from(mv, 0)[0] != _IO_MAGIC:
        return None
    return _parts_from(mv, _BLOB_HEAD.size, 0, [PARSE_BUDGET], set())


def _parts_from(
    mv: memoryview, off: int, depth: int, budget: list[int], failed: set[tuple[int, int]]
) -> list[tuple[int, np.ndarray, int, list[Region]]] | None:
    """The parts from ``off`` to the blob's end, or None if no reading covers it exactly.
    (A function of its own, not a closure: a closure that calls itself is a reference
    cycle, which held the blob, a put's staged payload, until the collector's next pass.)"""
    n = len(mv)
    if off == n:
        return []
    if depth == MAX_PARTS or (off, depth) in failed:
        return None
    for part, end in _read_part(mv, off, n):
        budget[0] -= 1
        if budget[0] < 0:
            return None
        tail = _parts_from(mv, end, depth + 1, budget, failed)
        if tail is not None:
            return tail if part is None else [part, *tail]
    if depth > 0 and _recurrent_tail(mv, off):  # a hybrid's recurrent state: skeleton
        return []
    failed.add((off, depth))
    return None


def _groups(pos: np.ndarray, c: int) -> tuple[np.ndarray, np.ndarray]:
    """Cell counts and full flags of the groups of cells at these positions (blob order)."""
    if len(pos) > 1:
        nxt, prev = pos[1:], pos[:-1]
        cut = np.flatnonzero((nxt != prev + 1) | (nxt // c != prev // c)) + 1
    else:
        cut = np.zeros(0, dtype=np.int64)
    starts = np.concatenate(([0], cut))
    counts = np.diff(np.concatenate((starts, [len(pos)])))
    full = (counts == c) & (pos[starts] % c == 0)
    return counts, full


def plan(blob: BlobBuffer, chunk_tokens: int, *, min_full: int = 1) -> Manifest | None:
    """The blob's manifest (no group data is copied), or None for a blob that stays whole:
    one that does not parse as KV cache parts (a hybrid's may end in its recurrent state,
    kept in the skeleton), a recurrent model's, n_stream != 1,
    cells of more than one sequence, a fragmented cache, or fewer than ``min_full`` full
    groups (nothing worth sharing). Each group's data is then :func:`gather`-ed from the
    same blob."""
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, not {chunk_tokens}")
    mv = memoryview(blob).cast("B")
    if not 0 < len(mv) <= MAX_BLOB:
        return None
    parsed = _parse(mv)
    if not parsed:
        return None
    parts: list[PartLayout] = []
    full_flags: list[bool] = []
    for cell_count, pos, v_trans, regions in parsed:
        counts, full = _groups(pos, chunk_tokens)
        if len(counts) > -(-cell_count // chunk_tokens) + EXTRA_GROUPS:
            return None
        parts.append(PartLayout(cell_count, v_trans, tuple(regions), tuple(counts.tolist())))
        full_flags += full.tolist()
    if sum(full_flags) < min_full:
        return None
    skeleton: list[bytes] = []
    end = 0
    for part in parts:
        for r in part.regions:
            skeleton.append(bytes(mv[end : r.offset]))
            end = r.offset + r.nrep * part.cell_count * r.unit
    skeleton.append(bytes(mv[end:]))
    return Manifest(len(mv), chunk_tokens, b"".join(skeleton), parts, full_flags)


def gather(manifest: Manifest, blob: BlobBuffer, i: int, out: memoryview) -> None:
    """Write group ``i``'s data (``manifest.group_sizes[i]`` bytes) from ``blob`` into ``out``:
    one block copy per region (a transposed V region is one strided numpy copy)."""
    gather_into(manifest, blob, [(i, out)])


def _by_region(
    manifest: Manifest, groups: Sequence[int]
) -> Iterator[tuple[Region, int, list[tuple[int, int, int, int]]]]:
    """Each region of the parts ``groups`` belong to, in blob order, with its part's cell
    count and, for each of those groups of that part: (index, first cell, cells, where
    the region's rows start in the group's data)."""
    mine: dict[int, list[tuple[int, int, int]]] = {}
    for i in groups:
        part, a, n = manifest.spans[i]
        mine.setdefault(id(part), []).append((i, a, n))
    for part in manifest.parts:
        if (spans := mine.get(id(part))) is None:
            continue
        before = 0
        for r in part.regions:
            yield r, part.cell_count, [(i, a, n, n * before) for i, a, n in spans]
            before += r.nrep * r.unit


def group_digests(manifest: Manifest, blob: BlobBuffer, groups: Sequence[int]) -> list[bytes]:
    """The XXH3-128 of each of ``groups``' data (what :func:`gather` writes), in that order,
    without gathering any whole: region by region, each group's rows of it fed to the
    group's own hasher (a transposed V region's through a scratch of one group's rows). A
    region is read once for all the groups, while it is in cache; group by group, every
    region was read again for each (at 4,096 tokens of an 8B model's KV: 37 us a token
    gathered and hashed group by group, 25 region by region)."""
    src = np.frombuffer(blob, dtype=np.uint8)
    hashers = {i: xxhash.xxh3_128() for i in groups}
    scratch = np.empty(0, dtype=np.uint8)
    for r, cc, mine in _by_region(manifest, groups):
        if r.nrep == 1:
            for i, a, n, _ in mine:
                hashers[i].update(src[r.offset + a * r.unit : r.offset + (a + n) * r.unit].data)
            continue
        block = src[r.offset : r.offset + r.nrep * cc * r.unit].reshape(r.nrep, -1)
        for i, a, n, _ in mine:
            size = r.nrep * n * r.unit
            if scratch.size < size:
                scratch = np.empty(size, dtype=np.uint8)
            piece = scratch[:size].reshape(r.nrep, -1)
            np.copyto(piece, block[:, a * r.unit : (a + n) * r.unit])
            hashers[i].update(piece.data)
    return [hashers[i].digest() for i in groups]


def gather_into(
    manifest: Manifest, blob: BlobBuffer, dests: Sequence[tuple[int, memoryview]]
) -> None:
    """:func:`gather` each ``(group, out)`` of ``dests``, region by region (each region
    read once for all of them, as :func:`group_digests`)."""
    src = np.frombuffer(blob, dtype=np.uint8)
    outs = {
        i: np.frombuffer(out, dtype=np.uint8, count=manifest.group_sizes[i]) for i, out in dests
    }
    for r, cc, mine in _by_region(manifest, list(outs)):
        block = src[r.offset : r.offset + r.nrep * cc * r.unit].reshape(r.nrep, -1)
        for i, a, n, q in mine:
            w = n * r.unit
            outs[i][q : q + r.nrep * w].reshape(r.nrep, w)[:] = block[
                :, a * r.unit : a * r.unit + w
            ]


def gathered(manifest: Manifest, blob: BlobBuffer) -> Iterator[tuple[int, memoryview]]:
    """Each group's index and data, in blob order, :func:`gather`-ed in turn into one
    scratch buffer of the largest group's size (a view is valid until the next)."""
    scratch = np.empty(max(manifest.group_sizes, default=0), dtype=np.uint8)
    for i, size in enumerate(manifest.group_sizes):
        view = scratch[:size].data
        gather(manifest, blob, i, view)
        yield i, view


def split(
    blob: BlobBuffer, chunk_tokens: int, *, min_full: int = 1
) -> tuple[Manifest, list[memoryview]] | None:
    """:func:`plan` and each group's data gathered into a new buffer (in blob order)."""
    manifest = plan(blob, chunk_tokens, min_full=min_full)
    if manifest is None:
        return None
    datas: list[memoryview] = []
    for i, size in enumerate(manifest.group_sizes):
        data = np.empty(size, dtype=np.uint8)
        gather(manifest, blob, i, data.data)
        datas.append(data.data)
    return manifest, datas


def assemble(
    manifest: Manifest, groups: Sequence[bytes | bytearray | memoryview], out: memoryview
) -> None:
    """Write the blob into ``out[:manifest.blob_len]`` from the manifest's skeleton and the
    groups' data (``groups[i]`` exactly ``group_sizes[i]`` bytes, else ArenaCorruptError).
    One block copy per (region, group): a transposed V block is one strided numpy copy."""
    sizes = manifest.group_sizes
    if len(groups) != len(sizes):
        raise ArenaCorruptError(
            f"chunked record has {len(groups)} chunks where its manifest lists {len(sizes)}: "
            "the record is dropped as a miss"
        )
    srcs = []
    for i, g in enumerate(groups):
        s = np.frombuffer(g, dtype=np.uint8)
        if s.size != sizes[i]:
            raise ArenaCorruptError(
                f"chunk {i} of a chunked record holds {s.size} bytes where its manifest says "
                f"{sizes[i]}: the record is dropped as a miss"
            )
        srcs.append(s)
    if out.nbytes < manifest.blob_len:
        raise ValueError(f"out holds {out.nbytes} bytes, the blob needs {manifest.blob_len}")
    dst = np.frombuffer(out, dtype=np.uint8, count=manifest.blob_len)
    skel = np.frombuffer(manifest.skeleton, dtype=np.uint8)
    for at, start, length in manifest.gaps:
        dst[at : at + length] = skel[start : start + length]
    # region by region, each filled from every group in turn: a transposed V region takes
    # n cells of each of its rows from each group, and filled group by group the whole blob
    # was swept between two visits of one region's rows (each small write a cache miss:
    # 49 ms for a 128 MiB state, 2.7 GB/s, where one region at a time stays in cache)
    ops = []
    for src, (part, a, n) in zip(srcs, manifest.spans, strict=True):
        q = 0
        for r in part.regions:
            ops.append((r, a, n, part.cell_count, src, q))
            q += r.nrep * n * r.unit
    ops.sort(key=lambda op: (op[0].offset, op[1]))
    for r, a, n, cc, src, q in ops:
        if r.nrep == 1:
            dst[r.offset + a * r.unit : r.offset + (a + n) * r.unit] = src[q : q + n * r.unit]
        else:
            block = dst[r.offset : r.offset + r.nrep * cc * r.unit].reshape(r.nrep, -1)
            block[:, a * r.unit : (a + n) * r.unit] = src[q : q + r.nrep * n * r.unit].reshape(
                r.nrep, -1
            )


#: bytes of a transposed V region :func:`blob_pieces` assembles at a time (whole rows)
PIECE_WINDOW = 1 << 20


@dataclass(frozen=True)
class Grouped:
    """A blob held as its groups: its manifest and each group's data, in blob order (a
    tier's chunked record, handed to a put without being assembled). ``digests``: for
    each group, the XXH3-128 its data is said to have (a full group's chunk key, as the
    tier stored it; None where unknown), or None for none known. Nothing here is trusted:
    the put checks every length and digest, and the whole blob's XXH3-64 unless
    ``sealed``.

    ``sealed``: the tier checked every byte that no digest covers (the manifest and the
    groups that are not full, under a checksum it stored with them) and ``digests`` names
    every full group's, so that the put's check of each full group's digest covers the
    rest: the blob need not be put in blob order and hashed whole (``kvformat.blob_pieces``:
    the transposed V gathered, most of a refill's time). The blob's XXH3-64 is still
    what a restore checks, so a tier that says sealed wrongly costs a miss, never a wrong
    state."""

    manifest: Manifest
    groups: Sequence[bytes | bytearray | memoryview]
    digests: Sequence[bytes | None] | None = None
    sealed: bool = False

    @property
    def covered(self) -> bool:
        """Sealed, and a digest named for every full group (what lets a put skip hashing
        the whole blob)."""
        if not self.sealed or self.digests is None:
            return False
        full = self.manifest.group_full
        if len(self.digests) != len(full):
            return False
        return all(d is not None for d, f in zip(self.digests, full, strict=True) if f)


def check_groups(manifest: Manifest, groups: Sequence[bytes | bytearray | memoryview]) -> None:
    """ArenaCorruptError unless ``groups`` are as many and as long as ``manifest`` says."""
    sizes = manifest.group_sizes
    if len(groups) != len(sizes):
        raise ArenaCorruptError(
            f"chunked record has {len(groups)} chunks where its manifest lists {len(sizes)}: "
            "the record is dropped as a miss"
        )
    for i, g in enumerate(groups):
        n = memoryview(g).nbytes
        if n != sizes[i]:
            raise ArenaCorruptError(
                f"chunk {i} of a chunked record holds {n} bytes where its manifest says "
                f"{sizes[i]}: the record is dropped as a miss"
            )


def blob_pieces(
    manifest: Manifest,
    groups: Sequence[bytes | bytearray | memoryview],
    window: int = PIECE_WINDOW,
) -> Iterator[memoryview]:
    """The blob :func:`assemble` would write, as consecutive pieces in blob order, without
    assembling it: skeleton pieces, each group's rows of an untransposed region straight
    from the group's data, and a transposed V region assembled into one scratch buffer a
    few whole rows (about ``window`` bytes, at least one row) at a time. A piece is valid
    until the next is asked for. ArenaCorruptError (at the first) if a group's length is
    not its manifest's."""
    check_groups(manifest, groups)
    srcs = [np.frombuffer(g, dtype=np.uint8) for g in groups]
    skel = memoryview(manifest.skeleton)
    # the regions in blob order, each with its part's groups (index, first cell, cells)
    # and its offset in each group's data (per cell: the regions before it)
    regions: list[tuple[Region, PartLayout, list[tuple[int, int, int]], int]] = []
    gi = 0
    for part in manifest.parts:
        spans, a = [], 0
        for n in part.group_cells:
            spans.append((gi, a, n))
            gi, a = gi + 1, a + n
        per_cell = 0
        for r in part.regions:
            regions.append((r, part, spans, per_cell))
            per_cell += r.nrep * r.unit
    gaps = iter(manifest.gaps)
    gap = next(gaps, None)
    scratch: np.ndarray | None = None
    for r, part, spans, before in regions:
        while gap is not None and gap[0] < r.offset:
            yield skel[gap[1] : gap[1] + gap[2]]
            gap = next(gaps, None)
        if r.nrep == 1:
            for g, _a, n in spans:
                q = n * before
                yield srcs[g][q : q + n * r.unit].data
            continue
        row = part.cell_count * r.unit
        rows = max(1, min(r.nrep, window // row))
        if scratch is None or scratch.size < rows * row:
            scratch = np.empty(rows * row, dtype=np.uint8)
        for j0 in range(0, r.nrep, rows):
            j1 = min(r.nrep, j0 + rows)
            dst = scratch[: (j1 - j0) * row].reshape(j1 - j0, row)
            for g, a, n in spans:
                q, w = n * before, n * r.unit
                dst[:, a * r.unit : (a + n) * r.unit] = srcs[g][q + j0 * w : q + j1 * w].reshape(
                    j1 - j0, w
                )
            yield dst.reshape(-1).data
    while gap is not None:
        yield skel[gap[1] : gap[1] + gap[2]]
        gap = next(gaps, None)


def blob_xxh3_64(manifest: Manifest, groups: Sequence[bytes | bytearray | memoryview]) -> int:
    """XXH3-64 of the blob :func:`assemble` would write, from :func:`blob_pieces` (one
    window of scratch, never the whole blob)."""
    h = xxhash.xxh3_64()
    for piece in blob_pieces(manifest, groups):
        h.update(piece)
    return h.intdigest()


@dataclass(frozen=True)
class HybridLayout:
    """Where a hybrid's blob keeps what a cut of it needs (:func:`hybrid_layout`): its one
    attention part's cells, their metadata and regions, and where its recurrent state
    starts. It holds no buffer (a view kept here would pin the blob's mapping)."""

    head: bytes  #: magic and seq_id: a recurrent state of the same sequence has the same
    cell_count: int
    positions: np.ndarray
    meta_at: int  #: the cells' metadata, after magic, seq_id, n_stream and cell_count
    stride: int  #: metadata bytes per cell
    regions: tuple[Region, ...]
    tail_at: int  #: where the recurrent state starts

    def cut(self, n_tokens: int, recurrent: BlobBuffer) -> HybridCut | None:
        """How to write the state of the first ``n_tokens`` tokens, given ``recurrent``:
        what ``llama_state_seq_get_data_ext`` with ``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY``
        gave at ``n_tokens`` (the magic and seq_id, then the recurrent state alone). A
        prefix's attention cells are the same whatever follows, so the cut is byte for byte
        the blob llama.cpp itself would have written then. None unless the recurrent state
        reads as such (of the blob's sequence), is one cell at position ``n_tokens - 1``,
        and the first ``n_tokens`` cells hold positions 0 to ``n_tokens - 1``."""
        rv, head = memoryview(recurrent).cast("B"), _BLOB_HEAD.size
        if len(rv) <= head or bytes(rv[:head]) != self.head or not _recurrent_tail(rv, head):
            return None
        if struct.unpack_from("<Ii", rv, head) != (1, n_tokens - 1):
            return None  # (one cell, the summary of positions up to n_tokens - 1)
        if not 0 < n_tokens <= self.cell_count or not np.array_equal(
            self.positions[:n_tokens], np.arange(n_tokens)
        ):
            return None
        dropped = self.cell_count - n_tokens
        per_cell = self.stride + sum(r.nrep * r.unit for r in self.regions)
        return HybridCut(self, n_tokens, self.tail_at - dropped * per_cell + len(rv) - head)


@dataclass(frozen=True)
class HybridCut:
    """A hybrid's blob of its first ``n_tokens`` tokens, to be made from the blob of more
    tokens its ``layout`` reads and that checkpoint's recurrent state
    (:meth:`HybridLayout.cut`): ``size`` bytes, which :meth:`write` writes."""

    layout: HybridLayout
    n_tokens: int
    size: int

    def write(self, blob: BlobBuffer, recurrent: BlobBuffer, out: memoryview) -> None:
        """Write the cut blob into ``out[:size]`` from the ``blob`` and ``recurrent`` it
        was planned with: the blob's head, its attention part cut to the first
        ``n_tokens`` cells (their metadata, K rows, V rows or each transposed V row's first
        cells), then the recurrent state (one block copy per region)."""
        if out.nbytes < self.size:
            raise ValueError(f"out holds {out.nbytes} bytes, the cut needs {self.size}")
        lay = self.layout
        src = np.frombuffer(blob, dtype=np.uint8)
        dst = np.frombuffer(out, dtype=np.uint8, count=self.size)
        n, cc, at = self.n_tokens, lay.cell_count, lay.meta_at
        dst[: at - 4] = src[: at - 4]  # magic, seq_id, n_stream
        dst[at - 4 : at] = np.frombuffer(struct.pack("<I", n), dtype=np.uint8)  # cell_count
        q = at + n * lay.stride
        dst[at:q] = src[at:q]
        end = at + cc * lay.stride  # (then v_trans, n_layer and each region's header)
        for r in lay.regions:
            gap = r.offset - end
            dst[q : q + gap] = src[end : r.offset]
            q += gap
            run = n * r.unit
            if r.nrep == 1:
                dst[q : q + run] = src[r.offset : r.offset + run]
            else:
                rows = src[r.offset : r.offset + r.nrep * cc * r.unit].reshape(r.nrep, -1)
                dst[q : q + r.nrep * run].reshape(r.nrep, run)[:] = rows[:, :run]
            q += r.nrep * run
            end = r.offset + r.nrep * cc * r.unit
        tail = np.frombuffer(recurrent, dtype=np.uint8)[_BLOB_HEAD.size :]
        if q + tail.size != self.size:
            raise ValueError("the recurrent state is not the one this cut was planned with")
        dst[q:] = tail


def hybrid_layout(blob: BlobBuffer) -> HybridLayout | None:
    """What cuts of ``blob`` need, read once for all of them; None unless it is a hybrid's
    state: one attention part, then a recurrent state (an attention model's state is cut
    back by llama.cpp itself)."""
    mv = memoryview(blob).cast("B")
    parsed = _parse(mv)
    if parsed is None or len(parsed) != 1:
        return None
    cell_count, pos, _, regions = parsed[0]
    last = regions[-1]
    tail_at = last.offset + last.nrep * cell_count * last.unit
    if not _recurrent_tail(mv, tail_at):
        return None
    meta_at = _BLOB_HEAD.size + 8  # after n_stream and cell_count
    meta = regions[0].offset - _KHDR.size - 8 - meta_at  # (v_trans, n_layer, K's header)
    if meta <= 0 or meta % cell_count:
        return None
    head = bytes(mv[: _BLOB_HEAD.size])
    return HybridLayout(head, cell_count, pos, meta_at, meta // cell_count, tuple(regions), tail_at)


def cut_hybrid(blob: BlobBuffer, n_tokens: int, recurrent: BlobBuffer) -> HybridCut | None:
    """:func:`hybrid_layout` of ``blob``, then its :meth:`~HybridLayout.cut` (for one cut)."""
    layout = hybrid_layout(blob)
    return None if layout is None else layout.cut(n_tokens, recurrent)
