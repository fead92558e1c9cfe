"""Read leases: which connection may be reading which record (supervisor only).

A lease is a :class:`Grant` (the client's handle on it is ``shmkv.client.Lease``).
This table only keeps them; ``store.py`` decides what a grant, a release or a
revocation does to the records. Every verdict is per lease: a revoked grant stays
here, marked, until its holder's release learns of it.
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
    """Grants by lease id; ids are never reused."""

    def __init__(self) -> None:
        super().__init__()
        self._next = 1

    def grant(self, gen: int, owner: int, now: float) -> int:
        lid = self._next
        self._next += 1
        self[lid] = Grant(gen, owner, now)
        return lid

    def stale(self, now: float, timeout: float) -> list[Grant]:
        """Grants not yet revoked and held longer than ``timeout``."""
        return [g for g in self.values() if not g.revoked and now - g.granted > timeout]

    def of_owner(self, owner: int) -> list[int]:
        return [lid for lid, g in self.items() if g.owner == owner]

    def active(self) -> int:
        """How many grants are held and not revoked."""
        return sum(1 for g in self.values() if not g.revoked)
