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
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

READY, RETRY, TIMEOUT, GO = "ready", "retry", "timeout", "go"


@dataclass
class Waiter:
    owner: int
    rid: int
    digest: bytes
    deadline: float


@dataclass
class Claims:
    """Claims by digest, their owners, and the requests waiting on them."""

    ttl: float = 60.0
    max_per_owner: int = 4096
    claims: dict[bytes, tuple[int, float]] = field(default_factory=dict)
    by_owner: dict[int, set[bytes]] = field(default_factory=dict)
    waiters: dict[bytes, list[Waiter]] = field(default_factory=dict)

    def claim(
        self, owner: int, rid: int, digests: list[bytes], now: float, wait: float
    ) -> tuple[str, Waiter | None]:
        """GO (claims granted), or ("wait", waiter) if another owner computes digests[0]."""
        held = self.claims.get(digests[0])
        if held is not None and held[0] != owner and held[1] > now and wait > 0:
            if sum(1 for ws in self.waiters.values() for w in ws if w.owner == owner) >= 16:
                return GO, None  # a pipelining peer: no more parked requests, just go
            w = Waiter(owner, rid, digests[0], now + wait)
            self.waiters.setdefault(digests[0], []).append(w)
            return "wait", w
        mine = self.by_owner.setdefault(owner, set())
        for d in digests:
            if len(mine) >= self.max_per_owner:
                break
            cur = self.claims.get(d)
            if cur is None or cur[0] == owner or cur[1] <= now:
                if cur is not None and cur[0] != owner:
                    self.by_owner.get(cur[0], set()).discard(d)
                self.claims[d] = (owner, now + self.ttl)
                mine.add(d)
        return GO, None

    def _end(self, digests: Iterable[bytes], status: str) -> list[tuple[Waiter, str]]:
        woken = []
        for d in digests:
            held = self.claims.pop(d, None)
            if held is not None:
                self.by_owner.get(held[0], set()).discard(d)
            for w in self.waiters.pop(d, []):
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
        for d in list(self.waiters):
            self.waiters[d] = [w for w in self.waiters[d] if w.owner != owner]
            if not self.waiters[d]:
                del self.waiters[d]
        return [(w, s) for w, s in woken if w.owner != owner]

    def expire(self, now: float) -> list[tuple[Waiter, str]]:
        woken = self._end([d for d, (_, exp) in self.claims.items() if exp <= now], RETRY)
        for d in list(self.waiters):
            keep = []
            for w in self.waiters[d]:
                (woken.append((w, TIMEOUT)) if w.deadline <= now else keep.append(w))
            if keep:
                self.waiters[d] = keep
            else:
                del self.waiters[d]
        return woken

    def next_deadline(self) -> float | None:
        times = [exp for _, exp in self.claims.values()]
        times += [w.deadline for ws in self.waiters.values() for w in ws]
        return min(times, default=None)
