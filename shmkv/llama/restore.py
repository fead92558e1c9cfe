"""One restore of a prompt's prefix from the arena, for a ``SharedPrefixCache``.

:class:`Restorer` finds the prompt's longest cached prefix (lock-free lookup), has
``policy.py`` plan which record to restore, lets ``kvstate.apply`` carry the plan
out, and counts what happened on the cache's ledger and the call's ``CallStats``.
It is given what it works with (the ``Llama``, the reader connection, the ledger, the
policy, the context's :class:`~shmkv.llama.kvstate.ContextState`), never the cache.
Failures cost a cold prefill, never the generation.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import llama_cpp
import numpy as np

from shmkv.core.arena import ArenaView, Hit, common_prefix
from shmkv.core.client import Client
from shmkv.core.errors import ArenaCorruptError, ShmkvError
from shmkv.core.stats import CallStats
from shmkv.llama import kvstate, policy
from shmkv.llama.counters import Ledger


@dataclass(frozen=True)
class Restored:
    """What one restore did for a call."""

    #: prompt tokens now in the context
    tokens: int
    #: publish the state of this many prompt tokens during the prefill (0: none)
    checkpoint: int = 0
    #: met a corrupt record: the call publishes a good copy even if one seems cached
    corrupt: bool = False


@dataclass(frozen=True)
class Found:
    """What the arena's index holds of a prompt: the longest record on its digest chain."""

    view: ArenaView
    chunk: int
    #: the prompt's digest chain for the arena's chunk size
    digests: list[bytes]
    hit: Hit | None


