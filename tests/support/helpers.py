"""What the test modules share: waiting, supervisor processes, blobs, a raw protocol peer,
llama worker processes and a gunicorn server.

Runs in the pytest process. Test modules import from here (and take the fixtures of
conftest.py), never from one another; the chaos files also share chaos_harness.py.
"""

from __future__ import annotations

import array
import grp
import hashlib
import json
import os
import pwd
import re
import signal
import socket
import struct
import subprocess
import sys
import sysconfig
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import msgpack
import numpy as np
import xxhash

from shmkv import Client, SupervisorUnavailable
from shmkv.core import arena as A
from shmkv.core import protocol as P

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent
ROOT = TESTS.parent
SHM = Path("/dev/shm")
CHUNK = 64  # the supervisor's default --chunk-tokens
MiB = 1 << 20


# ------------------------------------------------------------- waiting and processes
def wait_until(
    pred: Callable[[], Any], timeout: float = 10.0, what: str = "condition", step: float = 0.01
) -> Any:
    """Poll ``pred`` until it returns something truthy and return that; after ``timeout``
    seconds raise AssertionError naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(step)


def fd_count(pid: int) -> int:
    """How many descriptors process ``pid`` holds open."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def no_signal_deaths(*procs: subprocess.Popen | subprocess.CompletedProcess) -> None:
    """None of ``procs`` died of a signal (SIGBUS, SIGSEGV, ...)."""
    for p in procs:
        rc = p.returncode
        assert rc is not None and rc >= 0, f"pid {getattr(p, 'pid', '?')} died of signal {-rc}"


# ------------------------------------------------------------ the CLI and other users
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


def _retry(cmd: list[str]) -> subprocess.CompletedProcess:
    """Run a user/group tool; retry while another one holds /etc/passwd's lock."""
    for _ in range(50):
        res = subprocess.run(cmd, capture_output=True, text=True)
        if "lock" not in res.stderr:
            return res
        time.sleep(0.1)
    return res


def make_group(name: str = "shmkv-test-grp") -> grp.struct_group:
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
from shmkv import Client; from shmkv.core import arena as A
with Client(socket_path=sys.argv[1], timeout=5) as c:
    chunk = c.view.geometry.chunk_tokens
    root, tokens = os.urandom(16), np.arange(chunk, dtype=np.int32)
    c.put_bytes(root, tokens, b"fp", b"m" * 3000)
    hit = c.lookup(A.chain_digests(root, tokens, chunk))
    with c.acquire(hit) as lease:
        ok = bytes(lease.payload) == b"m" * 3000 and lease.finish()
print(json.dumps({"put": ok}))
"""


# ----------------------------------------------------------------------- supervisors
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
) -> Sup:
    """Start `shmkv supervise` with a unique name and socket under tmp_path (or the
    SHMKV_SOCKET of ``env_extra``), as ``user`` if given.

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
            [python_for(user), "-m", "shmkv", "supervise", *args],
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


# ----------------------------------------------------------------------------- blobs
class Blob(NamedTuple):
    """A blob as a worker publishes it: key root, token ids and payload."""

    root: bytes
    tokens: np.ndarray
    data: bytes

    def digests(self, chunk: int = CHUNK) -> list[bytes]:
        return A.chain_digests(self.root, self.tokens, chunk)


def blob(seed: int, size: int, n_tokens: int = 2 * CHUNK) -> Blob:
    """A blob that is a pure function of ``seed``, so that any process can rebuild it and
    check what it reads."""
    root = hashlib.blake2b(b"blob-%d" % seed, digest_size=16).digest()
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 30_000, n_tokens).astype("<i4")
    return Blob(root, tokens, rng.bytes(size))


