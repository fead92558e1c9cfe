"""llama_cpp.server's app, as bench_serve's ``nocache`` and ``ramcache`` arms run it, with Gemma
3's chat template registered first under the name ``shmkv serve`` gives it (the packaged GGUF
has none; llama-cpp-python's "gemma" drops system messages)."""

from typing import Any


def create_app() -> Any:
    from llama_cpp.server.app import create_app as plain

    from shmkv.serving.chat_template import register_gemma3

    register_gemma3()
    return plain()
