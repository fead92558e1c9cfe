"""One CPU budget shared by every worker of a deployment: who evaluates on how many cores.

Runs inside each worker (one :class:`CpuBudget` handle per llama context), and in the
gunicorn master, which removes the budget's files when it exits (:func:`remove`).

The budget is ``--cpu-budget`` cores, each one a byte of one file,
``--dir``/``shmkv-cpu@NAME``, held with an open-file-description lock
(``F_OFD_SETLK``, Linux). A worker about to evaluate a batch of prompt tokens waits
(at most ``--cpu-wait``) for one free core, takes every other free one without waiting
(up to ``--threads``, 0: all) and runs that batch on as many threads; a decode step
takes one core and one thread. The cores go back after each batch, so a decode step
of another worker gets in between the batches of a long prefill, and a prefill picks
up the cores others gave back at its next batch. When prefills wait for cores, the one
with the fewest tokens left goes first, a long wait moving a prefill up (``queue.py``):
prefills run one after another on all the cores instead of sharing them, and a short
suffix passes a long cold prompt. A long batch (``GATHER_MIN_TOKENS`` or more, a cold
prompt's) takes all the cores it wants or waits for them when the runs holding them
end soon (``Queue.gather``): on a deployment whose other workers are streaming, some
decode step nearly always holds a core when a batch begins, and the batch would run
its n_batch tokens, most of a second, on the cores left; decode steps take no core
while a batch gathers and get theirs between its batches (one step each per batch, as
in llama-server, whose decode tokens ride in the same batch). A wait ends early when the
cores' holders make no progress (a stopped process keeps its locks:
``cpuqueue.Queue.stalled``); a request whose
eval stopped waiting once runs the rest of its evals without waiting (:class:`Request`),
so a stuck holder costs each request one short wait, not one per token.

Why locks and not a counting semaphore: a semaphore has no owner, so the cores of a
worker killed while it evaluated would be lost until someone guessed how many it held.
The kernel drops a dead process's locks itself, whatever killed it, so a crash never
leaks a core. A POSIX semaphore (``/shmkv-cpu@NAME``) only rings a bell when cores are
given back, so that waiters wake at once instead of polling; a ring that is lost or
false costs a waiter at most one poll interval, never a wrong count.

Who can touch it: the file is created 0600 (``O_NOFOLLOW``) and used only if it is a
plain, single-link file of our uid (or root) that no one else may open; the semaphore
likewise. Another user can therefore neither take our cores nor ring our bell; a file
squatted under the name makes the workers fall back to the static split, with a
warning naming the file. Each handle also holds a read lock on a byte far past the
cores: :func:`remove` unlinks the file only when it can take that byte exclusively (no
worker of any deployment on this name has the file open), and a handle that opened a
file being unlinked notices and opens the new one.

Threads never change results here: llama.cpp splits a batch's work between threads by
output rows, so a prompt's logits are the same bit for bit on 1 or 4 threads
(tests/llama/cpu/test_cpubudget.py checks, flash attention on and off). A single-token step with
flash attention is not (its KV reduction is split between threads: logits differ by up
to ~1 on Gemma 3 270M), which is why any single-token micro-batch, a decode step or the
last token of a prompt, runs on exactly one thread (``n_threads`` = 1 always).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import math
import os
import stat
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import posix_ipc

from shmkv.core.errors import ConfigError, UnsafePathError
from shmkv.llama import offload
from shmkv.llama.cpu.ofd import OFD_AVAILABLE as _OFD
from shmkv.llama.cpu.ofd import is_held as _is_held
from shmkv.llama.cpu.ofd import lock as _lock
from shmkv.llama.cpu.queue import GATHER_WITHIN, Queue

log = logging.getLogger(__name__)

#: byte offset of the "users" byte: every open handle read-locks it (cores are bytes 0..N-1)
USERS_BYTE = 1 << 40
#: a waiter retries this often even without a bell (a core freed by a killed worker rings none)
POLL_SECONDS = 0.05
#: without a usable bell, waiters poll this often
POLL_NO_BELL_SECONDS = 0.005
#: a prefill batch of at least this many tokens runs on all the cores it wants or waits
#: for them, if they come free soon (``Queue.gather``); a shorter one (an arena hit's
#: suffix) runs at once on the cores free
GATHER_MIN_TOKENS = 128


def budget_path(directory: str, name: str) -> Path:
    """The budget file of arena ``name``. ``@`` is never in an arena name, so no arena or
    lock file can have this name."""
    return Path(directory) / f"shmkv-cpu@{name}"


def bell_name(name: str) -> str:
    return f"/shmkv-cpu@{name}"


def default_cores() -> int:
    """The CPUs this process may run on, capped by its cgroup's CPU quota."""
    cores = len(os.sched_getaffinity(0))
    quota = cgroup_quota()
    return max(1, min(cores, math.ceil(quota)) if quota else cores)


