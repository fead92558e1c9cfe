"""shmkv.core.kvformat on real llama.cpp blobs: split then assemble gives the blob back
byte for byte, equal prefixes give equal full groups, a packed manifest survives the
arena and nothing else does.

Blobs come from ``llama_state_seq_get_data`` on the suite's tiny models: LLaMA, Qwen 2,
Qwen 3 MoE (one KV cache), Gemma 3 with a 32-token window (iSWA: the base cache's part,
then the window's, whose ring of 256 cells rotates once a prompt passes it: swa_full off,
32-token batches), Mamba (recurrent: it stays whole) and Qwen 3.5 (hybrid: its attention
part splits, its recurrent state stays in the skeleton).
"""

from __future__ import annotations

import ctypes
import itertools
import random
import struct
import tracemalloc
from pathlib import Path

import llama_cpp
import pytest
import xxhash
from llama_cpp import llama_cpp as C

from shmkv.core import kvformat
from shmkv.core.errors import ArenaCorruptError
from shmkv.core.kvtypes import KV_TYPES
from tests.support import tinymodel

CHUNK = 16  # tokens per group in these tests (the arena's default is 64): more groups
SWA = 32  # the tiny Gemma 3's window
SEQ = 0
ATTENTION = ("llama", "gemma3", "qwen2", "qwen3moe")
#: (flash attention, K type, V type): V transposed without flash attention; a q8_0 V
#: cache needs flash attention
KV = [
    (False, "f16", "f16"),
    (True, "f16", "f16"),
    (True, "q8_0", "q8_0"),
    (False, "q8_0", "f16"),
]
# lengths: shorter than a group, exactly on a group boundary, past the window's ring
# (256 cells) with the ring's seam inside the window
LENGTHS = (10, 4 * CHUNK, 270)


#: 32-wide attention heads (q8_0's block size: 16-wide ones cannot hold a q8_0 V cache)
WIDE_HEADS = {
    "llama": {"n_head": 2},
    "gemma3": {"n_head": 2, "n_swa": SWA},
    "qwen2": {"n_embd": 128},
    "qwen3moe": {"n_embd": 128},
}


@pytest.fixture(scope="module")
def arch_models(tmp_path_factory) -> dict[str, str]:
    d: Path = tmp_path_factory.mktemp("kvformat")
    out = {}
    for arch in (*ATTENTION, "mamba", "qwen35"):
        path = d / f"tiny-{arch}.gguf"
        getattr(tinymodel, f"write_tiny_{arch}")(path, **WIDE_HEADS.get(arch, {}))
        out[arch] = str(path)
    return out


def context(model: str, flash: bool = False, k: str = "f16", v: str = "f16") -> llama_cpp.Llama:
    return llama_cpp.Llama(
        model,
        n_ctx=1024,
        n_batch=32,
        n_ubatch=32,
        swa_full=False,
        flash_attn=flash,
        type_k=KV_TYPES[k],
        type_v=KV_TYPES[v],
        n_threads=1,
        n_threads_batch=1,
        verbose=False,
    )


def tokens(n: int, seed: int) -> list[int]:
    return random.Random(seed).choices(range(5, 500), k=n)


def state(llm: llama_cpp.Llama, flags: int = 0) -> bytes:
    size = C.llama_state_seq_get_size_ext(llm.ctx, SEQ, flags)
    buf = (ctypes.c_uint8 * size)()
    assert C.llama_state_seq_get_data_ext(llm.ctx, buf, size, SEQ, flags) == size
    return bytes(buf)


def window_positions(llm: llama_cpp.Llama) -> list[int]:
    """The positions of the window cache's cells in blob order, read from llama.cpp's
    window-only state (magic, seq_id, n_stream, cell_count, then 12-byte cells)."""
    part = state(llm, C.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)
    (count,) = struct.unpack_from("<I", part, 12)
    return [struct.unpack_from("<i", part, 16 + 12 * i)[0] for i in range(count)]


