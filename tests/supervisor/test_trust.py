"""Who may talk to whom, and whose files a supervisor uses, with real other users.

Every test runs processes as real uids made for it (root only, skipped otherwise):
an attacker (``shmkv-test-evil``), a user who runs a supervisor of their own
(``shmkv-test-victim``) and a member of the ``--group`` group
(``shmkv-test-member``; both are in ``shmkv-test-grp``). The attacker squats the
socket directory a user's supervisor would use, puts a relay in place of the
supervisor's socket, and plants symbolic links and files in /dev/shm; the group
member tries what only the supervisor's own user may do.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from shmkv.core.errors import EXIT_UNTRUSTED
from tests.support import SHM
from tests.support.cli import assert_one_error_line, clean_env, shmkv
from tests.support.llama_workers import SYSTEM, completion, run_worker, texts
from tests.support.servers import free_port
from tests.support.supervisors import Sup, start_supervisor, wait_for_socket
from tests.support.users import GROUP, PUT_AND_READ, as_user, make_user, user_python
from tests.support.waiting import wait_until

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create and run as other users"),
]

EVIL, VICTIM, MEMBER = "shmkv-test-evil", "shmkv-test-victim", "shmkv-test-member"


# ------------------------------------------------------------------- helpers
@pytest.fixture
def evil() -> pwd.struct_passwd:
    return make_user(EVIL)


@pytest.fixture
def victim() -> pwd.struct_passwd:
    return make_user(VICTIM, (GROUP,))


@pytest.fixture
def member() -> pwd.struct_passwd:
    return make_user(MEMBER, (GROUP,))


def owned_dir(parent: Path, pw: pwd.struct_passwd, mode: int = 0o755) -> Path:
    """A new directory of ``pw``'s under ``parent``."""
    d = parent / f"{pw.pw_name}-{uuid.uuid4().hex[:6]}"
    d.mkdir()
    os.chown(d, pw.pw_uid, pw.pw_gid)
    d.chmod(mode)
    return d


