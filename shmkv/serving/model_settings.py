"""How `shmkv serve`'s workers load a model: one place for the llama and chat settings.

Runs in each gunicorn worker (``workers/app.py``) and in the commands that must key
states exactly as those workers do (``shmkv warm``, ``shmkv export --model``): a
state is found only by a context with the same fingerprint (``fingerprint.py``:
context parameters included), so these commands load their model through the
same llama-cpp-python loader with the same ``ModelSettings``, and render chat
messages with the same chat format. Needs the ``serve`` extra.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from shmkv.core.config import SPLIT_MODES, Settings
from shmkv.core.kvtypes import llama_kwargs
from shmkv.llama import offload
from shmkv.serving.chat_template import default_chat_format, register_gemma3

if TYPE_CHECKING:
    import llama_cpp
    from llama_cpp.server.settings import ModelSettings


def worker_threads(settings: Settings) -> int:
    """llama.cpp threads of one served worker: --threads, else cores // --workers."""
    return int(settings.threads) or max(1, (os.cpu_count() or 1) // settings.workers)


def model_settings(
    settings: Settings, model: str, alias: str | None = None, threads: int | None = None
) -> ModelSettings:
    """llama-cpp-python's ``ModelSettings`` of ``model`` as a served worker uses them."""
    from llama_cpp.server.settings import ModelSettings

    register_gemma3()
    n = worker_threads(settings) if threads is None else threads
    return ModelSettings(
        model=model,
        model_alias=alias,
        n_ctx=settings.n_ctx,
        n_threads=n,
        n_threads_batch=n,
        chat_format=settings.chat_format or default_chat_format(model),
        logits_all=settings.logits_all,
        n_gpu_layers=settings.n_gpu_layers,
        main_gpu=settings.main_gpu,
        split_mode=SPLIT_MODES[settings.split_mode],
        tensor_split=settings.tensor_split,
        verbose=False,
        **llama_kwargs(settings.cache_type_k, settings.cache_type_v, settings.flash_attn),
    )


def warn_once(settings: Settings) -> None:
    """The load warnings of ``settings``' models (a CPU-only build asked for GPU layers, a
    build compiled for AMX), given once: by the gunicorn master before it forks the workers,
    which inherit having warned (``workers/gunicorn_conf.py``)."""
    offload.warn_if_cpu_only(settings.n_gpu_layers)
    offload.warn_if_amx(", ".join(settings.model) if settings.model else "the default model")


def load_with(
    ms: ModelSettings,
    swa_full: bool,
    loader: Callable[[ModelSettings], llama_cpp.Llama] | None = None,
) -> llama_cpp.Llama:
    """``ms`` loaded by llama-cpp-python's server loader (``loader``, default its own), with
    the ``Llama`` arguments its ``ModelSettings`` lack: ``swa_full``; on a build compiled
    for AMX, without extra weight buffers (``offload.plain_weight_buffers``).

    That loader calls ``llama_cpp.Llama(...)``: for the length of this call (at a worker's
    start, before it serves) the name is a subclass that adds the arguments.
    """
    import llama_cpp
    from llama_cpp.server.model import LlamaProxy

    offload.warn_if_cpu_only(ms.n_gpu_layers)
    load = loader or LlamaProxy.load_llama_from_model_settings
    plain = llama_cpp.Llama

    class Llama(plain):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("swa_full", swa_full)
            super().__init__(*args, **kwargs)

    llama_cpp.Llama = Llama  # type: ignore[misc]
    try:
        with offload.plain_weight_buffers(ms.model):
            return load(ms)
    finally:
        llama_cpp.Llama = plain  # type: ignore[misc]


def load_llama(settings: Settings, model: str, threads: int | None = None) -> llama_cpp.Llama:
    """A plain ``Llama`` loaded exactly as a served worker loads ``model`` (no cache yet)."""
    return load_with(model_settings(settings, model, threads=threads), settings.swa_full)
