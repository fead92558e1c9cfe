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
takes the text they share with the whole chat's rendering and tokenizes it as its
chat handler tokenizes a prompt. The cache takes the token prefix that and the
prompt share (text and token boundaries need not line up: the shared token prefix
is what a restore can use) and publishes a checkpoint there during the first
prefill (``SharedPrefixCache.hint_boundaries``), so the second request on the same
system prompt restores it whole.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import llama_cpp
import numpy as np
from llama_cpp.llama_chat_format import get_chat_completion_handler

from shmkv.core.arena import common_prefix
from shmkv.llama import compat

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
            or compat.registered_chat_handler(llm)
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


def shared_text(a: str, b: str) -> int:
    """How many leading characters ``a`` and ``b`` share (binary search over C compares)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class ChatBoundaries:
    """Where a chat's shared leading messages end, as token prefixes of its prompt, for
    one ``Llama`` (its chat formatter and tokenizer).

    The formatter renders the whole chat and each leading part (cheap); the text the two
    share is tokenized as the chat handler tokenizes a prompt, which is the costly step
    (a few ms per thousand tokens on Gemma's vocabulary), so the last few such texts are
    kept: a system message shared by many chats is tokenized once. The whole prompt is
    not tokenized here (the handler does that): the cache compares these prefixes with
    the prompt it is given (``SharedPrefixCache.hint_boundaries``).
    """

    #: texts whose tokens are kept (a few system messages and few-shot blocks)
    KEEP = 8

    def __init__(self, llm: llama_cpp.Llama) -> None:
        self.llm = llm
        self._tokens: OrderedDict[tuple[str, bool], np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def _tokenize(self, text: str, add_bos: bool) -> np.ndarray:
        key = (text, add_bos)
        with self._lock:
            found = self._tokens.get(key)
            if found is not None:
                self._tokens.move_to_end(key)
                return found
        raw = self.llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=True)
        found = np.asarray(raw, dtype=np.int32)
        with self._lock:
            self._tokens[key] = found
            while len(self._tokens) > self.KEEP:
                self._tokens.popitem(last=False)
        return found

    def prefixes(
        self, messages: Sequence[Any], render: Mapping[str, Any] | None = None
    ) -> list[np.ndarray]:
        """The tokens of the chat's prompt up to each boundary worth a checkpoint (the
        last few may be tokenized otherwise within the whole prompt); none if the
        ``Llama``'s chat handler has no formatter we can render. ``render``: the
        formatter's other arguments (tools, ...)."""
        lengths = prefix_lengths(messages)
        formatter = formatter_of(self.llm) if lengths else None
        if formatter is None:
            return []
        args = {k: v for k, v in (render or {}).items() if k in RENDER_ARGS}
        whole = formatter(messages=list(messages), **args)
        out = []
        for k in lengths:
            try:  # (a template may refuse a conversation cut there: no boundary then)
                part = formatter(messages=list(messages[:k]), **args).prompt
            except Exception as e:
                log.debug("chat boundary after %d message(s) not rendered: %s", k, e)
                continue
            n = shared_text(part, whole.prompt)
            if 0 < n < len(whole.prompt):
                out.append(self._tokenize(whole.prompt[:n], not whole.added_special))
        return out


#: boundary hints kept for calls to come (a hint not taken by the next call is stale)
MAX_HINTS = 4
#: a hinted prefix's last tokens that its prompt may tokenize otherwise (merged with what
#: follows), so that it still applies
HINT_SLACK = 4


class Hints:
    """Token prefixes hinted for the next call of one cache (``hint_boundaries``)."""

    def __init__(self) -> None:
        self._pending: deque[list[np.ndarray]] = deque(maxlen=MAX_HINTS)

    def add(self, prefixes: Sequence[Sequence[int] | np.ndarray]) -> None:
        hint = [np.asarray(p, dtype=np.int32) for p in prefixes if len(p)]
        if hint:
            self._pending.append(hint)

    def take(self, prompt: np.ndarray) -> tuple[int, ...]:
        """The hinted boundaries of ``prompt``: where it stops matching each prefix that
        it matches but for at most its last ``HINT_SLACK`` tokens. Every pending hint is
        used up."""
        found: set[int] = set()
        while self._pending:
            for prefix in self._pending.popleft():
                n = common_prefix(prefix, prompt)
                if 0 < n < len(prompt) and n >= len(prefix) - HINT_SLACK:
                    found.add(n)
        return tuple(sorted(found))
