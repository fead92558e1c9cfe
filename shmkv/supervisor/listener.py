"""The supervisor's Unix socket: bind, stale-socket takeover, accept, peer credentials.

Runs in the supervisor only. ``bind`` creates the socket's directory, refuses
one that another user could write to (see :func:`check_socket_dir`), takes
over a socket nobody answers on (a killed supervisor's), refuses to start over
a live one, and binds under a temporary name renamed into place once
listening, with mode 0600 (0660 and the group with ``--group``). ``accept``
checks each peer's credentials with SO_PEERCRED before anything is read from
it; a refused peer gets one error frame and is closed. What a peer may do once
accepted is declared per op in ``ops.py``.
"""

from __future__ import annotations

import grp
import logging
import os
import pwd
import socket
import stat
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shmkv.core.config import Settings
from shmkv.core.errors import (
    ArenaExistsError,
    ConfigError,
    PermissionDenied,
    ShmkvError,
    SupervisorBusy,
    UnsafePathError,
    setup_error,
)
from shmkv.core.procfs import stat_fields
from shmkv.core.protocol import FrameBuffer, peer_credentials, send_msg
from shmkv.supervisor.fdcloser import discard_socket

log = logging.getLogger(__name__)


@dataclass
class Conn:
    """One accepted peer: who it is (SO_PEERCRED) and its connection's I/O state."""

    sock: socket.socket
    id: int
    pid: int
    uid: int
    gid: int
    #: the peer's parent pid when it connected (None: not visible in /proc)
    ppid: int | None = None
    frames: FrameBuffer = field(default_factory=FrameBuffer)
    #: descriptors received (SCM_RIGHTS) and not yet taken by a put, and for each the
    #: stream offset where the read that brought it ended: its frame holds a byte before
    #: that offset (the kernel hands descriptors with the last segment of a read)
    fds: list[int] = field(default_factory=list)
    fd_ends: list[int] = field(default_factory=list)
    #: stream bytes read from the peer, and those of the frames handled
    fed: int = 0
    handled: int = 0
    #: replies not yet sent: [data, fds or None] each
    out: deque[list[Any]] = field(default_factory=deque)
    out_bytes: int = 0
    #: whole frames received and not yet handled (they wait while ``busy``), their bytes
    backlog: deque[bytes] = field(default_factory=deque)
    backlog_bytes: int = 0
    #: a request of this connection is being worked on over several turns of the loop
    busy: bool = False
    #: the selector events the socket is registered for (0: not registered)
    events: int = 0
    attached: bool = False
    closing: bool = False

    def take_fd(self) -> int | None:
        """The first descriptor not yet taken (a put's memfd), or None."""
        if not self.fds:
            return None
        self.fd_ends.pop(0)
        return self.fds.pop(0)


def parent_pid(pid: int) -> int | None:
    """The parent of process ``pid`` (/proc/PID/stat), or None if it cannot be read."""
    fields = stat_fields(pid)
    try:
        return None if fields is None else int(fields[1])
    except (ValueError, IndexError):
        return None


