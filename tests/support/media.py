"""Media without a projector: embedding batches decoded as llama-cpp-python's mtmd chat
handlers decode an image's or audio's embeddings (``mtmd_helper_eval_chunk_single``).

Runs inside a llama worker (``llama_worker.py``, job kind ``media``). A media job's prompt
is text in which some runs of token positions are filled by "images": random embeddings
that are a pure function of a seed, decoded straight into the context, never through
``Llama.eval``. ``handler`` fills them as the mtmd handlers do (``n_tokens += n``, the
``input_ids`` there left as they were); ``declared`` goes through
``shmkv.llama.media.prefill`` with each image's digest, as a handler integration would.
"""

from __future__ import annotations

import ctypes
from typing import Any

import llama_cpp
import numpy as np
from llama_cpp import llama_cpp as lc


def embeddings(llm: llama_cpp.Llama, seed: int, n: int) -> np.ndarray:
    """``n`` positions of an "image": random embeddings, a pure function of ``seed``."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, llm.n_embd())).astype(np.float32)


def decode_embeddings(
    llm: llama_cpp.Llama, embd: np.ndarray, n_past: int, logits_last: bool = False
) -> int:
    """Decode ``embd`` at positions ``n_past``... of ``llm``'s sequence 0 (:func:`decode_into`)."""
    return decode_into(llm.ctx, embd, n_past, llm.n_batch, logits_last)


def decode_into(
    ctx: Any, embd: np.ndarray, n_past: int, n_batch: int, logits_last: bool = False
) -> int:
    """Decode ``embd`` at positions ``n_past``... of sequence 0 of the llama context
    ``ctx`` in ``n_batch`` batches, as ``mtmd_helper_eval_chunk_single`` does (with the
    last position's logits if ``logits_last``, for a prompt that ends with it); the
    position after them."""
    n, n_embd = embd.shape
    embd = np.ascontiguousarray(embd, dtype=np.float32)
    for i in range(0, n, n_batch):
        part = embd[i : i + n_batch]
        batch = lc.llama_batch_init(len(part), n_embd, 1)
        try:
            batch.n_tokens = len(part)
            ctypes.memmove(batch.embd, part.ctypes.data, part.nbytes)
            for j in range(len(part)):
                batch.pos[j] = n_past + i + j
                batch.n_seq_id[j] = 1
                batch.seq_id[j][0] = 0
                batch.logits[j] = int(logits_last and i + j == n - 1)
            rc = lc.llama_decode(ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode of an embedding batch returned {rc}")
        finally:
            lc.llama_batch_free(batch)
    return n_past + n


def pieces(llm: llama_cpp.Llama, job: dict) -> list[Any]:
    """The job's prompt as pieces: token lists and images (``job["images"]``: each
    ``{"at", "n", "seed"}``, filling positions at..at+n where the prompt's tokens were; ``n``
    None: to the prompt's end)."""
    ids = llm.tokenize(job["prompt"].encode("utf-8"), add_bos=True, special=True)
    out: list[Any] = []
    pos = 0
    for img in sorted(job["images"], key=lambda m: m["at"]):
        img = {**img, "n": img.get("n") or len(ids) - img["at"]}  # (None: to the end)
        out.append(ids[pos : img["at"]])
        out.append(img)
        pos = img["at"] + img["n"]
    out.append(ids[pos:])
    return [p for p in out if not isinstance(p, list) or p]


def run_media(llm: llama_cpp.Llama, job: dict) -> str:
    """Prefill a media job's prompt as a chat handler does, then complete it greedily from
    ``input_ids[:n_tokens]`` (what the handlers pass to ``create_completion``)."""
    parts = pieces(llm, job)
    shmkv = getattr(llm, "shmkv", None)
    if job.get("declared") and shmkv is not None:
        from shmkv.llama import media

        spec = [
            p
            if isinstance(p, list)
            else media.Media(
                p["n"],
                b"image-%d" % p["seed"],
                lambda n_past, p=p: decode_embeddings(
                    llm, embeddings(llm, p["seed"], p["n"]), n_past
                ),
            )
            for p in parts
        ]
        media.prefill(llm, spec)
    else:  # as llama_chat_format.MTMDChatHandler does
        llm.reset()
        lc.llama_memory_clear(lc.llama_get_memory(llm.ctx), True)
        for p in parts:
            if isinstance(p, list):
                llm.eval(p)
            else:
                embd = embeddings(llm, p["seed"], p["n"])
                decode_embeddings(llm, embd, llm.n_tokens, logits_last=p is parts[-1])
                llm.n_tokens += p["n"]
    prompt = llm.input_ids[: llm.n_tokens].tolist()
    out = llm.create_completion(
        prompt, max_tokens=job.get("max_tokens", 16), temperature=0.0, seed=0
    )
    return str(out["choices"][0]["text"])
