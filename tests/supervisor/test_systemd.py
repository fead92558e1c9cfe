"""The shipped unit files: `systemd-analyze verify` is clean, and the supervisor makes no
system call that its unit's SystemCallFilter= denies (checked under strace)."""

from __future__ import annotations

import grp
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.support import ROOT
from tests.support.cli import clean_env, shmkv
from tests.support.users import PUT_AND_READ, make_group

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
        "Wants=shmkv-supervise@%i.service",
        "User=shmkv",
        "RemoveIPC=no",
    ):
        assert line in app, line
    for binding in ("BindsTo=", "Requires=", "PartOf="):  # see the crash test below
        assert not any(ln.startswith(binding) for ln in app.splitlines()), binding


# ------------------------------------------------------------- the syscall filter
def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is missing: apt-get install {name} (.ci/run does)")
    return path


def syscall_group(name: str, cache: dict[str, set[str]]) -> set[str]:
    """The syscalls of systemd group ``@name`` (nested groups expanded), or ``{name}``."""
    if not name.startswith("@"):
        return {name}
    if name not in cache:
        out = subprocess.run(
            [_tool("systemd-analyze"), "syscall-filter", name],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout
        cache[name] = set()  # (no group nests itself, but stop if one did)
        entries = [ln.strip() for ln in out.splitlines()[1:]]
        for entry in entries:
            if entry and not entry.startswith("#"):
                cache[name] |= syscall_group(entry, cache)
    return cache[name]


def unit_syscalls(unit: str) -> tuple[set[str] | None, set[str]]:
    """(allowed, denied) by a unit's SystemCallFilter= lines, merged as systemd does: the
    first line makes an allow list (plus @default) or a deny list (~); each later line
    adds its names to that list or (the other kind) takes them out of it."""
    cache: dict[str, set[str]] = {}
    allowed: set[str] | None = None
    denied: set[str] = set()
    started = False
    for line in unit.splitlines():
        if not line.startswith("SystemCallFilter="):
            continue
        value = line.split("=", 1)[1].strip()
        invert = value.startswith("~")
        names: set[str] = set()
        for item in value.lstrip("~").split():
            names |= syscall_group(item, cache)
        if not started:
            started = True
            if invert:
                denied = names
            else:
                allowed = syscall_group("@default", cache) | names
        elif allowed is not None:
            allowed = allowed - names if invert else allowed | names
        else:
            denied = denied | names if invert else denied - names
    return allowed, (set() if allowed is not None else denied)


_CALL = re.compile(r"^\d+\s+(?:<\.\.\. )?([a-z_][a-z0-9_]*)(?:\(| resumed>)")


def traced_syscalls(trace: Path) -> set[str]:
    """The syscalls an `strace -f -o` file shows, from the program's execve on (systemd
    applies the filter just before it)."""
    names: set[str] = set()
    started = False
    for line in trace.read_text(errors="replace").splitlines():
        m = _CALL.match(line)
        if m is None:
            continue
        started = started or m.group(1) == "execve"
        if started:
            names.add(m.group(1))
    return names


@pytest.mark.timeout(180)
@pytest.mark.parametrize("group", ["none", "own", "other", "persist"])
def test_supervisor_makes_no_syscall_its_unit_denies(tmp_path: Path, group: str) -> None:
    """The unit's SystemCallFilter= killed the supervisor (SIGSYS): numpy's OpenBLAS calls
    mbind (@resources) at import, and --group with another group than the unit's Group=
    needs fchown (@privileged). Run it as the unit does (a runtime directory, READY and
    the watchdog on $NOTIFY_SOCKET) through an attach, a put, a read, the CLI and a
    SIGTERM, without --group, with its own group and with another, and with --persist
    (LMDB's writer thread), under strace."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to make a group and give the arena to it")
    unit = (UNITS / "shmkv-supervise@.service").read_text()
    allowed, denied = unit_syscalls(unit)
    strace = _tool("strace")
    args = {
        "none": [],
        "own": ["--group", grp.getgrgid(os.getegid()).gr_name],  # as the unit's Group=
        "other": ["--group", make_group().gr_name],
        "persist": ["--persist", str(tmp_path / "state")],  # LMDB's calls too
    }[group]
    name = f"t{uuid.uuid4().hex[:10]}"
    run = tmp_path / "run"  # its RuntimeDirectory=
    run.mkdir(mode=0o750)
    sock = run / f"{name}.sock"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(f"\0shmkv-test-{name}")
    notify.settimeout(60)
    env = clean_env(
        SHMKV_NAME=name,
        SHMKV_SOCKET=str(sock),
        SHMKV_SIZE="16M",
        NOTIFY_SOCKET=f"@shmkv-test-{name}",
        WATCHDOG_USEC="1000000",
    )
    trace = tmp_path / "trace"
    log_path = tmp_path / "supervisor.log"
    with open(log_path, "wb") as log, notify:
        proc = subprocess.Popen(
            [strace, "-f", "-qq", "-o", str(trace), sys.executable, "-m", "shmkv", "supervise"]
            + args,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            ready = notify.recv(4096).decode()
            assert "READY=1" in ready, ready
            pid = int(ready.split("MAINPID=")[1].split()[0])
            res = subprocess.run(
                [sys.executable, "-c", PUT_AND_READ, str(sock)],
                capture_output=True,
                text=True,
                timeout=60,
                env=clean_env(),
            )
            assert res.returncode == 0 and '"put": true' in res.stdout, res.stderr
            for cli in (["stats"], ["ls"], ["clear"]):
                out = shmkv(*cli, "--socket", str(sock), env=clean_env())
                assert out.returncode == 0, out.stderr
            os.kill(pid, signal.SIGTERM)
            assert proc.wait(60) == 0, log_path.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    used = traced_syscalls(trace)
    assert "execve" in used and "mmap" in used, trace.read_text()[:2000]
    outside = sorted(used - allowed) if allowed is not None else []
    inside = sorted(used & denied)
    assert not outside and not inside, (
        f"the unit's SystemCallFilter= would kill the supervisor: it calls {outside + inside}"
    )


# ---------------------------------------------------- a supervisor crash, for real
# Runs a systemd user manager (this machine's systemd) in a private mount namespace, with
# the shipped units' dependency and restart lines on stand-in services: whatever systemd
# does with them when the supervisor is killed is what the real units get.
CRASH = r"""
set -u
here=$(readlink /proc/self/ns/mnt)
[ "$here" != "$1" ] || { echo "refusing: not in a private mount namespace"; exit 3; }
mount -t tmpfs tmpfs /run/systemd && mkdir -p /run/systemd/system  # "booted with systemd"
export XDG_RUNTIME_DIR="$2/run" SYSTEMD_UNIT_PATH="$2/units"
timeout -s KILL 60 /lib/systemd/systemd --user --log-target=console > "$2/manager.log" 2>&1 &
manager=$!  # (timeout's: SIGALRM makes it SIGKILL the manager now)
trap 'kill -ALRM "$manager"' EXIT
S="systemctl --user --no-pager"
for _ in $(seq 100); do [ -S "$XDG_RUNTIME_DIR/systemd/private" ] && break; sleep 0.1; done
state() { echo "$($S show -p ActiveState --value "$1")/$($S show -p MainPID --value "$1")"; }
pids() { echo "sup=$(state shmkv-supervise@main) serve=$(state shmkv-serve@main)"; }
$S start shmkv-serve@main.service
sleep 1
echo "before: $(pids)"
kill -9 "$($S show -p MainPID --value shmkv-supervise@main)"
sleep 4
echo "after: $(pids)"
$S stop shmkv-serve@main.service shmkv-supervise@main.service
"""


def _stand_in(unit: str) -> str:
    """``unit`` for a user manager: its dependency and restart lines on /bin/sleep."""
    keep = ("After=", "Wants=", "Requires=", "BindsTo=", "PartOf=", "Requisite=", "Upholds=")
    deps = [
        ln.replace("%i", "main")
        for ln in unit.splitlines()
        if ln.startswith(keep) and "shmkv-" in ln
    ]
    restart = [ln for ln in unit.splitlines() if ln.startswith(("Restart=", "RestartSec="))]
    return "\n".join(
        ["[Unit]", "DefaultDependencies=no", *deps, "[Service]", "ExecStart=/bin/sleep infinity"]
        + restart
    )


@pytest.mark.timeout(120)
def test_supervisor_crash_leaves_the_server_running(tmp_path: Path) -> None:
    """With BindsTo= a supervisor crash stopped the serving unit for good: systemd 252 (no
    RestartMode=) takes the restarting supervisor through "failed", which stops what is
    bound to it, and its restart starts only itself. The server must keep serving (its
    workers run cold until the restarted supervisor is back, then reattach)."""
    unshare = shutil.which("unshare")
    if os.geteuid() != 0 or unshare is None or not Path("/lib/systemd/systemd").exists():
        pytest.skip("needs root, unshare and systemd, to run a user manager")
    units = tmp_path / "units"
    units.mkdir()
    (units / "default.target").write_text("[Unit]\nDescription=test\n")
    for name in ("shmkv-supervise@", "shmkv-serve@"):
        text = (UNITS / f"{name}.service").read_text()
        (units / f"{name}main.service").write_text(_stand_in(text) + "\n")
    (tmp_path / "run").mkdir(mode=0o700)
    ns = os.readlink("/proc/self/ns/mnt")
    res = subprocess.run(
        [
            unshare,
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            CRASH,
            "sh",
            ns,
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=90,
    )
    lines = dict(ln.split(": ", 1) for ln in res.stdout.splitlines() if ": " in ln)
    if "before" not in lines:
        pytest.skip(f"no user manager here: {res.stdout}{res.stderr}"[:500])
    before = dict(kv.split("=") for kv in lines["before"].split())
    after = dict(kv.split("=") for kv in lines["after"].split())
    sup, serve = "sup", "serve"
    assert before[sup].startswith("active/") and before[serve].startswith("active/"), before
    assert after[sup].startswith("active/") and after[sup] != before[sup], after  # restarted
    assert after[serve] == before[serve], f"the server was stopped or restarted: {after}"
