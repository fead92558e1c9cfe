"""Which prefill of a CPU budget gets the cores first: the one with the least left to do.

Runs inside each worker, under its :class:`~shmkv.llama.cpu.budget.CpuBudget` (one queue slot per
llama context). Decode steps do not queue here: they take a free core as they come,
unless a long prefill batch is gathering the cores (:meth:`Queue.gather`).

Why: when several workers prefill at once on a budget of a few cores, sharing the cores
between them makes every one of them as late as the last (four 1,000-token prompts on two
cores all answer after about four prefill times). Giving the cores to the prefill with the
fewest tokens left, one at a time, answers the first after one prefill time, the second
after two, and so on, and lets a short suffix (an arena hit evaluating its question) pass
a long cold prompt at its next batch: the mean time to first token falls, the total work
is the same. A prefill that has waited long moves up (``AGING_TOKENS_PER_SECOND``), so a
stream of short ones cannot starve a long one; the budget's ``--cpu-wait`` still bounds
every wait.

How: a board of :data:`SLOTS` records in the budget file, past the cores' lock bytes.
Each handle owns one record for its life by holding an open-file-description write lock
on the record's lock byte; the kernel drops a dead process's locks, so a record whose
lock nobody holds is ignored whatever it says. A record is what the handle's current
prefill still has to evaluate (tokens), how many cores its next batch wants, since when
it has been in line (``CLOCK_MONOTONIC``, one clock for all processes), and whether it
waits or runs. A decode step that finds no free core posts itself too (one token left: it
goes first), so that a prefill's next batch leaves it a core. A long prefill batch first
in line whose missing cores are held by runs about to end gathers them (``GATHERING``: it
holds none yet, and decode steps stay out of its way as ``DEFERRED``, behind it), so that
it runs on every core. A prefill posts itself as
waiting *before* it gives back the cores of one batch, so that a longer prefill woken by
the release sees it and lets it take the cores for its next batch.

What a record can do: a stale, torn or forged one (only our uid can open the file,
``cpubudget._check_file``) can make a waiter defer when it need not, for at most a poll
interval and never past ``--cpu-wait``, or stop waiting when it need not (one call then
runs one thread past the budget); it cannot take or hold a core, which are only ever the
core bytes' locks.

Holders that make no progress: a stopped process (SIGSTOP, a debugger, a paused
container) keeps its locks, and so its cores, but uses no CPU. Each record names its
holder (pid, and its pid namespace); one that runs (a prefill batch or a decode step)
carries when it began (its stamp) and how long its holder expects it to take (from its
own last batches). A run whose holder is stopped (``T``/``t`` in ``/proc/PID/stat``, its CPU
time unmoved for :data:`STOPPED_SECONDS` while a waiter watched) is stalled at any age:
stopped is read, not guessed from time, and the holder's estimate can be far off (one
made from a short prompt's batches on a loaded machine can exceed ``--cpu-wait``). Any
other run is stalled only once it is older than :func:`stall_bound` of what its holder
expected and its CPU time has not moved for :data:`PROGRESS_SECONDS` while a waiter
watched (a paused container's tasks do not show ``T``): age alone does not do, since on
a loaded machine a live holder's batch can take many times what it expected (its
threads wait for a core), and a waiter that took it for stalled ran past the budget
beside it. A holder this process cannot look at (in another pid namespace) is judged by
age alone. Waiters count a stalled holder's cores as free for admission
(:meth:`Queue.stalled`); the locks still decide who holds a core, and the kernel still
frees a dead holder's. A prefill in line whose holder is stopped is ahead of nobody
(:meth:`Queue.ahead`): it would age ahead of every other prefill and keep them from
cores it cannot use; it has its place back once it runs again.
"""

from __future__ import annotations

import fcntl
import math
import os
import struct
import time

from shmkv.core.procfs import stat_fields
from shmkv.llama.cpu.ofd import is_held, lock

#: records in the board: the most contexts that queue by priority at once (more: they
#: take cores in arrival order, as without a queue)
SLOTS = 64
#: file offset of the records (the cores' lock bytes are 0..cores-1)
BOARD_OFFSET = 1 << 20
#: lock byte of record i: LOCK_BASE + i (past the cpubudget's users byte)
LOCK_BASE = (1 << 40) + 4096
#: a waiting prefill's priority improves by this many tokens per second in line
AGING_TOKENS_PER_SECOND = 256.0
#: a running record is stalled once older than this many times what its holder expected
STALL_FACTOR = 4.0
#: ... and at least this many seconds old
STALL_MIN_SECONDS = 1.0
#: a running record whose holder expected nothing yet (its first batch) is stalled after
STALL_UNKNOWN_SECONDS = 5.0
#: ... and only once its holder's CPU time has not moved for this long (a live holder on a
#: loaded machine gets some CPU within it; a stopped or frozen one none)
PROGRESS_SECONDS = 1.0
#: a run whose holder is stopped (``T``/``t``) with its CPU time unmoved for this long is
#: stalled whatever its age (a SIGSTOP lasts until a SIGCONT; a sampling profiler's
#: ptrace stops last milliseconds, and the holder runs between them)
STOPPED_SECONDS = 0.1
#: a long prefill batch first in line waits for every core it wants (``gather``) when the
#: runs holding the others are expected to end within this many seconds
GATHER_WITHIN = 0.2
#: a gather whose record was not renewed for this long (a stopped gatherer) holds nobody
GATHER_STALE = 0.25

