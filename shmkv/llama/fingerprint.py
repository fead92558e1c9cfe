"""What makes a sequence blob restorable here: the model fingerprint.

Runs inside a worker, once, when its cache attaches. A blob restores
correctly only into a context with the same weights, KV types, flash
attention, sliding-window and RoPE settings, context size, LoRA, llama.cpp
version, GPU offload and weight buffers (``offload.py``: layers on a device, or
weights in other buffers, compute other numbers); the fingerprint covers all of
these and is stored beside every blob.
Every key chain starts from a root digest of the fingerprint and the tenant
namespace (``shmkv.core.keys.key_root``), so different models, setups or tenants
never share a key.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import llama_cpp
import msgpack
from llama_cpp import llama_cpp as lc

from shmkv.llama import compat, offload

_SAMPLE_BYTES = 1 << 16
_SAMPLES = 16
_HEAD_BYTES = 1 << 20
# Context parameters left out of the fingerprint: none of them changes what a sequence
# state means (its cells' positions and K/V rows) or whether llama.cpp can load it. All
# others are in it, among them the KV cache types (type_k, type_v: an f16 and a q8_0 state
# never meet, tests/llama/test_kvtype.py) and flash_attn_type (it changes the V layout).
_CTX_IGNORED = {
    # the requested size (0: the model's); the context's actual n_ctx and per-sequence
    # n_ctx_seq are in the description instead: RoPE scaling (e.g. Phi-3's long or short
    # factors) is chosen from n_ctx_seq, and a state must fit the context's cells
    "n_ctx",
    # how a prompt is split into batches: the same cells; the numbers' batch dependence
    # is exact mode's concern, which keys on n_batch itself (cache.py)
    "n_batch",
    "n_ubatch",
    # CPU scheduling
    "n_threads",
    "n_threads_batch",
    # rows of the logits/embeddings output buffer, not of the KV cache
    "n_outputs_max",
    "n_outputs_max_per_seq",
    # performance counters
    "no_perf",
    # when llama.cpp compacts its cells; a sequence state holds cells, not their slots
    "defrag_thold",
    # callbacks and pointers: not values
    "cb_eval",
    "cb_eval_user_data",
    "abort_callback",
    "abort_callback_data",
    "ctx_other",
    # sampling, after the KV cache
    "samplers",
    "n_samplers",
}


def file_identity(path: str | os.PathLike[str]) -> bytes:
    """Cheap identity of a (possibly 10 GB) model file: size, head, and spread samples."""
    h = hashlib.blake2b(digest_size=32)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        h.update(size.to_bytes(8, "little"))
        h.update(f.read(_HEAD_BYTES))  # GGUF header and metadata
        for i in range(_SAMPLES):
            f.seek(size * i // _SAMPLES)
            h.update(f.read(_SAMPLE_BYTES))
        f.seek(max(0, size - _SAMPLE_BYTES))
        h.update(f.read(_SAMPLE_BYTES))
    return h.digest()


def context_description(llm: llama_cpp.Llama) -> dict[str, Any]:
    """Everything besides the weights that decides whether a blob restores correctly."""
    params = llm.context_params
    names = compat.context_param_names(params)
    ctx = {name: getattr(params, name) for name in names if name not in _CTX_IGNORED}
    ctx = {
        k: (round(v, 6) if isinstance(v, float) else v)
        for k, v in ctx.items()
        if isinstance(v, (int, float, bool))
    }
    if "swa_full" in ctx and int(lc.llama_model_n_swa(llm.model)) <= 0:
        # no sliding-window layers: the setting changes nothing. Described as llama-cpp-
        # python's default, so that such a model's keys are what they were before served
        # workers turned it off (`shmkv serve --swa-full`), and match a default Llama's
        ctx["swa_full"] = True
    out: dict[str, Any] = {
        "llama_cpp_python": llama_cpp.__version__,
        "state_seq_version": getattr(lc, "LLAMA_STATE_SEQ_VERSION", None),
        "session_version": getattr(lc, "LLAMA_SESSION_VERSION", None),
        "n_vocab": llm.n_vocab(),
        "n_embd": llm.n_embd(),
        "context": ctx,
        # what the context really is (see _CTX_IGNORED): its cells, cells per sequence,
        # sequences
        "n_ctx": int(lc.llama_n_ctx(llm.ctx)),
        "n_ctx_seq": int(lc.llama_n_ctx_seq(llm.ctx)),
        "n_seq_max": int(lc.llama_n_seq_max(llm.ctx)),
        # a LoRA by its content, as the model: the same file at two paths is one adapter.
        # (lora_base is only kept by llama-cpp-python for pickling; it loads nothing.)
        "lora": [
            file_identity(llm.lora_path) if llm.lora_path else None,
            round(float(llm.lora_scale), 6),
        ],
        "kv_overrides": sorted((str(k), str(v)) for k, v in (llm.kv_overrides or {}).items()),
    }
    gpu = offload.description(llm)
    if gpu is not None:  # (absent on the CPU: such contexts key as before offload existed)
        out["offload"] = gpu
    buffers = offload.weight_buffers(llm)
    if buffers is not None:  # (absent with llama.cpp's default buffers, as before)
        out["weight_buffers"] = buffers
    return out


def model_fingerprint(llm: llama_cpp.Llama) -> bytes:
    """32-byte fingerprint of model file identity plus context description."""
    h = hashlib.blake2b(digest_size=32)
    h.update(file_identity(llm.model_path))
    h.update(msgpack.packb(context_description(llm), use_bin_type=True))
    return h.digest()
