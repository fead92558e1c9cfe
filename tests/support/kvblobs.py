"""Sequence-state blobs in llama.cpp's format, made without a model (for the arena's chunks).

A blob here is what ``llama_state_seq_get_data`` writes for one KV cache (see
``shmkv/core/kvformat.py``): a header, one stream of cells at positions 0..n-1 of
sequence 0, then per layer the K rows and per layer the V rows (f16, not transposed).
Each cell's rows are a pure function of the token ids up to it, as a causal model's KV
is: two prompts that share a prefix share its rows byte for byte, and so the full
token groups of that prefix (``kvformat.split``). A hybrid's blob (``hybrid_state``) adds
a recurrent cache's state after it: one cell, a summary of every token (never shared).
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np

STATE_MAGIC = 0xAF143CD8
F16 = 1


def prefix_rows(tokens: np.ndarray, width: int, salt: bytes = b"") -> np.ndarray:
    """``len(tokens) x width`` bytes: row i a pure function of ``salt`` and tokens[: i + 1]."""
    out = np.empty((len(tokens), width), dtype=np.uint8)
    h = hashlib.blake2b(salt, digest_size=64).digest()
    for i, t in enumerate(np.asarray(tokens, dtype="<i4").tolist()):
        h = hashlib.blake2b(h + struct.pack("<i", t), digest_size=64).digest()
        out[i] = np.resize(np.frombuffer(h, dtype=np.uint8), width)
    return out


def kv_state(tokens: np.ndarray, n_layer: int = 2, row: int = 256, salt: bytes = b"") -> bytes:
    """The state blob of a context that evaluated ``tokens`` (``row`` bytes of K and of V
    per cell and layer)."""
    n = len(tokens)
    rows = prefix_rows(tokens, 2 * n_layer * row, salt).reshape(n, 2 * n_layer, row)
    out = bytearray(struct.pack("<Ii", STATE_MAGIC, 0))
    out += struct.pack("<II", 1, n)  # one stream, n cells
    cells = np.zeros((n, 3), dtype="<i4")
    cells[:, 0] = np.arange(n)  # pos
    cells[:, 1] = 1  # one sequence id per cell: 0
    out += cells.tobytes()
    out += struct.pack("<II", 0, n_layer)  # v_trans 0
    for kind in range(2):  # K rows of every layer, then V rows of every layer
        for layer in range(n_layer):
            out += struct.pack("<iQ", F16, row)
            out += rows[:, kind * n_layer + layer].tobytes()
    return bytes(out)


def hybrid_state(tokens: np.ndarray, n_recurrent: int = 3, salt: bytes = b"") -> bytes:
    """A hybrid model's state blob: :func:`kv_state`'s attention part, then a recurrent
    cache's state (``llama_memory_recurrent::state_write``: one cell at the last position,
    ``s_trans`` 0, an r and an s block of f32 rows per recurrent layer), its bytes a pure
    function of all the tokens."""
    n = len(tokens)
    summary = prefix_rows(tokens, 64, salt + b"recurrent")[-1]
    out = bytearray(kv_state(tokens, salt=salt))
    out += struct.pack("<IiI", 1, n - 1, 0)  # one cell: its position, no sequence ids
    out += struct.pack("<II", 0, n_recurrent + 1)  # s_trans 0; the attention layer has none
    for size in (1536, 4096):  # r (conv) rows, then s (ssm) rows
        for _ in range(n_recurrent):
            out += struct.pack("<iQ", 0, size) + np.resize(summary, size).tobytes()
    return bytes(out)