def run_as(pw: pwd.struct_passwd, code: str, *args: str) -> subprocess.CompletedProcess:
    """Python ``code`` run as ``pw`` (argv[1:] = ``args``)."""
    return subprocess.run(
        [user_python(), "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=60,
        **as_user(pw, clean_env(XDG_RUNTIME_DIR="")),
    )


def last_json(res: subprocess.CompletedProcess) -> dict:
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def wait_exit(sup: Sup, bound: Path | None = None, timeout: float = 30) -> int:
    """The exit code of a supervisor expected to refuse to start; fails if it serves."""
    try:
        wait_until(
            lambda: sup.proc.poll() is not None or (bound is not None and bound.exists()),
            timeout,
            "the supervisor to exit",
        )
        assert sup.proc.poll() is not None, f"the supervisor serves on {bound}:\n{sup.log()}"
    finally:
        if sup.proc.poll() is None:  # (stopped cleanly: it removes its files)
            sup.stop()
    return sup.proc.returncode


def error_line(sup: Sup, *needles: str) -> str:
    """The supervisor failed with exactly one error line (its INFO lines aside)."""
    res = subprocess.CompletedProcess(sup.proc.args, sup.proc.returncode, "", sup.log())
    return assert_one_error_line(res, *needles, ignore_logs=True)


def default_dir(pw: pwd.struct_passwd) -> Path:
    """The socket directory ``pw``'s supervisor uses by default (no XDG_RUNTIME_DIR)."""
    code = "from shmkv.core.config import default_socket_path as d; print(d('x'))"
    out = run_as(pw, code)
    assert out.returncode == 0, out.stderr
    path = Path(out.stdout.strip()).parent
    assert path == Path(f"/tmp/shmkv-{pw.pw_uid}")
    return path


@pytest.fixture
def squatted(evil: pwd.struct_passwd, victim: pwd.struct_passwd) -> Iterator[Path]:
    """The victim's default socket directory, made first by the attacker (mode 0777)."""
    d = default_dir(victim)
    shutil.rmtree(d, ignore_errors=True)
    res = run_as(
        evil, "import os, sys; os.mkdir(sys.argv[1]); os.chmod(sys.argv[1], 0o777)", str(d)
    )
    assert res.returncode == 0, res.stderr
    yield d
    shutil.rmtree(d, ignore_errors=True)


# A relay as an attacker would put in place of a supervisor's socket: it accepts
# anyone and forwards bytes and descriptors both ways to a supervisor of its own.
RELAY = r"""
import os, selectors, socket, sys
listen, upstream = sys.argv[1], sys.argv[2]
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind(listen)
os.chmod(listen, 0o777)
srv.listen(16)
print("ready", flush=True)
sel = selectors.DefaultSelector()
sel.register(srv, selectors.EVENT_READ, None)
while True:
    for key, _ in sel.select():
        if key.data is None:
            c, _ = srv.accept()
            u = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            u.connect(upstream)
            sel.register(c, selectors.EVENT_READ, u)
            sel.register(u, selectors.EVENT_READ, c)
            continue
        src, dst = key.fileobj, key.data
        try:
            data, fds, _, _ = socket.recv_fds(src, 1 << 16, 8)
        except OSError:
            data, fds = b"", []
        if not data:
            for s in (src, dst):
                try:
                    sel.unregister(s)
                except (KeyError, ValueError):
                    pass
                s.close()
            continue
        try:
            if fds:
                socket.send_fds(dst, [data], fds)
            else:
                dst.sendall(data)
        except OSError:
            pass
        for fd in fds:
            os.close(fd)
"""


@pytest.fixture
def relay(
    tmp_path: Path, squatted: Path, evil: pwd.struct_passwd, public_dir: Path
) -> Iterator[tuple[Sup, str]]:
    """The attacker's supervisor, and a relay to it on the victim's default socket path."""
    os.chmod(squatted, 0o755)  # (the attacker's own supervisor needs a sane directory)
    upstream = owned_dir(public_dir, evil, 0o700)
    name = f"t{uuid.uuid4().hex[:10]}"
    sup = start_supervisor(
        tmp_path,
        "--size",
        "64M",
        name=name,
        env_extra={"SHMKV_SOCKET": str(upstream / "up.sock")},
        user=evil,
    )
    path = str(squatted / f"{name}.sock")
    proc = subprocess.Popen(
        [user_python(), "-c", RELAY, path, sup.socket],
        stdout=subprocess.PIPE,
        text=True,
        **as_user(evil),
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield sup, path
    finally:
        proc.kill()
        proc.wait(10)
        sup.stop()


@pytest.fixture
def public_model(models: dict[str, str], public_dir: Path) -> str:
    """The tiny model where other users can read it."""
    path = public_dir / "tiny.gguf"
    shutil.copy(models["seed0"], path)
    path.chmod(0o644)
    return str(path)


def their_stats(sup: Sup, pw: pwd.struct_passwd) -> dict:
    """``shmkv stats`` of a supervisor that runs as ``pw``, asked as ``pw``."""
    res = shmkv("stats", "--json", "--socket", sup.socket, env=clean_env(), user=pw)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


class Target:
    """Where a llama worker connects: a name and an explicit socket path."""

    def __init__(self, name: str, socket: str) -> None:
        self.name, self.socket = name, socket


# ------------------------------------- the socket directory, and who listens there
@pytest.mark.parametrize("made_by", ["another-user", "careless-owner"])
def test_supervisor_refuses_a_socket_directory_others_can_write(
    tmp_path: Path,
    evil: pwd.struct_passwd,
    victim: pwd.struct_passwd,
    squatted: Path,
    made_by: str,
) -> None:
    """Another uid made /tmp/shmkv-UID (0777) before the user's supervisor started: it bound
    its socket there, where the attacker could swap it for a relay."""
    if made_by == "careless-owner":  # the user's own directory, but writable by everyone
        os.chown(squatted, victim.pw_uid, victim.pw_gid)
    name = f"t{uuid.uuid4().hex[:10]}"
    sock = squatted / f"{name}.sock"
    sup = start_supervisor(
        tmp_path,
        "--size",
        "16M",
        name=name,
        env_extra={"SHMKV_SOCKET": "", "XDG_RUNTIME_DIR": ""},  # the default path
        wait=False,
        user=victim,
    )
    assert wait_exit(sup, sock) == EXIT_UNTRUSTED
    owner = f"owned by uid {evil.pw_uid} ({EVIL})" if made_by == "another-user" else "writable"
    error_line(sup, f"socket directory {squatted}", owner, "SHMKV_SOCKET")
    assert not list(squatted.iterdir())
    assert not list(SHM.glob(f"shmkv-{name}*"))


def test_supervisor_refuses_a_socket_directory_below_one_others_can_write(
    tmp_path: Path, public_dir: Path, victim: pwd.struct_passwd
) -> None:
    """Whoever can write to a directory above the socket's can rename the whole tree."""
    above = owned_dir(public_dir, victim, 0o777)
    d = owned_dir(above, victim, 0o700)
    sup = start_supervisor(
        tmp_path,
        "--size",
        "16M",
        env_extra={"SHMKV_SOCKET": str(d / "s.sock")},
        wait=False,
        user=victim,
    )
    assert wait_exit(sup, d / "s.sock") == EXIT_UNTRUSTED
    error_line(sup, f"{above}, above socket directory {d}", "writable by other users")


def test_client_refuses_a_relay_of_another_uid_and_runs_cold(
    relay: tuple[Sup, str], evil: pwd.struct_passwd, victim: pwd.struct_passwd, public_model: str
) -> None:
    """A relay on the user's socket path handed the user's worker the attacker's arena: it
    restored state of the attacker's choosing."""
    sup, path = relay
    jobs = [completion(SYSTEM + " Question: whose state is this?")]
    planted = run_worker(sup, public_model, jobs, user=evil)  # straight to its supervisor
    assert planted["totals"]["publishes"] >= 1
    puts = their_stats(sup, evil)["puts"]
    assert puts >= 1
    cold = run_worker(None, public_model, jobs, mode="cold")
    got = run_worker(Target(sup.name, path), public_model, jobs, user=victim)
    assert got["totals"]["tokens_restored"] == 0 and got["totals"]["hits"] == 0
    assert texts(got) == texts(cold)
    assert their_stats(sup, evil)["puts"] == puts  # nothing of the user's reached them
    assert f"runs as uid {evil.pw_uid}" in got["stderr"], got["stderr"]
    assert "SHMKV_SUPERVISOR_UID" in got["stderr"]
    # the CLI says the same in one line, with its exit code
    res = shmkv("stats", "--socket", path, env=clean_env(), user=victim)
    assert res.returncode == EXIT_UNTRUSTED
    assert_one_error_line(res, f"uid {evil.pw_uid}", "SHMKV_SUPERVISOR_UID")


def test_serve_refuses_a_relay_of_another_uid(
    relay: tuple[Sup, str], evil: pwd.struct_passwd, public_model: str
) -> None:
    """`shmkv serve` took the relay for a running supervisor and served through it."""
    _, path = relay
    args = ["serve", "--model", public_model, "--socket", path, "--workers", "1"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "shmkv", *args, "--port", str(free_port())],
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.communicate(timeout=60)
        pytest.fail("shmkv serve started its workers on another user's socket")
    res = subprocess.CompletedProcess(args, proc.returncode, out, err)
    assert res.returncode == EXIT_UNTRUSTED, err
    line = assert_one_error_line(
        res, f"uid {evil.pw_uid}", "SHMKV_SUPERVISOR_UID", ignore_logs=True
    )
    assert path in line


def test_client_trusts_the_supervisor_uid_it_is_given(
    tmp_path: Path, public_dir: Path, member: pwd.struct_passwd, victim: pwd.struct_passwd
) -> None:
    """A --group deployment whose supervisor runs as another user: its members connect once
    they name that user (SHMKV_SUPERVISOR_UID), and only then."""
    d = owned_dir(public_dir, member, 0o755)
    sup = start_supervisor(
        tmp_path,
        "--size",
        "16M",
        "--group",
        GROUP,
        env_extra={"SHMKV_SOCKET": str(d / "s.sock")},
        wait=False,
        user=member,
    )
    try:
        wait_for_socket(sup.socket, sup.proc)
        res = shmkv("stats", "--socket", sup.socket, env=clean_env(), user=victim)
        assert res.returncode == EXIT_UNTRUSTED
        assert_one_error_line(res, f"uid {member.pw_uid}", "SHMKV_SUPERVISOR_UID")
        for who in (MEMBER, str(member.pw_uid)):
            env = clean_env(SHMKV_SUPERVISOR_UID=who)
            res = shmkv("stats", "--json", "--socket", sup.socket, env=env, user=victim)
            assert res.returncode == 0, res.stderr
            assert json.loads(res.stdout)["pid"] == sup.proc.pid
    finally:
        assert sup.stop() == 0, sup.log()


# --------------------------------------------------------- the arena file's mode
def test_group_member_cannot_open_the_arena_for_writing(
    make_supervisor, public_dir: Path, member: pwd.struct_passwd
) -> None:
    """With --group the arena was 0660: a member opened it O_RDWR, scribbled on the index
    and truncated it."""
    sock = public_dir / "s.sock"
    sup = make_supervisor(
        "--size", "16M", "--group", GROUP, env_extra={"SHMKV_SOCKET": str(sock)}, wait=False
    )
    wait_for_socket(str(sock), sup.proc)
    probe = r"""
import json, os, sys
out = {}
for name, flags in (("rdwr", os.O_RDWR), ("wronly", os.O_WRONLY), ("rdonly", os.O_RDONLY)):
    for path in sys.argv[1:]:
        try:
            os.close(os.open(path, flags))
            out[name + ":" + path] = "ok"
        except OSError as e:
            out[name + ":" + path] = e.strerror
print(json.dumps(out))
"""
    lock = f"{sup.arena}.lock"
    out = last_json(run_as(member, probe, str(sup.arena), lock))
    assert out[f"rdwr:{sup.arena}"] == "Permission denied", out
    assert out[f"wronly:{sup.arena}"] == "Permission denied", out
    assert out[f"rdonly:{sup.arena}"] == "ok", out  # reading is what the group may do anyway
    assert all(out[f"{m}:{lock}"] == "Permission denied" for m in ("rdwr", "rdonly")), out
    st = os.stat(sup.arena)
    assert st.st_mode & 0o777 == 0o640 and st.st_uid == os.geteuid()
    assert os.stat(lock).st_mode & 0o777 == 0o600
    # the member still reads and writes through the supervisor
    res = run_as(member, PUT_AND_READ, str(sock))
    assert last_json(res)["put"] is True


# ----------------------------------------------------------- files in /dev/shm
def _plant(evil: pwd.struct_passwd, code: str, *args: str) -> None:
    res = run_as(evil, code, *args)
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("which", ["lock", "arena"])
def test_symlink_planted_for_lock_or_arena_is_never_followed(
    tmp_path: Path, public_dir: Path, evil: pwd.struct_passwd, which: str
) -> None:
    """A symlink at the lock file's name made the supervisor (root) write its pid into the
    file of the attacker's choosing."""
    name = f"t{uuid.uuid4().hex[:10]}"
    theirs = owned_dir(public_dir, evil)
    target = theirs / "precious"
    link = SHM / f"shmkv-{name}{'.lock' if which == 'lock' else ''}"
    _plant(
        evil,
        "import os, sys; open(sys.argv[1], 'w').write('precious\\n'); os.symlink(*sys.argv[1:])",
        str(target),
        str(link),
    )
    try:
        sup = start_supervisor(tmp_path, "--size", "16M", name=name, wait=False)
        assert wait_exit(sup, Path(sup.socket)) == EXIT_UNTRUSTED
        error_line(sup, str(link), "symbolic link", "sudo rm")
        assert target.read_text() == "precious\n"
        assert link.is_symlink()  # another user's: not ours to remove either
        assert not [p for p in SHM.glob(f"shmkv-{name}*") if p != link]
    finally:
        link.unlink(missing_ok=True)


@pytest.mark.parametrize("which", ["lock", "arena"])
@pytest.mark.parametrize("runs_as", ["root", "user"])
def test_lock_or_arena_file_of_another_user_is_one_line_and_exit_code(
    tmp_path: Path,
    public_dir: Path,
    evil: pwd.struct_passwd,
    victim: pwd.struct_passwd,
    which: str,
    runs_as: str,
) -> None:
    """A lock or arena file another user made first stopped the supervisor with a
    traceback (or, as root, was taken over)."""
    name = f"t{uuid.uuid4().hex[:10]}"
    planted = SHM / f"shmkv-{name}{'.lock' if which == 'lock' else ''}"
    _plant(evil, "import sys; open(sys.argv[1], 'w').write('mine\\n')", str(planted))
    user = victim if runs_as == "user" else None
    sock = owned_dir(public_dir, victim, 0o700) / "s.sock" if user else tmp_path / "s.sock"
    try:
        sup = start_supervisor(
            tmp_path,
            "--size",
            "16M",
            name=name,
            env_extra={"SHMKV_SOCKET": str(sock)},
            wait=False,
            user=user,
        )
        assert wait_exit(sup, sock) == EXIT_UNTRUSTED
        error_line(sup, str(planted), f"owned by uid {evil.pw_uid} ({EVIL})", "sudo rm")
        assert planted.read_text() == "mine\n" and planted.stat().st_uid == evil.pw_uid
        assert not [p for p in SHM.glob(f"shmkv-{name}*") if p != planted]
    finally:
        planted.unlink(missing_ok=True)


def test_cleanup_never_raises_when_its_files_were_replaced(tmp_path: Path) -> None:
    """cleanup() raised when the arena or lock name no longer held the supervisor's file;
    it must log, leave what is there now alone, and exit 0."""
    sup = start_supervisor(tmp_path, "--size", "16M")
    lock = Path(f"{sup.arena}.lock")
    try:
        for p in (sup.arena, lock):
            p.unlink()
            p.mkdir()  # someone else's now (here: root's directory)
        assert sup.stop() == 0, sup.log()
        assert "Traceback" not in sup.log(), sup.log()
        assert sup.arena.is_dir() and lock.is_dir()
    finally:
        for p in (sup.arena, lock):
            if p.is_dir():
                p.rmdir()


# --------------------------------------------------------------- admin ops
ADMIN_OPS = r"""
import json, os, sys
import numpy as np
from shmkv import Client
from shmkv.core.errors import ShmkvError
sock, key, pid = sys.argv[1], bytes.fromhex(sys.argv[2]), int(sys.argv[3])
out = {}
with Client(socket_path=sock, timeout=5) as c:
    tokens = np.arange(c.view.geometry.chunk_tokens, dtype=np.int32)
    put_pinned = lambda: c.put_bytes(os.urandom(16), tokens, b"fp", b"p" * 4000, pin=True)
    for name, call in (
        ("clear", lambda: c.clear()),
        ("pin", lambda: c.pin(key, True)),
        ("unpin", lambda: c.pin(key, False)),
        ("worker_exit", lambda: c.worker_exit(pid)),
        ("put_pinned", lambda: put_pinned()["key"].hex()),
        ("stats", lambda: c.stats()["entries"]),
    ):
        try:
            out[name] = ["ok", call()]
        except ShmkvError as e:
            out[name] = [e.code, str(e)]
print(json.dumps(out))
"""


def test_group_member_may_read_and_publish_but_not_administer(
    make_supervisor, public_dir: Path, member: pwd.struct_passwd
) -> None:
    """clear, pin, unpin and worker_exit worked for any connected peer of the group, and a
    member pinned through put(pin=True) (past --ttl, up to --max-pinned-percent, so that
    the owner's own pin was refused) while its pin op was refused."""
    sock = public_dir / "s.sock"
    sup = make_supervisor(
        "--size", "16M", "--group", GROUP, env_extra={"SHMKV_SOCKET": str(sock)}, wait=False
    )
    wait_for_socket(str(sock), sup.proc)
    with sup.client() as c:  # the owner's entry, and a connection of ours to close
        chunk = c.view.geometry.chunk_tokens
        key = c.put_bytes(b"\x01" * 16, np.arange(chunk, dtype=np.int32), b"fp", b"o" * 4000)["key"]
        assert last_json(run_as(member, PUT_AND_READ, str(sock)))["put"] is True
        out = last_json(run_as(member, ADMIN_OPS, str(sock), key.hex(), str(os.getpid())))
        for op in ("clear", "pin", "unpin", "worker_exit", "put_pinned"):
            code, message = out[op]
            assert code == "permission", out
            assert f"not uid {member.pw_uid}" in message and "--group member" in message
        assert "put it without pin" in out["put_pinned"][1], out
        assert out["stats"] == ["ok", 2]
        st = c.stats()  # our connection is still open, nothing was cleared, pinned or put
        assert st["entries"] == 2 and st["pinned"] == 0 and st["ops_denied"] == 5
    res = shmkv("clear", "--socket", str(sock), env=clean_env(), user=member)
    assert res.returncode == 6
    assert_one_error_line(res, "'clear'", f"uid {member.pw_uid}")
    with sup.client(attach=False) as c:  # the owner may
        assert c.pin(key) == 1 and c.clear() == 2


HOLD = r"""
import sys
from shmkv import Client
c = Client(socket_path=sys.argv[1], timeout=5)
c.ensure()
print("attached", flush=True)
sys.stdin.readline()
"""

REPORT_EXIT = r"""
import json, sys
from shmkv import Client
from shmkv.core.errors import ShmkvError
try:
    with Client(socket_path=sys.argv[1], attach=False, timeout=5) as c:
        print(json.dumps(["ok", c.worker_exit(int(sys.argv[2]))]))
except ShmkvError as e:
    print(json.dumps([e.code, str(e)]))
"""


def test_worker_exit_only_from_the_workers_parent(supervisor: Sup) -> None:
    """Any peer could say that any pid exited, and so close that worker's connections."""
    worker = subprocess.Popen(
        [sys.executable, "-c", HOLD, supervisor.socket],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert worker.stdout is not None and worker.stdout.readline().strip() == "attached"
        res = subprocess.run(
            [sys.executable, "-c", REPORT_EXIT, supervisor.socket, str(worker.pid)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        code, message = last_json(res)  # a sibling, of the same uid
        assert code == "permission", message
        assert f"not the parent of pid {worker.pid}" in message
        st = supervisor.stats()
        assert st["workers_attached"] == 1 and st["ops_denied"] == 1
        with supervisor.client(attach=False) as c:  # its parent: us
            assert c.worker_exit(worker.pid) == 0
            wait_until(lambda: c.stats()["workers_attached"] == 0, 5, "the worker's close")
    finally:
        worker.kill()
        worker.wait(10)
