"""llama-cpp-python's multimodal chat handlers, seen into: the same image shares its state.

Runs in a process that holds a ``Llama``. The mtmd chat handlers (``MTMDChatHandler``,
``Llava15ChatHandler`` and their subclasses) tokenize a chat into chunks of text and of
media (``mtmd_tokenize``), reset the context, then decode each chunk: text through
``Llama.eval``, an image or audio clip straight into the context
(``mtmd_helper_eval_chunk_single``). Left alone, shmkv sees those media positions only
afterwards and marks them as media of unknown content (``media.UNKNOWN``): nothing wrong
is restored, but nothing after the first image is shared either.

:func:`share` gives such a handler a stand-in for its mtmd library (the module it calls
through, ``compat.mtmd_library``) that changes two calls and passes every other through:

* ``mtmd_helper_bitmap_init_from_buf`` gives each bitmap an id, a digest of its bytes
  (llama.cpp's server keys image chunks the same way: a hash of the bitmap), which
  ``mtmd_tokenize`` copies into the chunk;
* ``mtmd_input_chunks_size`` on the chunks just tokenized (the handler asks it after its
  reset, before its decode loop) brings the whole prompt into the context with
  :func:`shmkv.llama.media.prefill`: each media chunk keyed by its id and the projector
  file's digest, the longest shared prefix restored (text, images and what follows
  them), the rest decoded with the library's own helper; it answers 0, so the handler's
  own loop decodes nothing and completes ``input_ids[:n_tokens]`` as it always does.

A handler that is not one of these (no mtmd library attribute), or one that serves a
second ``Llama``, is left alone: it shares nothing and restores nothing wrong.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

import llama_cpp

from shmkv.llama import compat, media

__all__ = ["projector_digest", "share"]

log = logging.getLogger(__name__)

#: the library functions the stand-in calls besides those it passes through
_NEEDS = (
    "mtmd_helper_bitmap_init_from_buf",
    "mtmd_bitmap_set_id",
    "mtmd_tokenize",
    "mtmd_input_chunks_size",
    "mtmd_input_chunks_get",
    "mtmd_input_chunk_get_type",
    "mtmd_input_chunk_get_tokens_text",
    "mtmd_input_chunk_get_id",
    "mtmd_input_chunk_get_n_pos",
    "mtmd_helper_eval_chunk_single",
    "MTMD_INPUT_CHUNK_TYPE_TEXT",
)

_digests: dict[tuple[str, int, int], bytes] = {}
_digests_lock = threading.Lock()


def projector_digest(path: str) -> bytes:
    """A digest of the projector file's bytes (read once per file and version of it):
    a media chunk's embeddings are a function of its bytes and of the projector."""
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
    with _digests_lock:
        if key not in _digests:
            h = hashlib.blake2b(digest_size=32, person=b"shmkv-mmproj")
            with open(path, "rb") as f:
                while block := f.read(1 << 22):
                    h.update(block)
            _digests[key] = h.digest()
        return _digests[key]


def share(llm: llama_cpp.Llama) -> bool:
    """Let ``llm``'s multimodal chat handler (``llm.chat_handler``) share media through
    ``llm.shmkv``; whether it now does. Called when a cache attaches."""
    handler = getattr(llm, "chat_handler", None)
    lib = compat.mtmd_library(handler)
    if lib is None:
        return False
    if isinstance(lib, _SharingLibrary):
        if lib.llm is not llm:
            lib.llm = None  # (a handler serving two contexts: share nothing)
        return lib.llm is llm
    missing = [n for n in _NEEDS if not hasattr(lib, n)]
    path = getattr(handler, "clip_model_path", None)
    if missing or not isinstance(path, str) or not os.path.isfile(path):
        log.info(
            "shmkv: the chat handler %s is not one shmkv can see into (%s): its media are "
            "never shared (and never restored as text)",
            type(handler).__name__,
            ", ".join(missing) or "no projector file",
        )
        return False
    compat.replace_mtmd_library(handler, _SharingLibrary(lib, llm, projector_digest(path)))
    return True


