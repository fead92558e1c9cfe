"""Whether and how a worker publishes its context's state: ``SharedPrefixCache.capture``.

Runs inside each worker, on the thread of the call that computed the state. A state is
published only if the context belongs to a tenant (its key root), the cache policy lets
a state of that length go, and it adds ``min_new`` tokens to what the arena already
holds; it is then copied out of the context (``kvstate.copy_out``) and queued for the
publisher thread (``publisher.py``), never waited for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from shmkv.core.errors import ShmkvError
from shmkv.core.keys import chain_digests
from shmkv.llama import kvstate, policy

if TYPE_CHECKING:
    from shmkv.llama.cache import SharedPrefixCache


def capture(
    cache: SharedPrefixCache,
    n_tokens: int | None = None,
    pin: bool = False,
    claimed: list[bytes] | None = None,
    min_new: int = 1,
    covered: int = 0,
) -> bool:
    """Copy the context's current sequence state and queue it for the supervisor.

    Only if it adds ``min_new`` tokens to what is cached (0: always, e.g. a
    sliding-window checkpoint that a longer record cannot stand in for) and to
    ``covered``, the leading tokens known to be published already (the prompt,
    when its completion is captured). The state is published under the key root of
    the tenant whose calls computed it (never, if the context is nobody's).
    """
    llm = cache.llm
    n = llm.n_tokens if n_tokens is None else n_tokens
    root = cache.context_root
    if root is None or not cache.policy.may_publish(n, cache._aligned):
        return False
    chunk = cache.chunk_tokens
    if chunk is None or n < cache.policy.rules.min_publish(chunk) or n != llm.n_tokens:
        return False
    tokens = np.array(llm.input_ids[:n], dtype=np.int32)
    republish = cache.call is not None and cache.call.republish
    if not republish and n - max(covered, coverage(cache, tokens, chunk, root)) < min_new:
        return False  # (nearly) all of it is cached already
    try:
        blob = kvstate.copy_out(llm, n, cache.writer)
    except (ShmkvError, OSError) as e:
        cache.ledger.fail("publish failed", e)
        cache.ledger.add(publish_failures=1)
        return False
    if blob is None:
        return False  # the KV cache does not hold exactly these tokens
    if not cache.publisher.submit(root, tokens, blob, pin, claimed):
        cache.ledger.add(publish_dropped=1)
        return False
    cache.ledger.add(publishes=1)
    cache.last.published += 1
    return True


def coverage(cache: SharedPrefixCache, tokens: np.ndarray, chunk: int, root: bytes) -> int:
    """How many leading ``tokens`` a record of root ``root`` already holds (a hint)."""
    try:
        view = cache.writer.ensure()
        digests = (
            cache.call.digests_of(tokens, chunk)
            if cache.call is not None and cache.call.root == root
            else chain_digests(root, tokens, chunk)
        )
        return policy.coverage(view, tokens, digests, cache.n_swa, cache.trust())
    except (ShmkvError, ValueError):
        return 0