def _owner(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def _unsafe(st: os.stat_result, leaf: bool) -> tuple[str, str] | None:
    """Why a directory with this lstat may not hold our socket (``leaf``) or lead to it,
    and the fix; None if it may."""
    euid = os.geteuid()
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a directory"
        return kind, "remove it"
    if st.st_uid not in (euid, 0):
        return (
            f"owned by {_owner(st.st_uid)}, not by us ({_owner(euid)}) or root",
            "remove it (another user may have made it to catch our socket)",
        )
    mode = stat.S_IMODE(st.st_mode)
    # A sticky ancestor (/tmp) is fine: others may add entries to it but not rename ours.
    if mode & (stat.S_IWGRP | stat.S_IWOTH) and (leaf or not mode & stat.S_ISVTX):
        who = "other users" if mode & stat.S_IWOTH else "its group"
        return f"writable by {who} (mode {mode:04o})", "make it writable by its owner only"
    return None


def check_socket_dir(directory: Path) -> Path:
    """The real path of ``directory`` once it is safe to bind our socket in; else UnsafePathError.

    As ssh's StrictModes: the directory and every directory above it must be owned
    by us or root and writable by nobody else (an ancestor may be world-writable if
    it is sticky, as /tmp is). Whoever can write to the directory can rename our
    socket away and put a relay in its place that reads every put and answers every
    lookup. A group-writable directory is refused too, even the ``--group`` group's:
    the group needs to reach the socket, never to replace it.
    """
    real = Path(os.path.realpath(directory))
    for d in (real, *real.parents):
        found = _unsafe(os.lstat(d), leaf=d == real)
        if found is None:
            continue
        problem, fix = found
        where = f"socket directory {d}" if d == real else f"{d}, above socket directory {real},"
        raise UnsafePathError(
            f"{where} is {problem}: another user could put their own socket in place of "
            f"ours. {fix.capitalize()}, or set --socket/SHMKV_SOCKET to a path in a "
            f"directory only you (or root) can write, e.g. under $XDG_RUNTIME_DIR"
        )
    return real


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


class Listener:
    """The listening socket, and the credential check of every peer it accepts."""

    def __init__(self, settings: Settings, gid: int | None) -> None:
        self.path = Path(settings.socket_path)
        self.name = settings.name
        self.max_connections = settings.max_connections
        self.gid = gid
        self.file_mode = 0o660 if gid is not None else 0o600
        self.sock: socket.socket | None = None
        self._next_id = 1

    def bind(self) -> socket.socket:
        """Bind and listen (non-blocking); ShmkvError naming the fix on failure."""
        try:
            self.sock = self._bind()
        except OSError as e:
            raise setup_error(e, self.path, "--socket") from None
        return self.sock

    def _take_over_stale(self) -> None:
        path = self.path
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise ConfigError(f"{path} exists and is not a socket: remove it or set --socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            log.info("taking over stale socket %s", path)
            path.unlink(missing_ok=True)
        except OSError as e:
            raise ConfigError(f"cannot check existing socket {path}: {e}") from None
        else:
            raise ArenaExistsError(
                f"another supervisor is listening on {path}: stop it, or set a different "
                f"--socket/SHMKV_SOCKET"
            )
        finally:
            probe.close()

    def _bind(self) -> socket.socket:
        created = False
        if not self.path.parent.exists():
            try:
                self.path.parent.mkdir(parents=True, mode=0o750 if self.gid is not None else 0o700)
                created = True
            except FileExistsError:  # made by someone else meanwhile: checked below
                pass
        # from here on the path holds no symbolic link that someone could redirect
        self.path = path = check_socket_dir(self.path.parent) / self.path.name
        if created and self.gid is not None and os.stat(path.parent).st_gid != self.gid:
            os.chown(path.parent, -1, self.gid)
        if path.exists() or path.is_symlink():
            self._take_over_stale()
        for p in path.parent.iterdir():  # temporary sockets of killed supervisors
            pid = p.name[len(path.name) + 2 :]
            if p.name.startswith(f".{path.name}.") and pid.isdigit() and not _alive(int(pid)):
                p.unlink(missing_ok=True)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        # Bind under a temporary name and rename it into place once listening, so the
        # path never names a socket that refuses connections (a worker racing start-up,
        # or another supervisor probing for a stale socket, would see ECONNREFUSED).
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        if len(os.fsencode(str(tmp))) > 107:  # AF_UNIX path limit: bind in place
            tmp = path
        old = os.umask(0o777 ^ self.file_mode)
        bound = False
        try:
            sock.bind(str(tmp))
            bound = True
            if self.gid is not None and os.stat(tmp).st_gid != self.gid:
                os.chown(tmp, -1, self.gid)
            os.chmod(tmp, self.file_mode)
            sock.listen(128)
            if tmp != path:
                os.rename(tmp, path)
        except BaseException:
            sock.close()
            if bound:
                tmp.unlink(missing_ok=True)
            raise
        finally:
            os.umask(old)
        sock.setblocking(False)
        return sock

    def accept(self, n_open: int) -> Conn | None:
        """Accept one peer if it may connect (``n_open``: connections already open)."""
        assert self.sock is not None, "accept before bind"
        try:
            sock, _ = self.sock.accept()
        except (BlockingIOError, InterruptedError):
            return None
        except OSError as e:  # EMFILE and friends: keep serving the others
            log.error("accept failed: %s", e)
            return None
        sock.setblocking(False)
        pid, uid, gid = peer_credentials(sock)
        refusal: ShmkvError | None = None
        if not self.allowed(uid, gid):
            refusal = PermissionDenied(
                f"uid {uid} may not use shmkv arena {self.name!r} (owned by uid "
                f"{os.geteuid()}): run as that user or start the supervisor with --group"
            )
            log.warning("refused pid %d uid %d: not allowed", pid, uid)
        elif n_open >= self.max_connections:
            refusal = SupervisorBusy(
                f"supervisor connection limit ({self.max_connections}) reached: this worker "
                f"runs without the cache; raise --max-connections"
            )
            log.warning("refused pid %d: connection limit %d reached", pid, self.max_connections)
        if refusal is not None:
            try:
                sock.setblocking(True)
                sock.settimeout(0.5)
                send_msg(sock, {"ok": False, "id": 0, "error": refusal.to_wire()})
            except OSError:
                pass
            discard_socket(sock)  # (it may hold descriptors the peer sent: see fdcloser.py)
            return None
        conn = Conn(sock, self._next_id, pid, uid, gid, ppid=parent_pid(pid))
        self._next_id += 1
        return conn

    def allowed(self, uid: int, gid: int) -> bool:
        """Whether a peer of these credentials may connect: our uid, or ``--group``."""
        if uid == os.geteuid():
            return True
        if self.gid is None:
            return False
        if gid == self.gid:
            return True
        try:
            return pwd.getpwuid(uid).pw_name in grp.getgrgid(self.gid).gr_mem
        except KeyError:
            return False

    def close(self, remove: bool = True) -> None:
        """Close the socket and (``remove``) unlink it; never raises."""
        if self.sock is None:
            return
        self.sock.close()
        self.sock = None
        if remove:
            try:
                self.path.unlink(missing_ok=True)
            except OSError as e:
                log.warning("could not remove %s: %s", self.path, e)