class _SharingLibrary:
    """The stand-in for a handler's mtmd library (see the module's docstring)."""

    def __init__(self, lib: Any, llm: llama_cpp.Llama, projector: bytes) -> None:
        self.lib = lib
        #: the context this handler fills (None: more than one; pass everything through)
        self.llm: llama_cpp.Llama | None = llm
        self.projector = projector
        #: the chunks of the last ``mtmd_tokenize``, until the handler asks their size
        self._tokenized: Any = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.lib, name)

    def mtmd_helper_bitmap_init_from_buf(self, ctx: Any, buf: Any, n: int, *rest: Any) -> Any:
        bitmap = self.lib.mtmd_helper_bitmap_init_from_buf(ctx, buf, n, *rest)
        if bitmap:
            data = _bytes_of(buf, n)
            digest = hashlib.blake2b(data, digest_size=32, person=b"shmkv-bitmap")
            self.lib.mtmd_bitmap_set_id(bitmap, digest.hexdigest().encode())
        return bitmap

    def mtmd_tokenize(self, ctx: Any, chunks: Any, *rest: Any) -> Any:
        result = self.lib.mtmd_tokenize(ctx, chunks, *rest)
        self._tokenized = (ctx, chunks) if result == 0 else None
        return result

    def mtmd_input_chunks_size(self, chunks: Any) -> int:
        n: int = self.lib.mtmd_input_chunks_size(chunks)
        tokenized, self._tokenized = self._tokenized, None
        llm = self.llm
        if tokenized is None or tokenized[1] != chunks or llm is None:
            return n
        if getattr(llm, "shmkv", None) is None:
            return n
        pieces = self._pieces(llm, tokenized[0], chunks, n)
        if pieces is None:
            return n  # (the handler decodes them itself: their positions go UNKNOWN)
        media.prefill(llm, pieces)
        return 0  # (the context holds the whole prompt: the handler's loop has nothing left)

    def _pieces(
        self, llm: llama_cpp.Llama, ctx: Any, chunks: Any, n: int
    ) -> list[media.Piece] | None:
        """The chunks as ``media.prefill``'s pieces; None: not a prompt it can take (no
        media, media whose id is unknown, or media at the end)."""
        lib = self.lib
        pieces: list[media.Piece] = []
        for i in range(n):
            chunk = lib.mtmd_input_chunks_get(chunks, i)
            if chunk is None:
                continue
            if lib.mtmd_input_chunk_get_type(chunk) == lib.MTMD_INPUT_CHUNK_TYPE_TEXT:
                count = ctypes.c_size_t()
                ptr = lib.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(count))
                tokens = [int(ptr[j]) for j in range(count.value)] if ptr else []
                if tokens:
                    pieces.append(tokens)
                continue
            chunk_id = lib.mtmd_input_chunk_get_id(chunk)
            if not chunk_id:
                return None
            n_pos = int(lib.mtmd_input_chunk_get_n_pos(chunk))
            digest = hashlib.blake2b(
                self.projector + b"|" + bytes(chunk_id), digest_size=32, person=b"shmkv-chunk"
            ).digest()
            pieces.append(media.Media(n_pos, digest, _Decoder(lib, ctx, llm, chunk)))
        if not any(isinstance(p, media.Media) for p in pieces) or not isinstance(
            pieces[-1], Sequence
        ):
            return None
        return pieces


def _bytes_of(buf: Any, n: int) -> bytes:
    """The first ``n`` bytes of a buffer the handler passed (a ctypes array)."""
    try:
        return bytes(memoryview(buf).cast("B")[:n])
    except TypeError:
        return ctypes.string_at(ctypes.addressof(buf), n)


class _Decoder:
    """Decode one media chunk into sequence 0 from a position, as the handlers do."""

    def __init__(self, lib: Any, ctx: Any, llm: llama_cpp.Llama, chunk: Any) -> None:
        self.lib, self.ctx, self.llm, self.chunk = lib, ctx, llm, chunk

    def __call__(self, n_past: int) -> None:
        new_n_past = ctypes.c_int32(0)  # (llama_pos, llama_seq_id: int32)
        rc = self.lib.mtmd_helper_eval_chunk_single(
            self.ctx,
            self.llm.ctx,
            self.chunk,
            ctypes.c_int32(n_past),
            ctypes.c_int32(0),
            self.llm.n_batch,
            False,
            ctypes.byref(new_n_past),
        )
        if rc != 0:
            raise ValueError(f"Failed to evaluate chunk: error code {rc}")
