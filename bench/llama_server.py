"""Build llama.cpp's ``llama-server`` once from the installed llama-cpp-python's sdist (cmake,
CPU only, no curl) into ``~/.cache/shmkv-bench/llama-server-<version>/``; prints its path."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import click

log = logging.getLogger("llama_server")

DIST = "llama-cpp-python"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "shmkv-bench"
# CPU only and nothing fetched at build time (the same kernels as the wheel), one binary
CMAKE_FLAGS = """-DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_CUDA=OFF -DGGML_METAL=OFF
-DGGML_VULKAN=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON
-DBUILD_SHARED_LIBS=OFF""".split()


def run(args: list[str], cwd: Path, log_path: Path) -> None:
    log.info("$ %s", " ".join(args))
    with open(log_path, "ab") as out:
        if rc := subprocess.run(args, cwd=cwd, stdout=out, stderr=subprocess.STDOUT).returncode:
            tail = log_path.read_text(errors="replace")[-3000:]
            raise click.ClickException(f"{args[0]} failed ({rc}); end of {log_path}:\n{tail}")


def build(ver: str | None = None, jobs: int = 2, keep: bool = False) -> Path:
    """``llama-server`` of llama-cpp-python ``ver``: the cached binary, built if missing."""
    with contextlib.suppress(PackageNotFoundError):  # the llama.cpp the other arms run
        ver = ver or version(DIST)
    dest = CACHE / f"llama-server-{(ver := ver or '0.3.36')}"
    if (exe := dest / "llama-server").is_file() and os.access(exe, os.X_OK):
        log.info("cached: %s", exe)
        return exe
    dest.mkdir(parents=True, exist_ok=True)
    (build_log := dest / "build.log").write_text("")
    work = Path(tempfile.mkdtemp(prefix="llama-server-build-", dir=dest))
    try:
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        run([*pip, f"{DIST}=={ver}", "-d", str(work)], work, build_log)
        (sdist,) = work.glob("*.tar.gz")
        with tarfile.open(sdist) as tar:
            tar.extractall(work, filter="data")
        (src,) = work.glob("*/vendor/llama.cpp")
        out, gen = work / "build", ["-G", "Ninja"] if shutil.which("ninja") else []
        run(["cmake", "-S", str(src), "-B", str(out), *gen, *CMAKE_FLAGS], work, build_log)
        log.info("building llama-server with %d jobs (minutes; log: %s)", jobs, build_log)
        make = ["cmake", "--build", str(out), "--target", "llama-server", "-j", str(jobs)]
        run(make, work, build_log)
        shutil.copy2(next(out.glob("bin/llama-server")), tmp := dest / "llama-server.tmp")
        tmp.replace(exe)  # atomic: a half-copied binary is never "cached"
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    log.info("built: %s", exe)
    return exe


@click.command()
@click.option("--version", "ver", help="llama-cpp-python version [the installed one].")
@click.option("--jobs", "-j", default=2, show_default=True, help="Parallel compile jobs.")
@click.option("--keep", is_flag=True, help="Keep the unpacked sources and build tree.")
def main(ver: str | None, jobs: int, keep: bool) -> None:
    """Build (once) and print the path of llama-server from llama-cpp-python's llama.cpp."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    click.echo(build(ver, jobs, keep))


if __name__ == "__main__":
    main()
