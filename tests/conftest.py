"""Shared fixtures: a real `shmkv supervise` process on a private name and socket."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from shmkv import Client

SHM = Path("/dev/shm")


@dataclass
class Sup:
    """A running supervisor started by a test."""

    name: str
    socket: str
    dir: str
    proc: subprocess.Popen
    env: dict[str, str] = field(default_factory=dict)
    log_path: Path | None = None

    @property
    def arena(self) -> Path:
        return Path(self.dir) / f"shmkv-{self.name}"

    def client(self, **kw) -> Client:
        return Client(name=self.name, socket_path=self.socket, **kw)

    def stats(self) -> dict:
        with self.client(populate=False, attach=False) as c:
            return c.stats()

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "shmkv.cli", *args], env=self.env,
                              capture_output=True, text=True, timeout=60, check=check)

    def stats_json(self) -> dict:
        return json.loads(self.cli("stats", "--json").stdout)

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path else ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)


def wait_for_socket(path: str, proc: subprocess.Popen, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path):
            return
        if proc.poll() is not None:
            raise RuntimeError(f"supervisor exited with {proc.returncode}")
        time.sleep(0.02)
    raise TimeoutError(f"supervisor socket {path} did not appear")


def start_supervisor(tmp_path: Path, *args: str, name: str | None = None,
                     env_extra: dict[str, str] | None = None, wait: bool = True) -> Sup:
    """Start `shmkv supervise` with a unique name and socket under tmp_path."""
    name = name or f"t{uuid.uuid4().hex[:10]}"
    sock = str(tmp_path / f"{name}.sock")
    env = {**os.environ, "SHMKV_NAME": name, "SHMKV_SOCKET": sock, "PYTHONUNBUFFERED": "1"}
    env.update(env_extra or {})
    log_path = tmp_path / f"{name}.log"
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen([sys.executable, "-m", "shmkv.cli", "supervise", *args],
                                env=env, stdout=logf, stderr=subprocess.STDOUT)
    sup = Sup(name, sock, env.get("SHMKV_DIR", "/dev/shm"), proc, env, log_path)
    if wait:
        wait_for_socket(sock, proc)
    return sup


@pytest.fixture
def make_supervisor(tmp_path: Path) -> Iterator:
    """Factory: start supervisors; all are stopped and checked for leftovers at teardown."""
    started: list[Sup] = []

    def make(*args: str, **kw) -> Sup:
        sup = start_supervisor(tmp_path, *args, **kw)
        started.append(sup)
        return sup

    yield make
    for sup in started:
        if sup.proc.poll() is None:
            sup.stop()
        if "--keep" not in sup.proc.args:
            leftovers = [p for p in SHM.glob(f"shmkv-{sup.name}*")]
            for p in leftovers:
                p.unlink()
            assert sup.proc.returncode != 0 or not leftovers, f"left behind {leftovers}"


@pytest.fixture
def supervisor(make_supervisor) -> Sup:
    """One supervisor with a 64 MiB arena."""
    return make_supervisor("--size", "64M")


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict[str, str]:
    """Tiny random-weight GGUFs: two llamas with the same shapes and different weights
    (seed0, seed1) and a Gemma 3 with a 32-token sliding window (swa)."""
    from tinymodel import write_tiny_gemma3, write_tiny_llama

    d = tmp_path_factory.mktemp("models")
    out = {}
    for seed in (0, 1):
        path = d / f"tiny{seed}.gguf"
        write_tiny_llama(path, seed=seed)
        out[f"seed{seed}"] = str(path)
    write_tiny_gemma3(d / "tiny-swa.gguf", n_swa=32)
    out["swa"] = str(d / "tiny-swa.gguf")
    return out