def expected_groups(positions: list[int], chunk: int) -> tuple[int, int]:
    """(groups, full groups) of cells at these positions in blob order: the rule, one
    cell at a time."""
    groups = full = 0
    run: list[int] = []
    for p in [*positions, None]:
        if run and (p is None or p != run[-1] + 1 or p // chunk != run[-1] // chunk):
            groups += 1
            full += len(run) == chunk and run[0] % chunk == 0
            run = []
        if p is not None:
            run.append(p)
    return groups, full


def roundtrip(blob: bytes, chunk: int = CHUNK) -> tuple[kvformat.Manifest, list[memoryview]]:
    """split, then assemble from the manifest and from its packed copy: both the blob."""
    got = kvformat.split(blob, chunk, min_full=0)
    assert got is not None
    manifest, groups = got
    assert [len(g) for g in groups] == manifest.group_sizes
    assert manifest.blob_len == len(blob)
    assert len(manifest.skeleton) + sum(manifest.group_sizes) == len(blob)
    # region by region, for any set of groups: each group's data and its XXH3-128 as
    # gathered one group at a time
    every = list(range(len(groups)))
    for some in (every, every[::-2]):
        assert kvformat.group_digests(manifest, blob, some) == [
            xxhash.xxh3_128_digest(groups[i]) for i in some
        ]
        outs = [(i, memoryview(bytearray(manifest.group_sizes[i]))) for i in some]
        kvformat.gather_into(manifest, blob, outs)
        assert all(bytes(out) == bytes(groups[i]) for i, out in outs)
    for m in (manifest, kvformat.Manifest.unpack(manifest.pack())):
        out = bytearray(len(blob) + 7)
        kvformat.assemble(m, [bytes(g) for g in groups], memoryview(out))
        assert out[: len(blob)] == blob
        assert out[len(blob) :] == bytes(7)
        # the blob in pieces, never assembled whole: its bytes and its XXH3-64
        for window in (kvformat.PIECE_WINDOW, 1):
            assert b"".join(bytes(p) for p in kvformat.blob_pieces(m, groups, window)) == blob
        assert kvformat.blob_xxh3_64(m, groups) == xxhash.xxh3_64_intdigest(blob)
    return manifest, groups


def group_keys(blob: bytes, chunk: int = CHUNK) -> set[tuple[bytes, bytes]]:
    """The chunk keys of a blob's full groups, as the supervisor makes them."""
    got = kvformat.split(blob, chunk)
    assert got is not None
    m, groups = got
    return {
        (sig, xxhash.xxh3_128_digest(g))
        for sig, full, g in zip(m.group_sigs, m.group_full, groups, strict=True)
        if full
    }


@pytest.mark.parametrize("flash,k,v", KV, ids=[f"fa{int(f)}-{k}-{v}" for f, k, v in KV])
@pytest.mark.parametrize("arch", ATTENTION)
def test_split_assemble_is_the_blob(arch_models, arch, flash, k, v):
    """For each length: split + assemble == blob; the groups are the rule's (positions
    read from llama.cpp's own state); a blob with no full group stays whole by default."""
    llm = context(arch_models[arch], flash, k, v)
    done = 0
    for n in LENGTHS:
        llm.eval(tokens(n - done, seed=n))
        done = n
        blob = state(llm)
        manifest, _ = roundtrip(blob)
        parts = [list(range(n))]
        if arch == "gemma3":
            window = window_positions(llm)
            assert len(window) == min(n, SWA)
            if n > 256:  # the ring rotated: the window's cells are not in position order
                assert window != sorted(window)
            parts.append(window)
        assert [p.cell_count for p in manifest.parts] == [len(p) for p in parts]
        want = [expected_groups(p, CHUNK) for p in parts]
        assert [len(p.group_cells) for p in manifest.parts] == [g for g, _ in want]
        assert sum(manifest.group_full) == sum(f for _, f in want)
        assert {p.v_trans for p in manifest.parts} == {0 if flash else 1}
        if sum(f for _, f in want) == 0:
            assert kvformat.split(blob, CHUNK) is None
        else:
            assert kvformat.split(blob, CHUNK) is not None


@pytest.mark.parametrize("flash", [False, True], ids=["fa0", "fa1"])
@pytest.mark.parametrize("arch", ATTENTION)
def test_one_prefix_two_suffixes_share_full_groups(arch_models, arch, flash):
    """One context: a prefix and a suffix, its state; cut back to the prefix (the way
    shmkv reuses a longer record), another suffix, its state. The two blobs' full groups
    over the prefix have equal keys (layout signature, XXH3-128 of the data): exactly the
    aligned ranges the prefix covers whole; nothing past it is shared. Both blobs (the
    second from a cut-back context) round-trip."""
    llm = context(arch_models[arch], flash)
    prefix = tokens(150, seed=1)
    llm.eval(prefix + tokens(40, seed=2))
    first = state(llm)
    assert C.llama_memory_seq_rm(C.llama_get_memory(llm.ctx), SEQ, len(prefix), -1)
    llm.n_tokens = len(prefix)
    llm.eval(tokens(50, seed=3))
    second = state(llm)
    assert first != second
    for blob in (first, second):
        roundtrip(blob)
    # (the window's cells are the last 32 positions of each: never in the prefix)
    shared = group_keys(first) & group_keys(second)
    assert len(shared) == len(prefix) // CHUNK
    assert len(group_keys(first, 64) & group_keys(second, 64)) == len(prefix) // 64


def test_recurrent_states_stay_whole(arch_models):
    llm = context(arch_models["mamba"])
    llm.eval(tokens(100, seed=4))
    assert kvformat.split(state(llm), CHUNK, min_full=0) is None


def test_a_hybrid_state_splits_its_attention_and_keeps_its_recurrent_state(arch_models):
    """Qwen 3.5 (delta-net and attention layers): its blob is the attention cache's part,
    then the recurrent state. The part splits into groups and round-trips; the recurrent
    state, exactly what llama.cpp's own partial state (``PARTIAL_ONLY``) holds after its
    magic and seq_id, ends the skeleton. Two prompts on one prefix, each evaluated in a
    fresh context, share the full groups the prefix covers and nothing else. The blob a
    byte short, a byte long, or with a transposed recurrent state stays whole."""
    prefix = tokens(150, seed=1)
    blobs, recurrent = [], []
    for seed in (2, 3):
        llm = context(arch_models["qwen35"])
        llm.eval(prefix + tokens(40, seed=seed))
        blobs.append(state(llm))
        recurrent.append(state(llm, C.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)[8:])
    for blob, tail in zip(blobs, recurrent, strict=True):
        manifest, _ = roundtrip(blob)
        assert [p.cell_count for p in manifest.parts] == [len(prefix) + 40]
        assert manifest.skeleton.endswith(tail)
        assert kvformat.split(blob[:-1], CHUNK) is None
        assert kvformat.split(blob + b"\0", CHUNK) is None
        at = len(blob) - len(tail)
        (cells,) = struct.unpack_from("<I", blob, at)
        transposed = bytearray(blob)
        struct.pack_into("<I", transposed, at + 4 + 8 * cells, 1)  # s_trans
        assert kvformat.split(bytes(transposed), CHUNK) is None
    assert len(group_keys(blobs[0]) & group_keys(blobs[1])) == len(prefix) // CHUNK


@pytest.mark.parametrize("flash", [False, True], ids=["fa0", "fa1"])
def test_a_hybrid_cut_is_the_state_llama_cpp_writes_at_that_length(arch_models, flash):
    """A context evaluates n tokens, copies its recurrent state alone (PARTIAL_ONLY), goes
    on to a longer prompt and copies its whole state; the cut of that state to n tokens
    with that recurrent state is byte for byte the state another context has after
    evaluating the same n tokens the same way. Nothing else is cut: an attention model's
    blob, a recurrent state cut short, with another head than the blob or of another position,
    more cells than the blob has."""
    prompt = tokens(230, seed=9)
    n = 137  # (inside a group: the cut ends in a partial one)
    a, ref = context(arch_models["qwen35"], flash), context(arch_models["qwen35"], flash)
    a.eval(prompt[:n])
    recurrent = state(a, C.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)
    a.eval(prompt[n:])
    whole = state(a)
    ref.eval(prompt[:n])
    want = state(ref)
    cut = kvformat.cut_hybrid(whole, n, recurrent)
    assert cut is not None and cut.size == len(want)
    out = bytearray(cut.size)
    cut.write(whole, recurrent, memoryview(out))
    assert bytes(out) == want
    roundtrip(bytes(out))
    llama = context(arch_models["llama"])
    llama.eval(prompt)
    assert kvformat.cut_hybrid(state(llama), n, recurrent) is None
    assert kvformat.cut_hybrid(whole, len(prompt) + 1, recurrent) is None
    assert kvformat.cut_hybrid(whole, n, recurrent[:-1]) is None
    assert kvformat.cut_hybrid(whole, n, b"\0" * 8 + recurrent[8:]) is None  # (magic)
    later = state(a, C.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)  # (its one cell: position 229)
    assert len(later) == len(recurrent) and kvformat.cut_hybrid(whole, n, later) is None


def test_blobs_that_do_not_parse_stay_whole(arch_models):
    """A blob cut short, with a byte more, or with a cell of two sequences is not split
    (a wrong reading would only cost a miss, but there is none to make)."""
    llm = context(arch_models["llama"])
    llm.eval(tokens(100, seed=5))
    blob = state(llm)
    assert kvformat.split(blob, CHUNK) is not None
    assert kvformat.split(blob[:-1], CHUNK) is None
    assert kvformat.split(blob + b"\0", CHUNK) is None
    assert kvformat.split(b"", CHUNK) is None
    two = bytearray(blob)
    struct.pack_into("<I", two, 16 + 12 * 3 + 4, 2)  # n_seq_id of the fourth cell
    assert kvformat.split(bytes(two), CHUNK) is None


def test_cells_with_the_extension(arch_models):
    """A model with M-RoPE or per-layer embeddings writes a 12-byte llama_kv_cell_ext
    (x, y, tok) in each cell's metadata (none of the tiny models does): the same blob with
    one splits into the same groups and round-trips."""
    llm = context(arch_models["llama"])
    n = 100
    llm.eval(tokens(n, seed=8))
    blob = state(llm)
    cells_at = 16  # magic, seq_id, n_stream, cell_count
    cells = [blob[cells_at + 12 * i : cells_at + 12 * (i + 1)] for i in range(n)]
    ext = b"".join(
        c[:8] + struct.pack("<iii", i % 7, i // 7, 5 + i) + c[8:] for i, c in enumerate(cells)
    )
    with_ext = blob[:cells_at] + ext + blob[cells_at + 12 * n :]
    plain, _ = roundtrip(blob)
    extended, _ = roundtrip(with_ext)
    assert extended.group_sizes == plain.group_sizes
    assert extended.group_full == plain.group_full
    assert len(extended.skeleton) == len(plain.skeleton) + 12 * n


def test_assembled_blob_restores_as_a_cold_run(arch_models):
    """An assembled blob restored with llama_state_seq_set_data into a fresh context
    continues greedily exactly as a cold run of the whole prompt."""
    model = arch_models["llama"]
    prompt = tokens(150, seed=6)
    src = context(model)
    src.eval(prompt[:-1])
    got = kvformat.split(state(src), 64)
    assert got is not None
    manifest, groups = got
    assert sum(manifest.group_full) == 2
    buf = bytearray(manifest.blob_len)
    kvformat.assemble(kvformat.Manifest.unpack(manifest.pack()), groups, memoryview(buf))

    warm = context(model)
    arr = (ctypes.c_uint8 * len(buf)).from_buffer(buf)
    assert C.llama_state_seq_set_data(warm.ctx, arr, len(buf), SEQ) == len(buf)
    assert C.llama_memory_seq_pos_max(C.llama_get_memory(warm.ctx), SEQ) == len(prompt) - 2
    warm.input_ids[: len(prompt) - 1] = prompt[:-1]
    warm.n_tokens = len(prompt) - 1

    cold = context(model)

    def greedy(llm: llama_cpp.Llama) -> list[int]:
        return list(itertools.islice(llm.generate(prompt, top_k=1, temp=0.0, reset=True), 12))

    assert greedy(warm) == greedy(cold)


# --- the manifest as a reader meets it in the arena -----------------------------------


@pytest.fixture(scope="module")
def window_manifest(arch_models) -> tuple[bytes, kvformat.Manifest, list[memoryview]]:
    """A Gemma 3 blob (two parts, the window's ring rotated), its manifest and groups."""
    llm = context(arch_models["gemma3"])
    llm.eval(tokens(270, seed=7))
    blob = state(llm)
    got = kvformat.split(blob, CHUNK)
    assert got is not None
    return blob, got[0], got[1]


HEADER = struct.Struct("<4sHHIQQIII")
PART = struct.Struct("<IIII")
REGION = struct.Struct("<QIiII")


def test_manifest_pack_unpack(window_manifest):
    blob, m, _ = window_manifest
    packed = m.pack()
    back = kvformat.Manifest.unpack(packed)
    assert len(back.parts) == 2
    for name in ("blob_len", "group_sizes", "group_full", "group_sigs", "skeleton", "parts"):
        assert getattr(back, name) == getattr(m, name), name
    assert back.pack() == packed
    assert kvformat.Manifest.unpack(memoryview(bytearray(packed))).pack() == packed
    # signatures tell groups of different layouts apart: the base part's from the window's,
    # a group of 16 cells from one of fewer
    assert len(set(m.group_sigs)) >= 3


def _field(packed: bytes, fmt: str, at: int, value: int) -> bytes:
    b = bytearray(packed)
    struct.pack_into(fmt, b, at, value)
    return bytes(b)


def test_unpack_rejects_inconsistent_manifests(window_manifest):
    _, m, _ = window_manifest
    p = m.pack()
    n_parts, n_regions = len(m.parts), sum(len(x.regions) for x in m.parts)
    regions_at = HEADER.size + n_parts * PART.size
    groups_at = regions_at + n_regions * REGION.size
    first_region = m.parts[0].regions[0]
    # the second region moved 8 bytes into the first, the skeleton 8 bytes longer to match:
    # every length adds up, only the overlap is wrong
    r0_end = first_region.offset + m.parts[0].cell_count * first_region.unit
    overlap = _field(p, "<Q", regions_at + REGION.size, r0_end - 8)
    overlap = _field(overlap, "<Q", 20, len(m.skeleton) + 8) + bytes(8)
    bad = {
        "empty": b"",
        "truncated header": p[:10],
        "truncated": p[:-1],
        "a byte more": p + b"\0",
        "magic": b"XXXX" + p[4:],
        "version": _field(p, "<H", 4, 2),
        "blob_len": _field(p, "<Q", 12, m.blob_len + 1),
        "blob_len huge": _field(p, "<Q", 12, 1 << 62),
        "chunk_tokens 0": _field(p, "<I", 8, 0),
        "skeleton_len": _field(p, "<Q", 20, len(m.skeleton) + 1),
        "no parts": _field(p, "<I", 28, 0),
        "huge group count": _field(p, "<I", 36, 0xFFFFFFFF),
        "huge region count": _field(p, "<I", 32, 0xFFFFFFFF),
        "cell count": _field(p, "<I", HEADER.size, m.parts[0].cell_count + 1),
        "v_trans 2": _field(p, "<I", HEADER.size + 4, 2),
        "overlapping regions": _field(p, "<Q", regions_at + REGION.size, first_region.offset + 1),
        "overlapping regions, lengths adding up": overlap,
        "region past the blob": _field(
            p, "<Q", regions_at + (n_regions - 1) * REGION.size, m.blob_len
        ),
        "region kind": _field(p, "<I", regions_at + 8, 7),
        "region unit 0": _field(p, "<I", regions_at + 16, 0),
        "untransposed region of 2 runs": _field(p, "<I", regions_at + 20, 2),
        "group of 0 cells": _field(p, "<I", groups_at, 0),
        "group cells do not add up": _field(p, "<I", groups_at, m.parts[0].group_cells[0] + 1),
        "a short group marked full": _field(
            p, "<I", groups_at + m.group_full.index(False) * 8 + 4, 1
        ),
        "unknown group flag": _field(p, "<I", groups_at + 4, 2),
    }
    assert m.group_full[0] and not all(m.group_full)
    for name, buf in bad.items():
        with pytest.raises(ArenaCorruptError):
            kvformat.Manifest.unpack(buf)
            pytest.fail(name)


def test_unpack_fuzz(window_manifest):
    """A few hundred random mutations of a packed manifest (byte flips, integers written
    over fields, cuts, insertions): each is read back or refused with ArenaCorruptError,
    never another exception, never an allocation of more than a few times its size; what
    is read back is self-consistent."""
    _, m, groups = window_manifest
    p = m.pack()
    rng = random.Random(21)
    fields = list(range(0, len(p) - len(m.skeleton), 4))
    refused = 0
    for i in range(400):
        b = bytearray(p)
        kind = i % 5
        if kind == 0:
            for _ in range(rng.randint(1, 4)):
                b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        elif kind == 1:
            at = rng.choice(fields)
            value = rng.choice([0, 1, 2, 0xFFFFFFFF, 0x80000000, rng.getrandbits(32)])
            struct.pack_into("<I", b, at, value)
        elif kind == 2:
            at = rng.choice(fields[:-1])
            struct.pack_into("<Q", b, at, rng.choice([1 << 40, 1 << 63, rng.getrandbits(64)]))
        elif kind == 3:
            del b[rng.randrange(len(b)) :]
        else:
            at = rng.randrange(len(b))
            b[at:at] = bytes(rng.randrange(256) for _ in range(rng.choice([1, 4, 8, 24])))
        tracemalloc.start()
        try:
            got = kvformat.Manifest.unpack(bytes(b))
        except ArenaCorruptError:
            refused += 1
            continue
        finally:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            assert peak < 8 * len(b) + (256 << 10), (i, kind, peak)
        assert len(got.skeleton) + sum(got.group_sizes) == got.blob_len
        if bytes(b) != p and got.group_sizes == m.group_sizes and got.blob_len == m.blob_len:
            out = bytearray(got.blob_len)
            kvformat.assemble(got, groups, memoryview(out))  # never raises: layout is sound
    assert refused > 300


def test_split_fuzz(window_manifest):
    """A worker's blob is untrusted too: a few hundred mutations of a real two-part blob's
    headers and cell metadata (flips, integers over fields, cuts, insertions) are either
    left whole (None) or split into groups that assemble back to exactly those bytes."""
    blob, m, _ = window_manifest
    rng = random.Random(22)
    skeleton_at = [at + i for at, _, length in m.gaps for i in range(0, length, 4)]
    split_ = 0
    for i in range(300):
        b = bytearray(blob)
        kind = i % 4
        at = rng.choice(skeleton_at)
        if kind == 0:
            b[at] ^= 1 << rng.randrange(8)
        elif kind == 1:
            value = rng.choice([0, 1, 2, 3, 0xFFFFFFFF, 0x7FFFFFFF, rng.getrandbits(32)])
            struct.pack_into("<I", b, at, value)
        elif kind == 2:
            del b[at:]
        else:
            b[at:at] = bytes(rng.choice([4, 12, 24]))
        got = kvformat.split(bytes(b), CHUNK, min_full=0)
        if got is None:
            continue
        split_ += 1
        out = bytearray(len(b))
        kvformat.assemble(kvformat.Manifest.unpack(got[0].pack()), got[1], memoryview(out))
        assert out == b, (i, kind, at)
    assert 0 < split_ < 300


def test_assemble_rejects_groups_of_the_wrong_length(window_manifest):
    blob, m, groups = window_manifest
    out = memoryview(bytearray(len(blob)))
    g = [bytes(x) for x in groups]
    for wrong in (
        [g[0][:-1], *g[1:]],
        [*g[:-1], g[-1] + b"\0"],
        g[:-1],
        [*g, b""],
        [g[1], g[0], *g[2:]] if len(g[0]) != len(g[1]) else [b"", *g[1:]],
    ):
        with pytest.raises(ArenaCorruptError):
            kvformat.assemble(m, wrong, out)
        with pytest.raises(ArenaCorruptError):
            kvformat.blob_xxh3_64(m, wrong)
    assert kvformat.blob_xxh3_64(m, g) == xxhash.xxh3_64_intdigest(blob)
    kvformat.assemble(m, g, out)
    assert bytes(out) == blob
