"""Idle release: the supervisor drops states nobody used for ``--ttl`` seconds.

Runs only in the supervisor, on its one thread: its loop calls :meth:`Expiry.tick`
about once a second. Each tick does a bounded amount of work (``budget`` records),
so a million idle records cost many short ticks, never one long stall.

* ``--ttl`` applies to evictable records: unpinned and not leased. Those are exactly
  ``Store.lru``, least recently used first, so the idle ones are at its front and a
  tick stops at the first record still in use. (A record re-enters the LRU at the
  end when its last lease ends, marked used then: an idle time never counts time
  spent under a lease.)
* A pinned record is kept regardless of ``--ttl``, unless its pin carries a TTL of
  its own (``shmkv pin --ttl``): past that much disuse it is unpinned and released.
* A leased record is never released here: it is in use. Nothing here revokes a lease.

Released records are counted in ``expired`` (``shmkv stats``), and the store's
write-behind tiers are told (``tiers/base.py``): ``--persist`` removes its copy too, so a
reboot's refill does not bring back what expired (the remote tier keeps its copy for
its own ``--remote-ttl``: other nodes may still use it).
"""

from __future__ import annotations

import heapq
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shmkv.supervisor.record import Entry
    from shmkv.supervisor.store import Store

log = logging.getLogger(__name__)

#: most records one tick looks at
BUDGET = 512
#: a pinned record found leased is looked at again this much later, at the soonest
RECHECK = 1.0


class Expiry:
    """Which records have been idle too long, and releasing them a few at a time."""

    def __init__(self, store: Store, ttl: float, budget: int = BUDGET) -> None:
        self.store = store
        #: seconds of disuse after which an evictable record is released (0: never)
        self.ttl = ttl
        self.budget = budget
        #: gen -> (its pin's TTL, when pinned, version): the heap's item for a gen counts
        #: only if it carries the current version
        self._pins: dict[int, tuple[float, float, int]] = {}
        self._heap: list[tuple[float, int, int]] = []
        self._version = 0

    def pin_ttl(self, e: Entry, ttl: float | None) -> None:
        """Give ``e``'s pin a TTL of its own (None: none, the pin lasts until unpinned)."""
        if ttl is None:
            self._pins.pop(e.gen, None)
            return
        self._version += 1
        since = self.store.clock()  # (a pin counts as a use: its TTL runs from now)
        self._pins[e.gen] = (ttl, since, self._version)
        heapq.heappush(self._heap, (since + ttl, e.gen, self._version))

    def pinned_ttl(self, gen: int) -> float | None:
        """The TTL of record ``gen``'s pin, if it has one."""
        got = self._pins.get(gen)
        return None if got is None else got[0]

    def tick(self) -> int:
        """Release what has been idle too long, within the budget; returns how many."""
        now = self.store.clock()
        budget = self.budget
        released = self._idle(now, budget)
        released += self._idle_pins(now, budget - released)
        if released:
            self.store.counters.expired += released
            log.info("released %d state(s) idle past their TTL", released)
        return released

    def _idle(self, now: float, budget: int) -> int:
        store, lru, released = self.store, self.store.lru, 0
        if self.ttl <= 0:
            return 0
        while lru and released < budget:
            e = store.entries[next(iter(lru))]
            if now - e.last_used <= self.ttl:
                break
            self._release(e)
            released += 1
        return released

    def _idle_pins(self, now: float, budget: int) -> int:
        store, heap, released = self.store, self._heap, 0
        looked = 0
        while heap and heap[0][0] <= now and looked < budget:
            looked += 1
            _due, gen, version = heapq.heappop(heap)
            got = self._pins.get(gen)
            if got is None or got[2] != version:
                continue  # its TTL changed or ended: another item (or none) stands for it
            ttl, since = got[0], got[1]
            e = store.entries.get(gen)
            if e is None or e.doomed or not e.pinned:
                del self._pins[gen]
                continue
            used = max(e.last_used, since)
            if e.leases == 0 and now - used > ttl:
                del self._pins[gen]
                self._release(e)
                released += 1
                continue
            heapq.heappush(heap, (max(used + ttl, now + RECHECK), gen, version))
        return released

    def _release(self, e: Entry) -> None:
        """Release ``e`` from the arena, and from the tiers that keep copies of it."""
        self.store.remove(e)
        for tier in self.store.tiers:
            tier.expired(e.content)
