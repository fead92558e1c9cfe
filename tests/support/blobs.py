"""Blobs that are a pure function of a seed, so that any process can rebuild and check them."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from shmkv import Client
from shmkv.core import arena as A
from shmkv.core.keys import chain_digests

CHUNK = 64  # the supervisor's default --chunk-tokens


class Blob(NamedTuple):
    """A blob as a worker publishes it: key root, token ids and payload."""

    root: bytes
    tokens: np.ndarray
    data: bytes

    def digests(self, chunk: int = CHUNK) -> list[bytes]:
        return chain_digests(self.root, self.tokens, chunk)


def blob(seed: int, size: int, n_tokens: int = 2 * CHUNK) -> Blob:
    """A blob that is a pure function of ``seed``, so that any process can rebuild it and
    check what it reads."""
    root = hashlib.blake2b(b"blob-%d" % seed, digest_size=16).digest()
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 30_000, n_tokens).astype("<i4")
    return Blob(root, tokens, rng.bytes(size))


def flip_payload_bytes(arena_path: Path) -> int:
    """Flip bytes in the middle of every record's payload (as a stray writer would): a
    chunked record's in the middle of the middle chunk it names (once, if records share
    it). Returns how many records were hit."""
    fd = os.open(arena_path, os.O_RDONLY)
    try:
        view = A.ArenaView(fd, populate=False)
    finally:
        os.close(fd)
    records = {(s.rec_offset, s.rec_gen) for s in view.scan()}
    targets = set()
    for off, gen in records:
        rec = view.read_record(off, gen)
        chunks = [i for i in view.peek_chunks(rec)[2] if i] if rec.chunked else []
        if chunks:
            mid = chunks[len(chunks) // 2]
            targets.add(mid.data_off + mid.length // 2)
        else:
            targets.add(rec.payload_off + rec.body_len // 2)
    view.close()
    with open(arena_path, "r+b") as f:
        for pos in targets:
            f.seek(pos)
            b = f.read(16)
            f.seek(pos)
            f.write(bytes(x ^ 0xFF for x in b))
    return len(records)


def put_and_hit(c: Client, n_chunks: int = 2, size: int = 10_000) -> tuple[dict, bytes, int]:
    """Put one blob and read it back through a lease; returns (put reply, root, tokens)."""
    g = c.view.geometry
    root = os.urandom(16)
    tokens = np.arange(n_chunks * g.chunk_tokens, dtype=np.int32)
    data = os.urandom(size)
    reply = c.put_bytes(root, tokens, b"fp", data)
    hit = c.lookup(chain_digests(root, tokens, g.chunk_tokens))
    assert hit is not None and hit.chunks == n_chunks
    with c.acquire(hit) as lease:
        assert bytes(lease.payload) == data
        assert lease.finish(len(tokens))
    return reply, root, len(tokens)


def payload_for(root: bytes, tokens: np.ndarray, size: int) -> bytes:
    """``size`` bytes that are a pure function of a blob's key (root + token ids), so that
    every read can be verified."""
    h = hashlib.blake2b(root + tokens.astype("<i4").tobytes(), digest_size=16).digest()
    return np.random.default_rng(int.from_bytes(h[:8], "little")).bytes(size)


def stored_keys(c: Client) -> set[str]:
    """The keys (hex) of every state the supervisor lists."""
    return {r["key"] for r in c.ls()["entries"]}


def put_blob(c: Client, b: Blob, pin: bool = False) -> str:
    """Put ``b`` (fingerprint b"fp"); its key (hex)."""
    return c.put_bytes(b.root, b.tokens, b"fp", b.data, pin=pin)["key"].hex()


def use_blob(c: Client, b: Blob) -> None:
    """What a worker's hit does: look the state up, lease it, read it, release it."""
    hit = c.lookup(b.digests())
    assert hit is not None
    with c.acquire(hit) as lease:
        assert bytes(lease.payload) == b.data
        assert lease.finish()


def each_record(arena: str | Path, read: Callable[[A.ArenaView, int, int], Any]) -> list[Any]:
    """``read(view, offset, gen)`` of every record the index of the arena file points at,
    through a fresh read-only view (no lease)."""
    fd = os.open(arena, os.O_RDONLY)
    try:
        view = A.ArenaView(fd, populate=False)
    finally:
        os.close(fd)
    try:
        found = {(s.rec_offset, s.rec_gen) for s in view.scan()}
        return [read(view, off, gen) for off, gen in sorted(found)]
    finally:
        view.close()
