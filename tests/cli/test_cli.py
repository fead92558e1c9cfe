"""The `shmkv` command line and `shmkv supervise` as a process: real subprocesses throughout."""

from __future__ import annotations

import grp
import json
import logging
import os
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from shmkv import Client, __version__
from shmkv.core import arena as A
from shmkv.core.config import resolve
from shmkv.core.errors import ArenaFullError, ConfigError
from shmkv.core.keys import chain_digests
from tests.support import SHM
from tests.support.blobs import put_and_hit
from tests.support.cli import assert_one_error_line, clean_env, shmkv
from tests.support.supervisors import Sup, wait_for_socket
from tests.support.users import system_user

log = logging.getLogger(__name__)

pytestmark = pytest.mark.timeout(60)

STATS_KEYS = (
    "entries",
    "bytes_used",
    "bytes_capacity",
    "hits",
    "misses",
    "tokens_restored",
    "evictions",
    "puts",
    "rejected_puts",
    "workers_attached",
)


def wait_serving(sup: Sup, sock: str | None = None, timeout: float = 15) -> None:
    """Wait until *this* supervisor accepts (a stale socket file may already exist)."""
    path = sock or sup.socket
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert sup.proc.poll() is None, f"supervisor exited:\n{sup.log()}"
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(path)
            return
        except OSError:
            time.sleep(0.02)
        finally:
            s.close()
    raise TimeoutError(f"{path} not served")


def leftovers(name: str, directory: Path = SHM) -> list[Path]:
    return sorted(directory.glob(f"shmkv-{name}*"))


# ------------------------------------------------------------------------ basics
def test_version() -> None:
    res = shmkv("--version")
    assert res.returncode == 0 and __version__ in res.stdout and "shmkv" in res.stdout


def test_supervise_help_mentions_env_vars() -> None:
    res = shmkv("supervise", "--help")
    assert res.returncode == 0
    for var in (
        "SHMKV_NAME",
        "SHMKV_SOCKET",
        "SHMKV_SIZE",
        "SHMKV_DIR",
        "SHMKV_GROUP",
        "SHMKV_KEEP",
        "SHMKV_CONFIG",
    ):
        assert var in res.stdout, var
    for cmd in ("stats", "ls", "clear"):
        res = shmkv(cmd, "--help")
        assert res.returncode == 0 and "SHMKV_SOCKET" in res.stdout and "SHMKV_NAME" in res.stdout


