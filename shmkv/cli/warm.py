"""``shmkv warm``: prefill prompts ahead of traffic, so that the first request is a hit.

Runs in the ``shmkv`` command's process. It loads the model as a served worker
does (``serving/model_settings.py``: the same ``ModelSettings``, the same chat format, so the same
fingerprint and the same prompt tokens) with the cache attached, and runs each
input line as a one-token completion: the cache restores what is cached, prefills
the rest and publishes the prompt's state (and, for a sliding-window model, its
tail checkpoint and a chat's message boundaries), exactly as it would for a served
request; ``--pin`` pins them all.

Input: JSON Lines, one prompt per line: a JSON string (a completion prompt),
``{"prompt": "..."}`` or ``{"messages": [{"role": ..., "content": ...}, ...]}`` (a
chat, rendered as ``/v1/chat/completions`` renders it), with an optional
``"pin": true``. Blank lines and lines starting with ``#`` are skipped; a line that
is none of these is reported with its number and skipped, and counted.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from shmkv.core.config import Settings
from shmkv.core.errors import BadInput, NotFound, ShmkvError
from shmkv.core.keys import chain_digests
from shmkv.llama import SharedPrefixCache, attach
from shmkv.serving.model_settings import load_llama

log = logging.getLogger(__name__)

#: longest input line read (a chat history of a long context fits easily)
MAX_LINE = 16 << 20


@dataclass(frozen=True)
class Item:
    """One input line: a completion prompt or a chat."""

    lineno: int
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    pin: bool = False


def _messages(v: Any, where: str) -> list[dict[str, Any]]:
    ok = (
        isinstance(v, list)
        and v
        and all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), (str, list, type(None)))
            for m in v
        )
    )
    if not ok:
        raise BadInput(
            f"{where}: 'messages' must be a non-empty list of "
            f'{{"role": ..., "content": ...}} objects'
        )
    return list(v)


def parse_line(lineno: int, line: str) -> Item | None:
    """The item of one input line (None: blank or a comment); BadInput names the line."""
    text = line.strip()
    if not text or text.startswith("#"):
        return None
    if len(text) > MAX_LINE:
        raise BadInput(f"line {lineno}: longer than {MAX_LINE} characters")
    try:
        v = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadInput(f"line {lineno}: not JSON ({e.msg} at column {e.colno})") from None
    if isinstance(v, str):
        return Item(lineno, prompt=v)
    if not isinstance(v, dict) or ("prompt" in v) == ("messages" in v):
        raise BadInput(
            f'line {lineno}: expected a JSON string, {{"prompt": "..."}} or {{"messages": [...]}}'
        )
    pin = v.get("pin", False)
    if not isinstance(pin, bool):
        raise BadInput(f"line {lineno}: 'pin' must be true or false")
    if "prompt" in v:
        if not isinstance(v["prompt"], str):
            raise BadInput(f"line {lineno}: 'prompt' must be a string")
        return Item(lineno, prompt=v["prompt"], pin=pin)
    return Item(lineno, messages=_messages(v["messages"], f"line {lineno}"), pin=pin)


def parse_chat(text: str) -> Item:
    """``export --messages``: a chat as a JSON list of messages (or a warm line's
    ``{"messages": [...]}``); BadInput says what is wrong with it."""
    try:
        v = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadInput(f"--messages is not JSON ({e.msg} at column {e.colno})") from None
    if isinstance(v, dict) and "messages" in v and "prompt" not in v:
        v = v["messages"]
    if not isinstance(v, list):
        raise BadInput('--messages must be a JSON list: [{"role": ..., "content": ...}, ...]')
    return Item(0, messages=_messages(v, "--messages"))


def parse(lines: Iterable[str]) -> tuple[list[Item], list[str]]:
    """The items of the input, and one message per line that is not one."""
    items, bad = [], []
    for n, line in enumerate(lines, 1):
        try:
            item = parse_line(n, line)
        except BadInput as e:
            bad.append(str(e))
            continue
        if item is not None:
            items.append(item)
    return items, bad


@dataclass
class Warmed:
    """What one item did."""

    tokens: np.ndarray
    restored: int
    evaluated: int
    seconds: float
    #: lengths of the checkpoints published mid-prefill (tail, chat message boundaries)
    checkpoints: tuple[int, ...] = ()


@dataclass
class Summary:
    """What a warm run did, for the closing line and ``--json``."""

    warmed: int = 0
    skipped: int = 0
    tokens_prefilled: int = 0
    tokens_restored: int = 0
    seconds: float = 0.0
    states_stored: int = 0
    bytes_stored: int = 0
    pinned: int = 0
    errors: list[str] = field(default_factory=list)


class Warmer:
    """One model loaded as a served worker loads it, attached to the arena."""

    def __init__(self, settings: Settings, model: str, threads: int | None = None) -> None:
        self.settings = settings
        self.model = model
        self.llm = load_llama(settings, model, threads)
        self.cache: SharedPrefixCache = attach(self.llm, settings=settings)
        self.cache.reader.ensure()  # no supervisor: say so now (warming is then pointless)
        # a batch job waits for the supervisor rather than drop a state when its puts
        # queue up (a prompt's checkpoints and its own state come in one burst)
        self.cache.publisher.wait_for_room = 60.0

    def run(self, item: Item) -> Warmed:
        """Restore or prefill ``item`` and publish its state (a one-token completion)."""
        kw: dict[str, Any] = {"max_tokens": 1, "temperature": 0.0}
        t0 = time.perf_counter()
        try:
            if item.messages is not None:
                self.llm.create_chat_completion(messages=item.messages, **kw)  # type: ignore[arg-type]
            else:
                self.llm.create_completion(item.prompt or "", **kw)
        except ValueError as e:  # too long for the context, a template that refuses ...
            raise BadInput(f"line {item.lineno}: {e}") from None
        call, last = self.cache.call, self.cache.last
        assert call is not None
        return Warmed(
            np.asarray(call.tokens, dtype=np.int32),
            last.tokens_restored,
            last.tokens_evaluated,
            time.perf_counter() - t0,
            tuple(last.checkpoints),
        )

    def flush(self) -> None:
        if not self.cache.flush(timeout=60.0):
            raise ShmkvError("the supervisor did not take every state within 60 s")

    def key(self, tokens: np.ndarray) -> bytes | None:
        """The key of the state of ``tokens`` (None: shorter than a chunk)."""
        chunk = self.cache.chunk_tokens
        digests = chain_digests(self.cache.root, tokens, chunk) if chunk else []
        return digests[-1] if digests else None

    def record_of(self, tokens: np.ndarray) -> tuple[int, int]:
        """(offset, gen) of the trusted record of exactly ``tokens``; NotFound if none."""
        chunk = self.cache.chunk_tokens
        key = self.key(tokens)
        if chunk is None or key is None:
            raise NotFound(f"no state of {len(tokens)} tokens: shorter than one chunk")
        uids = self.cache.trust().uids
        for offset, gen, n, common in self.cache.reader.owners(
            key, tokens, None if uids is None else sorted(uids)
        ):
            if n == common == len(tokens):
                return offset, gen
        raise NotFound(
            f"the prompt's state ({len(tokens)} tokens) is not in the arena: it may be "
            f"shorter than --min-tokens, or evicted"
        )

    def close(self) -> None:
        self.cache.close()
        self.llm.close()


def model_name(model: str) -> str:
    return Path(model).name
