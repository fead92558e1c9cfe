"""The hooks on a ``Llama``: ``generate``, ``eval`` and ``_create_completion``.

:func:`install` wraps those three methods of an existing ``Llama`` (``attach``);
``SharedCacheLlama`` overrides them instead. Either way ``generate`` goes to the
cache (``SharedPrefixCache.generate``), ``eval`` runs under the cache's context
guard while it keeps count of the logits rows the context fills, on the cores of
the CPU budget if the cache has one (:func:`run_eval`, ``cpubudget.py``), and
``_create_completion`` tells the generate call it makes whether it reads the
prompt's logits (:func:`run_completion`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import llama_cpp

from . import cpubudget, tenant

if TYPE_CHECKING:
    from .llama import SharedPrefixCache

_COMPLETION_PARAMS = inspect.signature(llama_cpp.Llama._create_completion)


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
        start = llm.n_tokens
        try:
            if cache.cpu is None:
                orig_eval(tokens)
            else:  # on cores of the deployment's CPU budget
                cpubudget.run_eval(cache, orig_eval, tokens)
        finally:
            if cache.logits_all and start <= cache.scores_valid:
                cache.scores_valid = llm.n_tokens


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


def install(cache: SharedPrefixCache, llm: llama_cpp.Llama) -> None:
    """Wrap ``llm``'s ``generate``, ``eval`` and ``_create_completion`` around ``cache``."""
    llm.generate = _hooked_generate(cache, llm.generate)  # type: ignore[method-assign,assignment]
    llm.eval = _hooked_eval(cache, llm.eval)  # type: ignore[method-assign,assignment]
    llm._create_completion = _hooked_completion(cache, llm._create_completion)  # type: ignore[method-assign]
