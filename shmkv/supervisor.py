"""``shmkv supervise``: the process that owns the arena and is its only writer.

One thread, one ``selectors`` loop. Signal handlers only queue the signal
number (through ``signal.set_wakeup_fd``); the loop dispatches it. Workers
connect over a Unix socket (see ``protocol.py`` for the framing); each peer's
credentials are checked with SO_PEERCRED before anything else.

Start-up order: take the name's lock file (flock, released by the kernel if we
die, so a killed supervisor's name is simply taken over), remove the arena and
temporary files a killed predecessor left, check and reserve the arena's space
with ``posix_fallocate`` (a full tmpfs fails here, never with SIGBUS later),
write the header, publish the file by rename, bind the socket (mode 0600, or
0660 with ``--group``), then send READY=1 to systemd.
"""

from __future__ import annotations

import errno
import fcntl
import grp
import logging
import mmap
import os
import re
import selectors
import signal
import socket
import stat
import struct
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from . import __version__
from . import arena as A
from . import protocol as P
from .claims import GO, Claims
from .config import Settings, format_size
from .errors import (
    ArenaCorruptError,
    ArenaExistsError,
    BadRequest,
    ConfigError,
    PermissionDenied,
    ProtocolError,
    ShmkvError,
    ShmSpaceError,
    SupervisorBusy,
)
from .stats import ArenaGauges, SupervisorStats, WorkerCounters, add_reported
from .store import Store

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_CONFIG = 2
EXIT_ARENA_EXISTS = 3
EXIT_NO_SPACE = 4
EXIT_FAILURE = 1
EXIT_ARENA_LOST = 7

_PEERCRED = struct.Struct("3i")
MAX_OUT = 16 << 20
MAX_PENDING_FDS = 4
#: records returned (and, of each kind, compared) per ``owners`` request
OWNERS_MAX = 32


def arena_path(settings: Settings) -> Path:
    return Path(settings.dir) / f"shmkv-{settings.name}"


def sd_notify(message: str) -> bool:
    """Send one datagram to $NOTIFY_SOCKET (systemd Type=notify); False if not under systemd."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(addr)
            s.sendall(message.encode())
        return True
    except OSError as e:
        log.warning("cannot notify systemd at %s: %s", addr, e)
        return False


def watchdog_interval() -> float | None:
    """Half the watchdog period systemd asks for, or None."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid.isdigit() and int(pid) != os.getpid()):
        return None
    try:
        return max(int(usec) / 2e6, 0.01)
    except ValueError:
        return None


def _setup_error(e: OSError, path: Path, setting: str) -> ShmkvError:
    """An OSError met while creating the arena or the socket, as one line naming the fix."""
    msg = (f"cannot create {e.filename or path}: {e.strerror or e}: fix {setting} or the "
           f"permissions there")
    return PermissionDenied(msg) if e.errno in (errno.EACCES, errno.EPERM) else ConfigError(msg)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


@dataclass
class Conn:
    sock: socket.socket
    id: int
    pid: int
    uid: int
    gid: int
    frames: P.FrameBuffer = field(default_factory=P.FrameBuffer)
    fds: list[int] = field(default_factory=list)
    out: deque = field(default_factory=deque)
    out_bytes: int = 0
    attached: bool = False
    closing: bool = False


