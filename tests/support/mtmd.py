"""llama-cpp-python's stock multimodal chat handler, on an mtmd library without a projector.

Runs inside a llama worker (``llama_worker.py``, spec key ``handler``). The handler is
llama-cpp-python's own ``MTMDChatHandler`` (its ``__call__`` unchanged: chat template,
image loading, tokenize, reset, the chunk loop, ``create_completion``); only the library it
calls through (``_mtmd_cpp``) is :class:`Library`, which does what mtmd does without a
vision encoder: ``mtmd_tokenize`` splits the rendered text at the media marker into text
chunks (the model's tokenizer) and one image chunk per bitmap, whose "embeddings" are a
pure function of the image's bytes; ``mtmd_helper_eval_chunk_single`` decodes them in
``n_batch`` batches as the real helper does; a bitmap's id, if set, becomes its chunk's
id, as in ``mtmd_tokenize``.
"""

from __future__ import annotations

import ctypes
import hashlib
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import llama_cpp
import llama_cpp.mtmd_cpp as real
import numpy as np
from llama_cpp import llama_cpp as lc
from llama_cpp.llama_chat_format import MTMDChatHandler

from tests.support.media import decode_into

MARKER = b"<__media__>"
#: a chat template that renders content parts in order (images as the media marker)
TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: "
    "{% if m.content is string %}{{ m.content }}"
    "{% else %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endif %}\n"
    "{% endfor %}assistant:"
)


@dataclass
class Bitmap:
    data: bytes
    id: bytes = b""


@dataclass
class Chunk:
    type: int
    tokens: list[int] = field(default_factory=list)
    n: int = 0
    data: bytes = b""
    id: bytes = b""


@dataclass
class Context:
    model: Any


def positions(data: bytes) -> int:
    """How many positions an image of these bytes fills (as an encoder's patch count)."""
    return 40 + data[0] % 24 if data else 40


class Library:
    """The part of ``llama_cpp.mtmd_cpp`` the chat handlers call, without a projector."""

    MTMD_INPUT_CHUNK_TYPE_TEXT = real.MTMD_INPUT_CHUNK_TYPE_TEXT
    MTMD_INPUT_CHUNK_TYPE_IMAGE = real.MTMD_INPUT_CHUNK_TYPE_IMAGE
    MTMD_INPUT_CHUNK_TYPE_AUDIO = real.MTMD_INPUT_CHUNK_TYPE_AUDIO
    mtmd_bitmap_p_ctypes = ctypes.py_object
    mtmd_input_text = real.mtmd_input_text

    def mtmd_context_params_default(self) -> Any:
        return SimpleNamespace()

    def mtmd_init_from_file(self, path: bytes, model: Any, params: Any) -> Context:
        return Context(model)

    def mtmd_support_vision(self, ctx: Context) -> bool:
        return True

    def mtmd_free(self, ctx: Context) -> None:
        pass

    def mtmd_default_marker(self) -> bytes:
        return MARKER

    def mtmd_helper_bitmap_init_from_buf(self, ctx: Context, buf: Any, n: int, audio: bool) -> Any:
        return Bitmap(bytes(buf)[:n])

    def mtmd_bitmap_set_id(self, bitmap: Bitmap, id: bytes) -> None:
        bitmap.id = id

    def mtmd_bitmap_free(self, bitmap: Bitmap) -> None:
        pass

    def mtmd_input_chunks_init(self) -> list[Chunk]:
        return []

    def mtmd_input_chunks_free(self, chunks: list[Chunk]) -> None:
        chunks.clear()

    def mtmd_input_chunks_size(self, chunks: list[Chunk]) -> int:
        return len(chunks)

    def mtmd_input_chunks_get(self, chunks: list[Chunk], i: int) -> Chunk:
        return chunks[i]

    def mtmd_tokenize(
        self, ctx: Context, chunks: list[Chunk], text_ref: Any, bitmaps: Any, n: int
    ) -> int:
        text = text_ref._obj
        parts = bytes(text.text[: text.text_len]).split(MARKER)
        if len(parts) != n + 1:
            return 1  # (mtmd: the markers and the bitmaps differ in number)
        vocab = lc.llama_model_get_vocab(ctx.model)
        for i, part in enumerate(parts):
            tokens = tokenize(vocab, part, add_special=i == 0 and text.add_special)
            if tokens:
                chunks.append(Chunk(self.MTMD_INPUT_CHUNK_TYPE_TEXT, tokens=tokens))
            if i < n:
                bitmap = bitmaps[i]
                chunks.append(
                    Chunk(
                        self.MTMD_INPUT_CHUNK_TYPE_IMAGE,
                        n=positions(bitmap.data),
                        data=bitmap.data,
                        id=bitmap.id,
                    )
                )
        return 0

    def mtmd_input_chunk_get_type(self, chunk: Chunk) -> int:
        return chunk.type

    def mtmd_input_chunk_get_tokens_text(self, chunk: Chunk, n_ref: Any) -> Any:
        n_ref._obj.value = len(chunk.tokens)
        return (ctypes.c_int32 * len(chunk.tokens))(*chunk.tokens)

    def mtmd_input_chunk_get_n_tokens(self, chunk: Chunk) -> int:
        return chunk.n

    def mtmd_input_chunk_get_n_pos(self, chunk: Chunk) -> int:
        return chunk.n

    def mtmd_input_chunk_get_id(self, chunk: Chunk) -> bytes:
        return chunk.id

    def mtmd_helper_eval_chunk_single(
        self,
        ctx: Context,
        lctx: Any,
        chunk: Chunk,
        n_past: Any,
        seq_id: Any,
        n_batch: int,
        logits_last: bool,
        new_n_past: Any,
    ) -> int:
        n_embd = lc.llama_model_n_embd(ctx.model)
        seed = int.from_bytes(hashlib.blake2b(chunk.data, digest_size=8).digest(), "little")
        embd = np.random.default_rng(seed).standard_normal((chunk.n, n_embd)).astype(np.float32)
        start = int(getattr(n_past, "value", n_past))
        new_n_past._obj.value = decode_into(lctx, embd, start, n_batch, logits_last)
        return 0


def tokenize(vocab: Any, text: bytes, add_special: bool) -> list[int]:
    out = (lc.llama_token * (len(text) + 8))()
    n = lc.llama_tokenize(vocab, text, len(text), out, len(out), add_special, True)
    if n < 0:
        raise ValueError(f"tokenize: {n}")
    return list(out[:n])


class Handler(MTMDChatHandler):
    """llama-cpp-python's ``MTMDChatHandler`` with :class:`Library` and :data:`TEMPLATE`."""

    def __init__(self, projector: str) -> None:
        super().__init__(clip_model_path=projector, verbose=False)
        self._mtmd_cpp = Library()

    def _get_chat_template(self, llama_model: llama_cpp.Llama) -> str:
        return TEMPLATE


def image_url(data: bytes) -> str:
    import base64

    return "data:image/png;base64," + base64.b64encode(data).decode()
