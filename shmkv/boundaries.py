"""Where a chat prompt's messages start: checkpoint hints for sliding-window models.

Runs inside a worker (a served gunicorn worker, ``shmkv warm``, any program with a
``SharedCacheLlama`` or ``attach``) when a chat completion starts, before its prompt
is evaluated.

A sliding-window state is restored only whole (``policy.py``), so a later prompt
gains from a state only if one was published exactly where it parts from the
earlier prompt. For a chat that place is known before the prefill: where the
messages that many requests share end (the system message; a few-shot block or a
conversation's history before its last user message). This module renders those
leading messages with the chat formatter llama-cpp-python uses for the request,
tokenizes them as its chat handler does, and takes the token prefix they share
with the whole prompt's tokens (text and token boundaries need not line up: the
shared token prefix is what a restore can use). The cache publishes a checkpoint
at each such position during the first prefill
(``SharedPrefixCache.hint_boundaries``), so the second request on the same system
prompt restores it whole.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import llama_cpp
import numpy as np
from llama_cpp.llama_chat_format import get_chat_completion_handler

from .arena import common_prefix

log = logging.getLogger(__name__)

#: message roles whose leading run is a system prompt
SYSTEM_ROLES = ("system", "developer")
#: the chat formatter's arguments besides the messages that change what it renders
RENDER_ARGS = ("functions", "function_call", "tools", "tool_choice")


def formatter_of(llm: llama_cpp.Llama) -> Callable[..., Any] | None:
    """The chat formatter behind ``llm``'s chat handler, or None.

    llama-cpp-python makes the handler of every registered chat format and of a GGUF's
    own template with ``chat_formatter_to_chat_completion_handler(formatter)``, a
    closure over the formatter; that is the formatter found here. Other handlers
    (a ``chat_handler`` object, e.g. multimodal ones) render their own way: None.
    """
    try:
        handler = (
            llm.chat_handler
            or llm._chat_handlers.get(llm.chat_format or "")
            or get_chat_completion_handler(llm.chat_format)  # type: ignore[arg-type]
        )
    except Exception:  # (no such format: the completion itself will say so)
        return None
    code = getattr(handler, "__code__", None)
    cells = getattr(handler, "__closure__", None)
    if code is None or not cells or "chat_formatter" not in code.co_freevars:
        return None
    formatter = cells[code.co_freevars.index("chat_formatter")].cell_contents
    return formatter if callable(formatter) else None


def prefix_lengths(messages: Sequence[Any]) -> list[int]:
    """How many leading messages end where a checkpoint is worth it, ascending.

    The leading system (and developer) messages, and everything before the last user
    message (a few-shot block, or a conversation's history) when that is more: each
    only if a message follows it.
    """
    roles = [m.get("role") if isinstance(m, Mapping) else None for m in messages]
    n_system = 0
    while n_system < len(roles) and roles[n_system] in SYSTEM_ROLES:
        n_system += 1
    last_user = max((i for i, r in enumerate(roles) if r == "user"), default=-1)
    out = [n_system] if 0 < n_system < len(roles) else []
    if last_user > n_system:
        out.append(last_user)
    return out


def render_tokens(
    llm: llama_cpp.Llama,
    formatter: Callable[..., Any],
    messages: Sequence[Any],
    render: Mapping[str, Any],
) -> list[int]:
    """The tokens of ``messages`` as llama-cpp-python's chat handler renders and
    tokenizes them (``chat_formatter_to_chat_completion_handler``)."""
    result = formatter(messages=list(messages), **render)
    return list(
        llm.tokenize(result.prompt.encode("utf-8"), add_bos=not result.added_special, special=True)
    )


def chat_boundaries(
    llm: llama_cpp.Llama, messages: Sequence[Any], render: Mapping[str, Any] | None = None
) -> tuple[list[int], list[int]] | None:
    """(the prompt's tokens, where its shared leading messages end) for a chat that
    ``llm``'s chat formatter renders; None if it has no formatter we can render or the
    chat no such boundary. ``render``: the formatter's other arguments (tools, ...)."""
    lengths = prefix_lengths(messages)
    formatter = formatter_of(llm) if lengths else None
    if formatter is None:
        return None
    render = {k: v for k, v in (render or {}).items() if k in RENDER_ARGS}
    full = render_tokens(llm, formatter, messages, render)
    prompt = np.asarray(full, dtype=np.int32)
    points = set()
    for k in lengths:
        try:  # (a template may refuse a conversation cut there: no boundary then)
            part = render_tokens(llm, formatter, messages[:k], render)
        except Exception as e:
            log.debug("chat boundary after %d message(s) not rendered: %s", k, e)
            continue
        n = common_prefix(np.asarray(part, dtype=np.int32), prompt)
        if 0 < n < len(full):
            points.add(n)
    return full, sorted(points)
