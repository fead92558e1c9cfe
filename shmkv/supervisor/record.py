"""The supervisor's bookkeeping for one record in the arena.

Runs only in the supervisor (see :mod:`shmkv.supervisor.store`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shmkv.supervisor.chunks import Chunk


@dataclass
class Entry:
    """The supervisor's bookkeeping for one record."""

    gen: int
    offset: int
    extent: int
    key: bytes
    root: bytes
    n_tokens: int
    payload_len: int
    digests: list[bytes]
    content: bytes
    created: float
    pinned: bool = False
    leases: int = 0
    hits: int = 0
    last_used: float = 0.0
    doomed: bool = False
    #: uid of the peer that put it
    publisher: int = 0
    #: a lease of it was revoked or ended with its connection: its holder may still be
    #: reading, so its pages are never punched (``pages.py``)
    stale_readers: bool = False
    #: the chunks it references, a reference held on each (``chunks.py``); none: whole
    chunks: list[Chunk] = field(default_factory=list)

    @property
    def footprint(self) -> int:
        """Its extent and its chunks' (shared ones counted in full: what pinning it holds)."""
        return self.extent + sum(c.extent for c in self.chunks)
