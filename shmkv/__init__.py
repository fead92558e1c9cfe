"""shmkv: share llama.cpp prompt state between worker processes through /dev/shm."""

from __future__ import annotations

__version__ = "0.1.0"

from shmkv.core.arena import Hit  # noqa: E402
from shmkv.core.client import Client, Lease  # noqa: E402
from shmkv.core.errors import *  # noqa: E402,F403
from shmkv.core.errors import __all__ as _errors_all  # noqa: E402

__all__ = ["__version__", "Client", "Hit", "Lease", *_errors_all]
