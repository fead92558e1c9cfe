"""llama-cpp-python's own server app, as the bench's ``nocache`` and ``ramcache`` arms run it.

Runs in each of their gunicorn workers (``bench_serve.py``: ``plain_app:create_app()``).
``llama_cpp.server.app.create_app`` unchanged, except that Gemma 3's chat template is
registered first under the name ``shmkv serve`` gives it
(``shmkv.serving.chat_template``): the packaged GGUF carries no template, so with
``CHAT_FORMAT=shmkv-gemma3`` a chat renders to the very prompt the shmkv workers render
(llama-cpp-python's own "gemma" format drops system messages).
"""

from __future__ import annotations

from typing import Any


def create_app() -> Any:
    from llama_cpp.server.app import create_app as plain

    from shmkv.serving.chat_template import register_gemma3

    register_gemma3()
    return plain()
