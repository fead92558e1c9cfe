"""An arena file and a supervisor's Store over it, in the test's own process."""

from __future__ import annotations

import logging
import mmap
import os
import uuid

from shmkv.core import arena as A
from shmkv.supervisor.store import Store
from tests.support import SHM

log = logging.getLogger(__name__)

PAGE = A.PAGE


class ArenaFile:
    """A writable arena file in /dev/shm with a valid header, plus a read-only view of it."""

    def __init__(
        self,
        data_pages: int,
        chunk_tokens: int,
        index_slots: int,
        lease_timeout: float = 10.0,
        **store_kw,
    ) -> None:
        slots = 1 << (index_slots - 1).bit_length()
        index_bytes = A.align(slots * A.SLOT_SIZE, PAGE)
        size = A.HEADER_SIZE + index_bytes + data_pages * PAGE
        self.path = SHM / f"shmkv-teststore-{os.getpid()}-{uuid.uuid4().hex[:10]}"
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        self.ro_fd = -1
        self.view: A.ArenaView | None = None
        try:
            os.posix_fallocate(self.fd, 0, size)
            self.mm = mmap.mmap(
                self.fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE
            )
            self.geometry = A.Geometry.plan(size, chunk_tokens, index_slots)
            write_header(self.mm, self.geometry)
            self.now = 1000.0
            self.store = Store(
                self.mm,
                self.geometry,
                lease_timeout=lease_timeout,
                clock=lambda: self.now,
                **store_kw,
            )
            self.ro_fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            self.view = A.ArenaView(self.ro_fd, populate=False)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.view is not None:
            self.view.close()
            self.view = None
        if getattr(self, "mm", None) is not None:
            self.store = None  # type: ignore[assignment]
            try:
                self.mm.close()
            except BufferError:
                log.warning("arena mapping still exported; left to GC")
            self.mm = None
        for fd in (self.fd, self.ro_fd):
            if fd >= 0:
                os.close(fd)
        self.fd = self.ro_fd = -1
        self.path.unlink(missing_ok=True)


def write_header(mm: mmap.mmap, geometry: A.Geometry) -> None:
    """The header the supervisor writes (ArenaFile.create), checksum included."""
    A.ArenaWriter(mm, geometry).format()
