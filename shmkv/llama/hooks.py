"""The hooks on a ``Llama``: ``generate``, ``eval``, ``_create_completion`` and
``create_chat_completion``.

:func:`install` wraps those four methods of an existing ``Llama`` (``attach``);
``SharedCacheLlama`` overrides them instead. Either way ``generate`` goes to the
cache (``SharedPrefixCache.generate``), ``eval`` runs under the cache's context
guard while it keeps count of the logits rows the context fills, on the cores of
the CPU budget if the cache has one (:func:`run_eval`, ``cpubudget.py``), timed
while it is the call's prefill (``CallStats.prefill_seconds``),
``_create_completion`` tells the generate call it makes whether it reads the
prompt's logits (:func:`run_completion`), and ``create_chat_completion`` tells the
cache where its messages start (:func:`run_chat_completion`, ``boundaries.py``).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import llama_cpp

from shmkv.llama import boundaries, tenant
from shmkv.llama.cpu import budget as cpubudget

if TYPE_CHECKING:
    from shmkv.llama.cache import SharedPrefixCache

_COMPLETION_PARAMS = inspect.signature(llama_cpp.Llama._create_completion)
_CHAT_PARAMS = inspect.signature(llama_cpp.Llama.create_chat_completion)


def run_eval(cache: SharedPrefixCache, orig_eval: Any, tokens: Sequence[int]) -> None:
    """The body of the hooked ``Llama.eval``: under the guard, and keeping count of the
    logits rows it fills (``scores_valid``)."""
    llm, guard = cache.llm, cache.guard
    outside = not guard.held_here()
    with guard:
        if outside:  # not a step of a call: the cells are nobody's now
            guard.begin()
            # (on top of another tenant's cells, the context is then nobody's)
            cache.enter(cache.root_for(tenant.current()), reset=llm.n_tokens == 0)
        start, t0 = llm.n_tokens, time.monotonic()
        try:
            if cache.cpu is None:
                orig_eval(tokens)
            else:  # on cores of the deployment's CPU budget
                cpubudget.run_eval(cache, orig_eval, tokens)
        finally:
            if cache.logits_all and start <= cache.scores_valid:
                cache.scores_valid = llm.n_tokens
            last = cache.last
            if not outside and not last.first_token_at:  # the call's prefill: timed
                last.prefill_end_at = time.monotonic()
                last.prefill_seconds += last.prefill_end_at - t0


def run_completion(cache: SharedPrefixCache, orig: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
    """The body of the hooked ``Llama._create_completion``: tells the generate call it
    makes (on this thread) whether it reads the prompt's logits."""
    try:
        bound = _COMPLETION_PARAMS.bind_partial(None, *args, **kwargs).arguments
        wants = bool(bound.get("echo")) and bound.get("logprobs") is not None
    except TypeError:  # (a signature we do not know: let the generate call assume so)
        wants = None
    cache._completion.prompt_logits = wants
    try:
        yield from orig(*args, **kwargs)
    finally:
        cache._completion.prompt_logits = None


def run_chat_completion(cache: SharedPrefixCache, orig: Any, *args: Any, **kwargs: Any) -> Any:
    """The body of the hooked ``Llama.create_chat_completion``: hint where its messages
    start (a model whose states cannot be cut back checkpoints there), then run it."""
    chat = cache.chat_boundaries
    if chat is not None:
        try:
            bound = _CHAT_PARAMS.bind_partial(None, *args, **kwargs).arguments
            cache.hint_boundaries(chat.prefixes(bound.get("messages") or [], bound))
        except Exception as e:  # (a chat the template refuses: the completion says so)
            boundaries.log.debug("no chat boundaries: %s", e)
    return orig(*args, **kwargs)


def take_prompt_logits(cache: SharedPrefixCache) -> bool | None:
    """What the completion around this generate call (on this thread) said about the
    prompt's logits, once (None: not known, e.g. no completion around it)."""
    wants: bool | None = getattr(cache._completion, "prompt_logits", None)
    cache._completion.prompt_logits = None
    return wants


def _hooked_generate(cache: SharedPrefixCache, orig: Any) -> Callable[..., Iterator[int]]:
    def generate(tokens: Sequence[int], reset: bool = True, **kwargs: Any) -> Iterator[int]:
        return cache.generate(orig, tokens, reset=reset, **kwargs)

    generate.__doc__ = orig.__doc__
    return generate


def _hooked_eval(cache: SharedPrefixCache, orig: Any) -> Callable[[Sequence[int]], None]:
    def eval(tokens: Sequence[int]) -> None:
        cache.eval(orig, tokens)

    eval.__doc__ = orig.__doc__
    return eval


def _hooked_completion(cache: SharedPrefixCache, orig: Any) -> Callable[..., Iterator[Any]]:
    def _create_completion(*args: Any, **kwargs: Any) -> Iterator[Any]:
        return cache.completion(orig, *args, **kwargs)

    return _create_completion


def _hooked_chat_completion(cache: SharedPrefixCache, orig: Any) -> Callable[..., Any]:
    def create_chat_completion(*args: Any, **kwargs: Any) -> Any:
        return cache.chat_completion(orig, *args, **kwargs)

    create_chat_completion.__doc__ = orig.__doc__
    return create_chat_completion


def install(cache: SharedPrefixCache, llm: llama_cpp.Llama) -> None:
    """Wrap ``llm``'s ``generate``, ``eval``, ``_create_completion`` and
    ``create_chat_completion`` around ``cache``."""
    llm.generate = _hooked_generate(cache, llm.generate)  # type: ignore[method-assign,assignment]
    llm.eval = _hooked_eval(cache, llm.eval)  # type: ignore[method-assign,assignment]
    llm._create_completion = _hooked_completion(cache, llm._create_completion)  # type: ignore[method-assign]
    llm.create_chat_completion = _hooked_chat_completion(cache, llm.create_chat_completion)  # type: ignore[method-assign]
