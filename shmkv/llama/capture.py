"""Whether and how a worker publishes its context's state: ``SharedPrefixCache.capture``.

Runs inside each worker, on the thread of the call that computed the state. A state is
published only if the context belongs to a tenant (its key root), the cache policy lets
a state of that length go, and it adds ``min_new`` tokens to what the arena already
holds; it is then copied out of the context (``kvstate.copy_out``) and queued for the
publisher thread (``publisher.py``), never waited for. :class:`Capturer` is given what
it works with (the ``Llama``, the context's state, the policy, the publisher, the
ledger), never the cache. A state that holds media of unknown content
(``kvstate.UNKNOWN``, ``media.py``) is never published.

A hybrid model's checkpoint (``Capturer.recurrent``) is its recurrent state alone, a
small copy: the call holds it until it captures the prompt's state, which the publisher
cuts it from (``publisher.py``), so the prefill copies no attention cell more than once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import llama_cpp
import numpy as np

from shmkv.core.errors import ShmkvError
from shmkv.core.keys import chain_digests
from shmkv.core.stats import CallStats
from shmkv.llama import kvstate, policy
from shmkv.llama.counters import Ledger
from shmkv.llama.publisher import Checkpoint, Publisher


class Prompt(Protocol):
    """What a capture asks of the call whose state it publishes (``cache.Call``)."""

    @property
    def root(self) -> bytes: ...

    @property
    def republish(self) -> bool: ...

    def digests_of(self, tokens: np.ndarray, chunk: int) -> list[bytes]: ...


class Capturer:
    """Publishes one context's state."""

    def __init__(
        self,
        llm: llama_cpp.Llama,
        context: kvstate.ContextState,
        strategy: policy.Strategy,
        publisher: Publisher,
        ledger: Ledger,
        trust: Callable[[], policy.Trust],
    ) -> None:
        self.llm, self.context, self.policy = llm, context, strategy
        self.publisher, self.ledger, self.trust = publisher, ledger, trust

    def capture(
        self,
        chunk: int | None,
        last: CallStats,
        call: Prompt | None = None,
        n_tokens: int | None = None,
        pin: bool = False,
        claimed: list[bytes] | None = None,
        min_new: int = 1,
        covered: int = 0,
        checkpoints: Sequence[Checkpoint] = (),
    ) -> bool:
        """Copy the context's current sequence state and queue it for the supervisor.

        Only if it adds ``min_new`` tokens to what is cached (0: always, e.g. a
        sliding-window checkpoint that a longer record cannot stand in for) and to
        ``covered``, the leading tokens known to be published already (the prompt,
        when its completion is captured). The state is published under the key root of
        the tenant whose calls computed it (never, if the context is nobody's).
        ``chunk``: the arena's chunk size (None: not attached); ``last``: the numbers of
        the current call, ``call`` (if any); ``checkpoints``: a hybrid's (:meth:`recurrent`)
        of shorter prefixes, published with it (dropped with it).
        """
        llm = self.llm
        n = llm.n_tokens if n_tokens is None else n_tokens
        root = self.context.root
        tokens = self._publishable(chunk, n)
        if root is None or chunk is None or tokens is None:
            return False
        republish = call is not None and call.republish
        if not republish and n - max(covered, self.coverage(tokens, chunk, root, call)) < min_new:
            return False  # (nearly) all of it is cached already
        try:
            blob = kvstate.copy_out(llm, n, self.publisher.writer)
        except (ShmkvError, OSError) as e:
            self.ledger.fail("publish failed", e)
            self.ledger.add(publish_failures=1)
            return False
        if blob is None:
            return False  # the KV cache does not hold exactly these tokens
        cuts = [c for c in checkpoints if c[0] < n]
        if not self.publisher.submit(root, tokens, blob, pin, claimed, cuts):
            self.ledger.add(publish_dropped=1 + len(cuts))
            return False
        self.ledger.add(publishes=1 + len(cuts))
        last.published += 1 + len(cuts)
        return True

    def recurrent(self, chunk: int | None, n_tokens: int) -> Checkpoint | None:
        """A hybrid's checkpoint of the context's ``n_tokens`` tokens: its recurrent state
        alone (``kvstate.copy_recurrent``), for :meth:`capture` to publish with the state
        it is cut from; None where :meth:`capture` would publish nothing (the same rules)
        or llama.cpp gave no such state."""
        if self.context.root is None or self._publishable(chunk, n_tokens) is None:
            return None
        state = kvstate.copy_recurrent(self.llm, n_tokens)
        return None if state is None else (n_tokens, state)

    def _publishable(self, chunk: int | None, n: int) -> np.ndarray | None:
        """The context's first ``n`` tokens if a state of them may be published: the policy
        lets that length go, it is the context's length, and no position holds media of
        unknown content (its cells must never match text); else None."""
        llm = self.llm
        if not self.policy.may_publish(n, self.context.aligned):
            return None
        if chunk is None or n < self.policy.rules.min_publish(chunk) or n != llm.n_tokens:
            return None
        tokens = np.array(llm.input_ids[:n], dtype=np.int32)
        return None if (tokens == kvstate.UNKNOWN).any() else tokens

    def coverage(
        self, tokens: np.ndarray, chunk: int, root: bytes, call: Prompt | None = None
    ) -> int:
        """How many leading ``tokens`` a record of root ``root`` already holds (a hint)."""
        try:
            view = self.publisher.writer.ensure()
            digests = (
                call.digests_of(tokens, chunk)
                if call is not None and call.root == root
                else chain_digests(root, tokens, chunk)
            )
            return policy.coverage(view, tokens, digests, self.policy.rules.n_swa, self.trust())
        except (ShmkvError, ValueError):
            return 0
