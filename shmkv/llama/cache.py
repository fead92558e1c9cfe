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
restorable here (``fingerprint.py``) and the caller's namespace, narrowed per call
by its tenant (``tenant.py``): a call finds and publishes only its tenant's records,
and a context that holds another tenant's cells is wiped before the call uses it.
Which record
to restore and which checkpoints to publish is planned in ``policy.py``; the
state moves in and out of llama.cpp in ``kvstate.py``; one restore is carried
out and counted in ``restore.py``, a state published in ``capture.py``; what the
context holds besides its tokens is its ``kvstate.ContextState``, the prefills it
claimed are ended by ``claims.py``; the hooks on ``Llama`` are in ``hooks.py``;
where a chat's messages start (checkpoints for sliding windows) in ``boundaries.py``;
``publisher.py`` talks to the supervisor off the token path; llama-cpp-python's
internals are touched in ``compat.py`` only. This module wires them together (they
never import it) and keeps the worker's counters (``shmkv.core.stats``). Any failure
of the cache (no supervisor, mismatch, corrupt blob, failed ``set_data``) is
logged once, counted, and costs a cold prefill: generation never fails because of it.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
from llama_cpp import llama_cpp as lc

from shmkv.core.arena import common_prefix
from shmkv.core.client import Client
from shmkv.core.config import Settings, resolve, trusted_uids
from shmkv.core.errors import ArenaCorruptError, ShmkvError
from shmkv.core.keys import chain_digests, key_root
from shmkv.core.stats import CallStats
from shmkv.llama import boundaries, compat, hooks, kvstate, media, mtmd, policy, tenant
from shmkv.llama.capture import Capturer
from shmkv.llama.claims import Claims
from shmkv.llama.counters import Ledger
from shmkv.llama.cpu import budget as cpubudget
from shmkv.llama.cpu.budget import CpuBudget
from shmkv.llama.fingerprint import model_fingerprint
from shmkv.llama.publisher import Checkpoint, Publisher
from shmkv.llama.restore import Restorer

log = logging.getLogger(__name__)

__all__ = [
    "SharedCacheLlama",
    "SharedPrefixCache",
    "attach",
    "close_all",
    "key_root",
    "live_caches",
    "model_fingerprint",
]

#: claim a prefill (and wait for another worker's) only if at least this many chunks remain
COALESCE_MIN_CHUNKS = 2
#: prefills shorter than this do not count towards the measured prefill speed
PREFILL_SAMPLE_MIN = 64

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


