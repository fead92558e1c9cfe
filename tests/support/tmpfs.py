"""Small tmpfs mounts, for a full /dev/shm or a full disk (root only: tests skip without)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def mounted_tmpfs(path: Path, size: str = "64m", mode: str | None = None) -> Iterator[Path]:
    """A tmpfs of ``size`` (mount's syntax), with root directory ``mode`` if given, on the
    new directory ``path``; lazily unmounted on exit. Skips the calling test where it
    cannot mount (it needs root / CAP_SYS_ADMIN)."""
    path.mkdir()
    opts = f"size={size}" + (f",mode={mode}" if mode else "")
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True, text=True
    )
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN): {res.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)
