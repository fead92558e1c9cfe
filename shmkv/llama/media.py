"""Images and audio in prompts: positions that media, not tokens, filled.

Runs in a process that holds a ``Llama``. llama-cpp-python's multimodal chat handlers
(``llama_chat_format.MTMDChatHandler`` and the Llava ones) decode an image's or audio's
embeddings straight into the context (``mtmd_helper_eval_chunk_single``) and advance
``n_tokens`` over them without writing ``input_ids``: the prompt they then complete is
``input_ids[:n_tokens]``, whatever ids an earlier call left there. shmkv keys states by
token ids, so a position that media filled must carry an id that no text has:

* :data:`UNKNOWN` (-1) where the hooks find positions filled behind their back
  (``kvstate.ContextState.catch_up``, at the next eval or generate): it matches nothing,
  no state holding it is published, and llama-cpp-python's own prefix match stops there;
* a media chunk declared with its content digest (:func:`prefill`, or
  ``SharedPrefixCache.media`` after decoding it yourself) gets :func:`pseudo_ids` derived
  from that digest, one per position, all below -1: the same image at the same place
  after the same text gives the same ids, so its state is published and restored like
  text; another image gets other ids.

A prompt that holds media ids is never restored into by the generate hook (the context
already holds it: the handler decoded it) and never evaluated from its ids.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import llama_cpp
import numpy as np
from llama_cpp import llama_cpp as lc

from shmkv.llama.kvstate import UNKNOWN

__all__ = ["UNKNOWN", "Media", "is_media", "prefill", "pseudo_ids"]

#: pseudo ids are -2 .. -(2**31 - 1): below UNKNOWN, within int32
_SPAN = 2**31 - 2


def pseudo_ids(digest: bytes, n_positions: int) -> np.ndarray:
    """The ids of a media chunk of ``n_positions`` positions whose content digest is
    ``digest``: 31 bits of a keyed hash per position (so two images' ids differ at every
    position but by chance), all below :data:`UNKNOWN`, never a token's."""
    if not digest:
        raise ValueError("a media digest must be non-empty (None: content not known)")
    if n_positions <= 0:
        raise ValueError(f"a media chunk must fill at least one position, not {n_positions}")
    seed = hashlib.blake2b(
        b"%d|" % n_positions + digest, digest_size=32, person=b"shmkv-media"
    ).digest()
    need, out, i = 4 * n_positions, bytearray(), 0
    while len(out) < need:
        out += hashlib.blake2b(i.to_bytes(8, "little"), key=seed, digest_size=64).digest()
        i += 1
    words = np.frombuffer(bytes(out[:need]), dtype="<u4").astype(np.int64)
    return (-2 - words % _SPAN).astype(np.int32)


def is_media(ids: np.ndarray) -> bool:
    """Whether ``ids`` (a prompt, a context's ids) hold a position that media filled."""
    return bool(len(ids)) and int(ids.min()) < 0


@dataclass(frozen=True)
class Media:
    """One media chunk of a prompt, for :func:`prefill`.

    ``digest``: what determines its embeddings (e.g. a hash of the image's bytes and of
    the projector file; mtmd's chunk id where the bitmap's id was set to such a hash);
    None: not known, never shared. ``decode(n_past)``: decode its embeddings into
    sequence 0 from position ``n_past`` (e.g. ``mtmd_helper_eval_chunk_single``),
    without moving ``n_tokens``.
    """

    n_positions: int
    digest: bytes | None
    decode: Callable[[int], Any]

    def ids(self) -> np.ndarray:
        if self.digest is None:
            return np.full(self.n_positions, UNKNOWN, dtype=np.int32)
        return pseudo_ids(self.digest, self.n_positions)


Piece = Sequence[int] | Media


def layout(pieces: Sequence[Piece]) -> tuple[np.ndarray, list[tuple[int, int, Media]]]:
    """A prompt's ids (tokens, media ids) and where each media chunk lies."""
    parts, spans, pos = [], [], 0
    for p in pieces:
        if isinstance(p, Media):
            ids = p.ids()
            spans.append((pos, pos + p.n_positions, p))
        else:
            ids = np.asarray(p, dtype=np.int32)
            if is_media(ids):
                raise ValueError("a prompt's text pieces must hold token ids (>= 0)")
        parts.append(ids)
        pos += len(ids)
    if not spans or isinstance(pieces[-1], Media):
        # (llama-cpp-python replays a prompt's last position for its logits)
        raise ValueError("a media prompt must hold media and end with text")
    return np.concatenate(parts), spans


def prefill(llm: llama_cpp.Llama, pieces: Sequence[Piece]) -> int:
    """Bring a prompt of text and media into ``llm``'s context, as a chat handler does,
    restoring its longest shared prefix first (through ``llm.shmkv``, if attached).

    ``pieces``: token id lists and :class:`Media` chunks, in order; the prompt must end
    with text. Then complete ``llm.input_ids[:llm.n_tokens]`` (the handlers'
    ``create_completion(prompt=...)``): the context holds it, and its state is published
    keyed by the media's digests. Returns the positions restored or kept (not decoded).
    """
    ids, spans = layout(pieces)
    if len(ids) > llm.n_ctx():
        raise ValueError(f"prompt exceeds n_ctx: {len(ids)} > {llm.n_ctx()}")
    cache = getattr(llm, "shmkv", None)
    if cache is None:
        return _decode(llm, pieces, ids, 0, lambda n, digest: None)
    with cache.guard:
        have = cache.restore_media(ids)
        for start, end, _ in spans:  # a media chunk is decoded whole, or not at all
            if start < have < end:
                have = start
        cache.cut_back(have)
        return _decode(llm, pieces, ids, have, cache.media)


def _decode(
    llm: llama_cpp.Llama,
    pieces: Sequence[Piece],
    ids: np.ndarray,
    have: int,
    declare: Callable[[int, bytes | None], None],
) -> int:
    """Evaluate the prompt's pieces past its first ``have`` positions (in the context)."""
    if not have:
        llm.reset()  # type: ignore[no-untyped-call]
        lc.llama_memory_clear(lc.llama_get_memory(llm.ctx), True)
    pos = 0
    for p in pieces:
        n = p.n_positions if isinstance(p, Media) else len(p)
        skip, pos = max(0, have - pos), pos + n
        if skip >= n:
            continue
        if isinstance(p, Media):
            p.decode(llm.n_tokens)
            llm.n_tokens += n
            llm.input_ids[llm.n_tokens - n : llm.n_tokens] = ids[pos - n : pos]
            declare(n, p.digest)
        else:
            llm.eval(list(p)[skip:])
    return have
