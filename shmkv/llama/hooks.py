"""The hooks on a ``Llama``: ``generate``, ``eval``, ``reset``, ``_create_completion``
and ``create_chat_completion``.

:func:`install` wraps those five methods of an existing ``Llama`` (``attach``) around
a :class:`Hooked` object (the cache); ``SharedCacheLlama`` overrides them instead.
Either way ``generate`` and ``eval`` go to the cache (``SharedPrefixCache.generate``,
``SharedPrefixCache.eval``), ``_create_completion`` tells the generate call it makes
whether it reads the prompt's logits (:func:`run_completion`, through a
:class:`PromptLogits`), ``reset`` tells the cache that what fills the context next
starts at 0 (a chat handler's image: ``media.py``), and ``create_chat_completion`` tells
the cache where its messages start (:func:`run_chat_completion`, ``boundaries.py``).
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import llama_cpp

from shmkv.llama import boundaries, compat

_COMPLETION_PARAMS = compat.completion_signature()
_CHAT_PARAMS = inspect.signature(llama_cpp.Llama.create_chat_completion)


class Hooked(Protocol):
    """What the hooks call: the bodies of the four hooked methods (the cache)."""

    def generate(
        self, orig_generate: Any, tokens: Sequence[int], reset: bool = True, **kwargs: Any
    ) -> Iterator[int]: ...

    def eval(self, orig_eval: Any, tokens: Sequence[int]) -> None: ...

    def reset(self, orig_reset: Any) -> None: ...

    def completion(self, orig: Any, *args: Any, **kwargs: Any) -> Iterator[Any]: ...

    def chat_completion(self, orig: Any, *args: Any, **kwargs: Any) -> Any: ...


class PromptLogits(threading.local):
    """Set by the hooked ``_create_completion`` for the generate call it makes, on its
    thread: whether that call reads the prompt's logits (None: not known)."""

    def __init__(self) -> None:
        self.wanted: bool | None = None

    def take(self) -> bool | None:
        """What the completion around this generate call (on this thread) said about the
        prompt's logits, once (None: not known, e.g. no completion around it)."""
        wants, self.wanted = self.wanted, None
        return wants


def run_completion(flag: PromptLogits, orig: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
    """The body of the hooked ``Llama._create_completion``: tells the generate call it
    makes (on this thread, through ``flag``) whether it reads the prompt's logits."""
    try:
        bound = _COMPLETION_PARAMS.bind_partial(None, *args, **kwargs).arguments
        wants = bool(bound.get("echo")) and bound.get("logprobs") is not None
    except TypeError:  # (a signature we do not know: let the generate call assume so)
        wants = None
    flag.wanted = wants
    try:
        yield from orig(*args, **kwargs)
    finally:
        flag.wanted = None


def run_chat_completion(
    chat: boundaries.ChatBoundaries | None,
    hints: boundaries.Hints,
    orig: Any,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """The body of the hooked ``Llama.create_chat_completion``: hint where its messages
    start (a model whose states cannot be cut back checkpoints there), then run it."""
    if chat is not None:
        try:
            bound = _CHAT_PARAMS.bind_partial(None, *args, **kwargs).arguments
            hints.add(chat.prefixes(bound.get("messages") or [], bound))
        except Exception as e:  # (a chat the template refuses: the completion says so)
            boundaries.log.debug("no chat boundaries: %s", e)
    return orig(*args, **kwargs)


def _hooked_generate(cache: Hooked, orig: Any) -> Callable[..., Iterator[int]]:
    def generate(tokens: Sequence[int], reset: bool = True, **kwargs: Any) -> Iterator[int]:
        return cache.generate(orig, tokens, reset=reset, **kwargs)

    generate.__doc__ = orig.__doc__
    return generate


def _hooked_eval(cache: Hooked, orig: Any) -> Callable[[Sequence[int]], None]:
    def eval(tokens: Sequence[int]) -> None:
        cache.eval(orig, tokens)

    eval.__doc__ = orig.__doc__
    return eval


def _hooked_reset(cache: Hooked, orig: Any) -> Callable[[], None]:
    def reset() -> None:
        cache.reset(orig)

    reset.__doc__ = orig.__doc__
    return reset


def _hooked_completion(cache: Hooked, orig: Any) -> Callable[..., Iterator[Any]]:
    def _create_completion(*args: Any, **kwargs: Any) -> Iterator[Any]:
        return cache.completion(orig, *args, **kwargs)

    return _create_completion


def _hooked_chat_completion(cache: Hooked, orig: Any) -> Callable[..., Any]:
    def create_chat_completion(*args: Any, **kwargs: Any) -> Any:
        return cache.chat_completion(orig, *args, **kwargs)

    create_chat_completion.__doc__ = orig.__doc__
    return create_chat_completion


def install(cache: Hooked, llm: llama_cpp.Llama) -> None:
    """Wrap ``llm``'s ``generate``, ``eval``, ``reset``, ``_create_completion`` and
    ``create_chat_completion`` around ``cache``."""
    llm.generate = _hooked_generate(cache, llm.generate)  # type: ignore[method-assign,assignment]
    llm.eval = _hooked_eval(cache, llm.eval)  # type: ignore[method-assign,assignment]
    llm.reset = _hooked_reset(cache, llm.reset)  # type: ignore[method-assign]
    compat.replace_completion(llm, _hooked_completion(cache, compat.completion_method(llm)))
    llm.create_chat_completion = _hooked_chat_completion(cache, llm.create_chat_completion)  # type: ignore[method-assign]
