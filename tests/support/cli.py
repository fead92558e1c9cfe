"""The ``shmkv`` command line run as a subprocess, and the one-line error it fails with."""

from __future__ import annotations

import os
import pwd
import re
import subprocess

from tests.support.users import python_for, spawn_kw


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without any SHMKV_* or systemd variables, plus ``extra``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("SHMKV_")
        and k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "RUNTIME_DIRECTORY")
    }
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def shmkv(
    *args: str,
    env: dict[str, str] | None = None,
    timeout: float = 30,
    user: pwd.struct_passwd | None = None,
) -> subprocess.CompletedProcess:
    """Run the ``shmkv`` CLI (as ``user``, see :func:`as_user`) and capture its output."""
    return subprocess.run(
        [python_for(user), "-m", "shmkv", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        **spawn_kw(user, env if env is not None else clean_env()),
    )


_LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (DEBUG|INFO|WARNING) ")


def assert_one_error_line(
    res: subprocess.CompletedProcess, *needles: str, ignore_logs: bool = False
) -> str:
    """A CLI failure: non-zero exit, no traceback, exactly one 'shmkv: error:' line.

    ``ignore_logs`` drops the supervisor's own log lines (a supervisor that got as far
    as creating its arena logs that before failing).
    """
    assert res.returncode != 0, res
    assert "Traceback" not in res.stderr + res.stdout
    lines = res.stderr.strip().splitlines()
    if ignore_logs:
        lines = [ln for ln in lines if not _LOG_LINE.search(ln)]
    assert len(lines) == 1, f"expected one line, got:\n{res.stderr}"
    assert lines[0].startswith("shmkv: error:"), lines[0]
    for n in needles:
        assert n in lines[0], f"{n!r} not in {lines[0]!r}"
    return lines[0]
