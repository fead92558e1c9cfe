"""The supervisor's allocator of the arena's data region (supervisor only).

Best-fit over free extents kept in address order, so a released extent merges
with its free neighbours at once. Offsets are plain integers: the allocator
never touches the arena's bytes.
"""

from __future__ import annotations

import bisect


class Allocator:
    """Best-fit allocator over [start, start+size) with address-ordered coalescing."""

    def __init__(self, start: int, size: int) -> None:
        self.start, self.size = start, size
        self._starts: list[int] = [start]
        self._len: dict[int, int] = {start: size}
        self.free_bytes = size

    def alloc(self, n: int) -> int | None:
        best, best_len = None, None
        for off in self._starts:
            ln = self._len[off]
            if ln >= n and (best_len is None or ln < best_len):
                best, best_len = off, ln
                if ln == n:
                    break
        if best is None or best_len is None:
            return None
        i = bisect.bisect_left(self._starts, best)
        del self._starts[i]
        del self._len[best]
        if best_len > n:
            self._starts.insert(i, best + n)
            self._len[best + n] = best_len - n
        self.free_bytes -= n
        return best

    def release(self, off: int, n: int) -> None:
        if not (self.start <= off and off + n <= self.start + self.size) or n <= 0:
            raise ValueError(f"release of [{off}, {off + n}) outside the heap")
        i = bisect.bisect_left(self._starts, off)
        if i < len(self._starts) and self._starts[i] < off + n:
            raise ValueError(f"double free of [{off}, {off + n})")
        if i > 0:
            prev = self._starts[i - 1]
            if prev + self._len[prev] > off:
                raise ValueError(f"double free of [{off}, {off + n})")
        self.free_bytes += n
        # merge with the next extent
        if i < len(self._starts) and self._starts[i] == off + n:
            n += self._len.pop(self._starts[i])
            del self._starts[i]
        # merge with the previous extent
        if i > 0 and self._starts[i - 1] + self._len[self._starts[i - 1]] == off:
            self._len[self._starts[i - 1]] += n
            return
        self._starts.insert(i, off)
        self._len[off] = n

    def largest(self) -> int:
        return max(self._len.values(), default=0)

    def extents(self) -> list[tuple[int, int]]:
        return [(o, self._len[o]) for o in self._starts]
