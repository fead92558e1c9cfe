"""The arena file's life in the supervisor: name lock, leftovers, creation, removal.

Runs in the supervisor only. Start-up order: take the name's lock file (flock,
released by the kernel if we die, so a killed supervisor's name is simply
taken over), remove the arena and temporary files a killed predecessor left,
check the arena's space, allocate it (``--reserve true``: all of it, so that a full
tmpfs fails here; ``--reserve false``, the default: only the header and index, and ``pages.py``
allocates each record's pages before it is written, so that a full tmpfs costs a rejected
put, never a SIGBUS), write the header, publish the file by rename,
and open the read-only descriptor every worker is handed. The bytes
are written through :class:`~shmkv.core.arena.ArenaWriter`. An arena a stopped or
killed predecessor left is adopted instead (``adopt.py``) unless ``--fresh``.

/dev/shm is shared with every user: no name there is followed if it is a
symbolic link (``O_NOFOLLOW``, ``O_EXCL``), and a lock or arena file that is not
a regular file of ours stops the start with :class:`UnsafePathError`. The
arena file is writable by our uid only (0600, or 0640 with ``--group``):
workers get a read-only descriptor over the socket and need no permission on
the file; the lock file is always 0600, so that nobody else can hold it.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import logging
import mmap
import os
import pwd
import re
import stat
import time
from pathlib import Path

from shmkv.core.arena import STATE_CLOSED, ArenaWriter, Geometry
from shmkv.core.config import Settings, format_size
from shmkv.core.errors import (
    ArenaExistsError,
    ConfigError,
    ShmSpaceError,
    UnsafePathError,
    setup_error,
)

log = logging.getLogger(__name__)


def arena_path(settings: Settings) -> Path:
    """Where the arena of ``settings.name`` lives: ``--dir``/shmkv-NAME."""
    return Path(settings.dir) / f"shmkv-{settings.name}"


def check_ours(path: Path, st: os.stat_result, what: str) -> None:
    """UnsafePathError unless ``st`` (an lstat or fstat of ``path``) is a plain file of ours.

    A symbolic link would make us write where its owner chose; another user's file
    may be a trap, and is theirs to remove; a second hard link would make us write
    to whatever file shares the inode.
    """
    euid = os.geteuid()
    if stat.S_ISLNK(st.st_mode):
        problem = "a symbolic link"
    elif not stat.S_ISREG(st.st_mode):
        problem = "not a regular file"
    elif st.st_uid != euid:
        try:
            who = f"uid {st.st_uid} ({pwd.getpwuid(st.st_uid).pw_name})"
        except KeyError:
            who = f"uid {st.st_uid}"
        problem = f"owned by {who}, not by us (uid {euid})"
    elif st.st_nlink != 1:
        problem = f"a file with {st.st_nlink} hard links"
    else:
        return
    raise UnsafePathError(
        f"{what} {path} is {problem}: it was not made by a shmkv supervisor of this user, "
        f"and shmkv will not use it. Remove it (`sudo rm {path}`), or pick another "
        f"--name/SHMKV_NAME or --dir/SHMKV_DIR"
    )


def _same_file(path: Path, fd: int) -> bool:
    """Whether ``path`` (not followed) still names the file open as ``fd``."""
    try:
        a, b = os.lstat(path), os.fstat(fd)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _unlink_if(path: Path, fd: int) -> None:
    """Unlink ``path`` if it still names our file ``fd``; log, never raise."""
    try:
        if _same_file(path, fd):
            path.unlink()
    except OSError as e:
        log.warning("could not remove %s: %s", path, e)


def map_arena(fd: int, size: int, reserve: bool, data_offset: int) -> mmap.mmap:
    """The supervisor's writable mapping of the arena, its pages mapped at once: all of
    them with ``reserve``, else the header and index only (faulting in the data region's
    holes would allocate them: see ``pages.py``)."""
    flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if reserve else 0)
    mm = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    if not reserve:
        prefault(mm, data_offset)
    return mm


def prefault(mm: mmap.mmap, end: int) -> None:
    """Fault in the pages of [0, end) of ``mm`` (allocated ones: the header and index)."""
    for off in range(0, end, mmap.PAGESIZE):
        mm[off]


class ArenaFile:
    """The lock file, the arena file with its writable mapping, and the read-only fd."""

    def __init__(self, settings: Settings, gid: int | None) -> None:
        self.settings = settings
        self.path = arena_path(settings)
        self.lock_path = self.path.with_name(self.path.name + ".lock")
        self.gid = gid
        #: never writable by the group: readers get a read-only descriptor over the socket
        self.file_mode = 0o640 if gid is not None else 0o600
        self.lock_fd = -1
        #: the descriptor handed to every worker: it cannot be mapped writable
        self.ro_fd = -1
        #: our writable descriptor: pages are allocated and punched through it (``pages.py``)
        self.rw_fd = -1
        self.mm: mmap.mmap | None = None
        self.geometry: Geometry | None = None
        #: the file was truncated under the mapping: never write to it again
        self.lost = False

    # ------------------------------------------------------------------ set-up
    def lock(self) -> None:
        """Take the name's lock; ArenaExistsError if a live supervisor holds it."""
        try:
            self._take_lock()
        except OSError as e:
            raise setup_error(e, self.lock_path, "--dir") from None

    def _open_lock(self) -> int:
        """Create the lock file, or open an existing one if it is a plain file of ours."""
        flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW
        while True:
            try:
                return os.open(self.lock_path, flags | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                pass
            try:  # the lstat first: never open another user's FIFO or device
                check_ours(self.lock_path, os.lstat(self.lock_path), "lock file")
                fd = os.open(self.lock_path, flags)
            except FileNotFoundError:
                continue  # removed meanwhile: create it
            try:
                st = os.fstat(fd)
                check_ours(self.lock_path, st, "lock file")
                if stat.S_IMODE(st.st_mode) != 0o600:  # (older versions shared it with --group)
                    os.fchmod(fd, 0o600)
            except BaseException:
                os.close(fd)
                raise
            return fd

    def _take_lock(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = self._open_lock()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                try:
                    other = os.read(fd, 32).decode(errors="replace").strip() or "?"
                finally:
                    os.close(fd)
                raise ArenaExistsError(
                    f"a supervisor (pid {other}) already owns arena {self.settings.name!r}: "
                    f"stop it, or pick another --name/SHMKV_NAME"
                ) from None
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

    def remove_leftovers(self, arena: bool = True) -> None:
        """Remove the half-made arena files of a killed predecessor, and (``arena``) the
        arena it left (not when ``adopt.py`` adopts it).

        We hold the name's lock, so no live supervisor owns them. Unlinking the stale
        arena before the space check means a restart needs room for one arena, not two
        (workers still mapping it keep its pages only until they reattach).
        """
        tmp = re.compile(rf"{re.escape(self.path.name)}\.\d+\.tmp")
        for p in self.path.parent.iterdir():
            if (arena and p == self.path) or tmp.fullmatch(p.name):
                try:
                    check_ours(p, os.lstat(p), "arena file")
                except FileNotFoundError:
                    continue
                p.unlink(missing_ok=True)
                log.info("removed %s, left by a supervisor that did not stop cleanly", p)

    def create(self) -> Geometry:
        """Create, reserve, format and publish the arena (we hold the lock)."""
        try:
            return self._create()
        except OSError as e:
            raise setup_error(e, self.path, "--dir") from None

    def _create(self) -> Geometry:
        self.remove_leftovers()
        size = self.settings.size
        reserve = self.settings.reserve
        st = os.statvfs(self.path.parent)
        free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
        if size > free:
            fix = (
                "Lower --size, free space there, or enlarge the tmpfs (Docker: --shm-size)"
                if reserve
                else "Once it is full, puts are rejected (workers miss); lower --size, or "
                "free or enlarge it (Docker: --shm-size), or use --reserve true (the "
                "default) to claim all of --size at start"
            )
            msg = (
                f"--size {format_size(size)} does not fit in {self.path.parent}: only "
                f"{format_size(free)} free of {format_size(total)}. {fix}"
            )
            if reserve:
                raise ShmSpaceError(msg)
            log.warning("%s", msg)
        try:
            geom = Geometry.plan(size, self.settings.chunk_tokens, self.settings.index_slots)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        geom = dataclasses.replace(geom, created=time.time())
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        fd = os.open(
            tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, self.file_mode
        )
        ro = -1
        try:
            if self.gid is not None:
                if os.fstat(fd).st_gid != self.gid:  # (no chown for our own group)
                    os.fchown(fd, -1, self.gid)
                os.fchmod(fd, self.file_mode)  # our umask may have masked the group's read
            allocated = size if reserve else geom.data_offset
            try:
                if not reserve:
                    os.ftruncate(fd, size)  # sparse: pages.py allocates the data region
                os.posix_fallocate(fd, 0, allocated)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
                    st = os.statvfs(self.path.parent)
                    raise ShmSpaceError(
                        f"cannot reserve --size {format_size(size)} in {self.path.parent} "
                        f"({format_size(st.f_bavail * st.f_frsize)} free): lower --size or "
                        f"enlarge the tmpfs (Docker: --shm-size)"
                    ) from None
                raise
            self.mm = map_arena(fd, size, reserve, geom.data_offset)
            ArenaWriter(self.mm, geom).format()
            self.geometry = geom
            # the workers' read-only descriptor, opened before the name is published
            ro = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            if not _same_file(tmp, fd) or not _same_file(tmp, ro):
                raise UnsafePathError(f"{tmp} was replaced while being created: check --dir")
            os.rename(tmp, self.path)
        except BaseException:
            if ro >= 0:
                os.close(ro)
            _unlink_if(tmp, fd)
            os.close(fd)
            raise
        self.rw_fd, self.ro_fd = fd, ro
        log.info(
            "arena %s: %s (%s), %d index slots, data %s, chunk %d tokens",
            self.path,
            format_size(size),
            "reserved" if reserve else "allocated as records are stored",
            geom.index_slots,
            format_size(geom.data_size),
            geom.chunk_tokens,
        )
        return geom

    # ------------------------------------------------------------------- watch
    def intact(self) -> bool:
        """False (and a log line) if the arena file shrank: writing to it would SIGBUS.

        The supervisor then exits with EXIT_ARENA_LOST; systemd or `shmkv serve`
        restarts it with a fresh arena and workers reattach (cold meanwhile).
        """
        try:
            size = os.fstat(self.ro_fd).st_size
        except OSError:
            size = -1
        if self.geometry is not None and size < self.geometry.arena_size:
            self.lost = True
            log.critical(
                "arena %s was truncated to %d bytes behind our back: exiting so that "
                "a fresh arena replaces it",
                self.path,
                size,
            )
            return False
        return True

    # ----------------------------------------------------------------- cleanup
    def close(self, remove: bool = True) -> None:
        """Mark the arena closed for its readers, unmap it, release the name; never raises.

        ``remove``: also unlink the arena and lock files (not with ``--keep``), each
        only if its name still holds our file.
        """
        if self.mm is not None:
            try:
                if not self.lost and self.geometry is not None:  # truncated: would SIGBUS
                    ArenaWriter(self.mm, self.geometry).set_state(STATE_CLOSED)
            except (ValueError, TypeError):
                pass
            try:
                self.mm.close()
            except BufferError:
                pass
            self.mm = None
        if self.rw_fd >= 0:
            os.close(self.rw_fd)
            self.rw_fd = -1
        if self.ro_fd >= 0:
            if remove:
                _unlink_if(self.path, self.ro_fd)
            os.close(self.ro_fd)
            self.ro_fd = -1
        if self.lock_fd >= 0:
            if remove:
                _unlink_if(self.lock_path, self.lock_fd)
            os.close(self.lock_fd)
            self.lock_fd = -1
