"""Real other users (made as root; tests skip without root) and running processes as them."""

from __future__ import annotations

import grp
import json
import os
import pwd
import subprocess
import sys
import sysconfig
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from tests.support import ROOT


def _retry(cmd: list[str]) -> subprocess.CompletedProcess:
    """Run a user/group tool; retry while another one holds /etc/passwd's lock."""
    for _ in range(50):
        res = subprocess.run(cmd, capture_output=True, text=True)
        if "lock" not in res.stderr:
            return res
        time.sleep(0.1)
    return res


#: the group the tests make, with --group
GROUP = "shmkv-test-grp"


def make_group(name: str = GROUP) -> grp.struct_group:
    """A real group made for the tests (root only); reused if it exists."""
    try:
        return grp.getgrnam(name)
    except KeyError:
        _retry(["groupadd", "-r", name])  # exit 9 (exists): made by a parallel run
        return grp.getgrnam(name)


def make_user(name: str, groups: tuple[str, ...] = ()) -> pwd.struct_passwd:
    """A real system user made for the tests (root only), member of ``groups``; reused
    if it exists (then added to ``groups``)."""
    for g in groups:
        make_group(g)
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        cmd = ["useradd", "-r", "-U", "-M", "-d", "/nonexistent", "-s", "/usr/sbin/nologin"]
        _retry([*cmd, *(["-G", ",".join(groups)] if groups else []), name])
        pw = pwd.getpwnam(name)
    for g in groups:
        if name not in grp.getgrnam(g).gr_mem:
            _retry(["usermod", "-aG", g, name])
    return pw


def _runnable_by_all(path: str) -> bool:
    real = Path(os.path.realpath(path))
    return all(os.stat(p).st_mode & 0o001 for p in (real, *real.parents))


def user_python() -> str:
    """A Python other users may run: ours, or else the system's of the same version (to
    which :func:`as_user` gives our packages). Ours may live under a 0700 /root."""
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    for exe in (sys.executable, f"/usr/bin/python{version}", f"/usr/local/bin/python{version}"):
        if os.path.exists(exe) and _runnable_by_all(exe):
            return exe
    import pytest

    pytest.skip(f"no Python {version} that other users may run (ours: {sys.executable})")


def as_user(pw: pwd.struct_passwd, env: dict[str, str] | None = None) -> dict[str, Any]:
    """subprocess keywords that run a child as ``pw`` with exactly its own groups, in ``env``
    (default: ours) with this checkout and our packages on PYTHONPATH, for
    :func:`user_python`."""
    env = dict(os.environ if env is None else env)
    path = [str(ROOT)]
    if user_python() != sys.executable:
        path += [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(path))
    return {
        "user": pw.pw_uid,
        "group": pw.pw_gid,
        "extra_groups": os.getgrouplist(pw.pw_name, pw.pw_gid),
        "cwd": "/",
        "env": env,
    }


def spawn_kw(user: pwd.struct_passwd | None, env: dict[str, str]) -> dict[str, Any]:
    """Popen keywords: ``env``, and if ``user`` is given, run as that user (:func:`as_user`)."""
    return as_user(user, env) if user else {"env": env}


def python_for(user: pwd.struct_passwd | None) -> str:
    """The interpreter to run a child with, as ``user`` (None: as we are)."""
    return user_python() if user else sys.executable


#: a client script (``python -c PUT_AND_READ SOCKET``), e.g. run as another user:
#: attaches, puts a blob, leases and reads it back; prints {"put": true} if all went well
PUT_AND_READ = r"""
import json, os, sys
import numpy as np
from shmkv import Client; from shmkv.core.keys import chain_digests
with Client(socket_path=sys.argv[1], timeout=5) as c:
    chunk = c.view.geometry.chunk_tokens
    root, tokens = os.urandom(16), np.arange(chunk, dtype=np.int32)
    c.put_bytes(root, tokens, b"fp", b"m" * 3000)
    hit = c.lookup(chain_digests(root, tokens, chunk))
    with c.acquire(hit) as lease:
        ok = bytes(lease.payload) == b"m" * 3000 and lease.finish()
print(json.dumps({"put": ok}))
"""


def system_user(name: str, group: str | None = None) -> tuple[int, int]:
    """(uid, gid) of system user ``name`` (made by :func:`make_user`), a member of
    ``group`` if given. Skips the calling test unless it runs as root."""
    import pytest

    if os.geteuid() != 0:
        pytest.skip("needs root to create and run as other users")
    pw = make_user(name, (group,) if group is not None else ())
    return pw.pw_uid, pw.pw_gid


# Runs as root until its imports are done and its input is read, then as uid/gid (with
# the group), and publishes one blob.
PUBLISH_AS = r"""
import json, os, sys
import numpy as np
from shmkv import Client
np.ctypeslib.as_array  # load lazily imported modules while we still can
spec = json.load(open(sys.argv[1]))
with open(spec["payload"], "rb") as f:
    payload = f.read()
os.setgroups(spec["groups"])
os.setgid(spec["gid"])
os.setuid(spec["uid"])
with Client(socket_path=spec["socket"], timeout=10) as c:
    reply = c.put_bytes(
        bytes.fromhex(spec["root"]),
        np.array(spec["tokens"], dtype=np.int32),
        bytes.fromhex(spec["fp"]),
        payload,
    )
print(json.dumps({"gen": reply["gen"], "uid": os.getuid()}))
"""


def publish_as(
    user: tuple[int, int],
    sup: Any,
    tmp_path: Path,
    root: bytes,
    tokens: np.ndarray | list[int],
    fp: bytes,
    payload: bytes,
) -> dict:
    """Publish one blob as ``user`` (uid, gid: a member of GROUP) to ``sup`` (a Sup), in a process
    that drops to that uid after its imports; its reply."""
    tag = uuid.uuid4().hex[:8]
    (tmp_path / f"payload-{tag}").write_bytes(payload)
    spec = {
        "uid": user[0],
        "gid": user[1],
        "groups": [grp.getgrnam(GROUP).gr_gid],
        "socket": sup.socket,
        "root": root.hex(),
        "tokens": [int(t) for t in tokens],
        "fp": fp.hex(),
        "payload": str(tmp_path / f"payload-{tag}"),
    }
    (tmp_path / f"spec-{tag}.json").write_text(json.dumps(spec))
    res = subprocess.run(
        [sys.executable, "-c", PUBLISH_AS, str(tmp_path / f"spec-{tag}.json")],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd="/",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["uid"] == user[0]
    return out