class Call:
    """One ``generate`` call: its prompt, the prompt's digest chain, and its steps.

    What belongs to one call lives here, not on the cache: the divergence checkpoint
    the plan asked for, whether a corrupt record was met, the digests it claimed.
    Its steps go through the cache's ``restore_or_claim`` and ``capture``.
    """

    def __init__(
        self, cache: SharedPrefixCache, tokens: Sequence[int], prompt_logits: bool = False
    ) -> None:
        self.cache = cache
        self.tokens = tokens
        self.prompt = np.asarray(tokens, dtype=np.int32)
        #: the key root of this call's tenant (the one in effect when the call started)
        self.root = cache.root_for(tenant.current())
        #: the caller reads the logits of the prompt's tokens (``echo`` with ``logprobs``):
        #: only tokens this context evaluated itself may be kept, none restored
        self.prompt_logits = prompt_logits
        #: the guard's number for this call (``ContextGuard.begin``)
        self.generation = 0
        self._chains: dict[int, list[bytes]] = {}
        #: publish the state of this many prompt tokens during the prefill (0: none)
        self.checkpoint_at = 0
        #: where the prompt's chat messages start (``hint_boundaries``): checkpoints there
        self.boundaries: tuple[int, ...] = ()
        #: a hybrid's checkpoints taken in this prefill (their recurrent state alone),
        #: published with the prompt's state, which they are cut from
        self.recurrent: list[Checkpoint] = []
        #: met a corrupt record: publish a good copy even if one seems cached
        self.republish = False
        #: chunk digests this call claimed: other workers wait for their publish
        self.claimed: list[bytes] | None = None
        #: when the prefill began (perf_counter), to measure the model's prefill speed
        self.prefill_started = time.perf_counter()
        #: a media prompt that ``media.prefill`` brought into the context: the positions it
        #: restored or kept (None: not such a prompt)
        self.prefilled: int | None = None

    def is_for(self, tokens: Sequence[int], root: bytes) -> bool:
        """Whether this is the call of ``tokens`` by the tenant whose root is ``root``."""
        if root != self.root:
            return False
        return tokens is self.tokens or (
            len(tokens) == len(self.prompt)
            and np.array_equal(np.asarray(tokens, dtype=np.int32), self.prompt)
        )

    def digests(self, chunk: int) -> list[bytes]:
        """The prompt's digest chain, computed once (per chunk size)."""
        chain = self._chains.get(chunk)
        if chain is None:
            chain = self._chains[chunk] = chain_digests(self.root, self.prompt, chunk)
        return chain

    def digests_of(self, tokens: np.ndarray, chunk: int) -> list[bytes]:
        """The digest chain of other ``tokens`` (a prefix of the prompt, or the prompt
        and its completion), reusing the prompt's as far as they agree."""
        known = self._chains.get(chunk)
        shared = common_prefix(tokens, self.prompt) // chunk if known is not None else 0
        if known is None or not shared:
            return chain_digests(self.root, tokens, chunk)
        head = known[:shared]  # (each digest chains from the one before it)
        return head + chain_digests(head[-1], tokens[shared * chunk :], chunk)

    def coalesce(self) -> int:
        """Restore; then, if a long prefill remains, claim it (other workers wait for its
        publish) or wait for whoever claimed it and restore again."""
        cache = self.cache
        if self.prompt_logits:  # a restore brings cells, not the logits of their tokens
            return cache.keep_local(self.prompt, limit=cache.scores_valid)
        reused = self.fetch_and_restore()
        budget = cache.settings.coalesce_wait
        chunk = cache.chunk_tokens if budget > 0 else None
        if chunk is None:
            return reused
        deadline = time.monotonic() + budget
        for _ in range(4):
            start = reused // chunk
            left = deadline - time.monotonic()
            if len(self.prompt) // chunk - start < COALESCE_MIN_CHUNKS or left <= 0:
                return reused
            digests = self.digests(chunk)[start:]
            t0 = time.perf_counter()
            try:
                status = cache.reader.claim(digests, left)
            except ShmkvError as e:
                cache.ledger.fail("claim failed", e)
                return reused
            if status == "go":
                self.claimed = digests
                return reused
            cache.last.coalesce_wait_seconds += time.perf_counter() - t0
            cache.ledger.add(coalesced_waits=1)
            reused = cache.restore(self.tokens)
            if status == "timeout":
                return reused
        return reused

    def fetch_and_restore(self) -> int:
        """Restore; first, if what the arena and the context hold of the prompt leaves a
        long prefill, ask the supervisor to fetch a longer prefix from ``--remote`` (one
        round trip, bounded wait), so that a record it fetches is the one restored (not a
        shorter local one first, then it). Returns the prompt tokens now in the context."""
        cache = self.cache
        chunk, wait = cache.chunk_tokens, float(getattr(cache.settings, "remote_wait", 0.0))
        if not chunk or wait <= 0 or not cache.reader.attach_info.get("remote"):
            return cache.restore(self.tokens)
        have = cache.probe(self.tokens)
        if len(self.prompt) - have < COALESCE_MIN_CHUNKS * chunk:
            return cache.restore(self.tokens)
        t0 = time.perf_counter()
        try:
            status = cache.reader.fetch(
                self.root, self.prompt, have, wait, cache.prefill_tps, cache.policy.cuts_back
            )
        except ShmkvError as e:
            cache.ledger.fail("fetch failed", e)
            return cache.restore(self.tokens)
        cache.last.remote = status
        cache.last.remote_wait_seconds = time.perf_counter() - t0
        cache.ledger.add(remote_asked=1)
        reused = cache.restore(self.tokens)
        if status == "fetched" and reused > have:
            cache.ledger.add(remote_restored=1)
        return reused

    def run(self, orig_generate: Any, reset: bool, kwargs: dict[str, Any]) -> Iterator[int]:
        """Restore, prefill with checkpoints, generate, publish; yields the tokens.

        Each step between two tokens holds the cache's context guard; the consumer may
        run the steps on different threads, one at a time.
        """
        cache, tokens = self.cache, self.tokens
        vocab = lc.llama_model_get_vocab(cache.llm.model)
        with cache.guard:
            self.generation = cache.guard.begin()
            stats = cache.last = CallStats(prompt_tokens=len(tokens), started_at=time.monotonic())
            cache.ledger.add(calls=1)
            cache.call = self
            cache.claims.end_orphaned()
            self._own_media()
            self._take_prefill(stats)
            cache.enter(self.root, reset)
            in_context = self._prepare(reset)
            gen = orig_generate(self.tokens, reset=reset, **kwargs)
        first = True
        prompt_capture = False  # due once the first token is out (off the TTFT path)
        try:
            sent = None
            while True:
                with cache.guard:
                    if prompt_capture:
                        prompt_capture = False
                        self._capture_prompt()
                    try:
                        tok = gen.send(sent) if sent is not None else next(gen)
                    except StopIteration:
                        return
                    if first:
                        first = False
                        stats.first_token_at = time.monotonic()
                        self._prefilled(in_context)
                        prompt_capture = True
                if not lc.llama_vocab_is_eog(vocab, tok):  # (completions stop at one)
                    stats.completion_tokens += 1
                sent = yield tok
        finally:
            self._finish(gen, first, prompt_capture)

    def _take_prefill(self, stats: CallStats) -> None:
        """A media prompt that ``media.prefill`` just brought into the context: its restore
        and prefill are this call's (``CallStats``)."""
        done, self.cache.media_prefill = self.cache.media_prefill, None
        if done is None or not media.is_media(self.prompt):
            return
        have, before = done
        self.prefilled = have
        stats.started_at = before.started_at
        stats.tokens_restored, stats.hit = before.tokens_restored, before.hit
        stats.restore_seconds = before.restore_seconds
        stats.tokens_reused_local = max(0, have - before.tokens_restored)

    def _own_media(self) -> None:
        """Positions filled behind the hooks' back since they last saw the context (a
        chat handler's image) are marked ``media.UNKNOWN``; if this call's prompt is the
        handler's (``input_ids[:n_tokens]``, read before that), it says so there too, so
        that llama-cpp-python completes it on the image the context holds."""
        llm = self.cache.llm
        filled = self.cache.catch_up()
        if filled is None:
            return
        start, stale = filled
        end = start + len(stale)
        if len(self.prompt) < end or not (
            np.array_equal(self.prompt[start:end], stale)
            and np.array_equal(self.prompt[:start], llm.input_ids[:start])
        ):
            return  # (another prompt: it matches the context up to the media at most)
        self.prompt = self.prompt.copy()
        self.prompt[start:end] = media.UNKNOWN
        self.tokens = self.prompt.tolist()

    def _prepare(self, reset: bool) -> int:
        """Restore (or claim) and prefill up to the checkpoints; the tokens in context."""
        cache, tokens = self.cache, self.tokens
        reused = 0
        if reset and tokens and media.is_media(self.prompt):
            # (a chat handler's prompt: the context holds its media, decoded there)
            llm = cache.llm
            return common_prefix(np.asarray(llm.input_ids[: llm.n_tokens]), self.prompt)
        if reset and tokens:
            try:
                reused = cache.restore_or_claim(tokens)
            except Exception as e:  # the cache must never break generation
                cache.ledger.fail("restore error", e)
                cache.go_cold()
        cache.last.tokens_reused_local = max(0, reused - cache.last.tokens_restored)
        if cache.last.tokens_reused_local:
            cache.ledger.add(tokens_reused_local=cache.last.tokens_reused_local)
        self.prefill_started = time.perf_counter()
        in_context = reused  # (what the checkpoint prefill evaluates counts as evaluated)
        if reset and tokens:
            in_context = min(in_context, self._prefill_checkpoints(reused))
        return in_context

    def _finish(self, gen: Any, first: bool, prompt_capture: bool) -> None:
        """The call ended or was closed: publish what it computed, end its claims.

        Only with the context guard, and only if no other call has started since: a
        stream its reader abandoned may be closed late, on another thread, while the
        context is in use or holds another call's cells. Its capture is then dropped
        (and counted) and its claims are ended by the next call.
        """
        cache = self.cache
        if cache.publisher.on_its_thread() or not cache.guard.try_hold(self.generation):
            gen.close()  # (llama-cpp-python's generate has no cleanup of its own)
            if prompt_capture or not first:
                cache.ledger.add(captures_dropped=1)
            if self.claimed:
                cache.claims.orphan(self.claimed)
                self.claimed = None
            cache.publisher.report_soon()
            return
        try:
            gen.close()
            if first and cache.cpu is not None:  # (a checkpoint's eval left it in line)
                cache.cpu.leave_line()
            if prompt_capture:  # stopped right after the first token: the KV is the prompt
                self._capture_prompt()
            elif not first:  # prompt + completion: worth a blob if it adds a chunk or more
                self._safe_capture(min_new=cache.chunk_tokens or 1, covered=len(self.tokens))
            elif self.claimed:  # ended before the prompt was evaluated
                claimed, self.claimed = self.claimed, None
                cache.claims.end(claimed)
        finally:
            cache.guard.release()
        cache.publisher.report_soon()

    def _prefill_checkpoints(self, reused: int) -> int:
        """Prefill up to each checkpoint the policy wants, publishing the state at each.

        Returns the tokens now in the context. llama-cpp-python's own batching, from
        where its own prefix match would start, so the numbers are one eval's.
        """
        cache, llm, tokens = self.cache, self.cache.llm, self.tokens
        plan = cache.policy.checkpoints(
            len(tokens), reused, self.checkpoint_at, cache.chunk_tokens, self.boundaries
        )
        self.checkpoint_at = 0
        if plan.aligned is not None:
            cache.context.aligned = plan.aligned
        if not plan.points:
            return reused
        cpu = cache.cpu.request(cache.last) if cache.cpu is not None else None
        try:
            llm.n_tokens = min(reused, len(tokens) - 1)
            for p in plan.points:
                if cpu is not None:  # (the rest keeps this eval's place in line for cores)
                    cpu.after = len(tokens) - p
                llm.eval(tokens[llm.n_tokens : p])
                t0 = time.perf_counter()
                if cache.recurrent_checkpoints:  # (published with the prompt's state)
                    held = cache.capturer.recurrent(cache.chunk_tokens, p)
                    if held is not None:
                        self.recurrent.append(held)
                        cache.ledger.add(recurrent_checkpoints=1)
                    taken = held is not None
                else:
                    taken = cache.capture(n_tokens=p, min_new=plan.min_new)
                cache.last.checkpoint_seconds += time.perf_counter() - t0
                if taken:
                    cache.ledger.add(checkpoints=1)
                    if p in self.boundaries:
                        cache.ledger.add(boundary_checkpoints=1)
                    cache.last.checkpoint = p
                    cache.last.checkpoints.append(p)
            return llm.n_tokens
        except Exception as e:  # never break generation: go cold
            cache.ledger.fail("checkpoint failed", e)
            cache.go_cold()
            return 0
        finally:
            if cpu is not None:
                cpu.after = 0

    def _prefilled(self, in_context: int) -> None:
        """At the first token: count what was evaluated, tell ``on_prefill``."""
        cache, n_prompt = self.cache, len(self.tokens)
        if self.prefilled is not None:  # (``media.prefill`` evaluated the rest)
            in_context = self.prefilled
        evaluated = max(0, n_prompt - in_context)
        if in_context >= n_prompt:
            evaluated = 1  # llama-cpp-python replays the last token for logits
        cache.last.tokens_evaluated = evaluated
        cache.measured_prefill(evaluated, time.perf_counter() - self.prefill_started)
        cache.ledger.add(tokens_evaluated=evaluated)
        if cache.on_prefill is not None:
            try:
                cache.on_prefill(cache)
            except Exception as e:
                cache.ledger.fail("on_prefill callback failed", e)

    def _capture_prompt(self) -> None:
        """Publish the prompt's state (the KV holds exactly the prompt), end our claims."""
        claimed, self.claimed = self.claimed, None
        held, self.recurrent = self.recurrent, []
        queued = self.cache.llm.n_tokens == len(self.tokens) and self._safe_capture(
            claimed, checkpoints=held
        )
        if claimed and not queued:
            self.cache.claims.end(claimed)

    def _safe_capture(
        self,
        claimed: list[bytes] | None = None,
        min_new: int = 1,
        covered: int = 0,
        checkpoints: Sequence[Checkpoint] = (),
    ) -> bool:
        try:
            return self.cache.capture(
                claimed=claimed, min_new=min_new, covered=covered, checkpoints=checkpoints
            )
        except Exception as e:
            self.cache.ledger.fail("publish failed", e)
            return False


