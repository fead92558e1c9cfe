"""llama-cpp-python integration: restore prompt state from the arena, publish new state.

Runs inside a worker, around its own ``llama_cpp.Llama``. Every completion and
chat completion of llama-cpp-python goes through ``Llama.generate``, so that is
the one hook:

* before prefill, the longest cached prefix of the prompt is found in the
  arena (lock-free), leased, checked (fingerprint, token ids, checksums) and
  restored with ``llama_state_seq_set_data`` straight from the read-only
  mapping; ``input_ids``/``n_tokens`` are set so that llama-cpp-python only
  evaluates the rest;
* at the first generated token the KV cache holds exactly the prompt: its
  state is copied into a memfd (one memcpy) and handed to a background thread
  that passes it to the supervisor; the same happens for prompt + completion
  when the generation ends, so the next turn of a chat continues anywhere.

Keys are chained from a root digest of everything that makes a blob
restorable here (model identity, KV types, flash attention, SWA, RoPE, LoRA,
llama.cpp version) and the caller's namespace. Any failure of the cache (no
supervisor, mismatch, corrupt blob, failed ``set_data``) is logged once,
counted, and costs a cold prefill: generation never fails because of it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import llama_cpp
import numpy as np
from llama_cpp import llama_cpp as C

from .arena import Hit, Slot, chain_digests, common_prefix
from .client import Client
from .config import Settings, resolve
from .errors import ArenaCorruptError, ModelMismatchError, NotFound, ShmkvError
from .fingerprint import key_root, model_fingerprint

log = logging.getLogger(__name__)

SEQ = 0
#: claim a prefill (and wait for another worker's) only if at least this many chunks remain
COALESCE_MIN_CHUNKS = 2
#: how many shorter chunk prefixes a sliding-window model tries when the longest cannot be cut
SWA_MAX_PROBES = 256
#: publish a divergence checkpoint only if it saves later prompts at least this many tokens
SWA_MIN_GAIN = 16


_LIVE: weakref.WeakSet[SharedPrefixCache] = weakref.WeakSet()


def live_caches() -> list[SharedPrefixCache]:
    """Caches attached in this process (for health checks and shutdown hooks)."""
    return list(_LIVE)


def close_all() -> None:
    """Flush and close every cache of this process (e.g. from gunicorn's worker_exit)."""
    for cache in live_caches():
        try:
            cache.close()
        except Exception:  # shutting down: never fail the exit path
            log.debug("closing a shmkv cache failed", exc_info=True)


@dataclass
class CallStats:
    """What the cache did for the last ``generate`` call."""

    prompt_tokens: int = 0
    tokens_restored: int = 0
    tokens_reused_local: int = 0
    tokens_evaluated: int = 0
    restore_seconds: float = 0.0
    hit: bool = False
    coalesce_wait_seconds: float = 0.0
    published: int = 0
    #: a checkpoint state published mid-prefill (sliding-window models; see ``_plan_checkpoint``)
    checkpoint: int = 0
    error: str | None = None


@dataclass
class Totals:
    """Running totals for this worker."""

    calls: int = 0
    hits: int = 0
    misses: int = 0
    tokens_restored: int = 0
    tokens_evaluated: int = 0
    restore_failures: int = 0
    publishes: int = 0
    publish_dropped: int = 0
    publish_failures: int = 0
    coalesced_waits: int = 0
    #: cached prefixes a sliding-window model could not use (their state cannot be cut back)
    swa_unusable: int = 0
    checkpoints: int = 0
    restore_seconds: float = 0.0
    errors: dict[str, int] = field(default_factory=dict)


class SharedPrefixCache:
    """Connects one ``Llama`` to a shmkv arena; see the module docstring."""

    def __init__(self, llm: llama_cpp.Llama, name: str | None = None,
                 namespace: str | None = None, socket_path: str | None = None,
                 min_tokens: int | None = None, settings: Settings | None = None,
                 publish: bool = True, verify: bool = True, max_pending: int = 2,
                 exact: bool | None = None) -> None:
        if settings is None:
            settings = resolve("client", {"name": name, "socket": socket_path,
                                          "namespace": namespace, "min_tokens": min_tokens,
                                          "exact": exact})
        self.llm = llm
        self.settings = settings
        self.namespace: str = settings.namespace
        self.fingerprint = model_fingerprint(llm)
        #: sliding-window width (0: none); such states keep only the window of those layers
        self.n_swa = max(0, int(C.llama_model_n_swa(llm.model)))
        self._checkpoint_at = 0
        #: this call met a corrupt record: publish a good copy even if one seems cached
        self._republish = False
        #: exact mode: restore only at multiples of n_batch (see ``_exact_hit``)
        self.exact: bool = bool(settings.exact)
        self.align = max(1, int(llm.n_batch))
        # exact-mode states live under their own keys: fast-mode ones were not computed in
        # whole batches
        self.root = key_root(self.fingerprint + (b"|exact|%d" % self.align if self.exact
                                                 else b""), self.namespace)
        #: leading context tokens computed in whole, aligned batches (exact mode)
        self._aligned = 0
        self.reader = Client(settings=settings)
        self.writer = Client(settings=settings, populate=False)
        self.publish_enabled = publish
        self.verify = verify
        self.last = CallStats()
        self.totals = Totals()
        self._warned: set[str] = set()
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._pending = 0
        self._cv = threading.Condition()
        self._report: dict[str, int] = {}
        self._thread: threading.Thread | None = None
        self._thread_pid = -1
        self._closed = False
        #: called with this cache at the first token of every call (``last`` is filled)
        self.on_prefill: Callable[[SharedPrefixCache], None] | None = None
        self._claimed: list[bytes] | None = None
        _LIVE.add(self)
        try:  # attach now (after fork, at model load), not on the first request
            self.reader.ensure()
        except ArenaCorruptError as e:  # e.g. a damaged header: say so, not "unavailable"
            self._fail("corrupt arena", e)
        except ShmkvError as e:
            self._fail("supervisor unavailable", e)

    # ---------------------------------------------------------------- helpers
    def _fail(self, kind: str, err: BaseException | str) -> None:
        """Count a cache failure and log it once per kind."""
        self.totals.errors[kind] = self.totals.errors.get(kind, 0) + 1
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning("shmkv %s (falling back to a cold prefill; logged once): %s", kind, err)
        else:
            log.debug("shmkv %s: %s", kind, err)

    def _count(self, **kv: int) -> None:
        with self._cv:
            for k, v in kv.items():
                self._report[k] = self._report.get(k, 0) + v

    @property
    def chunk_tokens(self) -> int | None:
        try:
            return self.reader.view.geometry.chunk_tokens
        except ShmkvError:
            return None

    def min_publish_tokens(self, chunk: int) -> int:
        return max(self.settings.min_tokens, chunk)

    # ------------------------------------------------------ sliding windows
    # A sliding-window layer (Gemma 2/3, Mistral, gpt-oss, ...) only ever attends to
    # the last n_swa positions, and llama.cpp serializes only those: a state of n
    # tokens holds positions n - n_swa .. n - 1 of its window layers. Cutting such a
    # state back to `keep` tokens and evaluating from there needs positions
    # keep - n_swa + 1 .. keep - 1, which it no longer has: llama.cpp would quietly
    # attend to fewer tokens and the output would differ from a cold run. So a
    # state may be cut back only as far as its window allows (one token for a long
    # state; llama-cpp-python always re-evaluates the last prompt token), and
    # otherwise only restored whole. The same holds for a context's own cells after
    # a restore. llama.cpp's server makes the same check with seq_pos_min.
    def _swa_cut_ok(self, n_state: int, keep: int) -> bool:
        """Whether a restored state of ``n_state`` tokens can be cut back to ``keep``."""
        if self.n_swa <= 0 or keep >= n_state:
            return True
        return max(0, n_state - self.n_swa) <= max(0, keep - self.n_swa + 1)

    def _live_cut_ok(self, keep: int) -> bool:
        """Whether the context's own cells still hold what evaluating after ``keep`` needs."""
        if self.n_swa <= 0 or keep <= 0:
            return True
        pos_min = C.llama_memory_seq_pos_min(C.llama_get_memory(self.llm.ctx), SEQ)
        return pos_min <= max(0, keep - self.n_swa + 1)

    @staticmethod
    def _peek(view: Any, slot: Any, prompt: np.ndarray) -> tuple[int, int] | None:
        """A lease-free look at a record: (its tokens, how many of ``prompt`` it matches).

        None if it does not parse; the lease path re-checks whatever is then used.
        """
        try:
            rec = view.read_record(slot.rec_offset, slot.rec_gen)
            return rec.n_tokens, common_prefix(view.tokens(rec), prompt)
        except (ArenaCorruptError, ValueError):
            return None

    def _usable_hit(self, view: Any, hit: Any, digests: list[bytes], prompt: np.ndarray,
                    chunk: int) -> tuple[Any, int, int]:
        """For a sliding-window model: the best record it can restore, and the divergence.

        1. The record the longest chunk prefix points at, if the prompt runs to its
           end (all but its last token): nothing can beat it.
        2. Else every record under that prefix (``owners``, one round trip): the one
           the prompt matches furthest among those it can restore whole, and how far
           the prompt goes along with any of them (where a checkpoint would help).
        3. Else shorter chunk prefixes, whose slots point at the records ending in
           them (the checkpoints published near a prompt's end), by lease-free peeks.

        Returns (hit or None, tokens it matches, divergence); the lease path re-checks
        everything.
        """

        n = len(prompt)

        def fits(slot: Any, k: int) -> tuple[bool | None, int]:
            """(restorable whole? None if it looks corrupt, tokens matched)."""
            peek = self._peek(view, slot, prompt)
            if peek is None or peek[1] < k * chunk:  # (ids contradicting their digests)
                return None, 0
            n_rec, common = peek
            return self._swa_cut_ok(n_rec, min(common, n - 1)), common

        top = hit.chunks
        ok, common = fits(hit.slot, top)
        if ok is None or (ok and common >= n - 1):
            return hit, common, 0  # (corrupt-looking: the lease path detects and counts it)
        diverge = common
        best_hit, best_common = (hit, common) if ok else (None, 0)
        for off, gen, n_rec, c in self.reader.owners(digests[top - 1], prompt):
            diverge = max(diverge, c)
            if c > best_common and c >= top * chunk and self._swa_cut_ok(n_rec, min(c, n - 1)):
                best_hit, best_common = Hit(top, Slot(digests[top - 1], off, gen, top)), c
        if best_hit is not None:
            return best_hit, best_common, diverge
        self.totals.swa_unusable += 1
        rejected = {(hit.slot.rec_offset, hit.slot.rec_gen)}
        for k in range(top - 1, max(0, top - 1 - SWA_MAX_PROBES), -1):
            slot = view.probe(digests[k - 1])
            if slot is None or (slot.rec_offset, slot.rec_gen) in rejected:
                continue
            ok, common = fits(slot, k)
            if ok is None or ok:
                return Hit(k, slot), common, diverge
            rejected.add((slot.rec_offset, slot.rec_gen))
            diverge = max(diverge, common)
        return None, 0, diverge

    def _exact_hit(self, view: Any, hit: Any, digests: list[bytes], prompt: np.ndarray,
                   chunk: int, local: int) -> tuple[Any, int]:
        """Exact mode: the longest multiple of n_batch that a cached state gives.

        A cold run evaluates a prompt in batches [0, B), [B, 2B), ...; a state cut at
        a multiple of B and computed in those same batches (exact-mode states are:
        they live under their own keys), followed by the rest evaluated from there,
        repeats the cold run's batches exactly, so its numbers are the same bit for
        bit. Returns (hit or None, how many tokens to keep).
        """

        a = self.align
        if a % chunk:
            self._fail("exact mode unavailable",
                       f"n_batch {a} is not a multiple of the arena's chunk_tokens {chunk}")
            return None, 0
        if hit is None:
            return None, 0
        n = len(prompt)
        p = min(hit.chunks * chunk, n - 1) // a * a
        while p > local:
            slot = hit.slot if p == hit.chunks * chunk else view.probe(digests[p // chunk - 1])
            if slot is not None:
                peek = self._peek(view, slot, prompt)
                if peek is None:
                    return Hit(p // chunk, slot), p  # the lease path detects and counts it
                if peek[1] >= p and self._swa_cut_ok(peek[0], p):
                    return Hit(p // chunk, slot), p
            p -= a
        return None, 0

    def _plan_checkpoint(self, diverge: int, have: int, n_prompt: int, chunk: int) -> None:
        """Publish the state of the first ``diverge`` tokens during this prefill.

        The prompt matched a cached one up to ``diverge`` tokens, but that state
        cannot be cut back (sliding window); a state of exactly that prefix is
        restored whole by every later prompt that shares it (a shared system
        prompt with different questions).
        """
        if (self.publish_enabled and have < diverge < n_prompt - 1
                and diverge >= self.min_publish_tokens(chunk)):
            self._checkpoint_at = diverge

    def _tail_checkpoint(self, n_prompt: int, have: int) -> int:
        """Where to publish a state a little before the end of a new prompt (0: nowhere).

        Before any divergence is known: a prompt whose last part differs (a new
        question after the same system prompt or document) then restores this
        state instead of prefilling from the start.
        """
        tail, chunk = self.settings.checkpoint_tail, self.chunk_tokens
        if self.n_swa <= 0 or tail <= 0 or chunk is None or not self.publish_enabled:
            return 0
        at = n_prompt - tail
        if (at < have + SWA_MIN_GAIN or at < self.min_publish_tokens(chunk)
                or self._swa_cut_ok(n_prompt, at)):
            return 0  # (a state a few tokens past one just restored helps nobody)
        return at

    # ---------------------------------------------------------------- restore
    def restore(self, tokens: Sequence[int]) -> int:
        """Restore the longest cached prefix of ``tokens`` if it beats the context's own.

        Returns the number of tokens now in the context that match ``tokens``.
        """
        llm = self.llm
        prompt = np.asarray(tokens, dtype=np.int32)
        local = common_prefix(np.asarray(llm.input_ids[: llm.n_tokens], dtype=np.int32), prompt)
        if local and not self._live_cut_ok(min(local, len(prompt) - 1)):
            # llama-cpp-python would keep `local` tokens whose window cells are gone
            # (this context was restored from a state): start from scratch instead
            llm.n_tokens = 0
            local = 0
        if self.exact:  # reuse only whole batches, as a cold run would have computed them
            local = min(local, self._aligned, len(prompt) - 1) // self.align * self.align
            if local < llm.n_tokens:
                llm.n_tokens = local
        cap = len(prompt)
        known: int | None = None  # tokens the chosen record matches, if already peeked
        t0 = time.perf_counter()
        try:
            view = self.reader.ensure()
            hit = None
            chunk = view.geometry.chunk_tokens
            if len(prompt) >= chunk:
                digests = chain_digests(self.root, prompt, chunk)
                hit = self.reader.lookup(digests)
        except ArenaCorruptError as e:
            self._fail("corrupt arena", e)
            self.totals.restore_failures += 1
            self._count(restore_failures=1)
            return local
        except ShmkvError as e:
            self._fail("supervisor unavailable", e)
            return local
        if len(prompt) < chunk:
            return local
        if self.exact:
            try:
                hit, cap = self._exact_hit(view, hit, digests, prompt, chunk, local)
            except ShmkvError as e:
                self._fail("supervisor unavailable", e)
                return local
        elif hit is not None and self.n_swa > 0 and hit.chunks * chunk + chunk > local:
            try:
                hit, known, diverge = self._usable_hit(view, hit, digests, prompt, chunk)
            except ShmkvError as e:
                self._fail("supervisor unavailable", e)
                return local
            if diverge >= max(local, known) + SWA_MIN_GAIN:
                self._plan_checkpoint(diverge, max(local, known), len(prompt), chunk)
        if hit is None or hit.chunks * chunk + chunk <= local:
            if hit is None and local < chunk:
                self.totals.misses += 1
                self._count(misses=1)
            return local
        # a lease-free peek: skip the round trip when the record cannot beat `local`
        # (token ids contradicting the digests that found them are corruption: the lease
        # path below detects and counts that, so do not skip it)
        if known is None:
            peek = self._peek(view, hit.slot, prompt)
            known = None if peek is None else peek[1]
        if known is not None and hit.chunks * chunk <= known <= local:
            return local
        try:
            lease = self.reader.acquire(hit)
        except NotFound:  # evicted between lookup and lease
            self.totals.misses += 1
            self._count(misses=1)
            return local
        except ArenaCorruptError as e:
            self._fail("corrupt record", e)
            self.totals.restore_failures += 1
            self._count(restore_failures=1)
            self._republish = True
            self._suspect(hit)
            return local
        except ShmkvError as e:
            self._fail("supervisor unavailable", e)
            return local
        restored = 0
        suspect = False
        try:
            rec = lease.record
            if lease.fingerprint() != self.fingerprint:
                raise ModelMismatchError("cached blob belongs to another model/context setup")
            cached = lease.tokens()
            need = hit.chunks * chunk
            if rec.n_tokens < need or not np.array_equal(cached[:need], prompt[:need]):
                raise ArenaCorruptError("cached token ids do not match their key digest")
            common = min(common_prefix(cached, prompt), cap)
            if common <= local or not self._swa_cut_ok(rec.n_tokens, min(common, len(prompt) - 1)):
                return local  # (nothing gained, or a window state that cannot be cut this far)
            lease.view.check()
            if self.verify and not lease.view.verify_payload(rec):
                raise ArenaCorruptError("blob payload fails its checksum")
            ptr = ctypes.cast(lease.address, ctypes.POINTER(ctypes.c_uint8))
            mem = C.llama_get_memory(llm.ctx)
            # Start from an empty cache with its head at cell 0, as a cold prefill does, so
            # the restored cells sit where a prefill would have put them (llama-cpp-python
            # uses sequence 0 only).
            C.llama_memory_clear(mem, False)
            llm.n_tokens = 0
            n = C.llama_state_seq_set_data(llm.ctx, ptr, rec.payload_len, SEQ)
            if n != rec.payload_len:
                llm.n_tokens = 0  # a failed set_data leaves the sequence wiped
                llm._requires_eval = True
                raise ArenaCorruptError(f"llama_state_seq_set_data accepted {n} of "
                                        f"{rec.payload_len} bytes")
            if common < rec.n_tokens and not C.llama_memory_seq_rm(mem, SEQ, common, -1):
                llm.n_tokens = 0
                llm._requires_eval = True
                raise ModelMismatchError("the context cannot cut a restored state back")
            if not self._live_cut_ok(min(common, len(prompt) - 1)):
                C.llama_memory_clear(mem, False)  # (_usable_hit should have prevented this)
                llm.n_tokens = 0
                llm._requires_eval = True
                raise ModelMismatchError("a restored sliding-window state lacks the window "
                                         "its cut needs")
            if not lease.finish(common):
                llm.n_tokens = 0
                llm._requires_eval = True
                self._fail("lease revoked", "a read lease was revoked during the restore")
                return 0
            llm.input_ids[:common] = prompt[:common]
            llm.n_tokens = common
            llm._requires_eval = True
            restored = common
        except ModelMismatchError as e:
            self._fail("model mismatch", e)
            self._count(restore_failures=1)
        except ArenaCorruptError as e:
            self._fail("corrupt record", e)
            self._count(restore_failures=1)
            suspect = True
        except ShmkvError as e:
            self._fail("cache error", e)
        finally:
            lease.finish(restored)
            if suspect:
                self._republish = True
                self._suspect(hit)
        dt = time.perf_counter() - t0
        if restored:
            self.totals.hits += 1
            self.totals.tokens_restored += restored
            self.totals.restore_seconds += dt
            self.last.tokens_restored = restored
            self.last.restore_seconds = dt
            self.last.hit = True
            return restored
        self.totals.restore_failures += 1
        return 0 if llm.n_tokens == 0 else local

    # ---------------------------------------------------------------- publish
    def _coverage(self, tokens: np.ndarray, chunk: int) -> int:
        """How many leading ``tokens`` a record in the arena already holds (a hint)."""
        try:
            view = self.writer.ensure()
            digests = chain_digests(self.root, tokens, chunk)
            hit = view.find_longest(digests)
        except (ShmkvError, ValueError):
            return 0
        peek = None if hit is None else self._peek(view, hit[1], tokens)
        if peek is None:
            return 0
        # a longer sliding-window state that cannot be cut back covers nothing
        return peek[1] if self._swa_cut_ok(*peek) else 0

    def capture(self, n_tokens: int | None = None, pin: bool = False,
                claimed: list[bytes] | None = None, min_new: int = 1,
                covered: int = 0) -> bool:
        """Copy the context's current sequence state and queue it for the supervisor.

        Only if it adds ``min_new`` tokens to what is cached (0: always, e.g. a
        sliding-window checkpoint that a longer record cannot stand in for) and to
        ``covered``, the leading tokens known to be published already (the prompt,
        when its completion is captured).
        """
        llm = self.llm
        n = llm.n_tokens if n_tokens is None else n_tokens
        if not self.publish_enabled or (self.exact and (n % self.align or n > self._aligned)):
            return False  # (exact mode: only states of whole batches, see _exact_hit)
        chunk = self.chunk_tokens
        if chunk is None or n < self.min_publish_tokens(chunk) or n != llm.n_tokens:
            return False
        tokens = np.array(llm.input_ids[:n], dtype=np.int32)
        if not self._republish and n - max(covered, self._coverage(tokens, chunk)) < min_new:
            return False  # (nearly) all of it is cached already
        try:
            mem = C.llama_get_memory(llm.ctx)
            if C.llama_memory_seq_pos_max(mem, SEQ) + 1 != n:
                return False  # the KV cache does not hold exactly these tokens
            size = C.llama_state_seq_get_size(llm.ctx, SEQ)
            if size <= 0:
                return False

            def fill(addr: int, sz: int) -> None:
                got = C.llama_state_seq_get_data(
                    llm.ctx, ctypes.cast(addr, ctypes.POINTER(ctypes.c_uint8)), sz, SEQ)
                if got != sz:
                    raise ShmkvError(f"llama_state_seq_get_data wrote {got} of {sz} bytes")

            blob = self.writer.prepare(size, fill)
        except (ShmkvError, OSError) as e:
            self._fail("publish failed", e)
            self.totals.publish_failures += 1
            return False
        self._start_thread()
        try:
            with self._cv:
                self._pending += 1
            self._queue.put_nowait(("put", tokens, blob, pin, claimed))
        except queue.Full:
            with self._cv:
                self._pending -= 1
            blob.close()
            self.totals.publish_dropped += 1
            return False
        self.totals.publishes += 1
        self.last.published += 1
        return True

    def _start_thread(self) -> None:
        if self._thread is not None and self._thread.is_alive() and self._thread_pid == os.getpid():
            return
        self._thread_pid = os.getpid()
        self._thread = threading.Thread(target=self._publisher, name="shmkv-publish",
                                        daemon=True)
        self._thread.start()

    def _publisher(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if item[0] == "report":
                self._send_report()
                with self._cv:
                    self._pending -= 1
                    self._cv.notify_all()
                continue
            _, tokens, blob, pin, claimed = item
            try:
                self.writer.put_blob(self.root, tokens, self.fingerprint, blob, pin=pin)
            except Exception as e:  # ShmkvError or a bug: never let the thread die
                self._fail("publish failed", e)
                self.totals.publish_failures += 1
                if claimed:  # nobody else will index them: let the waiters go
                    self._unclaim(claimed)
            finally:
                blob.close()
                self._send_report()
                with self._cv:
                    self._pending -= 1
                    self._cv.notify_all()

    def _send_report(self) -> None:
        with self._cv:
            counters, self._report = self._report, {}
        if counters:
            try:
                self.writer.report(**counters)
            except ShmkvError:
                pass

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until queued publishes and counters reached the supervisor."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        self._send_report()
        return True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.flush(timeout=5.0)
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=2.0)
        self.reader.close()
        self.writer.close()

    # ------------------------------------------------------------------- hook
    def generate(self, orig_generate: Any, tokens: Sequence[int], reset: bool = True,
                 **kwargs: Any) -> Iterator[int]:
        """The body of the hooked ``Llama.generate``."""
        llm = self.llm
        tokens = list(tokens)
        self.last = CallStats(prompt_tokens=len(tokens))
        self.totals.calls += 1
        self._republish = False
        reused = 0
        if reset and tokens:
            try:
                reused = self.prepare(tokens)
            except Exception as e:  # the cache must never break generation
                self._fail("restore error", e)
                llm.n_tokens = 0
                llm._requires_eval = True
        self.last.tokens_reused_local = max(0, reused - self.last.tokens_restored)
        at, self._checkpoint_at = self._checkpoint_at, 0
        in_context = reused  # (what the checkpoint prefill evaluates counts as evaluated)
        if reset and tokens and self.exact:
            reused = self._prefill_boundaries(tokens, reused)
        elif reset and tokens:
            at = at or self._tail_checkpoint(len(tokens), reused)
            if reused < at < len(tokens) - 1:
                reused = self._prefill_publishing(tokens, reused, [at], min_new=0)
                in_context = min(in_context, reused)
        gen = orig_generate(tokens, reset=reset, **kwargs)
        first = True
        prompt_capture = False  # due once the first token is out (off the TTFT path)
        try:
            sent = None
            while True:
                if prompt_capture:
                    prompt_capture = False
                    self._capture_prompt(len(tokens))
                tok = gen.send(sent) if sent is not None else next(gen)
                if first:
                    first = False
                    evaluated = max(0, len(tokens) - in_context)
                    if in_context >= len(tokens):
                        evaluated = 1  # llama-cpp-python replays the last token for logits
                    self.last.tokens_evaluated = evaluated
                    self.totals.tokens_evaluated += evaluated
                    self._count(tokens_evaluated=evaluated)
                    if self.on_prefill is not None:
                        try:
                            self.on_prefill(self)
                        except Exception as e:
                            self._fail("on_prefill callback failed", e)
                    prompt_capture = True
                sent = yield tok
        except StopIteration:
            return
        finally:
            gen.close()
            if prompt_capture:  # stopped right after the first token: the KV is the prompt
                self._capture_prompt(len(tokens))
            elif not first:  # prompt + completion: worth a blob if it adds a chunk or more
                self._safe_capture(min_new=self.chunk_tokens or 1, covered=len(tokens))
            elif self._claimed:  # ended before the prompt was evaluated
                claimed, self._claimed = self._claimed, None
                self._unclaim(claimed)
            self._queue_report()

    def _prefill_boundaries(self, tokens: list[int], reused: int) -> int:
        """Exact mode: prefill batch by batch, publishing the state at batch boundaries.

        Only these states are published in exact mode (a prompt's own end is not a
        boundary a longer prompt's cold run shares). A model that can cut a state
        back needs only the last boundary; a sliding-window one needs each.
        """
        a, n = self.align, len(tokens)
        chunk = self.chunk_tokens
        last = (n - 1) // a * a  # the start of a cold run's last batch
        # once prefilled from an aligned point, everything before `last` was computed in
        # the cold run's own batches (the rest and the completion were not)
        self._aligned = last if reused % a == 0 else 0
        if chunk is None or not self.publish_enabled or last <= reused or a % chunk:
            return reused
        wanted = range(last, reused, -a) if self.n_swa > 0 else [last]
        wanted = [b for b in sorted(wanted) if b >= self.min_publish_tokens(chunk)]
        return self._prefill_publishing(tokens, reused, wanted, min_new=1)

    def _prefill_publishing(self, tokens: list[int], reused: int, points: Sequence[int],
                            min_new: int) -> int:
        """Evaluate the prompt up to each of ``points`` (ascending), publishing the state
        at each; returns the tokens now in the context. llama-cpp-python's own batching,
        from where its own prefix match would start, so the numbers are one eval's."""
        llm = self.llm
        try:
            llm.n_tokens = min(reused, len(tokens) - 1)
            for p in points:
                llm.eval(tokens[llm.n_tokens : p])
                if self.capture(n_tokens=p, min_new=min_new):
                    self.totals.checkpoints += 1
                    self.last.checkpoint = p
            return llm.n_tokens
        except Exception as e:  # never break generation: go cold
            self._fail("checkpoint failed", e)
            llm.n_tokens = 0
            llm._requires_eval = True
            self._aligned = 0
            return 0

    def _capture_prompt(self, n_prompt: int) -> None:
        """Publish the prompt's state (the KV holds exactly the prompt), end our claims."""
        claimed, self._claimed = self._claimed, None
        queued = self.llm.n_tokens == n_prompt and self._safe_capture(claimed)
        if claimed and not queued:
            self._unclaim(claimed)

    def _queue_report(self) -> None:
        """Send this worker's counters to the supervisor off the token path."""
        with self._cv:
            if not self._report:
                return
            self._pending += 1
        self._start_thread()
        try:
            self._queue.put_nowait(("report",))
        except queue.Full:  # a publish is pending; it sends the counters too
            with self._cv:
                self._pending -= 1

    def _safe_capture(self, claimed: list[bytes] | None = None, min_new: int = 1,
                      covered: int = 0) -> bool:
        try:
            return self.capture(claimed=claimed, min_new=min_new, covered=covered)
        except Exception as e:
            self._fail("publish failed", e)
            return False

    def _suspect(self, hit: Any) -> None:
        """Ask the supervisor to re-check (and drop) a record that failed our checks."""
        try:
            self.reader.request({"op": "suspect", "offset": hit.slot.rec_offset,
                                 "gen": hit.slot.rec_gen})
        except ShmkvError as e:
            log.debug("suspect report failed: %s", e)

    def _unclaim(self, digests: list[bytes]) -> None:
        try:
            self.reader.unclaim(digests)
        except ShmkvError as e:
            log.debug("unclaim failed: %s", e)

    # -------------------------------------------------------------- coalescing
    def prepare(self, tokens: Sequence[int]) -> int:
        """Restore, and if a long prefill remains, claim it or wait for whoever claimed it.

        Returns the number of prompt tokens already in the context.
        """
        reused = self.restore(tokens)
        budget = self.settings.coalesce_wait
        chunk = self.chunk_tokens if budget > 0 else None
        if chunk is None:
            return reused
        prompt = np.asarray(tokens, dtype=np.int32)
        deadline = time.monotonic() + budget
        for _ in range(4):
            start = reused // chunk
            if len(prompt) // chunk - start < COALESCE_MIN_CHUNKS:
                return reused
            left = deadline - time.monotonic()
            if left <= 0:
                return reused
            digests = chain_digests(self.root, prompt, chunk)[start:]
            t0 = time.perf_counter()
            try:
                status = self.reader.claim(digests, left)
            except ShmkvError as e:
                self._fail("claim failed", e)
                return reused
            if status == "go":
                self._claimed = digests
                return reused
            self.last.coalesce_wait_seconds += time.perf_counter() - t0
            self.totals.coalesced_waits += 1
            reused = self.restore(tokens)
            if status == "timeout":
                return reused
        return reused


def _hooked_generate(cache: SharedPrefixCache, orig: Any):
    def generate(tokens: Sequence[int], reset: bool = True, **kwargs: Any) -> Iterator[int]:
        return cache.generate(orig, tokens, reset=reset, **kwargs)

    generate.__doc__ = orig.__doc__
    return generate


def attach(llm: llama_cpp.Llama, name: str | None = None, namespace: str | None = None,
           socket_path: str | None = None, **kwargs: Any) -> SharedPrefixCache:
    """Make an existing ``Llama`` share prompt state through the arena ``name``.

    Returns the cache object (also at ``llm.shmkv``); ``llm.shmkv.last`` tells what
    the last call restored and evaluated.
    """
    existing = getattr(llm, "shmkv", None)
    if isinstance(existing, SharedPrefixCache):
        return existing
    cache = SharedPrefixCache(llm, name=name, namespace=namespace, socket_path=socket_path,
                              **kwargs)
    llm.generate = _hooked_generate(cache, llm.generate)  # type: ignore[method-assign]
    llm.shmkv = cache  # type: ignore[attr-defined]
    return cache


class SharedCacheLlama(llama_cpp.Llama):
    """A drop-in ``llama_cpp.Llama`` whose prompts are shared through a shmkv arena.

    Extra keyword arguments: ``shmkv_name``, ``shmkv_namespace``, ``shmkv_socket``,
    ``shmkv_min_tokens``, ``shmkv_exact``. ``self.shmkv.last`` tells what the last call
    restored.
    """

    def __init__(self, *args: Any, shmkv_name: str | None = None,
                 shmkv_namespace: str | None = None, shmkv_socket: str | None = None,
                 shmkv_min_tokens: int | None = None, shmkv_exact: bool | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.shmkv = SharedPrefixCache(self, name=shmkv_name, namespace=shmkv_namespace,
                                       socket_path=shmkv_socket, min_tokens=shmkv_min_tokens,
                                       exact=shmkv_exact)

    def generate(self, tokens: Sequence[int], reset: bool = True,  # type: ignore[override]
                 **kwargs: Any) -> Iterator[int]:
        return self.shmkv.generate(super().generate, tokens, reset=reset, **kwargs)