# ------------------------------------------------------------ a raw protocol peer
class Raw:
    """A raw connection to the supervisor: frames in and out by hand."""

    def __init__(self, path: str, timeout: float = 5.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(path)
        self.next_id = 1
        self.geometry: A.Geometry | None = None

    def close(self) -> None:
        self.sock.close()

    def send_raw(self, data: bytes, fds: list[int] | None = None) -> None:
        if fds:
            sent = self.sock.sendmsg(
                [data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
            )
            data = data[sent:]
        if data:
            self.sock.sendall(data)

    def send_body(self, body: bytes, fds: list[int] | None = None) -> None:
        self.send_raw(struct.pack(">I", len(body)) + body, fds)

    def send(self, msg: dict[str, Any], fds: list[int] | None = None) -> None:
        msg = dict(msg)
        if "id" not in msg:
            msg["id"] = self.next_id
            self.next_id += 1
        self.send_body(msgpack.packb(msg, use_bin_type=True), fds)

    def recv(self) -> dict[str, Any] | None:
        """One reply, or None if the supervisor closed the connection."""
        try:
            msg, fds = P.recv_msg(self.sock)
        except (ConnectionResetError, BrokenPipeError):
            return None
        for fd in fds:
            os.close(fd)
        return msg

    def call(self, msg: dict[str, Any], fds: list[int] | None = None) -> dict[str, Any]:
        self.send(msg, fds)
        reply = self.recv()
        assert reply is not None, f"connection closed on {msg!r:.200}"
        return reply

    def attach(self) -> dict[str, Any]:
        self.send({"op": "attach", "pid": os.getpid()})
        msg, fds = P.recv_msg(self.sock)
        assert msg["ok"] and len(fds) == 1
        try:
            self.geometry = A.ArenaView(fds[0], populate=False).geometry
        finally:
            for fd in fds:
                os.close(fd)
        return msg

    def closed_by_peer(self) -> bool:
        """True once the supervisor has closed its end (EOF), reading any pending replies."""
        try:
            while True:
                data = self.sock.recv(65536)
                if not data:
                    return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except TimeoutError:
            return False


def memfd_with(data: bytes) -> int:
    fd = os.memfd_create("test-put", os.MFD_CLOEXEC)
    os.write(fd, data)
    return fd


def put_msg(toks: np.ndarray, data: bytes, **over: Any) -> dict[str, Any]:
    """A valid put request for ``data`` (its memfd goes with it), with fields ``over``."""
    msg = {
        "op": "put",
        "root": b"r" * 16,
        "tokens": toks.astype("<i4").tobytes(),
        "fingerprint": b"fp",
        "payload_len": len(data),
        "checksum": xxhash.xxh3_64_intdigest(data),
        "pin": False,
    }
    msg.update(over)
    return msg


def assert_healthy(sup: Sup) -> None:
    """The supervisor is up and a well-behaved client can put a blob and read it back."""
    assert sup.proc.poll() is None, f"supervisor died:\n{sup.log()}"
    data = os.urandom(5000 + int.from_bytes(os.urandom(2), "little"))
    root = os.urandom(16)
    with sup.client() as c:
        chunk = c.view.geometry.chunk_tokens
        tokens = np.arange(2 * chunk, dtype=np.int32)
        c.put_bytes(root, tokens, b"fp", data)
        hit = c.lookup(A.chain_digests(root, tokens, chunk))
        assert hit is not None and hit.chunks == 2
        with c.acquire(hit) as lease:
            assert bytes(lease.payload) == data
            assert np.array_equal(lease.tokens(), tokens)
            assert lease.finish(len(tokens))
    assert sup.proc.poll() is None
    assert "internal error" not in sup.log() and "Traceback" not in sup.log(), sup.log()


# ------------------------------------------------------------ llama worker processes
KW = {"n_ctx": 2048, "n_threads": 1, "n_threads_batch": 1, "seed": 0}
SYSTEM = " ".join(f"Rule {i}: the cat {i % 7} sits on mat {i % 5}." for i in range(50))


def completion(prompt: str, stream: bool = False, max_tokens: int = 16) -> dict:
    """A completion job for tests/llama_worker.py."""
    return {"kind": "completion", "prompt": prompt, "stream": stream, "max_tokens": max_tokens}


def texts(result: dict) -> list[str]:
    """The texts of a llama worker's results, in job order."""
    return [r["text"] for r in result["results"]]


def start_worker(
    sup: Any,
    model: str,
    jobs: list[dict],
    mode: str = "shmkv",
    namespace: str = "",
    kw: dict | None = None,
    env: dict | None = None,
    user: pwd.struct_passwd | None = None,
) -> subprocess.Popen:
    """A tests/llama_worker.py process (``sup`` None: no supervisor; ``user``: run as that
    user); it loads its modules while it waits for the jobs that finish_worker() sends it."""
    spec = {
        "model": model,
        "kw": {**KW, **(kw or {})},
        "name": sup.name if sup else "none",
        "socket": sup.socket if sup else "/nonexistent/shmkv.sock",
        "namespace": namespace,
        "mode": mode,
        "jobs": jobs,
    }
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    proc = subprocess.Popen(
        [python_for(user), str(HERE / "llama_worker.py")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **spawn_kw(user, env),
    )
    proc.spec = json.dumps(spec)  # type: ignore[attr-defined]
    return proc


def finish_worker(proc: subprocess.Popen, timeout: float = 240) -> dict:
    """Send a start_worker() process its jobs; its JSON result, with its ``stderr`` added."""
    try:
        out, err = proc.communicate(proc.spec, timeout=timeout)  # type: ignore[attr-defined]
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    no_signal_deaths(proc)
    assert proc.returncode == 0, err[-3000:]
    result = json.loads(out)
    result["stderr"] = err
    return result


def run_worker(
    sup: Any,
    model: str,
    jobs: list[dict],
    mode: str = "shmkv",
    namespace: str = "",
    kw: dict | None = None,
    env: dict | None = None,
    timeout: float = 120,
    user: pwd.struct_passwd | None = None,
) -> dict:
    """Run ``jobs`` in a fresh llama worker process: ``mode`` "shmkv" (SharedCacheLlama),
    "attach" (a plain Llama with ``attach``) or "cold" (a fresh plain Llama per job, the
    reference); returns its results, totals and stderr."""
    return finish_worker(start_worker(sup, model, jobs, mode, namespace, kw, env, user), timeout)


# A worker that attaches (and runs its "before" jobs), says so, waits for a line on stdin,
# then runs its jobs: lets a test break the arena between the attach and the first
# restore, or hold the connections of a worker that has published.
BARRIER_WORKER = r"""
import dataclasses, json, logging, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
from tests.support.llama_worker import run_job
from shmkv.llama import SharedCacheLlama
spec = json.loads(sys.argv[1])
llm = SharedCacheLlama(model_path=spec["model"], verbose=False, **spec["kw"],
                       shmkv_name=spec["name"], shmkv_socket=spec["socket"])
for job in spec["before"]:
    run_job(llm, job)
llm.shmkv.flush()
print("attached" if llm.shmkv.reader.connected else "cold", flush=True)
sys.stdin.readline()
results = []
for job in spec["jobs"]:
    text = run_job(llm, job)
    results.append({"text": text, "last": dataclasses.asdict(llm.shmkv.last)})
llm.shmkv.close()
print(json.dumps({"results": results, "totals": dataclasses.asdict(llm.shmkv.totals)}),
      flush=True)
"""


class BarrierWorker:
    """A llama worker that attaches, then waits for go() before it runs its jobs."""

    def __init__(
        self, sup: Sup, model: str, jobs: list[dict], before: list[dict] | None = None
    ) -> None:
        spec = {
            "model": model,
            "kw": KW,
            "name": sup.name,
            "socket": sup.socket,
            "jobs": jobs,
            "before": before or [],
        }
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", BARRIER_WORKER, json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert self.proc.stdout is not None and self.proc.stdin is not None
        self.state = self.proc.stdout.readline().strip()

    def go(self, timeout: float = 120) -> dict:
        out, err = self.proc.communicate("go\n", timeout=timeout)
        no_signal_deaths(self.proc)
        assert self.proc.returncode == 0, err
        self.stderr = err
        return json.loads(out)


def flip_payload_bytes(arena_path: Path) -> int:
    """Flip bytes in the middle of every record's payload (as a stray writer would)."""
    fd = os.open(arena_path, os.O_RDONLY)
    try:
        view = A.ArenaView(fd, populate=False)
    finally:
        os.close(fd)
    records = {(s.rec_offset, s.rec_gen) for s in view.scan()}
    targets = [view.read_record(off, gen) for off, gen in records]
    view.close()
    with open(arena_path, "r+b") as f:
        for rec in targets:
            pos = rec.payload_off + rec.payload_len // 2
            f.seek(pos)
            b = f.read(16)
            f.seek(pos)
            f.write(bytes(x ^ 0xFF for x in b))
    return len(targets)


def last_logits(llm: Any) -> np.ndarray:
    """A copy of the logits of the last token ``llm`` (a llama_cpp.Llama) evaluated."""
    from llama_cpp import llama_cpp as C

    ptr = C.llama_get_logits_ith(llm.ctx, -1)
    return np.array(np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)), copy=True)


# -------------------------------------------------------------------- gunicorn server
SAMPLING = {"temperature": 0.0, "max_tokens": 12}
EXTRA = {"repeat_penalty": 1.0, "top_k": 1}  # identical sampling on both sides
N_CTX = 2048


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """gunicorn with workers/gunicorn_conf.py, as `shmkv serve` or systemd runs it.

    (httpx and openai are imported here, not at the top: the child processes of the
    crash tests import this module too, and openai alone takes a third of a second.)
    """

    def __init__(
        self,
        sup: Sup,
        model: str,
        workers: int,
        tmp_path: Path,
        env: dict[str, str] | None = None,
    ) -> None:
        import httpx
        import openai

        self.sup, self.port = sup, free_port()
        self.env = {
            **sup.env,
            "SHMKV_MODEL": model,
            "SHMKV_WORKERS": str(workers),
            "SHMKV_PORT": str(self.port),
            "SHMKV_THREADS": "1",
            "SHMKV_N_CTX": str(N_CTX),
            "SHMKV_LOG_LEVEL": "info",
            "SHMKV_TIMEOUT": "2",
            **(env or {}),
        }
        self.log_path = tmp_path / "gunicorn.log"
        with open(self.log_path, "wb") as f:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gunicorn", "-c", str(ROOT / "workers/gunicorn_conf.py")],
                env=self.env,
                stdout=f,
                stderr=subprocess.STDOUT,
                cwd=tmp_path,
            )
        self.base = f"http://127.0.0.1:{self.port}"
        #: what /health and /metrics need with --api-key (its first key)
        key = self.env.get("SHMKV_API_KEY", "").split(",")[0]
        self.auth = {"Authorization": f"Bearer {key}"} if key else {}
        self.wait_workers(workers)
        # a new connection per request, so that requests spread over the workers
        self.client = openai.OpenAI(
            base_url=self.base + "/v1",
            api_key="unused",
            max_retries=0,
            timeout=60,
            http_client=httpx.Client(limits=httpx.Limits(max_keepalive_connections=0)),
        )

    def worker_pids(self) -> set[int]:
        path = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        try:
            return {int(p) for p in path.read_text().split()}
        except (FileNotFoundError, ValueError):
            return set()

    def wait_workers(self, n: int, timeout: float = 60) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        seen: set[int] = set()
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log_path.read_text()[-3000:]
            pids = self.worker_pids()
            if len(pids) == n:  # every worker answers /health (a worker that is still
                try:  # loading its model would skew which worker gets what)
                    r = httpx.get(self.base + "/health", headers=self.auth, timeout=5)
                    if r.status_code == 200:
                        seen.add(r.json()["worker_pid"])
                        if pids <= seen:
                            return
                except httpx.HTTPError:
                    pass
                time.sleep(0.02)
                continue
            time.sleep(0.2)
        raise TimeoutError(self.log_path.read_text()[-3000:])

    def complete(self, prompt: str, **kw: Any) -> tuple[str, dict]:
        """A completion and what the cache did for it (the ``x-shmkv-*`` headers)."""
        raw = self.client.completions.with_raw_response.create(
            model="tiny", prompt=prompt, extra_body=EXTRA, **{**SAMPLING, **kw}
        )
        body = raw.parse()
        h = {
            k[len("x-shmkv-") :].replace("-", "_"): v
            for k, v in raw.headers.items()
            if k.startswith("x-shmkv-")
        }
        info = {
            k: (v == "true" if k == "hit" else float(v) if k.endswith(("_ms", "_at")) else int(v))
            for k, v in h.items()
        }
        return body.choices[0].text, info

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(40)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# ------------------------------------------------------------------------ other users
def system_user(name: str, group: str | None = None) -> tuple[int, int]:
    """(uid, gid) of system user ``name`` (made by :func:`make_user`), a member of
    ``group`` if given. Skips the calling test unless it runs as root."""
    import pytest

    if os.geteuid() != 0:
        pytest.skip("needs root to create and run as other users")
    pw = make_user(name, (group,) if group is not None else ())
    return pw.pw_uid, pw.pw_gid