class SharedPrefixCache:
    """Connects one ``Llama`` to a shmkv arena; see the module docstring."""

    def __init__(
        self,
        llm: llama_cpp.Llama,
        name: str | None = None,
        namespace: str | None = None,
        socket_path: str | None = None,
        min_tokens: int | None = None,
        settings: Settings | None = None,
        publish: bool = True,
        verify: bool = True,
        max_pending: int = 2,
        exact: bool | None = None,
    ) -> None:
        if settings is None:
            settings = resolve(
                "client",
                {
                    "name": name,
                    "socket": socket_path,
                    "namespace": namespace,
                    "min_tokens": min_tokens,
                    "exact": exact,
                },
            )
        compat.check(llm)
        self.llm = llm
        self.settings = settings
        self.namespace: str = settings.namespace
        self.fingerprint = model_fingerprint(llm)
        #: sliding-window width (0: none); such states keep only the window of those layers.
        #: ``policy.WHOLE`` for a recurrent or hybrid model: its states are never cut back
        self.n_swa = max(0, int(lc.llama_model_n_swa(llm.model)))
        whole = kvstate.whole_states_only(llm.model)
        #: a hybrid's checkpoints are its recurrent state alone, cut from the prompt's
        #: state when that is published (``capture.py``); False: copied whole (so in exact
        #: mode, which publishes no state of a whole prompt to cut them from)
        self.recurrent_checkpoints = (
            whole == "hybrid" and not settings.exact and kvstate.can_copy_recurrent()
        )
        if whole:
            self.n_swa = policy.WHOLE
            log.info(
                "shmkv: a %s model: its states cannot be cut back to a shorter prefix, so "
                "only whole states are restored (checkpoints at chat message boundaries, "
                "where prompts part and before a prompt's end)",
                whole,
            )
        #: exact mode: restore only at multiples of n_batch (see ``policy.Exact``)
        self.exact: bool = bool(settings.exact)
        self.align = max(1, int(llm.n_batch))
        # exact-mode states live under their own keys: fast-mode ones were not computed in
        # whole batches
        self.root = key_root(
            self.fingerprint + (b"|exact|%d" % self.align if self.exact else b""), self.namespace
        )
        #: what the cache knows about its context's cells (their tenant, ...)
        self.context = kvstate.ContextState(root=self.root)
        self.publish_enabled = publish
        self.verify = verify
        #: publishers trusted besides our uid and the supervisor's (None: everyone)
        self._trusted = trusted_uids(getattr(settings, "trust_publishers", ""))
        self.policy = policy.strategy(
            policy.Rules(
                n_swa=self.n_swa,
                exact=self.exact,
                align=self.align,
                min_tokens=settings.min_tokens,
                publish=publish,
                checkpoint_tail=settings.checkpoint_tail,
                checkpoint_every=self.align if self.recurrent_checkpoints else 0,
            )
        )
        self.ledger = Ledger(log)
        #: the labels of this cache's counters in the supervisor's metrics: the model's
        #: alias (``workers/app.py`` sets the served alias) and the namespace
        self.ledger.labels = (Path(str(getattr(llm, "model_path", "") or "")).stem, self.namespace)
        #: this worker's running totals (``shmkv.core.stats.WorkerCounters``)
        self.totals = self.ledger.totals
        self.reader = Client(settings=settings)
        self.publisher = Publisher(
            settings, self.fingerprint, self.ledger, self._publish_failed, max_pending
        )
        self.publisher.on_cut_refused = self._cut_refused
        self.last = CallStats()
        #: the current (or last) call
        self.call: Call | None = None
        #: one step of one call touches the context at a time (see ``kvstate.ContextGuard``)
        self.guard = kvstate.ContextGuard()
        self.restorer = Restorer(
            llm,
            self.reader,
            self.ledger,
            self.policy,
            self.context,
            self.fingerprint,
            verify,
            self.trust,
            self.whole_states_only,
        )
        self.capturer = Capturer(
            llm, self.context, self.policy, self.publisher, self.ledger, self.trust
        )
        #: the prefills this cache's calls claimed, ended here when they will not publish
        self.claims = Claims(self.reader)
        #: the context keeps every token's logits (``Llama(logits_all=True)``)
        self.logits_all = compat.logits_all(llm)
        #: whether the generate call a completion makes reads the prompt's logits
        self.prompt_logits = hooks.PromptLogits()
        self._closed = False
        #: this context's measured prefill speed, tokens/s (0: not measured yet); the
        #: supervisor weighs a fetch from --remote against it
        self.prefill_tps = 0.0
        #: called with this cache at the first token of every call (``last`` is filled)
        self.on_prefill: Callable[[SharedPrefixCache], None] | None = None
        #: the deployment's CPU budget its evals run on (``shmkv.llama.cpu.budget``; None: the
        #: context's own threads)
        self.cpu: CpuBudget | None = None
        #: token prefixes hinted for the next call (``hint_boundaries``)
        self.hints = boundaries.Hints()
        #: said once that media filled positions behind the hooks' back (``catch_up``)
        self._media_logged = False
        #: what ``restore_media`` did for the prompt the next call completes
        self.media_prefill: tuple[int, CallStats] | None = None
        #: renders a chat's leading messages (``create_chat_completion``), where it helps
        self.chat_boundaries = (
            boundaries.ChatBoundaries(llm) if self.policy.wants_boundaries else None
        )
        #: llm's multimodal chat handler keys its media by content (``mtmd.py``)
        self.shares_media = mtmd.share(llm)
        _LIVE.add(self)
        try:  # attach now (after fork, at model load), not on the first request
            self.reader.ensure()
        except ArenaCorruptError as e:  # e.g. a damaged header: say so, not "unavailable"
            self.ledger.fail("corrupt arena", e)
        except ShmkvError as e:
            self.ledger.fail("supervisor unavailable", e)

    @property
    def writer(self) -> Client:
        """The publisher's connection (puts and counter reports)."""
        return self.publisher.writer

    @property
    def chunk_tokens(self) -> int | None:
        try:
            return self.reader.view.geometry.chunk_tokens
        except ShmkvError:
            return None

    def trust(self) -> policy.Trust:
        """Whose states this worker restores: its own uid's, the supervisor's, and those of
        ``--trust-publishers`` (everyone's with ``*``)."""
        extra = self._trusted
        if extra is None:
            return policy.EVERYONE
        sup = self.reader.supervisor_uid
        return policy.Trust(frozenset({os.geteuid(), *extra, *([] if sup is None else [sup])}))

    @property
    def context_root(self) -> bytes | None:
        """The key root of the tenant whose calls computed the context's cells (None:
        mixed, a continuation across tenants: nothing of it is published)."""
        return self.context.root

    @property
    def scores_valid(self) -> int:
        """Leading rows of ``llm.scores`` that hold the logits of ``llm.input_ids``."""
        return self.context.scores_valid

    def root_for(self, who: tenant.Tenant | None) -> bytes:
        """The key root of calls by tenant ``who`` (None: the deployment's own)."""
        return self.root if who is None else who.root(self.root)

    def enter(self, root: bytes, reset: bool = True) -> None:
        """A call of the tenant whose key root is ``root`` is about to use the context.

        If another tenant's calls computed its cells, they are wiped: this call reuses
        none of them (a faster answer would tell it they were there). A continuation
        (``reset`` False: the caller asked to go on from the context as it is) keeps
        them, and the context is then nobody's: nothing of it is published.
        """
        if self.context.root == root:
            return
        if not reset:
            self.context.root = None
            return
        if self.llm.n_tokens:
            self.ledger.add(tenant_switches=1)
        self.context.wipe(self.llm, root)

    def measured_prefill(self, tokens: int, seconds: float) -> None:
        """Fold one prefill of ``tokens`` in ``seconds`` into :attr:`prefill_tps`."""
        if tokens < PREFILL_SAMPLE_MIN or seconds <= 0:
            return  # (a short prefill is dominated by fixed costs)
        tps = tokens / seconds
        self.prefill_tps = tps if not self.prefill_tps else 0.7 * self.prefill_tps + 0.3 * tps

    def go_cold(self) -> None:
        """Forget the context's tokens: llama-cpp-python prefills the whole prompt."""
        self.context.go_cold(self.llm)

    # ---------------------------------------------------------------- media
    def catch_up(self) -> tuple[int, np.ndarray] | None:
        """(Holding the guard.) Mark positions filled behind the hooks' back (a chat
        handler's image or audio) as media of unknown content, never shared; where they
        start and the ids that were there (None: none). See ``media.py``."""
        filled = self.context.catch_up(self.llm)
        if filled is not None and not self._media_logged:
            self._media_logged = True
            log.info(
                "shmkv: %d positions were filled outside Llama.eval (an image or audio "
                "from a multimodal chat handler?): they never match text and states that "
                "hold them are not published (declare media with shmkv.llama.media.prefill "
                "to share them)",
                len(filled[1]),
            )
        return filled

    def media(self, n_positions: int, digest: bytes | None = None) -> None:
        """Declare that the last ``n_positions`` positions of the context (up to
        ``llm.n_tokens``, advanced over them) were just decoded from a media chunk's
        embeddings, not through ``Llama.eval``: they are keyed by ``digest`` (what
        determines the embeddings: the media's bytes and the projector), so prompts with
        the same media there share the state; None: not known, never shared."""
        ids = (
            np.full(n_positions, media.UNKNOWN, dtype=np.int32)
            if digest is None
            else media.pseudo_ids(digest, n_positions)
        )
        with self.guard:
            self.context.declare(self.llm, n_positions, ids)

    def restore_media(self, prompt: np.ndarray) -> int:
        """``media.prefill``'s restore of a media prompt's ids: counted in the numbers of
        the call that completes the prompt next. Returns the positions now in context."""
        with self.guard:
            before = self.last = CallStats(prompt_tokens=len(prompt), started_at=time.monotonic())
            have = self.restore(prompt.tolist())
            self.media_prefill = (have, before)
            return have

    def cut_back(self, n_tokens: int) -> None:
        """Keep only the context's first ``n_tokens`` positions (cells included), e.g.
        before decoding media after them (``media.prefill``)."""
        with self.guard:
            self.context.cut_back(self.llm, n_tokens)

    def reset(self, orig_reset: Any) -> None:
        """The body of the hooked ``Llama.reset`` (``n_tokens`` goes to 0): what a chat
        handler fills next is seen from 0 (``catch_up``)."""
        with self.guard:
            orig_reset()
            self.context.seen = 0

    # ---------------------------------------------------------------- restore
    def _call_for(self, tokens: Sequence[int]) -> Call:
        root = self.root_for(tenant.current())
        if self.call is None or not self.call.is_for(tokens, root):
            self.call = Call(self, tokens)
        return self.call

    def probe(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` a :meth:`restore` would leave in the context now, with
        nothing restored (the current tenant's records only)."""
        call = self._call_for(tokens)
        self.enter(call.root)
        return self.restorer.probe(call.prompt, call.digests)

    def restore(self, tokens: Sequence[int]) -> int:
        """Restore the longest usable cached prefix of ``tokens`` if it beats the context's own
        (the current tenant's records only; another tenant's cells in the context are wiped).

        Returns the number of tokens now in the context that match ``tokens``.
        """
        call = self._call_for(tokens)
        self.enter(call.root)
        done = self.restorer.restore(call.prompt, call.digests, self.last)
        if done.checkpoint:
            call.checkpoint_at = done.checkpoint
        if done.corrupt:
            call.republish = True
        return done.tokens

    def keep_local(
        self, prompt: np.ndarray, held: int | None = None, limit: int | None = None
    ) -> int:
        """How many of its own tokens the context keeps for ``prompt``; cuts it to that
        where the policy (or ``limit``, a cap on what it may keep) says so."""
        return self.restorer.keep_local(prompt, held, limit)

    def restore_or_claim(self, tokens: Sequence[int]) -> int:
        """Restore, and if a long prefill remains, claim it or wait for whoever claimed it.

        Returns the number of prompt tokens already in the context.
        """
        return self._call_for(tokens).coalesce()

    # ---------------------------------------------------------------- publish
    def capture(
        self,
        n_tokens: int | None = None,
        pin: bool = False,
        claimed: list[bytes] | None = None,
        min_new: int = 1,
        covered: int = 0,
        checkpoints: Sequence[Checkpoint] = (),
    ) -> bool:
        """Copy the context's current sequence state and queue it for the supervisor, if
        it adds ``min_new`` tokens to what is cached and to ``covered`` (``capture.py``),
        with a hybrid's ``checkpoints`` cut from it."""
        return self.capturer.capture(
            self.chunk_tokens,
            self.last,
            self.call,
            n_tokens,
            pin,
            claimed,
            min_new,
            covered,
            checkpoints,
        )

    def _cut_refused(self) -> None:
        """On the publisher thread: a hybrid's checkpoint could not be cut from the state
        it came with (a layout ``kvformat.hybrid_layout`` does not read): from now on this
        cache's checkpoints are captured whole, as before."""
        if self.recurrent_checkpoints:
            self.recurrent_checkpoints = False
            self._set_rules(checkpoint_every=0)
            self.ledger.fail(
                "checkpoint not cut",
                ShmkvError(
                    "a hybrid checkpoint could not be cut from the prompt's state (its layout "
                    "is not the one shmkv reads): checkpoints are now copied whole, which "
                    "costs a copy of the attention cells per checkpoint; please report it"
                ),
            )

    def whole_states_only(self) -> None:
        """llama.cpp refused to cut a state back (a model ``kvstate.whole_states_only`` did
        not recognise): plan for whole states only from now on, as for a recurrent model."""
        if self.n_swa == policy.WHOLE:
            return
        self.n_swa = policy.WHOLE
        self._set_rules(n_swa=policy.WHOLE)
        self.chat_boundaries = boundaries.ChatBoundaries(self.llm)

    def _set_rules(self, **changes: Any) -> None:
        """Plan by the policy's rules with ``changes`` from now on."""
        self.policy = policy.strategy(replace(self.policy.rules, **changes))
        self.restorer.policy = self.capturer.policy = self.policy

    def _publish_failed(self, err: BaseException, claimed: list[bytes] | None) -> None:
        """On the publisher thread: a put failed."""
        self.ledger.fail("publish failed", err)
        self.ledger.add(publish_failures=1)
        if claimed:  # nobody else will index them: let the waiters go
            self.claims.end(claimed)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until queued publishes and counters reached the supervisor."""
        return self.publisher.flush(timeout)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.publisher.close()
        self.reader.close()
        if self.cpu is not None:
            self.cpu.close()

    def hint_boundaries(self, prefixes: Sequence[Sequence[int] | np.ndarray]) -> None:
        """Message boundaries of the next call's prompt, as token prefixes of it: a model
        whose states cannot be cut back (sliding windows) publishes a checkpoint where
        its prompt stops matching each (those worth it), which later prompts sharing that
        much restore whole (a prefix the prompt does not match is ignored:
        ``boundaries.Hints``). The hooked
        ``create_chat_completion`` hints each chat (``boundaries.py``); for a prompt of
        your own, ``hint_boundaries([tokens[:n1], tokens[:n2]])`` before
        ``create_completion(tokens)``.
        """
        self.hints.add(prefixes)

    def generate(
        self, orig_generate: Any, tokens: Sequence[int], reset: bool = True, **kwargs: Any
    ) -> Iterator[int]:
        """The body of the hooked ``Llama.generate``."""
        wants = self.prompt_logits.take()
        # (a generate call that did not come through a completion may read any logits)
        call = Call(self, list(tokens), prompt_logits=self.logits_all and wants is not False)
        call.boundaries = self.hints.take(call.prompt)
        return (yield from call.run(orig_generate, reset, kwargs))

    def eval(self, orig_eval: Any, tokens: Sequence[int]) -> None:
        """The body of the hooked ``Llama.eval``: under the guard, and keeping count of the
        logits rows it fills (``scores_valid``), on the cores of the CPU budget if the cache
        has one (``cpu/budget.py``), timed while it is the call's prefill
        (``CallStats.prefill_seconds``)."""
        llm, guard, context = self.llm, self.guard, self.context
        outside = not guard.held_here()
        with guard:
            self.catch_up()  # (an image a chat handler decoded before this eval)
            if outside:  # not a step of a call: the cells are nobody's now
                guard.begin()
                # (on top of another tenant's cells, the context is then nobody's)
                self.enter(self.root_for(tenant.current()), reset=llm.n_tokens == 0)
            start, t0 = llm.n_tokens, time.monotonic()
            try:
                if self.cpu is None:
                    orig_eval(tokens)
                else:  # on cores of the deployment's CPU budget
                    cpubudget.run_eval(self, orig_eval, tokens)
            finally:
                context.seen = llm.n_tokens
                if self.logits_all and start <= context.scores_valid:
                    context.scores_valid = llm.n_tokens
                last = self.last
                if not outside and not last.first_token_at:  # the call's prefill: timed
                    last.prefill_end_at = time.monotonic()
                    last.prefill_seconds += last.prefill_end_at - t0

    def completion(self, orig: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
        """The body of the hooked ``Llama._create_completion``: tells the generate call it
        makes (on this thread) whether it reads the prompt's logits."""
        return hooks.run_completion(self.prompt_logits, orig, *args, **kwargs)

    def chat_completion(self, orig: Any, *args: Any, **kwargs: Any) -> Any:
        """The body of the hooked ``Llama.create_chat_completion``: hints where the
        messages of its prompt start (``boundaries.py``)."""
        return hooks.run_chat_completion(self.chat_boundaries, self.hints, orig, *args, **kwargs)


def attach(
    llm: llama_cpp.Llama,
    name: str | None = None,
    namespace: str | None = None,
    socket_path: str | None = None,
    **kwargs: Any,
) -> SharedPrefixCache:
    """Make an existing ``Llama`` share prompt state through the arena ``name``.

    Returns the cache object (also at ``llm.shmkv``); ``llm.shmkv.last`` tells what
    the last call restored and evaluated.
    """
    existing = getattr(llm, "shmkv", None)
    if isinstance(existing, SharedPrefixCache):
        return existing
    cache = SharedPrefixCache(
        llm, name=name, namespace=namespace, socket_path=socket_path, **kwargs
    )
    hooks.install(cache, llm)
    llm.shmkv = cache  # type: ignore[attr-defined]
    return cache


class SharedCacheLlama(compat.CompletionOverride, llama_cpp.Llama):
    """A drop-in ``llama_cpp.Llama`` whose prompts are shared through a shmkv arena.

    Extra keyword arguments: ``shmkv_name``, ``shmkv_namespace``, ``shmkv_socket``,
    ``shmkv_min_tokens``, ``shmkv_exact``. ``self.shmkv.last`` tells what the last call
    restored.
    """

    shmkv: SharedPrefixCache

    def __init__(
        self,
        *args: Any,
        shmkv_name: str | None = None,
        shmkv_namespace: str | None = None,
        shmkv_socket: str | None = None,
        shmkv_min_tokens: int | None = None,
        shmkv_exact: bool | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.shmkv = SharedPrefixCache(
            self,
            name=shmkv_name,
            namespace=shmkv_namespace,
            socket_path=shmkv_socket,
            min_tokens=shmkv_min_tokens,
            exact=shmkv_exact,
        )

    def generate(  # type: ignore[override]
        self,
        tokens: Sequence[int],
        reset: bool = True,
        **kwargs: Any,
    ) -> Iterator[int]:
        return self.shmkv.generate(super().generate, tokens, reset=reset, **kwargs)

    def eval(self, tokens: Sequence[int]) -> None:
        self.shmkv.eval(super().eval, tokens)

    def reset(self) -> None:
        cache = getattr(self, "shmkv", None)  # (None while Llama.__init__ runs)
        if cache is None:
            super().reset()  # type: ignore[no-untyped-call]
        else:
            cache.reset(super().reset)

    def create_chat_completion(self, *args: Any, **kwargs: Any) -> Any:
        return self.shmkv.chat_completion(super().create_chat_completion, *args, **kwargs)
