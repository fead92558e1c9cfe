"""In-flight prefill claims: one worker computes a new prefix, the others wait for it.

Runs in the supervisor (single thread, no locks). When several workers miss on
the same new prefix at once (a system prompt nobody has cached yet), only the
first needs to prefill it. A worker about to prefill claims the chunk digests
it will compute; a worker whose first missing digest is already claimed by
another connection waits until a put indexes that digest ("ready"), the
claim ends without one ("retry": the claimer died, gave up or its claim
expired), or its own deadline passes ("timeout"). It then looks up again and
restores what is there. Claims are advisory: a wait costs at most
``--claim-timeout``/the worker's own deadline, never correctness.

Deadlines (claim expiries and waiters' deadlines) are kept in a heap, so the
loop learns the next one in O(1) and ends each in O(log n), however many
claims are held; an entry whose claim ended or was renewed is dropped when it
reaches the top. A connection holds at most ``max_per_owner`` claims (the
rest of a longer claim is not claimed: it costs coalescing, never
correctness) and parks at most ``MAX_WAITS`` requests.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

from shmkv.core.stats import LimitCounters

READY, RETRY, TIMEOUT, GO = "ready", "retry", "timeout", "go"

#: requests one connection may have waiting at once; more just go (prefill themselves)
MAX_WAITS = 16


@dataclass(eq=False)
class Waiter:
    owner: int
    rid: int
    digest: bytes
    deadline: float
    #: answered, or its connection closed: its heap entry is stale
    done: bool = False


@dataclass
class Claims:
    """Claims by digest, their owners, and the requests waiting on them."""

    ttl: float = 60.0
    max_per_owner: int = 1024
    claims: dict[bytes, tuple[int, float]] = field(default_factory=dict)
    by_owner: dict[int, set[bytes]] = field(default_factory=dict)
    waiters: dict[bytes, list[Waiter]] = field(default_factory=dict)
    #: counts the digests refused past ``max_per_owner`` (``claims_refused``)
    limits: LimitCounters = field(default_factory=LimitCounters)
    #: (time, seq, digest or waiter): every claim expiry and waiter deadline, some stale
    _heap: list[tuple[float, int, bytes | Waiter]] = field(default_factory=list)
    _seq: itertools.count[int] = field(default_factory=itertools.count)
    _waits: dict[int, int] = field(default_factory=dict)
    _n_waiting: int = 0

    def _push(self, when: float, item: bytes | Waiter) -> None:
        heapq.heappush(self._heap, (when, next(self._seq), item))
        if len(self._heap) > 64 + 2 * (len(self.claims) + self._n_waiting):
            self._compact()

    def _compact(self) -> None:
        """Drop stale heap entries (ended or renewed claims, answered waiters)."""
        self._heap = [t for t in self._heap if not self._stale(t[0], t[2])]
        heapq.heapify(self._heap)

    def _stale(self, when: float, item: bytes | Waiter) -> bool:
        if isinstance(item, Waiter):
            return item.done
        held = self.claims.get(item)
        return held is None or held[1] != when

    def claim(
        self, owner: int, rid: int, digests: list[bytes], now: float, wait: float
    ) -> tuple[str, Waiter | None]:
        """GO (claims granted), or ("wait", waiter) if another owner computes digests[0]."""
        held = self.claims.get(digests[0])
        if held is not None and held[0] != owner and held[1] > now and wait > 0:
            if self._waits.get(owner, 0) >= MAX_WAITS:
                return GO, None  # a pipelining peer: no more parked requests, just go
            w = Waiter(owner, rid, digests[0], now + wait)
            self.waiters.setdefault(digests[0], []).append(w)
            self._waits[owner] = self._waits.get(owner, 0) + 1
            self._n_waiting += 1
            self._push(w.deadline, w)
            return "wait", w
        mine = self.by_owner.setdefault(owner, set())
        exp = now + self.ttl
        for k, d in enumerate(digests):
            cur = self.claims.get(d)
            if cur is not None and cur[0] != owner and cur[1] > now:
                continue  # another owner's, still running
            if cur is None or cur[0] != owner:
                if len(mine) >= self.max_per_owner:
                    self.limits.claims_refused += len(digests) - k
                    break
                if cur is not None:
                    self.by_owner.get(cur[0], set()).discard(d)
            self.claims[d] = (owner, exp)
            mine.add(d)
            self._push(exp, d)
        return GO, None

    def _unwait(self, w: Waiter) -> None:
        w.done = True
        self._n_waiting -= 1
        left = self._waits.get(w.owner, 0) - 1
        if left > 0:
            self._waits[w.owner] = left
        else:
            self._waits.pop(w.owner, None)

    def _end(self, digests: Iterable[bytes], status: str) -> list[tuple[Waiter, str]]:
        woken = []
        for d in digests:
            held = self.claims.pop(d, None)
            if held is not None:
                self.by_owner.get(held[0], set()).discard(d)
            for w in self.waiters.pop(d, []):
                self._unwait(w)
                woken.append((w, status))
        return woken

    def indexed(self, digests: Iterable[bytes]) -> list[tuple[Waiter, str]]:
        """A put indexed ``digests``: their claims end and their waiters are READY."""
        return self._end(digests, READY)

    def unclaim(self, owner: int, digests: Iterable[bytes]) -> list[tuple[Waiter, str]]:
        mine = [d for d in digests if self.claims.get(d, (None,))[0] == owner]
        return self._end(mine, RETRY)

    def drop_owner(self, owner: int) -> list[tuple[Waiter, str]]:
        """The owner's connection closed: end its claims (RETRY) and forget its waits."""
        woken = self._end(list(self.by_owner.pop(owner, set())), RETRY)
        if self._waits.get(owner):
            for d in list(self.waiters):
                keep = []
                for w in self.waiters[d]:
                    (self._unwait(w) if w.owner == owner else keep.append(w))
                if keep:
                    self.waiters[d] = keep
                else:
                    del self.waiters[d]
        return [(w, s) for w, s in woken if w.owner != owner]

    def expire(self, now: float) -> list[tuple[Waiter, str]]:
        """End the claims and the waits whose time has come (RETRY and TIMEOUT)."""
        woken: list[tuple[Waiter, str]] = []
        heap = self._heap
        while heap and heap[0][0] <= now:
            when, _, item = heapq.heappop(heap)
            if self._stale(when, item):
                continue
            if isinstance(item, Waiter):
                ws = self.waiters.get(item.digest, [])
                ws.remove(item)
                if not ws:
                    self.waiters.pop(item.digest, None)
                self._unwait(item)
                woken.append((item, TIMEOUT))
            else:
                woken += self._end([item], RETRY)
        return woken

    def waiting(self) -> int:
        """Requests waiting for a claim to end (``claims_waiting``)."""
        return self._n_waiting

    def next_deadline(self) -> float | None:
        heap = self._heap
        while heap and self._stale(heap[0][0], heap[0][2]):
            heapq.heappop(heap)
        return heap[0][0] if heap else None