class Restorer:
    """Restores the longest usable cached prefix of a prompt into one context."""

    def __init__(
        self,
        llm: llama_cpp.Llama,
        reader: Client,
        ledger: Ledger,
        strategy: policy.Strategy,
        context: kvstate.ContextState,
        fingerprint: bytes,
        verify: bool,
        trust: Callable[[], policy.Trust],
        cannot_cut: Callable[[], None] = lambda: None,
    ) -> None:
        self.llm, self.reader, self.ledger = llm, reader, ledger
        self.policy, self.context = strategy, context
        self.fingerprint, self.verify, self.trust = fingerprint, verify, trust
        #: called when llama.cpp refused to cut a state back (the cache then plans for
        #: whole states only)
        self.cannot_cut = cannot_cut

    def owners(self, trust: policy.Trust) -> policy.Owners:
        """The supervisor's ``owners``, for records of trusted publishers only."""
        uids = None if trust.uids is None else sorted(trust.uids)
        return lambda digest, tokens: self.reader.owners(digest, tokens, uids)

    def keep_local(
        self, prompt: np.ndarray, held: int | None = None, limit: int | None = None
    ) -> int:
        """How many of its own tokens the context keeps for ``prompt``; cuts it to that
        where the policy (or ``limit``, a cap on what it may keep) says so."""
        llm = self.llm
        if held is None:
            ids = np.asarray(llm.input_ids[: llm.n_tokens], dtype=np.int32)
            held = common_prefix(ids, prompt)
        if limit is not None:
            held = min(held, limit)
        local, cut = self._local(prompt, held)
        if (cut or limit is not None) and local < llm.n_tokens:
            llm.n_tokens = local
            self.context.seen = min(self.context.seen, local)
        return local

    def _local(self, prompt: np.ndarray, held: int) -> tuple[int, bool]:
        """The policy's (tokens the context keeps of the ``held`` it shares with ``prompt``,
        whether it must cut to that)."""
        pos_min = kvstate.pos_min(self.llm) if held and self.policy.rules.n_swa != 0 else -1
        return self.policy.keep_local(
            policy.Local(held, pos_min, self.context.aligned), len(prompt)
        )

    def probe(self, prompt: np.ndarray, digests_of: Callable[[int], list[bytes]]) -> int:
        """How many of ``prompt``'s tokens :meth:`restore` would leave in the context now
        (its own, or the record it would restore), with nothing restored, cut or counted:
        whether to ask ``--remote`` for more before restoring anything."""
        llm = self.llm
        held = common_prefix(np.asarray(llm.input_ids[: llm.n_tokens], dtype=np.int32), prompt)
        local, _ = self._local(prompt, held)
        try:
            found = self._find(prompt, digests_of)
            if found is None:
                return local
            plan, _ = self._plan(prompt, found, local)
        except ShmkvError:  # (restore says what is wrong, and counts it)
            return local
        if plan.hit is None:
            return local
        # (the record shares the prompt's first hit.chunks chunks, its digests say, or
        # what a peek at its tokens found; ``keep`` only bounds what is kept of it)
        shares = max(plan.known or 0, plan.hit.chunks * found.chunk)
        return max(local, min(plan.keep, shares))

    def _find(self, prompt: np.ndarray, digests_of: Callable[[int], list[bytes]]) -> Found | None:
        """The arena's longest record on ``prompt``'s digest chain (lock-free); None if the
        prompt is shorter than a chunk. Raises what the reader raises."""
        view = self.reader.ensure()
        chunk = view.geometry.chunk_tokens
        if len(prompt) < chunk:
            return None
        digests = digests_of(chunk)
        return Found(view, chunk, digests, self.reader.lookup(digests))

    def _plan(
        self, prompt: np.ndarray, found: Found, local: int
    ) -> tuple[policy.Plan, policy.Trust]:
        """The policy's plan for what ``found`` offers a context that keeps ``local`` tokens
        (one owners round trip where the policy needs it), and the trust it was made under.
        Raises ShmkvError if the supervisor cannot be asked."""
        trust = self.trust()
        owners = self.owners(trust)
        lookup = policy.Lookup(
            found.view, prompt, found.chunk, found.digests, found.hit, local, owners, trust
        )
        return self.policy.plan(lookup), trust

    def restore(
        self, prompt: np.ndarray, digests_of: Callable[[int], list[bytes]], last: CallStats
    ) -> Restored:
        """Restore the longest usable cached prefix of ``prompt`` (whose digest chain for
        a chunk size is ``digests_of(chunk)``) if it beats the context's own; counted in
        ``last``, the call's numbers."""
        llm, ledger, reader = self.llm, self.ledger, self.reader
        held = common_prefix(np.asarray(llm.input_ids[: llm.n_tokens], dtype=np.int32), prompt)
        local = self.keep_local(prompt, held=held)
        t0 = time.perf_counter()
        try:
            found = self._find(prompt, digests_of)
        except ArenaCorruptError as e:
            ledger.fail("corrupt arena", e)
            ledger.add(restore_failures=1)
            return Restored(local)
        except ShmkvError as e:
            ledger.fail("supervisor unavailable", e)
            return Restored(local)
        if found is None:
            return Restored(local)
        chunk = found.chunk
        try:
            plan, trust = self._plan(prompt, found, local)
        except ShmkvError as e:  # (the owners round trip)
            ledger.fail("supervisor unavailable", e)
            return Restored(local)
        if plan.problem:
            ledger.fail(*plan.problem)
        if plan.window_unusable:
            ledger.add(swa_unusable=1)
        if plan.untrusted:
            ledger.add(untrusted=plan.untrusted)
        if plan.miss:
            ledger.add(misses=1)
        if plan.hit is None:
            return Restored(local, checkpoint=plan.checkpoint)
        done = kvstate.apply(
            llm,
            reader,
            plan.hit,
            prompt,
            chunk=chunk,
            local=local,
            keep=plan.keep,
            n_swa=self.policy.rules.n_swa,
            fingerprint=self.fingerprint,
            verify=self.verify,
            trust=trust,
        )
        # (shmkv set n_tokens: a restore's cells, or a context gone cold)
        self.context.seen = llm.n_tokens if done.restored else min(self.context.seen, llm.n_tokens)
        if done.failure:
            ledger.fail(*done.failure)
        if done.failed:
            ledger.add(restore_failures=1)
        if done.evicted:
            ledger.add(misses=1)
        if done.refused:
            ledger.add(misses=1, states_refused=1)
        if done.cannot_cut:
            self.cannot_cut()
        if done.untrusted:
            ledger.add(untrusted=1, misses=1)
        if not done.restored:
            in_context = local if llm.n_tokens else 0  # (0: the context went cold)
            return Restored(in_context, checkpoint=plan.checkpoint, corrupt=done.corrupt)
        # the rows past what the context held are another prompt's logits, or none
        self.context.scores_valid = min(self.context.scores_valid, held)
        dt = time.perf_counter() - t0
        ledger.add(hits=1, tokens_restored=done.restored, restore_seconds=dt)
        last.tokens_restored = done.restored
        last.restore_seconds = dt
        last.hit = True
        return Restored(done.restored, checkpoint=plan.checkpoint, corrupt=done.corrupt)
