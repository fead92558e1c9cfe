"""Which records own each chunk digest, and which one its index slot points at.

Runs only in the supervisor, on its one thread, as part of
:class:`~shmkv.supervisor.store.Store`; nothing here takes a lock. Index slots are written
through :class:`~shmkv.core.arena.ArenaWriter` under their per-slot seqlock.
"""

from __future__ import annotations

import heapq

from shmkv.core.arena import ArenaWriter, Slot
from shmkv.supervisor.record import Entry


class IndexOwners:
    """The owners of every indexed chunk digest, and the choice of the one each slot names."""

    def __init__(self, arena: ArenaWriter, entries: dict[int, Entry], chunk_tokens: int, uid: int):
        self.arena = arena
        #: the store's records by gen (shared, not copied)
        self.entries = entries
        self.chunk_tokens = chunk_tokens
        #: the supervisor's uid: its records win an index slot (see ``point``)
        self.uid = uid
        #: chunk digest -> {gen: n_tokens} of every live record indexed under it
        self.owners: dict[bytes, dict[int, int]] = {}
        #: (rank, gen) heaps of the digests with several owners (see best); some stale
        self._heaps: dict[bytes, list[tuple[tuple[int, int, int, int], int]]] = {}

    def rank(self, nch: int, gen: int, n_tokens: int) -> tuple[int, int, int, int]:
        """Order of the owners of chunk prefix ``nch`` for :meth:`point` (least is best).

        A record's rank never changes while it lives (its publisher and length are
        fixed), so a heap entry stays valid until the record leaves.
        """
        theirs = int(self.entries[gen].publisher != self.uid)  # the supervisor's uid first
        if n_tokens < (nch + 1) * self.chunk_tokens:  # ends within the next chunk
            return (0, theirs, -n_tokens, gen)  # the longest of those
        return (1, theirs, n_tokens, gen)  # else the shortest

    def best(self, digest: bytes, nch: int, owners: dict[int, int]) -> int:
        """The owner of ``digest`` its slot should point at, in O(log n) amortized.

        A digest with several owners (a chunk prefix many prompts share, e.g. a system
        prompt's) keeps its owners in a heap by rank; owners removed since are dropped
        when they reach the top.
        """
        if len(owners) == 1:
            return next(iter(owners))
        heap = self._heaps.get(digest)
        if heap is None:
            heap = [(self.rank(nch, g, n), g) for g, n in owners.items()]
            heapq.heapify(heap)
            self._heaps[digest] = heap
        while heap[0][1] not in owners:
            heapq.heappop(heap)
        return heap[0][1]

    def add(self, digest: bytes, nch: int, gen: int, n_tokens: int) -> None:
        self.owners.setdefault(digest, {})[gen] = n_tokens
        heap = self._heaps.get(digest)
        if heap is not None:
            heapq.heappush(heap, (self.rank(nch, gen, n_tokens), gen))

    def drop(self, digest: bytes, gen: int) -> None:
        owners = self.owners.get(digest)
        if owners is None:
            return
        owners.pop(gen, None)
        if not owners:
            del self.owners[digest]
        heap = self._heaps.get(digest)
        if heap is not None:
            if len(owners) <= 1:
                del self._heaps[digest]
            elif len(heap) > 2 * len(owners) + 8:  # mostly removed owners: rebuild
                self._heaps[digest] = [t for t in heap if t[1] in owners]
                heapq.heapify(self._heaps[digest])

    def wanted(self, digest: bytes, nch: int) -> Slot | None:
        """The slot :meth:`point` would write for chunk prefix ``nch`` (None: none)."""
        owners = self.owners.get(digest)
        if not owners:
            return None
        e = self.entries[self.best(digest, nch, owners)]
        return Slot(digest, e.offset, e.gen, nch)

    def point(self, digest: bytes, nch: int) -> bool:
        """Point the slot of chunk prefix ``nch`` at the owner a lookup should try first.

        That is the longest of the records whose last full chunk this is (they end
        before the next chunk: a prompt or checkpoint that a prompt matching this
        chunk may match to its very end, which is what a sliding-window model
        needs to restore it whole), else the shortest (cheapest to restore); the
        oldest among equals. Within each, records published by the supervisor's own
        uid come first, as every worker trusts those: another user's record never
        takes their place.
        """
        slot = self.wanted(digest, nch)
        if slot is None:
            self.arena.index_del(digest)
            return True
        return self.arena.index_set(slot)