def cgroup_quota(
    proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")
) -> float | None:
    """The tightest CPU quota (in CPUs) of our cgroup and its ancestors (None: none).

    cgroup v2: ``cpu.max`` in the unified tree (``root``, or ``root/unified`` on a hybrid
    host); cgroup v1: ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` in the ``cpu``
    controller's tree (``root/cpu``, or ``root/cpu,cpuacct``). ``/proc/self/cgroup`` has
    one line per hierarchy, the unified one (``0::``) not necessarily first."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    found: list[float] = []
    for line in lines:
        _id, sep, rest = line.partition(":")
        controllers, sep2, path = rest.partition(":")
        if not (sep and sep2):
            continue
        rel = path.lstrip("/")
        if not controllers:
            for base in (root, root / "unified"):
                found += _walk_up(base, rel, _v2_quota)
        elif "cpu" in controllers.split(","):
            for base in dict.fromkeys((root / controllers, root / "cpu")):
                found += _walk_up(base, rel, _v1_quota)
    return min(found, default=None)


def _walk_up(base: Path, rel: str, read: Callable[[Path], float | None]) -> list[float]:
    """The quotas ``read`` finds in ``base/rel`` and each directory above it up to
    ``base`` (in a container, ``rel`` may name a path of the host's tree: those that do
    not exist here are skipped)."""
    if not base.is_dir():
        return []
    d, out = base / rel, []
    while True:
        q = read(d)
        if q is not None:
            out.append(q)
        if d == base or base not in d.parents:
            return out
        d = d.parent


def _v2_quota(d: Path) -> float | None:
    try:
        quota, period = (d / "cpu.max").read_text().split()
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _v1_quota(d: Path) -> float | None:
    try:
        quota = int((d / "cpu.cfs_quota_us").read_text())
        period = int((d / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def _check_file(path: Path, st: os.stat_result) -> None:
    """UnsafePathError unless ``st`` is a plain single-link file of ours (or root's) that
    nobody else may open: another user who could lock its bytes could take our cores."""
    problem = None
    if not stat.S_ISREG(st.st_mode):
        problem = "not a regular file"
    elif st.st_uid not in (os.geteuid(), 0):
        problem = f"owned by uid {st.st_uid}, not by us (uid {os.geteuid()})"
    elif st.st_nlink != 1:
        problem = f"a file with {st.st_nlink} hard links"
    elif st.st_mode & 0o077:
        problem = f"open to others (mode {stat.S_IMODE(st.st_mode):04o})"
    if problem:
        raise UnsafePathError(
            f"CPU budget file {path} is {problem}: shmkv will not share cores through it "
            f"(the workers use the static split). Remove it (`sudo rm {path}`), or pick "
            f"another --name/SHMKV_NAME or --dir/SHMKV_DIR"
        )


def _open_file(path: Path) -> int:
    """Open (or create, 0600) the budget file and read-lock its users byte; the file the
    path names at that moment (one being removed is left for the new one)."""
    for _ in range(100):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise UnsafePathError(
                    f"CPU budget file {path} is a symbolic link: remove it (`sudo rm {path}`)"
                ) from None
            raise ConfigError(f"cannot open the CPU budget file {path}: {e.strerror}") from None
        try:
            st = os.fstat(fd)
            _check_file(path, st)
            _lock(fd, fcntl.F_RDLCK, USERS_BYTE, wait=True)  # (a remover holds it briefly)
            try:
                now = os.lstat(path)
            except FileNotFoundError:
                now = None
            if now is not None and (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # removed while we opened it: open the new one
    raise ConfigError(f"the CPU budget file {path} keeps being replaced")


def _open_bell(name: str) -> posix_ipc.Semaphore | None:
    """The wake-up bell, or None (waiters then poll) if it is not safely ours."""
    try:
        bell = posix_ipc.Semaphore(name, posix_ipc.O_CREAT, mode=0o600, initial_value=0)
    except (posix_ipc.Error, OSError, ValueError) as e:
        log.warning("CPU budget bell %s unusable (%s): waiters poll instead", name, e)
        return None
    try:  # (glibc keeps named semaphores as /dev/shm/sem.NAME)
        st = os.stat(f"/dev/shm/sem.{name[1:]}", follow_symlinks=False)
        _check_file(Path(f"/dev/shm/sem.{name[1:]}"), st)
    except FileNotFoundError:
        pass
    except UnsafePathError as e:
        bell.close()
        log.warning("%s: waiters poll instead", e)
        return None
    return bell


class Grant:
    """Cores one eval holds; ``threads`` is how many threads it runs on. ``timed_out``:
    it stopped waiting without a core (``stalled``: because the holders of the cores made
    no progress; else ``--cpu-wait`` ran out) and runs on one thread past the budget."""

    __slots__ = ("slots", "threads", "waited", "timed_out", "stalled", "tokens", "started")

    def __init__(self, tokens: int = 1) -> None:
        self.slots: list[int] = []
        self.threads = 1
        self.waited = 0.0
        self.timed_out = False
        self.stalled = False
        self.tokens = tokens
        self.started = 0.0


class Request:
    """What one request (a ``generate`` call) has learned of the budget. Once one of its
    evals stopped waiting (``bypass``: the cores were held by a holder making no progress,
    or none came free within ``--cpu-wait``), its later evals take only cores free at
    once and otherwise run on one thread: a stuck holder costs a request one wait, not one
    per token."""

    __slots__ = ("bypass", "after")

    def __init__(self) -> None:
        self.bypass = False
        #: tokens the call evaluates after its current eval, apart (past a checkpoint): the
        #: eval's last batch keeps its place in line for them instead of leaving it
        self.after = 0


class CpuBudget:
    """A handle on the deployment's CPU budget; one per llama context (its locks are its own)."""

    def __init__(
        self, directory: str, name: str, cores: int, wait: float = 30.0, max_threads: int = 0
    ) -> None:
        if not _OFD:
            raise ConfigError("the CPU budget needs Linux open-file-description locks")
        if cores < 1:
            raise ConfigError(f"--cpu-budget must be at least 1, got {cores}")
        self.path = budget_path(directory, name)
        self.cores = cores
        self.wait = wait
        #: the most threads one batch takes (0: the whole budget)
        self.max_threads = max_threads
        self._bell_name = bell_name(name)
        self._pid = -1
        self._fd = -1
        self._bell: posix_ipc.Semaphore | None = None
        self._next = 0  # where the next search for a free core starts
        #: seconds per token per thread of this handle's last batch (False) and last
        #: single-token step (True): what its next run expects to take (0: unknown)
        self._rate = {False: 0.0, True: 0.0}
        self._request_key: object = None
        self._request = Request()
        self._open()

    def _open(self) -> None:
        self._fd = _open_file(self.path)
        self._bell = _open_bell(self._bell_name)
        self._pid = os.getpid()
        self._next = self._pid % self.cores
        self._queue = Queue(self._fd)

    def _ensure(self) -> None:
        """After a fork, the child must not share the parent's locks: open its own."""
        if self._pid != os.getpid():
            self._fd = -1  # (the parent's descriptor: not ours to close)
            self._open()

    # ------------------------------------------------------------------ taking cores
    def _grab(self, want: int, into: list[int]) -> None:
        """Take up to ``want`` free cores without waiting."""
        for i in range(self.cores):
            if len(into) >= want:
                break
            slot = (self._next + i) % self.cores
            if _lock(self._fd, fcntl.F_WRLCK, slot):
                into.append(slot)
        self._next = (self._next + 1) % self.cores

    def _free(self) -> int:
        return sum(not _is_held(self._fd, s) for s in range(self.cores))

    def _yield_to_those_ahead(self, slots: list[int], ahead: int) -> None:
        """After a grab: the board was read before it, and a prefill between two batches
        posts itself in line just before it gives its cores back, so it may have got
        ahead of us while we grabbed them. Keep only what the prefills now ahead leave
        (the rule ``take`` applies before a grab) and give the rest back."""
        again, _ = self._queue.ahead()
        if again <= ahead:
            return
        # (``_free`` counts our own cores as free: a lock never conflicts with its owner)
        keep = max(0, min(len(slots), self._free() - again))
        self._release(slots[keep:])
        del slots[keep:]

    def _release(self, slots: list[int]) -> None:
        """Unlock ``slots`` and wake the waiters: every waiting prefill looks at the board
        again (the one the cores are for may not be the one a single ring would wake), and
        one decode step per core."""
        for slot in slots:
            _lock(self._fd, fcntl.F_UNLCK, slot)
        bell = self._bell
        if bell is None or not slots:
            return
        rings = len(slots) + self._queue.waiting()
        for _ in range(rings):
            try:
                if bell.value >= rings:  # nobody waits: do not pile up rings
                    break
                bell.release()
            except posix_ipc.Error:
                break

    def request(self, key: object) -> Request:
        """The :class:`Request` of the call ``key`` stands for (the same object for the
        same call; a new one when ``key`` is another object)."""
        if key is not self._request_key:
            self._request_key, self._request = key, Request()
        return self._request

    def _expect(self, tokens: int, threads: int) -> float:
        """Seconds a run of ``tokens`` tokens on ``threads`` threads should take, from this
        handle's last run of the kind (0: none yet)."""
        return self._rate[tokens <= 1] * tokens / max(1, threads)

    def take(
        self, want: int, remaining: int = 1, tokens: int = 0, request: Request | None = None
    ) -> Grant:
        """Wait (at most ``wait`` seconds) for one core, then take up to ``want`` in all
        of those free. A wait ends early when the cores are held by holders that make no
        progress (``cpuqueue.Queue.stalled``). After a wait that ended without a core the
        eval runs on one thread without one (``timed_out``): a stuck holder must not stop
        the worker, and the ``request``'s later evals do not wait again (``Request``).

        ``remaining``: tokens the eval still has to evaluate, this batch included. A batch
        of a prefill (``remaining`` > 1) lets the cores go first to waiting prefills with
        less left to do (``queue.py``); a decode step takes a free core as it comes,
        and goes first in line if there is none. A batch of ``GATHER_MIN_TOKENS`` or
        more first in line takes all ``want`` cores at once, waiting for those whose
        runs are about to end (``Queue.gather``; decode steps defer to it meanwhile), and
        lets those ahead of it in line take theirs first (for at most ``GATHER_WITHIN``)
        instead of starting on the cores they leave. ``tokens``: tokens in this batch (0:
        as many as ``remaining``), from which the holder's record says how long it
        expects to run."""
        self._ensure()
        g = Grant(tokens or max(1, remaining))
        want = max(1, min(want, self.cores))
        queue = self._queue
        prefill = remaining > 1
        bypass = request is not None and request.bypass
        if prefill:
            queue.wait(remaining, want)
        t0 = time.monotonic()
        deadline = t0 + self.wait
        slept = posted = gathering = False
        behind = 0.0  # (since when a long batch has let those ahead in line take their cores)
        gather = prefill and not bypass and want > 1 and g.tokens >= GATHER_MIN_TOKENS
        while True:
            allowed, ahead = want, 0
            if prefill:
                ahead, _ = queue.ahead()
                wait_all = False
                if ahead:  # (a long batch lets them take theirs, for a while, then gathers)
                    behind = behind or time.monotonic()
                    allowed = min(want, self._free() - ahead)
                    if gather and time.monotonic() - behind < GATHER_WITHIN:
                        allowed = 0
                elif gather:  # every core, or none while the rest come free soon
                    behind, free = 0.0, self._free()
                    wait_all = free < want <= free + queue.ending(GATHER_WITHIN)
                    allowed = 0 if wait_all else want
                if wait_all:
                    queue.gather(want)
                elif gathering:  # (no longer first in line, or the rest come late)
                    queue.wait(remaining, want)
                gathering = wait_all
            deferring = not prefill and queue.gathering()
            if deferring:  # (behind a long prefill batch, not ahead of it)
                allowed, posted = 0, False
                queue.defer()
            if allowed > 0:
                self._grab(allowed, g.slots)
                if g.slots and prefill and not bypass:
                    self._yield_to_those_ahead(g.slots, ahead)
                if g.slots:
                    break
            if bypass:  # (this request stopped waiting once already)
                break
            if queue.stalled() > ahead:  # (the cores' holders make no progress)
                g.timed_out = g.stalled = True
                break
            left = deadline - time.monotonic()
            if left <= 0:
                g.timed_out = True
                break
            if not (prefill or posted or deferring):  # first in line: a prefill's next batch waits
                queue.wait(1, 1)
                posted = True
            self._sleep(left)
            slept = True
        g.started = time.monotonic()
        g.waited = g.started - t0 if slept else 0.0
        g.threads = max(1, len(g.slots))
        if g.timed_out and request is not None:
            request.bypass = True
        queue.run(len(g.slots), self._expect(g.tokens, g.threads))
        return g

    def _sleep(self, left: float) -> None:
        if self._bell is None:
            time.sleep(min(left, POLL_NO_BELL_SECONDS))
            return
        try:
            self._bell.acquire(min(left, POLL_SECONDS))
        except posix_ipc.BusyError:
            pass

    def give_back(self, g: Grant, next_remaining: int = 0, next_want: int = 1) -> None:
        """Release a grant's cores and wake the waiters. ``next_remaining``: tokens the
        same prefill evaluates next (0: it is done), so that it is in line, at its place,
        before its cores are free."""
        queue = self._queue
        if g.started:  # what this handle's next run of the kind expects
            took = time.monotonic() - g.started
            self._rate[g.tokens <= 1] = took * g.threads / max(1, g.tokens)
            g.started = 0.0
        if next_remaining > 1:
            queue.wait(next_remaining, max(1, min(next_want, self.cores)), after_batch=True)
        else:
            queue.done()
        self._release(g.slots)
        g.slots = []

    # ------------------------------------------------------------------ observing
    def leave_line(self) -> None:
        """Out of line: a call that said more tokens would follow (``Request.after``) and
        evaluates none after all."""
        self._ensure()
        self._queue.done()

    def held(self) -> int:
        """Cores held by other handles right now (a snapshot, for tests and health)."""
        self._ensure()
        return sum(_is_held(self._fd, s) for s in range(self.cores))

    def close(self) -> None:
        if self._fd >= 0 and self._pid == os.getpid():
            os.close(self._fd)  # (drops every lock of this handle)
        self._fd = -1
        if self._bell is not None:
            self._bell.close()
            self._bell = None

    def __enter__(self) -> CpuBudget:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def held_cores(directory: str, name: str, cores: int) -> int:
    """Cores of arena ``name``'s budget held right now, seen from outside."""
    fd = os.open(budget_path(directory, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        return sum(_is_held(fd, s) for s in range(cores))
    finally:
        os.close(fd)


def remove(directory: str, name: str) -> bool:
    """Remove the budget's file and bell if no handle has the file open (e.g. when the
    gunicorn master exits: another deployment on the same name may still use it)."""
    path = budget_path(directory, name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or not _lock(fd, fcntl.F_WRLCK, USERS_BYTE):
            return False
        now = os.lstat(path)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            return False
        path.unlink()
        try:
            posix_ipc.unlink_semaphore(bell_name(name))
        except posix_ipc.Error:
            pass
        return True
    except OSError as e:
        log.warning("could not remove the CPU budget file %s: %s", path, e)
        return False
    finally:
        os.close(fd)


# ---------------------------------------------------------------------- evaluating
def set_threads(llm: Any, n: int) -> None:
    """Run the context's next batches on ``n`` threads, and any single-token step on one.

    llama.cpp picks per micro-batch: ``n_threads_batch`` for several tokens, ``n_threads``
    for one. A single-token step always gets one thread, whichever eval it is part of
    (the last token of a prompt split into batches, too): with flash attention its
    result depends on the thread count, a batch's does not.
    """
    import llama_cpp

    from shmkv.llama import compat

    if compat.threads_of(llm) != n:
        llama_cpp.llama_set_n_threads(llm.ctx, 1, n)
        compat.remember_threads(llm, n)


def evaluate(
    budget: CpuBudget,
    llm: Any,
    orig_eval: Callable[[Sequence[int]], None],
    tokens: Sequence[int],
    on_grant: Callable[[Grant, int], None] | None = None,
    request: Request | None = None,
) -> None:
    """``orig_eval(tokens)`` on cores of the budget, batch by batch (``n_batch`` tokens, the
    batches ``Llama.eval`` makes itself), each on the cores free at its start, up to the
    budget's ``max_threads``; a single token (a decode step) on one core. ``request``:
    the call the eval is part of (see :class:`Request`)."""
    step = max(1, int(llm.n_batch))
    pieces = [tokens[i : i + step] for i in range(0, max(1, len(tokens)), step)]
    left = len(tokens)

    def wants(n_tokens: int) -> int:
        return 1 if n_tokens <= 1 else budget.max_threads or budget.cores

    after = request.after if request is not None else 0
    for k, piece in enumerate(pieces):
        g = budget.take(wants(len(piece)), left + after, tokens=len(piece), request=request)
        left -= len(piece)
        # (then in line for the next batch, or for the tokens after this eval, if any)
        following = len(pieces[k + 1]) if k + 1 < len(pieces) else after
        try:
            set_threads(llm, g.threads)
            if on_grant is not None:
                on_grant(g, len(piece))
            orig_eval(piece)
        except BaseException:
            budget.give_back(g)
            raise
        budget.give_back(g, left + after, wants(following))


def run_eval(cache: Any, orig_eval: Callable[[Sequence[int]], None], tokens: Sequence[int]) -> None:
    """A ``SharedPrefixCache``'s eval on its budget (``cache.cpu``), counted in its ledger."""

    def count(g: Grant, n_tokens: int) -> None:
        if g.waited:
            cache.ledger.add(cpu_waits=1, cpu_wait_seconds=g.waited)
            cache.last.cpu_wait_seconds += g.waited
        if g.timed_out:  # (once per call: its later evals do not wait)
            cache.ledger.add(cpu_wait_timeouts=1)
            if g.stalled:
                log.warning(
                    "the cores of the CPU budget (%s) are held by a worker that makes no "
                    "progress (stopped?): this call evaluates on its own thread, past the "
                    "budget (counted as cpu_wait_timeouts)",
                    cache.cpu.path,
                )
            else:
                log.warning(
                    "no core of the CPU budget (%s) came free in %s s: this call evaluates "
                    "on its own thread anyway (counted as cpu_wait_timeouts; raise "
                    "--cpu-wait if this is normal load)",
                    cache.cpu.path,
                    cache.cpu.wait,
                )
        if n_tokens > 1:
            cache.last.prefill_threads = max(cache.last.prefill_threads, g.threads)

    budget = cache.cpu
    request = budget.request(cache.last)  # (a new CallStats per call)
    evaluate(budget, cache.llm, orig_eval, tokens, on_grant=count, request=request)


def for_settings(settings: Any, llm: Any = None) -> CpuBudget | None:
    """The budget a worker's context (``llm``) uses under ``settings`` (None: the static
    split), with a warning if it cannot be used. The budget governs CPU-evaluated work
    only: a context whose model is fully offloaded to a GPU (``offload.uses_cpu``) takes
    no cores from it, so that its prefills never queue behind CPU prefills for cores
    they would not use; a partly offloaded one still does."""
    if settings.static_threads:
        return None
    if llm is not None and not offload.uses_cpu(llm):
        log.info("model fully offloaded to a GPU: its evals take no cores of the CPU budget")
        return None
    try:
        return CpuBudget(
            settings.dir,
            settings.name,
            settings.cpu_budget or default_cores(),
            wait=settings.cpu_wait,
            max_threads=settings.threads,
        )
    except (ConfigError, UnsafePathError, OSError) as e:
        log.warning("no CPU budget, static thread split: %s", e)
        return None
