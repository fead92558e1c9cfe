"""`shmkv top` in a real terminal: a detached tmux session of fixed size on a private tmux
server, a real supervisor with entries and reported counters; the screen is read with
capture-pane, and q / Ctrl-C end it with exit status 0."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

from shmkv.core.keys import chain_digests
from tests.support.cli import shmkv
from tests.support.llama_workers import SYSTEM, completion, run_worker
from tests.support.peer import Raw
from tests.support.waiting import wait_until

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")


class Tmux:
    """One detached session on a tmux server of its own (``-L``), killed at the end."""

    def __init__(
        self, cmd: list[str], env: dict[str, str], status: Path, width: int = 120, height: int = 40
    ):
        self.server = f"shmkv-test-{uuid.uuid4().hex[:8]}"
        pairs = [f"{k}={v}" for k, v in env.items() if k.startswith(("SHMKV_", "PYTHON"))]
        # the shell writes the exit status down: tmux marks a pane dead when its terminal
        # closes, and under load it had not always recorded the status 10 s later
        self.status = status
        line = shlex.join(["env", *pairs, *cmd]) + f"; echo $? > {shlex.quote(str(status))}"
        self.tmux("new-session", "-d", "-s", "t", "-x", str(width), "-y", str(height), "sh")
        self.tmux("set-option", "-t", "t", "remain-on-exit", "on")
        self.tmux("respawn-pane", "-k", "-t", "t", line)

    def tmux(self, *args: str) -> str:
        res = subprocess.run(
            ["tmux", "-L", self.server, *args], capture_output=True, text=True, timeout=10
        )
        assert res.returncode == 0, res.stderr
        return res.stdout

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-t", "t")

    def showing(self, text: str) -> str | None:
        """The screen if it shows ``text``."""
        screen = self.screen()
        return screen if text in screen else None

    def exit_status(self) -> int | None:
        """The program's exit status once it has exited (None: still running)."""
        try:
            text = self.status.read_text().strip()
        except FileNotFoundError:
            return None
        return int(text) if text else None

    def kill(self) -> None:
        path = self.tmux("display-message", "-p", "#{socket_path}").strip()
        subprocess.run(["tmux", "-L", self.server, "kill-server"], capture_output=True)
        Path(path).unlink(missing_ok=True)  # (tmux leaves its socket file behind)


def publish(c, n: int, hits: int) -> str:
    """Put one entry of ``n`` chunks and lease it ``hits`` times; its key (hex)."""
    g = c.view.geometry
    root = os.urandom(16)
    tokens = np.arange(n * g.chunk_tokens, dtype=np.int32)
    reply = c.put_bytes(root, tokens, b"fp", os.urandom(20_000))
    for _ in range(hits):
        hit = c.lookup(chain_digests(root, tokens, g.chunk_tokens))
        with c.acquire(hit) as lease:
            assert lease.finish()
    return reply["key"].hex()


def report(raw: Raw, calls: int, hits: int, restored: int) -> None:
    counters = {"calls": calls, "hits": hits, "tokens_restored": restored}
    assert raw.call({"op": "report", "reporter": 5, "model": "m", "counters": counters})["ok"]


@pytest.fixture
def deployment(make_supervisor):
    sup = make_supervisor("--size", "32M")
    c = sup.client()
    keys = [publish(c, n, hits) for n, hits in ((2, 1), (3, 7), (4, 3))]
    raw = Raw(sup.socket)
    raw.attach()
    report(raw, calls=10, hits=4, restored=1000)
    yield sup, keys, raw
    raw.close()
    c.close()


@pytest.mark.parametrize("how", ["q", "C-c"])
def test_top_in_tmux(deployment, how: str, tmp_path: Path) -> None:
    sup, keys, raw = deployment
    cmd = [sys.executable, "-m", "shmkv", "top", "--interval", "0.3"]
    term = Tmux(cmd, sup.env, tmp_path / "status")
    try:
        # (curses draws a screen line by line: wait for its last row, not just the header)
        screen = wait_until(lambda: term.showing(keys[0][:16]), 20, "top's first screen")
        assert "hottest" in screen
        assert "arena " + sup.name in screen
        assert "40.0% since start (4 of 10 requests)" in screen, screen
        assert "3 (0 pinned, 0 B)" in screen and "workers 1" in screen
        assert max(map(len, screen.splitlines())) <= 80  # (fits an 80-column terminal)
        rows = [
            ln.split() for ln in screen.splitlines() if ln.strip()[:16] in {k[:16] for k in keys}
        ]
        assert [r[0] for r in rows] == [keys[1][:16], keys[2][:16], keys[0][:16]]  # by hits
        assert [r[4] for r in rows] == ["7", "3", "1"]  # (key, tokens, size, unit, hits)
        # a second worker's report: the next refreshes show the rate and the saved tokens
        report(raw, calls=20, hits=14, restored=6000)

        screen = wait_until(lambda: term.showing("14 of 20 requests"), 20, "the refreshed counters")
        assert "70.0% since start" in screen and "6,000 since start" in screen
        assert "/s" in screen and " 0/s" not in screen  # tokens saved per second, measured
        # refreshed in place: one screen, not appended lines
        assert screen.count("hottest prefixes") == 1
        assert term.exit_status() is None
        term.tmux("send-keys", "-t", "t", how if how != "q" else "q")
        wait_until(lambda: term.exit_status() is not None, 10, f"top to exit on {how}")
        assert term.exit_status() == 0
        assert "Traceback" not in term.screen()
    finally:
        term.kill()


def test_top_once_without_a_terminal(deployment) -> None:
    sup, keys, _ = deployment
    res = sup.cli("top", "--once", "--interval", "0.1", "--rows", "2")
    lines = res.stdout.splitlines()
    assert any("hit rate" in ln for ln in lines) and any("memory" in ln for ln in lines)
    assert any(ln.strip().startswith(keys[1][:16]) for ln in lines)
    assert not any(ln.strip().startswith(keys[0][:16]) for ln in lines)  # (--rows 2)


def test_top_shows_real_requests(make_supervisor, models) -> None:
    """End to end: two llama workers' completions of one prompt (a miss, then a hit from
    the arena) reach `shmkv top` through the workers' own reports."""
    sup = make_supervisor("--size", "64M")
    prompt = SYSTEM + " Question: which mat?"
    calls = [run_worker(sup, models["seed0"], [completion(prompt)])["results"][0]["last"]]
    calls.append(run_worker(sup, models["seed0"], [completion(prompt)])["results"][0]["last"])
    assert [c["hit"] for c in calls] == [False, True], calls

    def screen() -> str | None:
        out = sup.cli("top", "--once", "--interval", "0.1").stdout
        return out if "(1 of 2 requests)" in out else None

    out = wait_until(screen, 20, "the workers' reports in top")
    assert "50.0% since start (1 of 2 requests)" in out, out
    assert f"{calls[1]['tokens_restored']:,} since start" in out, out


def test_top_without_a_supervisor(tmp_path) -> None:
    env = {**os.environ, "SHMKV_SOCKET": str(tmp_path / "none.sock")}
    res = shmkv("top", "--once", env=env)
    assert res.returncode != 0
    assert res.stderr.count("\n") == 1 and "supervise" in res.stderr
