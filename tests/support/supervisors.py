"""``shmkv supervise`` processes started by tests."""

from __future__ import annotations

import json
import os
import pwd
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from shmkv import Client, SupervisorUnavailable
from shmkv.core.config import SETTINGS
from shmkv.core.keys import chain_digests
from tests.support.users import python_for, spawn_kw
from tests.support.waiting import wait_until

#: the arena mode (``--reserve``) a supervisor runs in unless told otherwise, and the
#: other: a test that runs in both gives the other a share of its work
RESERVE_DEFAULT = "true" if SETTINGS["reserve"].default else "false"
RESERVE_OTHER = "false" if RESERVE_DEFAULT == "true" else "true"


@dataclass
class Sup:
    """A running `shmkv supervise` started by a test."""

    name: str
    socket: str
    dir: str
    proc: subprocess.Popen
    env: dict[str, str] = field(default_factory=dict)
    log_path: Path | None = None

    @property
    def arena(self) -> Path:
        return Path(self.dir) / f"shmkv-{self.name}"

    def client(self, **kw: Any) -> Client:
        return Client(name=self.name, socket_path=self.socket, **kw)

    def stats(self) -> dict:
        with self.client(populate=False, attach=False) as c:
            return c.stats()

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "shmkv", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
            check=check,
        )

    def stats_json(self) -> dict:
        return json.loads(self.cli("stats", "--json").stdout)

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path else ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)


def wait_for_socket(path: str, proc: subprocess.Popen, timeout: float = 15) -> None:
    """Wait until the socket file ``path`` exists; fail if ``proc`` exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path):
            return
        if proc.poll() is not None:
            raise RuntimeError(f"supervisor exited with {proc.returncode}")
        time.sleep(0.02)
    raise TimeoutError(f"supervisor socket {path} did not appear")


def start_supervisor(
    tmp_path: Path,
    *args: str,
    name: str | None = None,
    env_extra: dict[str, str] | None = None,
    wait: bool = True,
    user: pwd.struct_passwd | None = None,
    python: list[str] | None = None,
) -> Sup:
    """Start `shmkv supervise` with a unique name and socket under tmp_path (or the
    SHMKV_SOCKET of ``env_extra``), as ``user`` if given; ``python``: the command that
    runs Python instead (``[strace, ..., sys.executable]``).

    Tests that stop it themselves call this; others use the ``make_supervisor`` fixture,
    which also stops it and checks for leftovers.
    """
    name = name or f"t{uuid.uuid4().hex[:10]}"
    env = {
        **os.environ,
        "SHMKV_NAME": name,
        "SHMKV_SOCKET": str(tmp_path / f"{name}.sock"),
        "PYTHONUNBUFFERED": "1",
    }
    env.update(env_extra or {})
    sock = env["SHMKV_SOCKET"]
    log_path = tmp_path / f"{name}.log"
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen(
            [*(python or [python_for(user)]), "-m", "shmkv", "supervise", *args],
            stdout=logf,
            stderr=subprocess.STDOUT,
            **spawn_kw(user, env),
        )
    sup = Sup(name, sock, env.get("SHMKV_DIR", "/dev/shm"), proc, env, log_path)
    if wait:
        wait_for_socket(sock, proc)
    return sup


def wait_ready(sup: Sup, timeout: float = 20.0) -> Sup:
    """Wait until ``sup`` itself answers (a killed predecessor's socket file may still exist)."""

    def answers() -> bool:
        if sup.proc.poll() is not None:
            raise AssertionError(f"supervisor exited with {sup.proc.returncode}: {sup.log()}")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:  # a raw probe first: a refused Client would log a warning every time
                probe.connect(sup.socket)
            except OSError:
                return False
        with sup.client(attach=False, populate=False) as c:
            return c.stats()["pid"] == sup.proc.pid

    wait_until(answers, timeout, "the restarted supervisor", step=0.005)
    return sup


def try_stats(c: Client) -> dict | None:
    """``c.stats()``, or None while its supervisor is unavailable."""
    try:
        return c.stats()
    except SupervisorUnavailable:
        return None


def assert_healthy(sup: Sup) -> None:
    """The supervisor is up and a well-behaved client can put a blob and read it back."""
    assert sup.proc.poll() is None, f"supervisor died:\n{sup.log()}"
    data = os.urandom(5000 + int.from_bytes(os.urandom(2), "little"))
    root = os.urandom(16)
    with sup.client() as c:
        chunk = c.view.geometry.chunk_tokens
        tokens = np.arange(2 * chunk, dtype=np.int32)
        c.put_bytes(root, tokens, b"fp", data)
        hit = c.lookup(chain_digests(root, tokens, chunk))
        assert hit is not None and hit.chunks == 2
        with c.acquire(hit) as lease:
            assert bytes(lease.payload) == data
            assert np.array_equal(lease.tokens(), tokens)
            assert lease.finish(len(tokens))
    assert sup.proc.poll() is None
    assert "internal error" not in sup.log() and "Traceback" not in sup.log(), sup.log()


def kill9(sup: Sup) -> None:
    """SIGKILL ``sup`` and check that the kill is what ended it."""
    sup.proc.kill()
    assert sup.proc.wait(10) == -signal.SIGKILL


def restart(make_supervisor: Callable[..., Sup], sup: Sup, *args: str) -> Sup:
    """A new supervisor on ``sup``'s name (``make_supervisor``: the fixture), once it answers."""
    return wait_ready(make_supervisor(*args, name=sup.name, wait=False))


def no_internal_errors(*sups: Sup) -> None:
    """No traceback and no internal error in any of the supervisors' logs."""
    for sup in sups:
        log = sup.log()
        assert "Traceback" not in log and "internal error" not in log, log[-3000:]


def persisted_all(sup: Sup) -> bool:
    """Whether ``--persist``'s write-behind has written (or dropped) every put so far."""
    st = sup.stats()
    return st["persist_queue"] == 0 and st["persisted"] + st["persist_gone"] >= st["puts"] > 0