IDLE, WAITING, RUNNING, GATHERING, DEFERRED = 0, 1, 2, 3, 4
#: states of a prefill in line (a gathering one is in line too)
IN_LINE = (WAITING, GATHERING)
#: since (monotonic seconds), tokens left, cores wanted (running: held), state,
#: stamp (monotonic seconds the run began), expected seconds of the run (0: unknown),
#: the holder's pid and its pid namespace's inode (0: unknown)
REC = struct.Struct("=dqiiddiQ")


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def holder_state(pid: int) -> tuple[str, int] | None:
    """(state letter, user + system CPU time in clock ticks) of process ``pid`` from
    ``/proc/PID/stat``; None if it cannot be read."""
    fields = stat_fields(pid)
    try:
        return (
            None
            if fields is None
            else (fields[0].decode("ascii", "replace"), int(fields[11]) + int(fields[12]))
        )
    except (IndexError, ValueError):
        return None


#: ``/proc/PID/stat`` states of a stopped process (by a signal, by a debugger)
STOPPED = ("T", "t")


def stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped now (False if it cannot be read)."""
    got = holder_state(pid)
    return got is not None and got[0] in STOPPED


def stall_bound(expect: float) -> float:
    """Seconds after which a run its holder expected to take ``expect`` s (0: unknown) is
    stalled."""
    if not (math.isfinite(expect) and expect > 0):
        return STALL_UNKNOWN_SECONDS
    return max(STALL_MIN_SECONDS, STALL_FACTOR * expect)


class Queue:
    """One handle's record on the board of the budget file ``fd``."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.slot: int | None = None
        self.since = 0.0
        self.remaining = 0
        self.pid, self.pidns = os.getpid(), _pid_namespace()
        #: (slot, stamp) of runs past their bound -> (holder's CPU ticks, when first seen)
        self._watched: dict[tuple[int, float], tuple[int, float]] = {}
        for i in range(SLOTS):
            if lock(fd, fcntl.F_WRLCK, LOCK_BASE + i):
                self.slot = i
                self._write(IDLE, 0, 0)
                break

    def _write(
        self, state: int, remaining: int, want: int, stamp: float = 0.0, expect: float = 0.0
    ) -> None:
        if self.slot is not None:
            rec = REC.pack(self.since, remaining, want, state, stamp, expect, self.pid, self.pidns)
            os.pwrite(self.fd, rec, BOARD_OFFSET + self.slot * REC.size)

    def _key(self, remaining: int, since: float, now: float) -> float:
        return remaining - AGING_TOKENS_PER_SECOND * (now - since)

    def wait(self, remaining: int, want: int, after_batch: bool = False) -> None:
        """In line for a batch, with ``remaining`` tokens left to evaluate; ``after_batch``:
        its last batch has just ended. A prefill ages by the time it waits, not by the time
        its batches ran: a long prompt running batch after batch must not age ahead of a
        short one that just got in line (a cold prompt's last tokens, evaluated apart
        after a checkpoint, waited for the next cold prompt's whole prefill)."""
        if self.remaining == 0 or after_batch:
            self.since = time.monotonic()
        self.remaining = remaining
        self._write(WAITING, remaining, want)

    def run(self, cores: int, expect: float = 0.0) -> None:
        """Running on ``cores`` cores (0: none, past the budget), expecting to take
        ``expect`` seconds (0: unknown), from now."""
        self._write(RUNNING, self.remaining, cores, time.monotonic(), expect)

    def gather(self, want: int) -> None:
        """First in line and waiting for all ``want`` cores at once (a long prefill batch):
        decode steps take no core meanwhile (:meth:`gathering`) and the runs holding cores
        end, so that the batch runs on every core instead of on the one a decode step
        happened not to hold when it began. Renewed at each look at the board."""
        self._write(GATHERING, self.remaining, want, time.monotonic())

    def defer(self) -> None:
        """A decode step waiting behind a gathering prefill: it is not ahead of it in line
        (a decode step in line goes first, :meth:`wait`), so that the prefill gets every
        core before the next round of decode steps."""
        self._write(DEFERRED, 1, 1)

    def done(self) -> None:
        self.remaining = 0
        self._write(IDLE, 0, 0)

    def _others(self) -> list[tuple[int, float, int, int, int, float, float, int, int]]:
        """Every other record on the board: (slot, since, remaining, want, state, stamp,
        expect, pid, pidns); none when we have no record (the board is full: we queue by
        arrival, as without a board)."""
        if self.slot is None:
            return []
        try:
            raw = os.pread(self.fd, SLOTS * REC.size, BOARD_OFFSET)
        except OSError:
            return []
        if len(raw) < SLOTS * REC.size:  # (a new file: the board was never written)
            raw = raw.ljust(SLOTS * REC.size, b"\0")
        return [(j, *rec) for j, rec in enumerate(REC.iter_unpack(raw)) if j != self.slot]

    def ahead(self) -> tuple[int, int]:
        """(cores wanted by live waiting prefills ahead of ours, waiting prefills in all).
        One whose holder is stopped is not ahead: at worst (a holder stopped for an
        instant) a prefill behind it takes its turn, never a core past the budget."""
        now = time.monotonic()
        mine = (self._key(self.remaining, self.since, now), self.since, self.slot)
        wanted = waiting = 0
        for j, since, remaining, want, state, _, _, pid, pidns in self._others():
            if state not in IN_LINE or want <= 0:
                continue
            waiting += 1
            theirs = (self._key(remaining, since, now), since, j)
            if theirs < mine and is_held(self.fd, LOCK_BASE + j):
                if self._looked_at(pid, pidns) and stopped(pid):
                    continue
                wanted += min(int(want), 1 << 16)
        return wanted, waiting

    def waiting(self) -> int:
        """Live-or-not records other than ours that wait for cores (how many to wake)."""
        return sum(1 for rec in self._others() if rec[4] in (*IN_LINE, DEFERRED))

    def ending(self, within: float) -> int:
        """Cores held by live runs that their holders expect to end within ``within``
        seconds from now; a run that is already late by more than that (a stopped holder,
        a loaded machine) is not counted, nor a batch whose length is unknown (a decode
        step of unknown length is taken to be short)."""
        now, cores = time.monotonic(), 0
        for j, _, remaining, want, state, stamp, expect, *_ in self._others():
            if state != RUNNING or want <= 0 or not math.isfinite(expect):
                continue
            if expect <= 0 and remaining > 1:
                continue
            if abs(stamp + expect - now) < within and is_held(self.fd, LOCK_BASE + j):
                cores += min(int(want), 1 << 16)
        return cores

    def gathering(self) -> bool:
        """Whether a live prefill gathers cores (:meth:`gather`) now, its record renewed
        within :data:`GATHER_STALE`: a decode step then takes none."""
        now = time.monotonic()
        for j, _, _, _, state, stamp, *_ in self._others():
            if state == GATHERING and 0 <= now - stamp < GATHER_STALE:
                if is_held(self.fd, LOCK_BASE + j):
                    return True
        return False

    def stalled(self) -> int:
        """Cores held by live running records whose holders make no progress
        (:meth:`_progressing`): a stopped process keeps its locks."""
        now = time.monotonic()
        cores = 0
        watched: dict[tuple[int, float], tuple[int, float]] = {}
        for j, _, _, want, state, stamp, expect, pid, pidns in self._others():
            if state != RUNNING or want <= 0 or not math.isfinite(stamp):
                continue
            late = now - stamp > stall_bound(expect)
            if is_held(self.fd, LOCK_BASE + j):
                if self._progressing((j, stamp), pid, pidns, late, now, watched):
                    continue
                cores += min(int(want), 1 << 16)
        self._watched = watched
        return cores

    def _looked_at(self, pid: int, pidns: int) -> bool:
        """Whether this process can look at the holder ``pid`` (in its pid namespace)."""
        return pid > 0 and pidns != 0 and pidns == self.pidns

    def _progressing(
        self,
        run: tuple[int, float],
        pid: int,
        pidns: int,
        late: bool,
        now: float,
        watched: dict[tuple[int, float], tuple[int, float]],
    ) -> bool:
        """Whether the holder of ``run`` (slot, stamp) still makes progress: not once it
        has been stopped with its CPU time unmoved for :data:`STOPPED_SECONDS` of this
        handle's watch (at once if the run is ``late``, past its bound), nor, late, once
        its CPU time has not moved for :data:`PROGRESS_SECONDS`. A holder this process
        cannot look at is judged by age alone (``late``)."""
        if not self._looked_at(pid, pidns):
            return not late
        got = holder_state(pid)
        if got is None:
            return not late
        state, ticks = got
        seen = self._watched.get(run)
        if seen is None or seen[0] != ticks:
            seen = (ticks, now)
        watched[run] = seen
        quiet = now - seen[1]
        if state in STOPPED:
            return not late and quiet < STOPPED_SECONDS
        return not late or quiet < PROGRESS_SECONDS
