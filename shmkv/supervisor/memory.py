"""The supervisor's own memory: glibc's allocator made to give back what the tiers free.

Runs in the supervisor, set up once at its start (:func:`tune`, before any thread) and
looked at once a second from its loop (:meth:`Heap.tick`). The arena is shared pages; what
the supervisor holds of its own is Python objects and the buffers its tiers fill and free
(a payload loaded for the refill, a record fetched from Redis, a write-behind batch: MiBs
each, freed within the second). glibc kept those pages: its mmap threshold grows to the
size of the largest buffer freed (up to 32 MiB), so later buffers of that size come from
a heap, and the tiers' threads each have their own heap, which glibc trims only from its
top. Measured (docs/benchmarks.md, "The supervisor's own memory"): over a 2 x 4-minute soak
with both tiers on, the supervisors' RssAnon grew 38 -> 89 -> 91 and 55 -> 68 -> 68 MiB,
while malloc's own count of the bytes in use stayed ~55 MiB and ~95 MiB of the heaps were
free but held.

Two settings bound it, whatever a tier allocates:

* a fixed mmap threshold (:data:`MMAP_THRESHOLD`): a buffer that large is a mapping of its
  own, unmapped when freed; fixing it also stops glibc from raising it;
* :func:`trim` (``malloc_trim(0)``: every heap's free pages back to the kernel) when the
  heaps hold more than :data:`TRIM_SLACK` free and that changed since the last trim, checked
  once a second; a trim of 33 MiB freed by three threads took 1.5 ms of the loop (the next,
  with nothing new to give back, 0.03 ms).

Elsewhere than glibc (musl, or no ``mallinfo2``) it does nothing, and says so once at
debug level.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time

log = logging.getLogger(__name__)

MiB = 1 << 20
#: allocations of this size or more are mappings of their own, unmapped when freed
MMAP_THRESHOLD = MiB
#: free bytes the heaps may hold before a trim gives them back
TRIM_SLACK = 8 * MiB
#: seconds between looks at the heaps
TRIM_EVERY = 1.0
_M_MMAP_THRESHOLD = -3


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _glibc() -> ctypes.CDLL | None:
    """The C library if it is glibc with ``mallinfo2`` (2.33 or later), else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 (glibc's own symbol: musl has none)
        libc.mallinfo2.restype = _MallInfo2
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
    except (OSError, AttributeError):
        return None
    return libc


class Heap:
    """The supervisor's heaps: tuned once, trimmed when they hold too much free."""

    def __init__(self) -> None:
        self.libc = _glibc()
        self.next_look = 0.0
        #: trims done, bytes they found free, and the time they took
        self.trims = 0
        self.trimmed_bytes = 0
        self.trim_seconds = 0.0
        #: the heaps' free bytes after the last trim (what a trim gave back stays counted
        #: as free: a trim again only once that changed)
        self.after_trim = -1

    def tune(self) -> bool:
        """Fix the mmap threshold (call before the tiers' threads start); False where it
        cannot be done (not glibc)."""
        if self.libc is None:
            log.debug("not glibc: the supervisor's heap is left as the C library keeps it")
            return False
        return bool(self.libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))

    def free_bytes(self) -> int:
        """Bytes the heaps hold free (0 where unknown)."""
        return 0 if self.libc is None else int(self.libc.mallinfo2().fordblks)

    def tick(self, now: float | None = None) -> bool:
        """At most once a :data:`TRIM_EVERY`: trim if the heaps hold over
        :data:`TRIM_SLACK` free, other than what the last trim left. True if it trimmed."""
        now = time.monotonic() if now is None else now
        if self.libc is None or now < self.next_look:
            return False
        self.next_look = now + TRIM_EVERY
        free = self.free_bytes()
        if free <= TRIM_SLACK or abs(free - self.after_trim) < MiB:
            return False
        self.trim(free)
        return True

    def trim(self, free: int | None = None) -> None:
        """Give every heap's free pages back to the kernel now."""
        if self.libc is None:
            return
        free = self.free_bytes() if free is None else free
        t = time.perf_counter()
        self.libc.malloc_trim(0)
        dt = time.perf_counter() - t
        self.trims += 1
        self.trimmed_bytes += free
        self.trim_seconds += dt
        self.after_trim = self.free_bytes()
        log.debug("heaps held %d MiB free: trimmed in %.2f ms", free >> 20, dt * 1e3)