def test_stats_json_values_after_put_and_hit(make_supervisor) -> None:
    sup = make_supervisor("--size", "16M")
    with sup.client() as c:
        g = c.view.geometry
        reply, _, n_tok = put_and_hit(c)
        c.report(misses=3)
        st = sup.stats_json()  # the CLI connects without attaching: not a worker
        *_, extent = A.record_layout(n_tok, 2, 10_000)
        want = {
            "entries": 1,
            "bytes_used": extent,
            "bytes_capacity": g.data_size,
            "hits": 1,
            "misses": 3,
            "tokens_restored": n_tok,
            "evictions": 0,
            "puts": 1,
            "rejected_puts": 0,
            "workers_attached": 1,
        }
        assert {k: st[k] for k in STATS_KEYS} == want
        assert st["name"] == sup.name and st["pid"] == sup.proc.pid
        # a blob that can never fit is rejected and counted; big ones evict old ones
        with pytest.raises(ArenaFullError, match="--size"):
            c.put_bytes(
                os.urandom(16),
                np.arange(g.chunk_tokens, dtype=np.int32),
                b"fp",
                b"x" * (g.data_size + 1),
            )
        for _ in range(4):
            c.put_bytes(
                os.urandom(16),
                np.arange(g.chunk_tokens, dtype=np.int32),
                b"fp",
                b"y" * (g.data_size // 3),
            )
        st = sup.stats_json()
        assert st["rejected_puts"] == 1 and st["puts"] == 5
        assert st["evictions"] >= 2 and st["evictions"] == st["puts"] - st["entries"]
        assert 0 < st["bytes_used"] <= st["bytes_capacity"]
    # the human form shows the same numbers
    text = sup.cli("stats").stdout
    assert "entries" in text and "evictions" in text and str(st["evictions"]) in text


def test_ls_json_and_clear(make_supervisor) -> None:
    sup = make_supervisor("--size", "16M")
    with sup.client() as c:
        reply, root, n_tok = put_and_hit(c)
        assert c.pin(reply["key"]) == 1
        rows = json.loads(sup.cli("ls", "--json").stdout)
        assert len(rows) == 1
        row = rows[0]
        assert row["key"] == reply["key"].hex() and row["root"] == root.hex()
        assert row["tokens"] == n_tok and row["bytes"] == 10_000
        assert row["pinned"] is True and row["hits"] == 1 and row["leases"] == 0
        assert abs(row["last_used"] - time.time()) < 30
        text = sup.cli("ls").stdout
        assert reply["key"].hex()[:16] in text and "1 of 1 entries" in text
        res = sup.cli("clear")
        assert res.returncode == 0 and "removed 1 entries" in res.stdout
        assert json.loads(sup.cli("ls", "--json").stdout) == []
        st = sup.stats_json()
        assert st["entries"] == 0 and st["bytes_used"] == 0
        g = c.view.geometry
        assert c.lookup(chain_digests(root, np.arange(n_tok), g.chunk_tokens)) is None


def test_ls_limit_lists_the_most_recently_used(make_supervisor) -> None:
    """``ls --limit 2`` of three entries: the two used last, and the total."""
    sup = make_supervisor("--size", "16M")
    with sup.client() as c:
        keys = [put_and_hit(c)[0]["key"].hex() for _ in range(3)]
    rows = json.loads(sup.cli("ls", "--json", "--limit", "2").stdout)
    assert [r["key"] for r in rows] == keys[:0:-1]
    assert sup.cli("ls", "--limit", "2").stdout.splitlines()[-1] == "2 of 3 entries"


def test_pin_tokens_pins_only_that_entry_of_a_key(make_supervisor) -> None:
    """Two entries under one key (one prompt, two lengths past its last whole chunk):
    ``pin KEY --tokens N`` pins the one of N tokens only."""
    sup = make_supervisor("--size", "16M")
    root = os.urandom(16)
    with sup.client() as c:
        chunk = c.view.geometry.chunk_tokens
        for n in (2 * chunk + 5, 2 * chunk + 9):
            c.put_bytes(root, np.arange(n, dtype=np.int32), b"fp", b"x" * 1000)
    key = chain_digests(root, np.arange(2 * chunk, dtype=np.int32), chunk)[-1].hex()
    assert sup.cli("pin", key, "--tokens", str(2 * chunk + 9)).stdout.strip() == "pinned 1 entry"
    rows = json.loads(sup.cli("ls", "--json").stdout)
    assert {(r["key"], r["tokens"], r["pinned"]) for r in rows} == {
        (key, 2 * chunk + 5, False),
        (key, 2 * chunk + 9, True),
    }


def test_log_level_sets_what_the_supervisor_logs(make_supervisor) -> None:
    """``--log-level debug`` logs each connection; SHMKV_LOG_LEVEL=warning leaves out
    even the INFO lines of a start and a clean stop."""
    debug = make_supervisor("--size", "16M", "--log-level", "debug")
    quiet = make_supervisor("--size", "16M", env_extra={"SHMKV_LOG_LEVEL": "warning"})
    for sup in (debug, quiet):
        with sup.client() as c:
            put_and_hit(c)
        assert sup.stop() == 0
    assert " DEBUG shmkv" in debug.log() and " INFO shmkv" in debug.log(), debug.log()
    assert " INFO " not in quiet.log() and " DEBUG " not in quiet.log(), quiet.log()


def test_env_vars_are_honoured(make_supervisor, tmp_path: Path) -> None:
    """SHMKV_NAME/SHMKV_SOCKET/SHMKV_SIZE select the supervisor and the CLI's target."""
    name = f"t{uuid.uuid4().hex[:10]}"
    sock = str(tmp_path / "env.sock")
    sup = make_supervisor(
        name=name,
        env_extra={"SHMKV_SOCKET": sock, "SHMKV_SIZE": "24M", "SHMKV_CHUNK_TOKENS": "32"},
        wait=False,
    )
    assert sup.socket == sock  # the env's, not the fixture's default
    wait_serving(sup, sock)
    assert (SHM / f"shmkv-{name}").exists()
    st = json.loads(
        shmkv("stats", "--json", env=clean_env(SHMKV_NAME=name, SHMKV_SOCKET=sock)).stdout
    )
    assert st["name"] == name and st["socket"] == sock and st["chunk_tokens"] == 32
    assert st["bytes_capacity"] == A.Geometry.plan(24 << 20, 32).data_size
    # --socket on the command line beats SHMKV_SOCKET
    res = shmkv(
        "stats",
        "--json",
        "--socket",
        sock,
        env=clean_env(SHMKV_NAME=name, SHMKV_SOCKET=str(tmp_path / "nope.sock")),
    )
    assert res.returncode == 0 and json.loads(res.stdout)["name"] == name
    # and a wrong SHMKV_SOCKET is what the CLI uses (and names in its error)
    res = shmkv("stats", env=clean_env(SHMKV_SOCKET=str(tmp_path / "nope.sock")))
    assert_one_error_line(res, str(tmp_path / "nope.sock"))
    assert sup.stop() == 0
    assert not Path(sock).exists() and not leftovers(name)


# ------------------------------------------------------------------ error lines
@pytest.mark.parametrize(
    "cmd", [["stats"], ["stats", "--json"], ["ls"], ["ls", "--json"], ["clear"]]
)
def test_missing_supervisor_is_one_line(tmp_path: Path, cmd: list[str]) -> None:
    sock = str(tmp_path / "absent.sock")
    res = shmkv(*cmd, env=clean_env(SHMKV_SOCKET=sock, SHMKV_NAME="absent"))
    line = assert_one_error_line(res, sock, "shmkv supervise", "--name absent")
    assert res.returncode == 5 and res.stdout == "", line


def test_wrong_name_is_one_line() -> None:
    res = shmkv("stats", env=clean_env(SHMKV_NAME=f"nosuch{uuid.uuid4().hex[:6]}"))
    assert_one_error_line(res, "nosuch", "shmkv supervise", "SHMKV_NAME")


def test_socket_path_that_is_not_listening_is_one_line(tmp_path: Path) -> None:
    stale = tmp_path / "stale.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(stale))
    s.close()  # bound, never listening: connection refused
    res = shmkv("stats", "--socket", str(stale))
    assert_one_error_line(res, str(stale), "shmkv supervise")
    res = shmkv("stats", "--socket", str(tmp_path))  # a directory
    assert_one_error_line(res, str(tmp_path))


def test_silent_supervisor_times_out_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "silent.sock"
    lsn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lsn.bind(str(path))
    lsn.listen(4)
    try:
        t0 = time.monotonic()
        res = shmkv("stats", "--socket", str(path), "--timeout", "0.5")
        assert time.monotonic() - t0 < 15
        assert_one_error_line(res, str(path))
    finally:
        lsn.close()


@pytest.mark.parametrize(
    "args,env,needle,code",
    [
        (["--size", "abc"], {}, "--size", 2),
        ([], {"SHMKV_SIZE": "lots"}, "SHMKV_SIZE", 2),
        (["--size", "1K"], {}, "--size", 2),
        (["--name", "../etc"], {}, "name", 2),
        (["--group", "no-such-group-xyz"], {}, "--group", 2),
        (["--log-level", "loud"], {}, "--log-level", 2),
        (["--dir", "/proc/self", "--size", "8M"], {}, "--dir", 2),
        (["--dir", "/dev/null/sub", "--size", "8M"], {}, "--dir", 2),
        (["--socket", "/proc/self/x.sock", "--size", "8M"], {}, "--socket", 2),
    ],
    ids=[
        "bad-size",
        "bad-env-size",
        "tiny-size",
        "bad-name",
        "bad-group",
        "bad-log-level",
        "unwritable-dir",
        "dir-under-a-file",
        "unbindable-socket",
    ],
)
def test_supervise_bad_settings_are_one_line(
    tmp_path: Path, args: list[str], env: dict[str, str], needle: str, code: int
) -> None:
    name = f"t{uuid.uuid4().hex[:10]}"
    full_env = clean_env(SHMKV_NAME=name, SHMKV_SOCKET=str(tmp_path / "s.sock"), **env)
    res = shmkv("supervise", *args, env=full_env)
    lines = [ln for ln in res.stderr.splitlines() if " INFO " not in ln]
    assert res.returncode == code, res.stderr
    assert "Traceback" not in res.stderr
    assert len(lines) == 1 and lines[0].startswith("shmkv: error:") and needle in lines[0], lines
    assert not leftovers(name) and not (tmp_path / "s.sock").exists()


def test_config_file_errors_are_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("nmae = 'x'\n")
    assert_one_error_line(shmkv("stats", "--config", str(bad)), "nmae")
    bad.write_text("this is = not toml [\n")
    assert_one_error_line(shmkv("stats", env=clean_env(SHMKV_CONFIG=str(bad))), str(bad))
    assert_one_error_line(
        shmkv("stats", "--config", str(tmp_path / "missing.toml")), "missing.toml"
    )


# --------------------------------------------------------------- process life
def test_second_supervisor_on_the_same_name_is_refused(make_supervisor) -> None:
    first = make_supervisor("--size", "16M")
    res = shmkv("supervise", "--size", "16M", env=first.env)
    line = assert_one_error_line(res, f"pid {first.proc.pid}", first.name, "--name")
    assert res.returncode == 3, line
    # the first one's files are untouched and it still serves
    assert first.arena.exists() and Path(first.socket).exists()
    assert Path(str(first.arena) + ".lock").exists()
    with first.client() as c:
        put_and_hit(c)
    assert first.proc.poll() is None


def test_second_supervisor_on_the_same_socket_is_refused(make_supervisor) -> None:
    first = make_supervisor("--size", "16M")
    other = f"t{uuid.uuid4().hex[:10]}"
    res = shmkv(
        "supervise", "--size", "16M", env=clean_env(SHMKV_NAME=other, SHMKV_SOCKET=first.socket)
    )
    assert_one_error_line(res, first.socket, "--socket", ignore_logs=True)
    assert res.returncode == 3
    assert not leftovers(other), "the refused supervisor left its arena behind"
    with first.client() as c:
        put_and_hit(c)


def test_stale_socket_of_a_killed_supervisor_is_taken_over(make_supervisor) -> None:
    first = make_supervisor("--size", "16M")
    with first.client() as c:
        put_and_hit(c)
    first.stop(signal.SIGKILL)
    assert Path(first.socket).exists() and first.arena.exists()  # what kill -9 leaves
    # (--fresh: the killed one's arena is dropped, not adopted; see test_adopt.py)
    second = make_supervisor("--size", "16M", "--fresh", name=first.name, wait=False)
    assert second.socket == first.socket
    wait_serving(second)
    with second.client() as c:
        assert c.attach_info["supervisor_pid"] == second.proc.pid
        assert c.stats()["entries"] == 0  # a fresh arena, not the dead one's
        put_and_hit(c)
    assert "stale socket" in second.log()
    assert second.stop() == 0
    assert not Path(second.socket).exists() and not leftovers(second.name)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_removes_socket_arena_and_lock(make_supervisor, sig: int) -> None:
    sup = make_supervisor("--size", "16M")
    lock = Path(str(sup.arena) + ".lock")
    assert sup.arena.exists() and lock.exists() and Path(sup.socket).exists()
    c = sup.client()
    _, root, n_tok = put_and_hit(c)
    g = c.view.geometry
    hit = c.lookup(chain_digests(root, np.arange(n_tok), g.chunk_tokens))
    lease = c.acquire(hit)  # a lease still held at exit
    assert sup.stop(sig) == 0
    assert not Path(sup.socket).exists()
    assert not sup.arena.exists() and not lock.exists() and not leftovers(sup.name)
    assert lease.finish() in (True, False)  # no hang, no crash on a dead supervisor
    c.close()


def test_keep_leaves_socket_and_arena(make_supervisor) -> None:
    sup = make_supervisor("--size", "16M", "--keep")
    with sup.client() as c:
        put_and_hit(c)
    assert sup.stop() == 0
    lock = Path(str(sup.arena) + ".lock")
    try:
        assert Path(sup.socket).exists() and sup.arena.exists()
        with open(sup.arena, "rb") as f:
            view = A.ArenaView(f.fileno(), populate=False)
            assert view.state() == A.STATE_CLOSED  # readers can tell it is no longer served
            assert len(view.scan()) == 2  # the kept entry's two chunk digests
            view.close()
        # a new supervisor takes the kept name and socket over
        again = make_supervisor("--size", "16M", name=sup.name, wait=False)
        wait_serving(again)
        with again.client() as c:
            put_and_hit(c)
        assert again.stop() == 0
        assert not Path(again.socket).exists() and not leftovers(sup.name)
    finally:
        for p in (Path(sup.socket), sup.arena, lock):
            p.unlink(missing_ok=True)


def _mode(p: str | Path) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


def test_files_are_0600_by_default(make_supervisor, tmp_path: Path) -> None:
    sock = tmp_path / "sub" / "dir" / "s.sock"  # the supervisor creates the socket's dir
    sup = make_supervisor("--size", "16M", env_extra={"SHMKV_SOCKET": str(sock)}, wait=False)
    wait_for_socket(str(sock), sup.proc)
    assert _mode(sup.arena) == 0o600 and _mode(sock) == 0o600
    assert _mode(str(sup.arena) + ".lock") == 0o600
    assert _mode(sock.parent) == 0o700
    assert stat.S_ISSOCK(os.stat(sock).st_mode)


def _test_group() -> grp.struct_group:
    for name in ("nogroup", "nobody", "daemon"):
        try:
            return grp.getgrnam(name)
        except KeyError:
            continue
    subprocess.run(["groupadd", "-r", "shmkvtest"], check=True, capture_output=True)
    return grp.getgrnam("shmkvtest")


def test_group_makes_socket_0660_and_arena_0640(make_supervisor, tmp_path: Path) -> None:
    group = _test_group()
    sock = tmp_path / "gsub" / "s.sock"
    sup = make_supervisor(
        "--size", "16M", "--group", group.gr_name, env_extra={"SHMKV_SOCKET": str(sock)}, wait=False
    )
    wait_for_socket(str(sock), sup.proc)
    for p, mode in ((sock, 0o660), (sup.arena, 0o640)):  # the group never writes the arena
        st = os.stat(p)
        assert stat.S_IMODE(st.st_mode) == mode and st.st_gid == group.gr_gid, p
    assert _mode(str(sup.arena) + ".lock") == 0o600
    st = os.stat(sock.parent)
    assert stat.S_IMODE(st.st_mode) == 0o750 and st.st_gid == group.gr_gid
    # a numeric gid works too
    sup2 = make_supervisor("--size", "16M", "--group", str(group.gr_gid))
    assert _mode(sup2.arena) == 0o640 and os.stat(sup2.arena).st_gid == group.gr_gid


# --------------------------------------------------------------------- settings
def test_config_precedence_cli_env_file_default(tmp_path: Path) -> None:
    cfg = tmp_path / "shmkv.toml"
    cfg.write_text(
        textwrap.dedent("""
        name = "from-file"
        size = "32M"
        chunk-tokens = 16
        log_level = "debug"
        socket = "/tmp/from-file.sock"
    """)
    )
    env = {"SHMKV_NAME": "from-env", "SHMKV_SIZE": "64M", "SHMKV_SOCKET": "/tmp/from-env.sock"}
    s = resolve("supervise", {"name": "from-cli", "size": None}, env=env, config_file=str(cfg))
    assert s.name == "from-cli" and s.sources["name"] == "--name"
    assert s.size == 64 << 20 and s.sources["size"] == "SHMKV_SIZE"
    assert s.chunk_tokens == 16 and s.sources["chunk_tokens"].endswith(":chunk_tokens")
    assert s.log_level == "debug"
    assert s.lease_timeout == 30.0 and s.sources["lease_timeout"] == "default"
    assert s.socket_path == "/tmp/from-env.sock"
    # SHMKV_CONFIG names the file when --config is absent
    s = resolve("supervise", {}, env={"SHMKV_CONFIG": str(cfg)})
    assert s.name == "from-file" and s.size == 32 << 20 and s.socket_path == "/tmp/from-file.sock"
    # nothing set: defaults
    s = resolve("supervise", {}, env={})
    assert s.name == "default" and s.size == 1 << 30 and s.dir == "/dev/shm"
    assert s.keep is False and s.group is None
    # bad values name where they came from
    with pytest.raises(ConfigError, match="SHMKV_SIZE"):
        resolve("supervise", {}, env={"SHMKV_SIZE": "big"})
    with pytest.raises(ConfigError, match="--chunk-tokens"):
        resolve("supervise", {"chunk_tokens": "0"}, env={})
    cfg.write_text("size = -1\n")
    with pytest.raises(ConfigError, match="size"):
        resolve("supervise", {}, env={}, config_file=str(cfg))
    cfg.write_text("sise = '1G'\n")
    with pytest.raises(ConfigError, match="unknown settings sise"):
        resolve("supervise", {}, env={}, config_file=str(cfg))


def test_config_file_reaches_a_real_supervisor(make_supervisor, tmp_path: Path) -> None:
    cfg = tmp_path / "sup.toml"
    cfg.write_text('size = "16M"\nchunk_tokens = 16\nlease_timeout = 5.0\n')
    # file: size 16M and chunk 16; env: size 24M; command line: chunk 32
    sup = make_supervisor(
        "--config",
        str(cfg),
        "--chunk-tokens",
        "32",
        env_extra={"SHMKV_SIZE": "24M", "SHMKV_CHUNK_TOKENS": "8"},
    )
    st = sup.stats_json()
    assert st["chunk_tokens"] == 32
    assert st["bytes_capacity"] == A.Geometry.plan(24 << 20, 32).data_size


def test_shm_too_small_is_one_line_and_leaves_nothing(small_tmpfs: Path, tmp_path: Path) -> None:
    name = f"t{uuid.uuid4().hex[:10]}"
    sock = tmp_path / "small.sock"
    env = clean_env(SHMKV_NAME=name, SHMKV_SOCKET=str(sock))
    # (--reserve true; with --reserve false, the default, a too large arena only warns)
    res = shmkv(
        "supervise", "--dir", str(small_tmpfs), "--size", "128M", "--reserve", "true", env=env
    )
    assert res.returncode == 4
    assert_one_error_line(res, "--size 128.0 MiB", "64.0 MiB", str(small_tmpfs))
    assert os.listdir(small_tmpfs) == [] and not sock.exists()
    # partly used: the free space is what is reported
    (small_tmpfs / "filler").write_bytes(b"\0" * (10 << 20))
    res = shmkv(
        "supervise", "--dir", str(small_tmpfs), "--size", "60M", "--reserve", "true", env=env
    )
    assert res.returncode == 4
    assert_one_error_line(res, "60.0 MiB", "54.0 MiB")
    assert os.listdir(small_tmpfs) == ["filler"] and not sock.exists()


def test_arena_that_fits_the_small_tmpfs_works(small_tmpfs: Path, make_supervisor) -> None:
    sup = make_supervisor("--size", "48M", env_extra={"SHMKV_DIR": str(small_tmpfs)})
    assert (small_tmpfs / f"shmkv-{sup.name}").exists()
    with sup.client() as c:
        put_and_hit(c)
    assert sup.stop() == 0
    assert os.listdir(small_tmpfs) == []


# ------------------------------------------------------------- peer credentials
_AS_NOBODY = r"""
import json, os, socket, sys, time
import numpy as np
import shmkv.cli
from shmkv import Client; from shmkv.core import protocol as P
from shmkv.core.keys import chain_digests
from shmkv.core.errors import ShmkvError
np.ctypeslib.as_array  # load lazily imported modules while we still can
uid, gid, mode, sock = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
delay = float(sys.argv[5])
if delay:  # make the supervisor's accept-time refusal land before our first request
    _connect = socket.socket.connect
    def connect(self, addr):
        _connect(self, addr)
        time.sleep(delay)
    socket.socket.connect = connect
os.setgroups([])
os.setgid(gid)
os.setuid(uid)
if mode == "cli":
    sys.argv = ["shmkv", "stats", "--socket", sock]
    shmkv.cli.main()
if mode == "raw":  # what the supervisor sends a refused peer, without sending anything
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(sock)
    msg, fds = P.recv_msg(s)
    print(json.dumps({"reply": msg, "fds": len(fds), "eof": s.recv(1) == b""}))
    sys.exit(0)
try:
    with Client(socket_path=sock, timeout=5) as c:
        st = c.stats()
        root = os.urandom(16)
        chunk = c.view.geometry.chunk_tokens
        tokens = np.arange(chunk, dtype=np.int32)
        c.put_bytes(root, tokens, b"fp", b"n" * 1000)
        hit = c.lookup(chain_digests(root, tokens, chunk))
        with c.acquire(hit) as lease:
            ok = bytes(lease.payload) == b"n" * 1000 and lease.finish()
    print(json.dumps({"ok": ok, "uid": os.getuid()}))
except ShmkvError as e:
    print(json.dumps({"ok": False, "type": type(e).__name__, "code": e.code,
                      "message": str(e)}))
"""


def run_peer(
    uid: int, gid: int, mode: str, sock: str, connect_delay: float = 0.0
) -> subprocess.CompletedProcess:
    """Run a client, the CLI or a raw socket that drops to uid/gid after its imports."""
    return subprocess.run(
        [sys.executable, "-c", _AS_NOBODY, str(uid), str(gid), mode, sock, str(connect_delay)],
        capture_output=True,
        text=True,
        timeout=30,
        env=clean_env(),
        cwd="/",
    )


@pytest.fixture
def other_user() -> tuple[int, int]:
    return system_user("shmkv-test-peer")


def _peer_supervisor(make_supervisor, public_dir: Path, *args: str) -> tuple[Sup, Path]:
    sock = public_dir / "peer.sock"
    sup = make_supervisor("--size", "16M", *args, env_extra={"SHMKV_SOCKET": str(sock)}, wait=False)
    wait_for_socket(str(sock), sup.proc)
    return sup, sock


def test_peer_of_another_uid_is_refused(
    public_dir: Path, make_supervisor, other_user: tuple[int, int]
) -> None:
    uid, gid = other_user
    sup, sock = _peer_supervisor(make_supervisor, public_dir)
    sock.chmod(0o666)  # reachable: only SO_PEERCRED stands in the way
    for _ in range(3):
        res = run_peer(uid, gid, "raw", str(sock))
        assert res.returncode == 0, res.stderr
        out = json.loads(res.stdout.strip().splitlines()[-1])
        reply = out["reply"]
        assert reply["ok"] is False and reply["id"] == 0
        assert reply["error"]["code"] == "permission"
        assert f"uid {uid}" in reply["error"]["message"]
        assert "--group" in reply["error"]["message"]
        assert out["fds"] == 0 and out["eof"] is True  # no arena fd, and hung up
    assert "refused" in sup.log()
    # the supervisor keeps serving its own user, and holds nothing for the refused peers
    assert sup.proc.poll() is None
    with Client(socket_path=str(sock)) as c:
        put_and_hit(c)
        st = c.stats()
        assert st["connections"] == 1 and st["workers_attached"] == 1


def test_refused_client_and_cli_see_permission_denied(
    public_dir: Path, make_supervisor, other_user: tuple[int, int]
) -> None:
    uid, gid = other_user
    _, sock = _peer_supervisor(make_supervisor, public_dir)
    sock.chmod(0o666)
    res = run_peer(uid, gid, "client", str(sock), connect_delay=0.3)
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["type"] == "PermissionDenied", out
    res = run_peer(uid, gid, "cli", str(sock), connect_delay=0.3)
    assert res.returncode == 6
    assert_one_error_line(res, f"uid {uid}", "--group")


def test_socket_mode_keeps_other_users_out(
    public_dir: Path, make_supervisor, other_user: tuple[int, int]
) -> None:
    uid, gid = other_user
    sup, sock = _peer_supervisor(make_supervisor, public_dir)
    res = run_peer(uid, gid, "cli", str(sock))  # socket is 0600: connect() itself fails
    assert res.returncode == 6
    assert_one_error_line(res, "permission", str(sock), "--group")
    assert sup.proc.poll() is None


def test_group_member_is_let_in(
    public_dir: Path, make_supervisor, other_user: tuple[int, int]
) -> None:
    uid, gid = other_user
    sup, sock = _peer_supervisor(make_supervisor, public_dir, "--group", str(gid))
    res = run_peer(uid, gid, "client", str(sock))
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out == {"ok": True, "uid": uid}, (out, res.stderr)
    with Client(socket_path=str(sock)) as c:
        assert c.stats()["puts"] == 1
    assert sup.proc.poll() is None


# ------------------------------------------------------------------------ systemd
def _notify_socket(tmp_path: Path, abstract: bool) -> tuple[socket.socket, str]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if abstract:
        name = f"shmkv-test-{uuid.uuid4().hex}"
        s.bind("\0" + name)
        addr = "@" + name
    else:
        addr = str(tmp_path / "notify")
        s.bind(addr)
    s.settimeout(10)
    return s, addr


@pytest.mark.parametrize("abstract", [False, True], ids=["path", "abstract"])
def test_ready_is_sent_once_accepting(make_supervisor, tmp_path: Path, abstract: bool) -> None:
    ns, addr = _notify_socket(tmp_path, abstract)
    with ns:
        sup = make_supervisor("--size", "16M", env_extra={"NOTIFY_SOCKET": addr}, wait=False)
        msg = ns.recv(4096).decode()
        assert "READY=1" in msg.splitlines() and f"MAINPID={sup.proc.pid}" in msg
        # READY means accepting: a client attaches at once, no retry
        with sup.client() as c:
            put_and_hit(c)
        assert sup.stop() == 0
        assert "STOPPING=1" in ns.recv(4096).decode()


def test_watchdog_is_sent_repeatedly(make_supervisor, tmp_path: Path) -> None:
    ns, addr = _notify_socket(tmp_path, False)
    with ns:
        sup = make_supervisor(
            "--size",
            "16M",
            wait=False,
            env_extra={"NOTIFY_SOCKET": addr, "WATCHDOG_USEC": "200000"},
        )
        assert "READY=1" in ns.recv(4096).decode()
        times = []
        deadline = time.monotonic() + 1.5
        ns.settimeout(0.5)
        while time.monotonic() < deadline:
            try:
                if ns.recv(4096).decode() == "WATCHDOG=1":
                    times.append(time.monotonic())
            except TimeoutError:
                break
        # every 100 ms (half of WATCHDOG_USEC); allow a loaded machine some slack
        assert len(times) >= 5, times
        # systemd would kill us after a 200 ms silence; allow a loaded test machine slack
        assert max(b - a for a, b in zip(times, times[1:], strict=False)) < 0.8
        # and it keeps coming while clients are served
        with sup.client() as c:
            put_and_hit(c)
        ns.settimeout(2)
        assert ns.recv(4096).decode() == "WATCHDOG=1"


def test_no_watchdog_for_another_pid(make_supervisor, tmp_path: Path) -> None:
    ns, addr = _notify_socket(tmp_path, False)
    with ns:
        make_supervisor(
            "--size",
            "16M",
            wait=False,
            env_extra={"NOTIFY_SOCKET": addr, "WATCHDOG_USEC": "100000", "WATCHDOG_PID": "1"},
        )
        assert "READY=1" in ns.recv(4096).decode()
        ns.settimeout(0.6)
        with pytest.raises(TimeoutError):
            ns.recv(4096)


def test_pin_and_unpin_from_the_cli(supervisor) -> None:
    from shmkv.core.keys import chain_digests

    root = b"\x07" * 16
    tokens = np.arange(128, dtype=np.int32)
    with supervisor.client() as c:
        c.put_bytes(root, tokens, b"fp", b"x" * 5000)
    key = chain_digests(root, tokens, 64)[-1].hex()
    out = supervisor.cli("pin", key)
    assert out.stdout.strip() == "pinned 1 entry"
    assert supervisor.stats_json()["pinned"] == 1
    assert supervisor.cli("unpin", key).stdout.strip() == "unpinned 1 entry"
    assert supervisor.stats_json()["pinned"] == 0
    bad = supervisor.cli("pin", "zz", check=False)
    assert bad.returncode != 0 and "32-hex-digit" in bad.stderr
