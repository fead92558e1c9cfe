"""shmkv: share llama.cpp prompt state between worker processes through /dev/shm."""

from __future__ import annotations

__version__ = "0.1.0"

from .arena import Hit  # noqa: E402
from .client import Client, Lease  # noqa: E402
from .errors import *  # noqa: E402,F403
from .errors import __all__ as _errors_all  # noqa: E402

__all__ = ["__version__", "Client", "Hit", "Lease", *_errors_all]
