"""One restore of a prompt's prefix from the arena, for a ``SharedPrefixCache``.

:class:`Restorer` finds the prompt's longest cached prefix (lock-free lookup), has
``policy.py`` plan which record to restore, lets ``kvstate.apply`` carry the plan
out, and counts what happened on the cache's ledger and ``last``. Failures cost a
cold prefill, never the generation.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from shmkv.core.arena import common_prefix
from shmkv.core.errors import ArenaCorruptError, ShmkvError
from shmkv.llama import kvstate

if TYPE_CHECKING:
    from shmkv.llama.cache import Call, SharedPrefixCache


class Restorer:
    """Restores the longest usable cached prefix of a call's prompt into the cache's context."""

    def __init__(self, cache: SharedPrefixCache) -> None:
        self.cache = cache

    def restore(self, call: Call) -> int:
        """Restore the longest usable cached prefix of ``call``'s prompt if it beats the
        context's own; returns the number of tokens now in the context that match it."""
        cache = self.cache
        llm, ledger, reader = cache.llm, cache.ledger, cache.reader
        prompt = call.prompt
        held = common_prefix(np.asarray(llm.input_ids[: llm.n_tokens], dtype=np.int32), prompt)
        local = cache.keep_local(prompt, held=held)
        t0 = time.perf_counter()
        try:
            view = reader.ensure()
            chunk = view.geometry.chunk_tokens
            if len(prompt) < chunk:
                return local
            digests = call.digests(chunk)
            hit = reader.lookup(digests)
        except ArenaCorruptError as e:
            ledger.fail("corrupt arena", e)
            ledger.add(restore_failures=1)
            return local
        except ShmkvError as e:
            ledger.fail("supervisor unavailable", e)
            return local
        trust = cache.trust()
        try:
            plan = cache.policy.plan(
                view, prompt, chunk, digests, hit, local, cache._owners(trust), trust
            )
        except ShmkvError as e:  # (the owners round trip)
            ledger.fail("supervisor unavailable", e)
            return local
        if plan.problem:
            ledger.fail(*plan.problem)
        if plan.window_unusable:
            ledger.add(swa_unusable=1)
        if plan.untrusted:
            ledger.add(untrusted=plan.untrusted)
        if plan.miss:
            ledger.add(misses=1)
        if plan.checkpoint:
            call.checkpoint_at = plan.checkpoint
        if plan.hit is None:
            return local
        done = kvstate.apply(
            llm,
            reader,
            plan.hit,
            prompt,
            chunk=chunk,
            local=local,
            keep=plan.keep,
            n_swa=cache.n_swa,
            fingerprint=cache.fingerprint,
            verify=cache.verify,
            trust=trust,
        )
        if done.failure:
            ledger.fail(*done.failure)
        if done.failed:
            ledger.add(restore_failures=1)
        if done.corrupt:
            call.republish = True
        if done.evicted:
            ledger.add(misses=1)
        if done.refused:
            ledger.add(misses=1, states_refused=1)
        if done.untrusted:
            ledger.add(untrusted=1, misses=1)
        if not done.restored:
            return local if llm.n_tokens else 0  # (0: the context went cold)
        # the rows past what the context held are another prompt's logits, or none
        cache.scores_valid = min(cache.scores_valid, held)
        dt = time.perf_counter() - t0
        ledger.add(hits=1, tokens_restored=done.restored, restore_seconds=dt)
        last = cache.last
        last.tokens_restored = done.restored
        last.restore_seconds = dt
        last.hit = True
        return done.restored
