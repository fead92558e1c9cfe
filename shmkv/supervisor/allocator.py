"""The supervisor's allocator of the arena's data region (supervisor only).

Best-fit over free extents with address-ordered coalescing: a released extent
merges with its free neighbours at once. The free extents are kept twice, in
sorted containers: by address (to find a released extent's neighbours) and by
(size, address) (to find the smallest extent that fits, the lowest address
among equals). ``alloc``, ``release`` and ``largest`` are O(log n) in the
number of free extents, so an eviction loop that asks ``largest`` after every
eviction stays linear in the evictions, however fragmented the region is.
Offsets are plain integers: the allocator never touches the arena's bytes.
"""

from __future__ import annotations

from sortedcontainers import SortedDict, SortedList


class Allocator:
    """Best-fit allocator over [start, start+size) with address-ordered coalescing."""

    def __init__(self, start: int, size: int) -> None:
        self.start, self.size = start, size
        #: offset -> length of every free extent, in address order
        self._by_addr = SortedDict({start: size})
        #: (length, offset) of every free extent: best fit is the first that is long enough
        self._by_size = SortedList([(size, start)])
        self.free_bytes = size

    def _add(self, off: int, n: int) -> None:
        self._by_addr[off] = n
        self._by_size.add((n, off))

    def _drop(self, off: int) -> int:
        n: int = self._by_addr.pop(off)
        self._by_size.remove((n, off))
        return n

    def alloc(self, n: int) -> int | None:
        """The offset of ``n`` free bytes (best fit, lowest address among equals), or None."""
        i = self._by_size.bisect_left((n, -1))
        if i == len(self._by_size):
            return None
        best_len, best = self._by_size[i]
        self._drop(best)
        if best_len > n:
            self._add(best + n, best_len - n)
        self.free_bytes -= n
        return int(best)

    def release(self, off: int, n: int) -> None:
        """Free [off, off+n); ValueError if it is outside the heap or (partly) free already."""
        if not (self.start <= off and off + n <= self.start + self.size) or n <= 0:
            raise ValueError(f"release of [{off}, {off + n}) outside the heap")
        addr = self._by_addr
        i = addr.bisect_left(off)
        nxt = addr.peekitem(i) if i < len(addr) else None
        prv = addr.peekitem(i - 1) if i > 0 else None
        if (nxt is not None and nxt[0] < off + n) or (prv is not None and sum(prv) > off):
            raise ValueError(f"double free of [{off}, {off + n})")
        self.free_bytes += n
        if nxt is not None and nxt[0] == off + n:  # merge with the next extent
            n += self._drop(nxt[0])
        if prv is not None and sum(prv) == off:  # merge with the previous extent
            off, n = prv[0], prv[1] + n
            self._drop(off)
        self._add(off, n)

    def reserve(self, off: int, n: int) -> None:
        """Take exactly [off, off+n) (an adopted record's extent); ValueError unless all free."""
        addr = self._by_addr
        i = addr.bisect_right(off) - 1
        if n <= 0 or i < 0:
            raise ValueError(f"[{off}, {off + n}) is not free")
        start, length = addr.peekitem(i)
        if off + n > start + length:
            raise ValueError(f"[{off}, {off + n}) is not free")
        self._drop(start)
        if off > start:
            self._add(start, off - start)
        if start + length > off + n:
            self._add(off + n, start + length - off - n)
        self.free_bytes -= n

    def largest(self) -> int:
        """Length of the largest free extent (0 if none)."""
        return int(self._by_size[-1][0]) if self._by_size else 0

    def count(self) -> int:
        """How many free extents there are (fragmentation)."""
        return len(self._by_addr)

    def extents(self) -> list[tuple[int, int]]:
        """Every free extent as (offset, length), in address order (O(n): for checks)."""
        return [(int(o), int(n)) for o, n in self._by_addr.items()]
