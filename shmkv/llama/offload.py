"""GPU offload as a context really has it: how many layers run on a device, and what that
changes for shmkv (runs in each process that loads a ``Llama``).

``--n-gpu-layers`` asks; the llama-cpp-python build decides. A CPU-only build (the one
``pip install llama-cpp-python`` compiles) loads the model with every layer on the CPU
whatever was asked, so everything here starts from what llama.cpp reports
(``llama_supports_gpu_offload()``: a GPU backend with a device is there), never from the
setting alone. llama.cpp puts layers ``n_layer - N .. n_layer - 1`` on the device for
``N`` requested layers, and the output layer too only when ``N > n_layer``; the input
embeddings always stay in host memory. A model is *fully offloaded* when every layer and
the output are on a device and so is the KV cache (``offload_kqv``, llama-cpp-python's
default): then a prompt's evaluation leaves the CPU only a token-embedding lookup, and
the CPU budget (``cpu/budget.py``) does not apply to it.

Where the CPU holds the weights, the build decides their buffers too: with
``use_extra_bufts`` (llama.cpp's default) a CPU backend compiled for AMX moves them into
its AMX buffers, whose matrix multiply crashes with SIGSEGV on Q4_K weights (llama.cpp
#20824; Gemma 3 270M Q4_K_M in the first decode). Models loaded the served workers' way
(``serving/model_settings.py``) go without extra buffers on such a build
(:func:`plain_weight_buffers`), and the fingerprint says so: other kernels, other numbers.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from typing import Any

from llama_cpp import llama_cpp as lc

log = logging.getLogger(__name__)

#: llama-cpp-python's stand-in for ``n_gpu_layers=-1`` (every layer)
ALL_LAYERS = 0x7FFFFFFF

_warned = False
_warned_amx = False


@functools.cache
def supports_gpu_offload() -> bool:
    """Whether this llama-cpp-python build can put layers on a device (asked once)."""
    return bool(lc.llama_supports_gpu_offload())


def warn_if_cpu_only(n_gpu_layers: int) -> bool:
    """Whether layers asked for (``n_gpu_layers`` != 0) can go to a GPU. When they cannot,
    one warning per process, naming the fix; the model then runs on the CPU (one per
    deployment when the gunicorn master asks first: :func:`warn_if_amx`)."""
    global _warned
    if n_gpu_layers == 0:
        return False
    if supports_gpu_offload():
        return True
    if not _warned:
        _warned = True
        log.warning(
            "--n-gpu-layers %d: this llama-cpp-python build (%s) cannot offload to a GPU "
            "(a CPU-only build, or no GPU it can use), so the model runs on the CPU. For "
            "a GPU, install a CUDA, Metal or ROCm build of llama-cpp-python, e.g. "
            'CMAKE_ARGS="-DGGML_CUDA=on" pip install --force-reinstall --no-cache-dir '
            "llama-cpp-python",
            n_gpu_layers,
            _version(),
        )
    return False


@functools.cache
def amx_weight_buffers() -> bool:
    """Whether this build's CPU backend was compiled for AMX (its system info says
    ``AMX_INT8 = 1``), so that a model loaded with extra buffers keeps weights in them."""
    return b"AMX_INT8 = 1" in bytes(lc.llama_print_system_info() or b"")


def warn_if_amx(model: str = "the model") -> bool:
    """Whether this build keeps CPU weights in AMX buffers unless told not to
    (:func:`amx_weight_buffers`); if so, one warning per process naming the way out. The
    gunicorn master asks before it forks its workers (``workers/gunicorn_conf.py``), so they
    inherit having warned: one warning per deployment, not one per worker."""
    global _warned_amx
    if not amx_weight_buffers():
        return False
    if not _warned_amx:
        _warned_amx = True
        log.warning(
            "%s loads without llama.cpp's AMX weight buffers: this llama-cpp-python build "
            "(%s) was compiled for AMX, whose matrix multiply crashes on Q4_K weights "
            "(llama.cpp#20824). For its speed on other weights, build one that leaves it "
            "out (docs/guides/serving.md, a CPU with AMX)",
            model,
            _version(),
        )
    return True


@contextlib.contextmanager
def plain_weight_buffers(model: str = "the model") -> Iterator[None]:
    """For the length of the block, on a build compiled for AMX, models load without
    llama.cpp's extra weight buffers (``use_extra_bufts`` off in
    ``llama_model_default_params()``, which ``Llama()`` starts from); one warning per
    process (:func:`warn_if_amx`). Elsewhere nothing changes."""
    if not warn_if_amx(model):
        yield
        return
    default = lc.llama_model_default_params

    def without_extra_buffers() -> Any:
        params = default()
        params.use_extra_bufts = False
        return params

    lc.llama_model_default_params = without_extra_buffers
    try:
        yield
    finally:
        lc.llama_model_default_params = default


def weight_buffers(llm: Any) -> str | None:
    """What the fingerprint says of a loaded ``Llama``'s weight buffers: ``"plain"`` when
    it loaded without extra buffers, None (the default, absent from fingerprints as before
    this existed) otherwise."""
    return None if getattr(llm.model_params, "use_extra_bufts", True) else "plain"


def offloaded_layers(requested: int, n_layer: int, supported: bool) -> int:
    """Layers llama.cpp puts on a device for ``requested`` (-1 or ``ALL_LAYERS``: all) of a
    model of ``n_layer`` layers: 0 without offload support, at most ``n_layer + 1`` (the
    output layer counts as one)."""
    if not supported or requested == 0:
        return 0
    if requested < 0 or requested >= ALL_LAYERS:
        return n_layer + 1
    return min(requested, n_layer + 1)


def evaluates_on_cpu(offloaded: int, n_layer: int, offload_kqv: bool) -> bool:
    """The CPU budget's rule: whether a context evaluates prompts on CPU cores, so that its
    evals take cores from the budget. Only a fully offloaded one (every layer, the output
    layer and the KV cache on a device) does not; a partly offloaded one still runs its
    other layers, or its attention, on the CPU."""
    return not (offloaded > n_layer and offload_kqv)


def offloaded_layers_of(llm: Any) -> int:
    """:func:`offloaded_layers` of a loaded ``Llama``."""
    n_layer = int(lc.llama_model_n_layer(llm.model))
    return offloaded_layers(int(llm.model_params.n_gpu_layers), n_layer, supports_gpu_offload())


def uses_cpu(llm: Any) -> bool:
    """:func:`evaluates_on_cpu` of a loaded ``Llama``."""
    n_layer = int(lc.llama_model_n_layer(llm.model))
    return evaluates_on_cpu(offloaded_layers_of(llm), n_layer, bool(llm.context_params.offload_kqv))


def description(llm: Any) -> dict[str, Any] | None:
    """:func:`describe` of a loaded ``Llama``."""
    return describe(
        offloaded_layers_of(llm),
        int(llm.model_params.split_mode),
        int(llm.model_params.main_gpu),
        list(llm.tensor_split or []),
    )


def describe(
    layers: int, split_mode: int, main_gpu: int, tensor_split: list[float]
) -> dict[str, Any] | None:
    """What the fingerprint says of a context's offload: None when every layer runs on the
    CPU (``layers`` = 0, whatever ``--n-gpu-layers`` asked of a CPU-only build), so that
    such a context keys as it always did; else the layers on a device and how they are
    split between GPUs. A sequence state is written from device memory in the same format,
    but its numbers are the device's (docs/guides/serving.md, "GPU offload"): contexts
    that compute their cells differently are kept apart."""
    if layers == 0:
        return None
    return {
        "layers": layers,
        "split_mode": split_mode,
        "main_gpu": main_gpu,
        "tensor_split": [round(float(x), 6) for x in tensor_split],
    }


def _version() -> str:
    import llama_cpp

    return str(getattr(llama_cpp, "__version__", "?"))