class Supervisor:
    """Owns the arena file, the socket and the single-writer :class:`Store`."""

    def __init__(self, settings: Settings) -> None:
        self.s = settings
        self.path = arena_path(settings)
        self.lock_path = self.path.with_name(self.path.name + ".lock")
        self.socket_path = Path(settings.socket_path)
        self.gid = self._group_id(settings.group)
        self.file_mode = 0o660 if self.gid is not None else 0o600
        self.sel = selectors.DefaultSelector()
        self.conns: dict[int, Conn] = {}
        self._next_conn = 1
        self._signals: deque[int] = deque()
        self._stop = False
        self._lost = False
        self.started = time.time()
        self.lock_fd = -1
        self.ro_fd = -1
        self.listener: socket.socket | None = None
        self.mm: mmap.mmap | None = None
        self.store: Store | None = None
        self.view: A.ArenaView | None = None
        self.claims = Claims(ttl=settings.claim_timeout)
        #: sums of the counters workers reported
        self.reported = WorkerCounters()
        self._wake_r = self._wake_w = -1
        self._old_wakeup: int | None = None

    # ------------------------------------------------------------------ set-up
    @staticmethod
    def _group_id(group: str | None) -> int | None:
        if group is None:
            return None
        try:
            return int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
        except KeyError:
            raise ConfigError(f"--group {group!r}: no such group (see `getent group`)") from None

    def _take_lock(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, self.file_mode)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                try:
                    other = os.read(fd, 32).decode(errors="replace").strip() or "?"
                finally:
                    os.close(fd)
                raise ArenaExistsError(
                    f"a supervisor (pid {other}) already owns arena {self.s.name!r}: "
                    f"stop it, or pick another --name/SHMKV_NAME") from None
            # the lock file may have been unlinked and recreated between open and flock
            try:
                same = os.stat(self.lock_path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()}\n".encode())
                self.lock_fd = fd
                return
            os.close(fd)

    def _remove_leftovers(self) -> None:
        """Remove the arena and half-made arena files of a killed predecessor.

        We hold the name's lock, so no live supervisor owns them. Unlinking the stale
        arena before the space check means a restart needs room for one arena, not two
        (workers still mapping it keep its pages only until they reattach).
        """
        tmp = re.compile(rf"{re.escape(self.path.name)}\.\d+\.tmp")
        for p in self.path.parent.iterdir():
            if p == self.path or tmp.fullmatch(p.name):
                p.unlink(missing_ok=True)
                log.info("removed %s, left by a supervisor that did not stop cleanly", p)

    def _create_arena(self) -> None:
        self._remove_leftovers()
        size = self.s.size
        st = os.statvfs(self.path.parent)
        free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
        if size > free:
            raise ShmSpaceError(
                f"--size {format_size(size)} does not fit in {self.path.parent}: only "
                f"{format_size(free)} free of {format_size(total)}. Lower --size, free space "
                f"there, or enlarge the tmpfs (Docker: --shm-size)")
        try:
            geom = A.Geometry.plan(size, self.s.chunk_tokens, self.s.index_slots)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        geom = A.Geometry(**{**geom.__dict__, "created": time.time()})
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, self.file_mode)
        try:
            if self.gid is not None:
                os.fchown(fd, -1, self.gid)
                os.fchmod(fd, self.file_mode)
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
                    st = os.statvfs(self.path.parent)
                    raise ShmSpaceError(
                        f"cannot reserve --size {format_size(size)} in {self.path.parent} "
                        f"({format_size(st.f_bavail * st.f_frsize)} free): lower --size or "
                        f"enlarge the tmpfs (Docker: --shm-size)") from None
                raise
            self.mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE,
                                prot=mmap.PROT_READ | mmap.PROT_WRITE)
            A.ArenaWriter(self.mm, geom).format()
            os.rename(tmp, self.path)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        # the read-only descriptor handed to every worker: it cannot be mapped writable
        self.ro_fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        self.store = Store(self.mm, geom, lease_timeout=self.s.lease_timeout,
                           intact=self._intact)
        self.view = A.ArenaView(self.ro_fd, populate=False)  # to re-check suspect records
        log.info("arena %s: %s, %d index slots, data %s, chunk %d tokens", self.path,
                 format_size(size), geom.index_slots, format_size(geom.data_size),
                 geom.chunk_tokens)

    def _bind(self) -> None:
        path = self.socket_path
        if not path.parent.exists():
            path.parent.mkdir(parents=True, mode=0o750 if self.gid is not None else 0o700)
            if self.gid is not None:
                os.chown(path.parent, -1, self.gid)
        if path.exists() or path.is_symlink():
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
                    f"--socket/SHMKV_SOCKET")
            finally:
                probe.close()
        for p in path.parent.iterdir():  # temporary sockets of killed supervisors
            pid = p.name[len(path.name) + 2:]
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
            if self.gid is not None:
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
        self.listener = sock
        self.sel.register(sock, selectors.EVENT_READ, None)

    def _install_signals(self) -> None:
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._old_wakeup = signal.set_wakeup_fd(self._wake_w)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda signum, _frame: self._signals.append(signum))
        self.sel.register(self._wake_r, selectors.EVENT_READ, "signal")

    def start(self) -> None:
        """Lock the name, create the arena, bind the socket; raises ShmkvError on failure."""
        try:
            self._take_lock()
        except OSError as e:
            raise _setup_error(e, self.lock_path, "--dir") from None
        try:
            try:
                self._create_arena()
            except OSError as e:
                raise _setup_error(e, self.path, "--dir") from None
            try:
                self._bind()
            except OSError as e:
                raise _setup_error(e, self.socket_path, "--socket") from None
        except BaseException:
            self.cleanup(remove=True)
            raise

    # -------------------------------------------------------------------- loop
    def serve_forever(self) -> int:
        self._install_signals()
        sd_notify(f"READY=1\nSTATUS=serving arena {self.s.name}\nMAINPID={os.getpid()}")
        log.info("shmkv %s supervising %r on %s (pid %d)", __version__, self.s.name,
                 self.socket_path, os.getpid())
        wd = watchdog_interval()
        next_wd = time.monotonic()
        next_check = time.monotonic() + 1.0
        try:
            while not self._stop:
                if time.monotonic() >= next_check:
                    next_check = time.monotonic() + 1.0
                    if not self.arena_intact():
                        break
                timeout = None
                now = time.monotonic()
                if wd is not None:
                    if now >= next_wd:
                        sd_notify("WATCHDOG=1")
                        next_wd = now + wd
                    timeout = max(0.0, next_wd - now)
                due = self.claims.next_deadline()
                if due is not None:
                    if due <= now:
                        self._wake(self.claims.expire(now))
                        due = self.claims.next_deadline()
                    if due is not None:
                        left = max(0.0, due - now)
                        timeout = left if timeout is None else min(timeout, left)
                timeout = 1.0 if timeout is None else min(timeout, 1.0)
                for key, events in self.sel.select(timeout):
                    if key.data is None:
                        self._accept()
                    elif key.data == "signal":
                        self._drain_signals()
                    else:
                        conn: Conn = key.data
                        if events & selectors.EVENT_READ:
                            self._on_readable(conn)
                        if events & selectors.EVENT_WRITE and not conn.closing:
                            self._flush(conn)
        finally:
            sd_notify("STOPPING=1")
            self.cleanup(remove=not self.s.keep)
        return EXIT_ARENA_LOST if self._lost else EXIT_OK

    def arena_intact(self) -> bool:
        """False (and a log line) if the arena file shrank: writing to it would SIGBUS.

        The supervisor then exits with EXIT_ARENA_LOST; systemd or `shmkv serve`
        restarts it with a fresh arena and workers reattach (cold meanwhile).
        """
        try:
            size = os.fstat(self.ro_fd).st_size
        except OSError:
            size = -1
        if self.store is not None and size < self.store.geometry.arena_size:
            self._lost = True
            log.critical("arena %s was truncated to %d bytes behind our back: exiting so that "
                         "a fresh arena replaces it", self.path, size)
            return False
        return True

    def _drain_signals(self) -> None:
        try:
            while os.read(self._wake_r, 64):
                pass
        except BlockingIOError:
            pass
        while self._signals:
            sig = self._signals.popleft()
            if sig in (signal.SIGTERM, signal.SIGINT):
                log.info("received %s: shutting down", signal.Signals(sig).name)
                self._stop = True
            elif sig == signal.SIGHUP:
                log.info("stats: %s", self.stats())

    def stop(self) -> None:
        self._stop = True

    # ------------------------------------------------------------ connections
    def _accept(self) -> None:
        assert self.listener is not None
        try:
            sock, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:  # EMFILE and friends: keep serving the others
            log.error("accept failed: %s", e)
            return
        sock.setblocking(False)
        pid, uid, gid = _PEERCRED.unpack(
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
        refusal: ShmkvError | None = None
        if not self._allowed(uid, gid):
            refusal = PermissionDenied(
                f"uid {uid} may not use shmkv arena {self.s.name!r} (owned by uid "
                f"{os.geteuid()}): run as that user or start the supervisor with --group")
            log.warning("refused pid %d uid %d: not allowed", pid, uid)
        elif len(self.conns) >= self.s.max_connections:
            refusal = SupervisorBusy(
                f"supervisor connection limit ({self.s.max_connections}) reached: this worker "
                f"runs without the cache; raise --max-connections")
            log.warning("refused pid %d: connection limit %d reached", pid,
                        self.s.max_connections)
        if refusal is not None:
            try:
                sock.setblocking(True)
                sock.settimeout(0.5)
                P.send_msg(sock, {"ok": False, "id": 0, "error": refusal.to_wire()})
            except OSError:
                pass
            sock.close()
            return
        conn = Conn(sock, self._next_conn, pid, uid, gid)
        self._next_conn += 1
        self.conns[conn.id] = conn
        self.sel.register(sock, selectors.EVENT_READ, conn)
        log.debug("connection %d from pid %d", conn.id, pid)

    def _allowed(self, uid: int, gid: int) -> bool:
        if uid == os.geteuid():
            return True
        if self.gid is None:
            return False
        if gid == self.gid:
            return True
        try:
            import pwd

            return pwd.getpwuid(uid).pw_name in grp.getgrgid(self.gid).gr_mem
        except KeyError:
            return False

    def _close(self, conn: Conn, reason: str = "") -> None:
        if conn.id not in self.conns:
            return
        del self.conns[conn.id]
        conn.closing = True
        try:
            self.sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()
        for fd in conn.fds:
            os.close(fd)
        conn.fds.clear()
        # releasing may bump the epoch or free a doomed record: both write to the arena
        intact = self.store is not None and not self._lost and self.arena_intact()
        released = self.store.release_owner(conn.id) if intact else 0
        self._wake(self.claims.drop_owner(conn.id))
        log.debug("connection %d (pid %d) closed%s; released %d lease(s)", conn.id, conn.pid,
                  f": {reason}" if reason else "", released)

    def _on_readable(self, conn: Conn) -> None:
        try:
            data, anc, flags, _ = conn.sock.recvmsg(1 << 16, socket.CMSG_SPACE(4 * MAX_PENDING_FDS))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self._close(conn, str(e))
            return
        for level, typ, cdata in anc:
            if level == socket.SOL_SOCKET and typ == socket.SCM_RIGHTS:
                n = len(cdata) // 4
                conn.fds.extend(struct.unpack(f"{n}i", cdata[: 4 * n]))
        if flags & socket.MSG_CTRUNC or len(conn.fds) > MAX_PENDING_FDS:
            self._reply_error(conn, 0, ProtocolError(
                f"more than {MAX_PENDING_FDS} file descriptors sent at once"))
            self._flush(conn)  # the reason, before the close (as for a framing error)
            self._close(conn, "too many fds")
            return
        if not data:
            self._close(conn, "peer closed")
            return
        conn.frames.feed(data)
        try:
            bodies = conn.frames.frames()
        except ProtocolError as e:
            self._reply_error(conn, 0, e)
            self._flush(conn)
            self._close(conn, str(e))
            return
        for body in bodies:
            if conn.closing:
                return
            self._handle_frame(conn, body)
        if conn.frames.pending() == 0 and conn.fds:  # fds that belonged to no put
            for fd in conn.fds:
                os.close(fd)
            conn.fds.clear()
        if not conn.closing:
            self._flush(conn)

    def _handle_frame(self, conn: Conn, body: bytes) -> None:
        rid = 0
        try:
            msg = P.decode_body(body)
            rid = msg.get("id", 0)
            if not isinstance(rid, int) or isinstance(rid, bool) or not 0 <= rid <= P.MAX_U64:
                rid = 0
                raise BadRequest("field 'id' must be an int in [0, 2**64)")
            op = msg.get("op")
            handler = self._HANDLERS.get(op) if isinstance(op, str) else None
            if handler is None:
                raise BadRequest(f"unknown op {op!r:.40}")
            if op in ("acquire", "release", "put", "report", "claim", "unclaim", "suspect",
                      "owners") \
                    and not conn.attached:
                raise BadRequest(f"op {op!r} before attach")
            if self._lost or not self.arena_intact():  # writing to it now would SIGBUS
                self._stop = True
                raise ArenaCorruptError("the arena file was truncated; the supervisor restarts")
            reply, fds = handler(self, conn, msg)
            if reply is None:  # answered later (a claim waiting on another worker)
                return
        except ShmkvError as e:
            self._reply_error(conn, rid, e)
            return
        except Exception:  # a bug must cost this request, not the supervisor
            log.exception("internal error handling a request from pid %d", conn.pid)
            self._reply_error(conn, rid, ShmkvError("internal supervisor error (see its log)"))
            return
        reply["ok"], reply["id"] = True, rid
        self._queue(conn, P.encode(reply), fds)

    def _reply_error(self, conn: Conn, rid: int, err: ShmkvError) -> None:
        self._queue(conn, P.encode({"ok": False, "id": rid, "error": err.to_wire()}), None)

    def _queue(self, conn: Conn, data: bytes, fds: list[int] | None) -> None:
        conn.out.append([memoryview(data), fds])
        conn.out_bytes += len(data)
        if conn.out_bytes > MAX_OUT:
            self._close(conn, "peer does not read its replies")

    def _flush(self, conn: Conn) -> None:
        while conn.out and not conn.closing:
            item = conn.out[0]
            data, fds = item
            try:
                if fds:
                    sent = conn.sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                                       struct.pack(f"{len(fds)}i", *fds))])
                    item[1] = None
                else:
                    sent = conn.sock.send(data)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:
                self._close(conn, str(e))
                return
            conn.out_bytes -= sent
            if sent < len(data):
                item[0] = data[sent:]
                break
            conn.out.popleft()
        if conn.closing:
            return
        want = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.out else 0)
        try:
            self.sel.modify(conn.sock, want, conn)
        except (KeyError, ValueError):
            pass

    # ---------------------------------------------------------------- handlers
    def _op_attach(self, conn: Conn, msg: dict[str, Any]) -> tuple[dict, list[int] | None]:
        P.get_int(msg, "pid", 0, 1 << 31, required=False)
        conn.attached = True
        assert self.store is not None
        g = self.store.geometry
        return ({"name": self.s.name, "path": str(self.path), "arena_id": g.arena_id,
                 "version": __version__, "supervisor_pid": os.getpid(),
                 "epoch": self.store.epoch}, [self.ro_fd])

    def _op_ping(self, conn: Conn, msg: dict[str, Any]) -> tuple[dict, None]:
        return {"version": __version__}, None

    def _op_acquire(self, conn: Conn, msg: dict[str, Any]) -> tuple[dict, None]:
        assert self.store is not None
        g = self.store.geometry
        offset = P.get_int(msg, "offset", g.data_offset, g.data_offset + g.data_size)
        gen = P.get_int(msg, "gen", 1)
        lease = self.store.acquire(offset, gen, conn.id)
        return {"lease": lease, "epoch": self.store.epoch}, None

    def _op_suspect(self, conn: Conn, msg: dict[str, Any]) -> tuple[dict, None]:
        """A worker found a record corrupt: check it ourselves; remove it if it is.

        A corrupt record would otherwise cost a miss on every lookup until evicted, and
        stop workers from publishing a good copy over it.
        """
        assert self.store is not None
        g = self.store.geometry
        offset = P.get_int(msg, "offset", g.data_offset, g.data_offset + g.data_size)
        gen = P.get_int(msg, "gen", 1)
        e = self.store.entries.get(gen)
        if e is None or e.doomed or e.offset != offset:
            return {"removed": False}, None
        intact = self._intact(e)
        if not intact:
            self.store.remove(e)
            self.store.counters.corrupt_removed += 1
            log.warning("removed corrupt record %d at offset %d (reported by pid %d)", gen,
                        offset, conn.pid)
        return {"removed": not intact}, None

    def _op_owners(self, conn: Conn, msg: dict[str, Any]) -> tuple[dict, None]:
        """The records indexed under chunk prefix ``digest``, and how far ``tokens`` match each.

        The index points a chunk prefix at one record. A worker of a sliding-window
        model can restore a record only whole, so when that one does not fit its
        prompt it asks for the others: every record that ends within the next chunk
        (the only ones a prompt can match to their end) and the most recent longer
        ones (how far the prompt goes along with them is where a checkpoint helps).
        Reads token ids only; the worker checks everything again under its lease.
        """
        assert self.store is not None and self.view is not None
        digest = P.get_digest(msg, "digest")
        tokens = np.frombuffer(P.get_tokens(msg), dtype="<i4")
        owners = self.store.owners.get(digest) or {}
        live = [e for e in map(self.store.entries.get, owners) if e is not None and not e.doomed]
        if not live:
            return {"owners": []}, None
        # the digest is chunk prefix k of every record that owns it
        end = (live[0].digests.index(digest) + 2) * self.store.geometry.chunk_tokens
        ending = [e.gen for e in live if e.n_tokens < end]
        longer = sorted((e.gen for e in live if e.n_tokens >= end), reverse=True)
        picked = ending[:OWNERS_MAX] + longer[:OWNERS_MAX]
        out = []
        for gen in picked:
            e = self.store.entries[gen]
            try:
                cached = self.view.tokens(self.view.read_record(e.offset, gen))
            except (ArenaCorruptError, ValueError):
                continue
            common = A.common_prefix(cached, tokens)
            out.append((common, e.n_tokens, e.offset, gen))
        out.sort(reverse=True)
        return {"owners": [[off, gen, n, c] for c, n, off, gen in out[:OWNERS_MAX]]}, None

    def _intact(self, e: Any) -> bool:
        """Whether a stored record still passes every check a worker makes."""
        assert self.view is not None
        return self.view.intact(e.offset, e.gen)

    def _op_release(self, conn: Conn, msg: dict[str, Any]) -> tuple[dict, None]:
        assert self.store is not None
        lease = P.get_int(msg, "lease", 1)
        restored = P.get_int(msg, "tokens_restored", 0, A.MAX_TOKENS, required=False, default=0)
        valid = self.store.release(lease, conn.id)
        if valid:
            self.reported.tokens_restored += restored
        return {"valid": valid}, None

    def _op_put(self, conn: Conn, msg: dict[str, Any]) -> tuple[dict, None]:
        assert self.store is not None
        root = P.get_digest(msg, "root")
        tokens = np.frombuffer(P.get_tokens(msg), dtype="<i4")
        fingerprint = P.get_fingerprint(msg)
        # no upper bound here: Store.put refuses a blob that can never fit with an
        # ArenaFullError naming --size (the memfd size check below bounds the read)
        payload_len = P.get_int(msg, "payload_len", 1)
        checksum = P.get_int(msg, "checksum", 0, P.MAX_U64)
        pin = P.get_bool(msg, "pin")
        if not conn.fds:
            raise BadRequest("put without a memfd: send the payload fd with SCM_RIGHTS")
        fd = conn.fds.pop(0)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise BadRequest("the put descriptor is not a regular file (send a memfd)")
            try:
                fcntl.fcntl(fd, fcntl.F_GET_SEALS)  # only shmem files (memfd) answer this
            except OSError:
                raise BadRequest("the put descriptor is not a memfd") from None
            if st.st_size < payload_len:
                raise BadRequest(f"memfd holds {st.st_size} bytes, put says {payload_len}")
            if not self.arena_intact():
                self._stop = True
                raise ArenaCorruptError("the arena file was truncated; the supervisor restarts")

            def fill(view: memoryview) -> None:
                done = 0
                while done < len(view):
                    try:
                        n = os.preadv(fd, [view[done:]], done)
                    except OSError as e:  # e.g. a write-only descriptor of a memfd
                        raise BadRequest(f"cannot read the put descriptor: {e.strerror}; "
                                         "send a readable memfd") from None
                    if n <= 0:
                        raise BadRequest("memfd shrank while being read")
                    done += n

            e = self.store.put(root, tokens, fingerprint, payload_len, checksum, fill, pin=pin)
        finally:
            os.close(fd)
        self._wake(self.claims.indexed(e.digests))
        return {"gen": e.gen, "key": e.key, "n_tokens": e.n_tokens}, None

    def _op_pin(self, conn: Conn, msg: dict[str, Any], pinned: bool = True) -> tuple[dict, None]:
        assert self.store is not None
        key = P.get_digest(msg, "key")
        entries = self.store.by_key(key)
        for e in entries:
            self.store.set_pinned(e, pinned)
        return {"count": len(entries)}, None

    def _op_unpin(self, conn: Conn, msg: dict[str, Any]) -> tuple[dict, None]:
        return self._op_pin(conn, msg, pinned=False)

    def _op_stats(self, conn: Conn, msg: dict[str, Any]) -> tuple[dict, None]:
        return self.stats(), None

    def _op_ls(self, conn: Conn, msg: dict[str, Any]) -> tuple[dict, None]:
        assert self.store is not None
        limit = P.get_int(msg, "limit", 1, 100_000, required=False, default=1000)
        now_mono, now = time.monotonic(), time.time()
        rows = []
        for e in sorted(self.store.live_entries(), key=lambda e: -e.last_used)[:limit]:
            rows.append({"key": e.key.hex(), "root": e.root.hex(), "tokens": e.n_tokens,
                         "bytes": e.payload_len, "extent": e.extent, "pinned": e.pinned,
                         "hits": e.hits, "leases": e.leases, "created": e.created,
                         "last_used": now - (now_mono - e.last_used)})
        return {"entries": rows, "total": len(self.store.live_entries())}, None

    def _op_clear(self, conn: Conn, msg: dict[str, Any]) -> tuple[dict, None]:
        assert self.store is not None
        removed = self.store.clear()
        log.info("cleared %d entries at the request of pid %d", removed, conn.pid)
        return {"removed": removed}, None

    def _op_report(self, conn: Conn, msg: dict[str, Any]) -> tuple[dict, None]:
        assert self.store is not None
        add_reported(self.reported, P.get_counters(msg))
        return {}, None

    def _op_worker_exit(self, conn: Conn, msg: dict[str, Any]) -> tuple[dict, None]:
        pid = P.get_int(msg, "pid", 1, 1 << 31)
        released = 0
        for other in [c for c in self.conns.values() if c.pid == pid and c is not conn]:
            assert self.store is not None
            released += self.store.release_owner(other.id)
            self._close(other, "worker exited (reported)")
        return {"released": released}, None

    def _op_claim(self, conn: Conn, msg: dict[str, Any]) -> tuple[dict | None, None]:
        digests = P.get_digests(msg, "digests")
        wait = P.get_float(msg, "wait", 0.0, 600.0)
        rid = msg.get("id", 0)
        status, _ = self.claims.claim(conn.id, rid, digests, time.monotonic(), wait)
        if status == GO:
            return {"status": GO}, None
        return None, None

    def _op_unclaim(self, conn: Conn, msg: dict[str, Any]) -> tuple[dict, None]:
        digests = P.get_digests(msg, "digests")
        self._wake(self.claims.unclaim(conn.id, digests))
        return {}, None

    def _wake(self, woken: list) -> None:
        for waiter, status in woken:
            conn = self.conns.get(waiter.owner)
            if conn is not None and not conn.closing:
                self._queue(conn, P.encode({"ok": True, "id": waiter.rid, "status": status}),
                            None)
                self._flush(conn)

    _HANDLERS = {
        "claim": _op_claim, "unclaim": _op_unclaim, "suspect": _op_suspect,
        "owners": _op_owners,
        "attach": _op_attach, "ping": _op_ping, "acquire": _op_acquire,
        "release": _op_release, "put": _op_put, "pin": _op_pin, "unpin": _op_unpin,
        "stats": _op_stats, "ls": _op_ls, "clear": _op_clear, "report": _op_report,
        "worker_exit": _op_worker_exit,
    }

    # ------------------------------------------------------------------- stats
    def stats(self) -> dict[str, Any]:
        assert self.store is not None
        store, g = self.store, self.store.geometry
        live = store.live_entries()
        gauges = ArenaGauges(
            entries=len(live), pinned=sum(1 for e in live if e.pinned),
            bytes_used=store.bytes_used(), bytes_capacity=g.data_size,
            bytes_free_largest=store.alloc.largest(), free_extents=len(store.alloc.extents()),
            index_used=len(store.owners), index_capacity=store.index_capacity,
            chunk_tokens=g.chunk_tokens, leases_active=store.leases.active(),
            workers_attached=sum(1 for c in self.conns.values() if c.attached),
            connections=len(self.conns))
        return SupervisorStats(
            name=self.s.name, pid=os.getpid(), version=__version__, arena=str(self.path),
            socket=str(self.socket_path), uptime=round(time.time() - self.started, 3),
            gauges=gauges, counters=store.counters, reported=self.reported).to_dict()

    # ----------------------------------------------------------------- cleanup
    def cleanup(self, remove: bool = True) -> None:
        for conn in list(self.conns.values()):
            self._close(conn, "supervisor stopping")
        if self.listener is not None:
            try:
                self.sel.unregister(self.listener)
            except (KeyError, ValueError):
                pass
            self.listener.close()
            self.listener = None
            if remove:
                self.socket_path.unlink(missing_ok=True)
        if self.mm is not None:
            try:
                if not self._lost and self.store is not None:  # truncated: would SIGBUS
                    A.ArenaWriter(self.mm, self.store.geometry).set_state(A.STATE_CLOSED)
            except (ValueError, TypeError):
                pass
            self.store = None
            try:
                self.mm.close()
            except BufferError:
                pass
            self.mm = None
            if remove:
                self.path.unlink(missing_ok=True)
        if self.view is not None:
            self.view.close()
            self.view = None
        if self.ro_fd >= 0:
            os.close(self.ro_fd)
            self.ro_fd = -1
        if self._wake_r >= 0:
            signal.set_wakeup_fd(self._old_wakeup if self._old_wakeup is not None else -1)
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_r = self._wake_w = -1
        if self.lock_fd >= 0:
            if remove:
                self.lock_path.unlink(missing_ok=True)
            os.close(self.lock_fd)
            self.lock_fd = -1
