"""KV cache types for served models: ``--cache-type-k``, ``--cache-type-v``, ``--flash-attn``.

Runs in ``shmkv serve`` (settings are checked before anything starts) and in each
gunicorn worker (the kwargs of its ``Llama``). No llama_cpp import here: the ggml
type ids below are llama.cpp's ABI (``enum ggml_type``), checked against
``llama_cpp.GGML_TYPE_*`` by a test.

A quantized cache makes every stored state smaller by the same ratio (q8_0: 34
bytes per 32 values instead of 64, about half of f16), so the arena holds about
twice as many. The fingerprint covers both types and flash attention
(``shmkv/fingerprint.py``), so states of different types never meet.
"""

from __future__ import annotations

from typing import Any

from shmkv.core.errors import ConfigError

# llama-server's --cache-type-k/-v choices, by ggml type id
KV_TYPES: dict[str, int] = {
    "f32": 0,
    "f16": 1,
    "bf16": 30,
    "q8_0": 8,
    "q4_0": 2,
    "q4_1": 3,
    "iq4_nl": 20,
    "q5_0": 6,
    "q5_1": 7,
}
_UNQUANTIZED = {"f32", "f16", "bf16"}
FLASH_ATTN = ("auto", "on", "off")


def parse_kv_type(text: str) -> str:
    """A KV cache type name (``q8_0``, ``F16`` ...), lower-cased."""
    name = str(text).strip().lower()
    if name not in KV_TYPES:
        raise ValueError(f"unknown KV cache type {text!r}: use one of {', '.join(KV_TYPES)}")
    return name


def parse_flash_attn(text: str | bool) -> str:
    """``auto``, ``on`` or ``off`` (true/false and friends accepted)."""
    if isinstance(text, bool):
        return "on" if text else "off"
    low = str(text).strip().lower()
    low = {"true": "on", "1": "on", "yes": "on", "false": "off", "0": "off", "no": "off"}.get(
        low, low
    )
    if low not in FLASH_ATTN:
        raise ValueError(f"not a flash attention mode: {text!r} (use auto, on or off)")
    return low


def is_quantized(name: str) -> bool:
    return name not in _UNQUANTIZED


def llama_kwargs(type_k: str, type_v: str, flash_attn: str) -> dict[str, Any]:
    """``Llama``/``ModelSettings`` keyword arguments for these settings.

    llama.cpp refuses a quantized V cache without flash attention ("quantized V
    cache requires flash_attn"), so ``auto`` turns it on exactly then and leaves it
    off otherwise (llama-cpp-python's default); ``off`` with a quantized V cache is
    a ConfigError. Flash attention changes llama.cpp's numbers a little: compare
    outputs only between contexts with the same settings.
    """
    k, v = parse_kv_type(type_k), parse_kv_type(type_v)
    mode = parse_flash_attn(flash_attn)
    if mode == "off" and is_quantized(v):
        raise ConfigError(
            f"--cache-type-v {v} needs flash attention (llama.cpp cannot quantize the V "
            "cache without it): drop --flash-attn off (auto turns it on) or use "
            "--cache-type-v f16"
        )
    flash = mode == "on" or (mode == "auto" and is_quantized(v))
    return {"type_k": KV_TYPES[k], "type_v": KV_TYPES[v], "flash_attn": flash}


def describe(type_k: str, type_v: str, flash_attn: str) -> str:
    """``K q8_0, V q8_0, flash attention on``: for logs and error messages."""
    kw = llama_kwargs(type_k, type_v, flash_attn)
    return f"K {type_k}, V {type_v}, flash attention {'on' if kw['flash_attn'] else 'off'}"
