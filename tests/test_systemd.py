"""The shipped unit files pass `systemd-analyze verify` with clean output."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
UNITS = ROOT / "workers" / "systemd"


@pytest.fixture
def installed_units(tmp_path: Path) -> list[Path]:
    """The units as the README installs them: /opt/shmkv replaced by this checkout."""
    venv = Path(sys.executable).parent.parent
    out = []
    for unit in sorted(UNITS.glob("*@.service")):
        text = (
            unit.read_text().replace("/opt/shmkv/.venv", str(venv)).replace("/opt/shmkv", str(ROOT))
        )
        instance = tmp_path / unit.name.replace("@.", "@main.")
        instance.write_text(text)
        (tmp_path / unit.name).write_text(text)
        out.append(instance)
    return out


def test_units_verify_clean(installed_units):
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.fail("systemd-analyze is missing: apt-get install systemd (.ci/run does)")
    assert len(installed_units) == 2
    proc = subprocess.run(
        [tool, "verify", "--man=no", *map(str, installed_units)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "" and proc.stderr.strip() == "", proc.stdout + proc.stderr


def test_supervisor_unit_is_notify_with_watchdog_and_keeps_dev_shm():
    text = (UNITS / "shmkv-supervise@.service").read_text()
    for line in (
        "Type=notify",
        "WatchdogSec=",
        "RuntimeDirectory=shmkv",
        "User=shmkv",
        "RemoveIPC=no",
        "ReadWritePaths=/dev/shm",
    ):
        assert line in text, line
    app = (UNITS / "shmkv-serve@.service").read_text()
    for line in (
        "After=shmkv-supervise@%i.service",
        "BindsTo=shmkv-supervise@%i.service",
        "User=shmkv",
        "RemoveIPC=no",
    ):
        assert line in app, line
