"""What runs in a process that holds a llama-cpp-python ``Llama``: restore prompt state
from the arena before prefill, publish new state after it.

``shmkv.llama`` is the public face (``attach``, ``SharedCacheLlama``, ...); the mechanism is
in the modules of this package: ``cache.py`` (the cache object and one call's steps),
``hooks.py`` (the hooks on a ``Llama``), ``restore.py``, ``capture.py``, ``policy.py`` (which
state a prompt restores and publishes: pure), ``kvstate.py`` (llama.cpp state in and out),
``publisher.py``, ``claims.py``, ``fingerprint.py``, ``tenant.py``, ``counters.py``,
``media.py`` (images and audio: positions that no token filled) and ``cpu/`` (the CPU
budget); llama-cpp-python's private names only in ``compat.py``. ``cache.py`` imports the
others, never the reverse. Nothing here imports the supervisor.
"""

from shmkv.llama.cache import (
    SharedCacheLlama,
    SharedPrefixCache,
    attach,
    close_all,
    key_root,
    live_caches,
    model_fingerprint,
)

__all__ = [
    "SharedCacheLlama",
    "SharedPrefixCache",
    "attach",
    "close_all",
    "key_root",
    "live_caches",
    "model_fingerprint",
]
