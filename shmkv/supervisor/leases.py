"""Read leases: which connection may be reading which record (supervisor only).

A lease is a :class:`Grant` (the client's handle on it is ``shmkv.core.client.Lease``).
This table only keeps them, indexed by lease id and by owner (so that a
connection's count and its close cost what it holds, not what everyone
holds); ``store.py`` decides what a grant, a release or a revocation does to
the records, and how many a connection may hold. Every verdict is per lease: a
revoked grant stays here, marked, until its holder's release learns of it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Grant:
    """Record ``gen`` leased by connection ``owner`` at ``granted`` (store clock)."""

    gen: int
    owner: int
    granted: float
    revoked: bool = False


class Leases(dict[int, Grant]):
    """Grants by lease id; ids are never reused. Remove grants with ``del`` only."""

    def __init__(self) -> None:
        super().__init__()
        self._next = 1
        self._by_owner: dict[int, set[int]] = {}

    def grant(self, gen: int, owner: int, now: float) -> int:
        lid = self._next
        self._next += 1
        self[lid] = Grant(gen, owner, now)
        self._by_owner.setdefault(owner, set()).add(lid)
        return lid

    def __delitem__(self, lid: int) -> None:
        grant = self[lid]
        super().__delitem__(lid)
        mine = self._by_owner[grant.owner]
        mine.discard(lid)
        if not mine:
            del self._by_owner[grant.owner]

    def stale(self, now: float, timeout: float) -> list[Grant]:
        """Grants not yet revoked and held longer than ``timeout``."""
        return [g for g in self.values() if not g.revoked and now - g.granted > timeout]

    def of_owner(self, owner: int) -> list[int]:
        return sorted(self._by_owner.get(owner, ()))

    def held_by(self, owner: int) -> int:
        """How many grants (revoked or not) ``owner`` holds."""
        return len(self._by_owner.get(owner, ()))

    def active(self) -> int:
        """How many grants are held and not revoked."""
        return sum(1 for g in self.values() if not g.revoked)
