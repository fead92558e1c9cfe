"""What runs inside a worker: the connection to the supervisor and the read-only arena view.

A :class:`Client` is thread-safe (one lock around each request) and fork-safe
(it notices a changed ``os.getpid()`` and reconnects in the child, never
touching the parent's socket). When the supervisor is unreachable it raises
:class:`SupervisorUnavailable` at once and waits a short, growing back-off
before trying again, so a dead supervisor costs a worker a cache miss, not a
hang. Before it sends anything, it checks who listens on the socket
(SO_PEERCRED): a process of another uid than ours, root's or
``--supervisor-uid`` is not trusted (:class:`UntrustedSupervisor`).

Reading a blob (see ``store.py`` for why it is safe)::

    hit = client.lookup(digests)            # lock-free, in the mapping
    with client.acquire(hit) as lease:      # one round trip: a lease
        rec = lease.record                  # validated header
        ... use lease.address / lease.payload ...
        ok = lease.finish(tokens_restored)  # False: revoked mid-read, discard
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import select
import socket
import struct
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Self

import numpy as np
import xxhash

from shmkv.core.arena import ArenaView, Hit, Record
from shmkv.core.config import Settings, resolve
from shmkv.core.errors import (
    ArenaCorruptError,
    BadRequest,
    ClosedError,
    PermissionDenied,
    ProtocolError,
    ShmkvError,
    SupervisorUnavailable,
    UntrustedSupervisor,
    from_wire,
)
from shmkv.core.protocol import MAX_PUBLISHERS, peer_credentials, recv_msg, send_msg

log = logging.getLogger(__name__)

_BACKOFF_MIN, _BACKOFF_MAX = 0.5, 5.0


class _Memfd:
    """A memfd and a writable mapping of it, reused across puts (no memfd_create, ftruncate
    or mmap once made); its pages are given back between puts (:meth:`release_pages`)."""

    def __init__(self, capacity: int) -> None:
        self.fd = os.memfd_create("shmkv-put", os.MFD_CLOEXEC)
        # closed by close(), or when the memfd is collected (a Client never closed)
        self._close_fd = weakref.finalize(self, os.close, self.fd)
        self.capacity = 0
        self.mm: mmap.mmap | None = None
        self.grow(capacity)

    def grow(self, capacity: int) -> None:
        if capacity <= self.capacity:
            return
        if self.mm is not None:
            self.mm.close()
        os.ftruncate(self.fd, capacity)
        self.mm = mmap.mmap(
            self.fd,
            capacity,
            flags=mmap.MAP_SHARED | mmap.MAP_POPULATE,
            prot=mmap.PROT_READ | mmap.PROT_WRITE,
        )
        self.capacity = capacity

    def release_pages(self) -> None:
        """Give the memfd's pages back to the kernel (a hole punched in all of it): an idle
        worker holds no copy of the last state it published, which on a large model is
        hundreds of MiB. The next fill faults them in again (about 0.25 ms per MiB)."""
        if self.mm is not None:
            self.mm.madvise(mmap.MADV_REMOVE)

    def address(self) -> int:
        assert self.mm is not None
        buf = np.frombuffer(self.mm, dtype=np.uint8)
        addr = buf.ctypes.data
        del buf
        return addr

    def close(self) -> None:
        if self.mm is not None:
            try:
                self.mm.close()
            except BufferError:
                pass
            self.mm = None
        self._close_fd()  # once only: a later collection closes nothing
        self.fd = -1


def _peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket (SO_PEERCRED)."""
    _pid, uid, _gid = struct.unpack(
        "iII", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    )
    return int(uid)


def _fresh(err: ShmkvError) -> ShmkvError:
    """A copy of ``err`` without a traceback, to keep or re-raise.

    A raised exception's traceback holds the frames it passed through, and their locals:
    kept in ``last_error`` it would keep a replaced arena's ArenaView (and its mapping of
    an unlinked /dev/shm file) alive, and re-raising the same object grows it every time.
    """
    return type(err)(*err.args)


class Blob:
    """A payload written into a memfd, ready to be handed over by :meth:`Client.put_blob`."""

    def __init__(self, memfd: _Memfd, size: int, pool: _MemfdPool) -> None:
        self.memfd: _Memfd | None = memfd  # None once given back
        self.size, self._pool = size, pool

    @property
    def fd(self) -> int:
        return self.memfd.fd if self.memfd is not None else -1

    def checksum(self) -> int:
        assert self.memfd is not None and self.memfd.mm is not None
        return xxhash.xxh3_64_intdigest(memoryview(self.memfd.mm)[: self.size])

    def view(self) -> memoryview:
        """The payload's bytes, read in place (release the view before :meth:`close`)."""
        assert self.memfd is not None and self.memfd.mm is not None
        return memoryview(self.memfd.mm)[: self.size]

    def close(self) -> None:
        """Give the memfd back to its pool (or close it)."""
        if self.memfd is not None:
            self._pool.give_back(self.memfd)
            self.memfd = None

    def __del__(self) -> None:
        self.close()


class _MemfdPool:
    """A few memfds per process, made once and reused: a put makes no memfd, mapping or
    file size of its own. The pages of one given back are released at once (the pool
    keeps descriptors and mappings, not states)."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._free: list[_Memfd] = []
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def take(self, size: int) -> _Memfd:
        with self._lock:
            if os.getpid() != self._pid:  # forked: these belong to the parent
                self._free, self._pid = [], os.getpid()
            fits = [m for m in self._free if m.capacity >= size]
            m = (
                min(fits, key=lambda m: m.capacity)
                if fits
                else (self._free[-1] if self._free else None)
            )
            if m is not None:
                self._free.remove(m)
        if m is None:
            return _Memfd(size)
        try:
            m.grow(size)
        except BaseException:
            m.close()
            raise
        return m

    def give_back(self, m: _Memfd) -> None:
        try:
            m.release_pages()  # (outside the lock: a hole punched in MiBs of pages)
        except OSError:  # (a kernel without MADV_REMOVE on shmem: not kept, then)
            m.close()
            return
        with self._lock:
            if os.getpid() == self._pid and len(self._free) < self.keep:
                self._free.append(m)
                return
        m.close()

    def close(self) -> None:
        with self._lock:
            free, self._free = self._free, []
        for m in free:
            m.close()


class Lease:
    """A granted read lease on one record; use as a context manager.

    Whether the bytes read under it were safe is known per lease, at its release: the
    supervisor answers ``valid: False`` for a lease it revoked. A lease of a connection
    that is gone (dropped after a timeout, closed by the supervisor, a supervisor that
    died, a fork) is void without asking: the supervisor released it when the connection
    closed and may have reused its space, and a release sent on a later connection could
    only end some other lease of the same id.
    """

    def __init__(
        self, client: Client, view: ArenaView, lease_id: int, connection: int, record: Record
    ) -> None:
        self.client, self.view, self.id, self.record = client, view, lease_id, record
        #: which of the client's connections holds it (``Connection.generation``)
        self.connection = connection
        self._done = False
        self.valid: bool | None = None
        #: the lease ended with its connection (not revoked by the supervisor)
        self.lost = False

    @property
    def address(self) -> int:
        return self.view.payload_address(self.record)

    @property
    def payload(self) -> memoryview:
        """The record's payload: a whole record's bytes in the mapping, a chunked one's
        assembled into a new buffer (``ArenaView.blob``); check it against its XXH3."""
        return self.view.blob(self.record)

    def tokens(self) -> np.ndarray:
        return self.view.tokens(self.record)

    def fingerprint(self) -> bytes:
        return bytes(self.view.fingerprint(self.record))

    def finish(self, tokens_restored: int = 0) -> bool:
        """Release the lease; True only if the bytes read under it were intact.

        Call it after the last read: the supervisor's answer covers everything read
        between the grant and now.
        """
        if self._done:
            return bool(self.valid)
        self._done = True
        verdict = self.client.release(self.id, self.connection, tokens_restored)
        self.lost = verdict is None
        self.valid = verdict is True
        return self.valid

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.finish()


class Connection:
    """One fork-safe, thread-safe connection to a supervisor, and the arena view it attached.

    Requests run one at a time under a lock. After a fork the child drops its copy of
    the socket (never shutting down the parent's) and connects anew. A supervisor
    that cannot be reached costs :class:`SupervisorUnavailable` at once, then a
    growing back-off before the next try.
    """

    def __init__(
        self,
        name: str | None = None,
        socket_path: str | None = None,
        timeout: float | None = None,
        settings: Settings | None = None,
        populate: bool = True,
        attach: bool = True,
        backoff: bool = True,
    ) -> None:
        if settings is None:
            settings = resolve("client", {"name": name, "socket": socket_path, "timeout": timeout})
        self.settings = settings
        self.name: str = settings.name
        self.socket_path = settings.socket_path
        self.timeout: float = settings.timeout
        self.populate = populate
        #: False for admin tools (stats, ls, clear): no arena mapping, not counted as a worker
        self.attach = attach
        #: False for admin tools and scrapes: every call tries to connect again, with no
        #: back-off after a supervisor that could not be reached
        self._backoff_min = _BACKOFF_MIN if backoff else 0.0
        self._lock = threading.RLock()
        self._sock: socket.socket | None = None
        self._view: ArenaView | None = None
        self._pid = os.getpid()
        self._next_id = 1
        self._retry_at = 0.0
        self._backoff = self._backoff_min
        self._closed = False
        #: bumped whenever the connection is dropped: a lease belongs to one generation
        self.generation = 0
        #: the supervisor's uid (SO_PEERCRED of the connection), once connected
        self.supervisor_uid: int | None = None
        self.attach_info: dict[str, Any] = {}
        self.last_error: ShmkvError | None = None

    # ------------------------------------------------------------- connection
    def _check_fork(self) -> None:
        if os.getpid() != self._pid:  # we are a forked child: the socket is the parent's
            self._pid = os.getpid()
            # closing our copies (no shutdown()) leaves the parent's connection intact
            self._drop()

    def _connect(self) -> None:
        now = time.monotonic()
        if now < self._retry_at:
            raise (
                _fresh(self.last_error)
                if self.last_error
                else SupervisorUnavailable("supervisor unavailable")
            )
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.settimeout(self.timeout)
        try:
            try:
                sock.connect(self.socket_path)
            except FileNotFoundError:
                raise SupervisorUnavailable(
                    f"no shmkv supervisor at {self.socket_path}: start `shmkv supervise "
                    f"--name {self.name}`, or set SHMKV_SOCKET/SHMKV_NAME to the running one"
                ) from None
            except PermissionError:
                raise PermissionDenied(
                    f"no permission to connect to {self.socket_path}: run as the supervisor's "
                    f"user or a member of its --group"
                ) from None
            except OSError as e:
                raise SupervisorUnavailable(
                    f"cannot connect to the shmkv supervisor at {self.socket_path}: "
                    f"{e.strerror or e}; is `shmkv supervise --name {self.name}` running?"
                ) from None
            self._check_supervisor(sock)
            self._sock = sock
            self.supervisor_uid = _peer_uid(sock)
            if not self.attach:
                return
            reply, fds = self._roundtrip({"op": "attach", "pid": os.getpid()})
            if not fds:
                raise ProtocolError("attach reply carried no arena descriptor")
            try:
                view = ArenaView(fds[0], populate=self.populate)
            finally:
                for fd in fds:
                    os.close(fd)
            if view.geometry.arena_id != reply.get("arena_id"):
                view.close()
                raise ArenaCorruptError("arena id does not match the supervisor's")
            self._view = view
            self.attach_info = reply
            self._backoff = self._backoff_min
            log.info(
                "attached to shmkv arena %r (supervisor pid %s)",
                self.name,
                reply.get("supervisor_pid"),
            )
        except ShmkvError as e:
            self._drop()
            sock.close()
            self._retry_at = time.monotonic() + self._backoff
            self._backoff = min(self._backoff * 2, _BACKOFF_MAX)
            if type(e) is not type(self.last_error):
                log.warning("shmkv cache unavailable, running without it: %s", e)
            self.last_error = _fresh(e)
            raise

    def _check_supervisor(self, sock: socket.socket) -> None:
        """Trust the socket's listener only if it runs as our uid, root or --supervisor-uid.

        Anyone who can write to the socket's directory could have put their own socket
        there, to read our puts and hand us state of their choosing.
        """
        pid, uid, _ = peer_credentials(sock)
        mine, extra = os.geteuid(), self.settings.values.get("supervisor_uid")
        if uid in (mine, 0, extra):
            return
        raise UntrustedSupervisor(
            f"the process listening on {self.socket_path} (pid {pid}) runs as uid {uid}, "
            f"not as us (uid {mine}), root or SHMKV_SUPERVISOR_UID "
            f"({'unset' if extra is None else extra}): not trusted, running without the "
            f"cache. If uid {uid} runs your supervisor, set SHMKV_SUPERVISOR_UID={uid} "
            f"(--supervisor-uid); if not, another user took the socket's place: check "
            f"`ls -ld {os.path.dirname(self.socket_path) or '.'}`"
        )

    def _drop(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
        self._sock = None
        self.generation += 1  # the leases of this connection are void
        # Drop our reference only, never unmap here: a Lease still in use (maybe by
        # another thread copying from lease.address) keeps the view alive, and the
        # mapping goes away with the last reference to it.
        self._view = None

    def _roundtrip(
        self, msg: dict[str, Any], fds: list[int] | None = None
    ) -> tuple[dict[str, Any], list[int]]:
        assert self._sock is not None
        rid = self._next_id
        self._next_id += 1
        msg["id"] = rid
        try:
            try:
                send_msg(self._sock, msg, fds)
            except (BrokenPipeError, ConnectionResetError):
                # refused at accept (permission, connection limit): the reason is
                # already waiting in our receive buffer; read it rather than lose it
                self._sock.settimeout(min(self.timeout, 1.0))
            while True:
                reply, rfds = recv_msg(self._sock)
                if reply.get("id") in (rid, 0):
                    break
                for fd in rfds:
                    os.close(fd)
        except (OSError, ProtocolError) as e:
            self._drop()
            self._retry_at = time.monotonic() + _BACKOFF_MIN
            self.last_error = SupervisorUnavailable(
                f"lost the shmkv supervisor at {self.socket_path}: {e}; workers run "
                f"without the cache until it is back"
            )
            raise _fresh(self.last_error) from None
        if not reply.get("ok"):
            for fd in rfds:
                os.close(fd)
            err = from_wire(reply.get("error"))
            if reply.get("id") == 0 and not isinstance(err, BadRequest):
                self._drop()  # refused at accept (permission, connection limit)
            try:
                raise err
            finally:  # a local bound to the raised error is a cycle through its traceback
                del err
        return reply, rfds

    def ensure(self) -> ArenaView:
        """Connect and attach if needed; returns the arena view."""
        with self._lock:
            if self._closed:
                raise ClosedError("shmkv Client used after close()")
            self._check_fork()
            if self._sock is not None and self._peer_closed():
                self._drop()  # the supervisor died: its arena is frozen, attach to the next one
            if self._sock is None or (self.attach and self._view is None):
                self._connect()
            if self._view is None:
                raise ClosedError("this Client was made with attach=False: it has no arena view")
            return self._view

    def _peer_closed(self) -> bool:
        """True if the supervisor closed our connection; never blocks.

        A worker whose lookups all miss sends no request, so without this it would keep
        reading a dead supervisor's frozen arena and never see the new one.
        """
        assert self._sock is not None
        poller = select.poll()
        poller.register(self._sock, select.POLLIN)
        if not poller.poll(0):
            return False
        try:  # readable: EOF, or a late reply (to a claim we stopped waiting for)
            return self._sock.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _ensure_connected(self) -> None:
        try:
            self.ensure()
        except ClosedError:
            if self._closed or self._sock is None:
                raise

    def request(
        self, msg: dict[str, Any], fds: list[int] | None = None, timeout: float | None = None
    ) -> dict[str, Any]:
        """Send one request and return its reply; raises the supervisor's error.

        ``timeout`` replaces the client's timeout for this request only (for a claim
        that may wait on another worker's prefill).
        """
        with self._lock:
            self._ensure_connected()
            if timeout is not None and self._sock is not None:
                self._sock.settimeout(timeout)
            try:
                reply, rfds = self._roundtrip(msg, fds)
            finally:
                if timeout is not None and self._sock is not None:
                    self._sock.settimeout(self.timeout)
            for fd in rfds:
                os.close(fd)
            return reply

    def release(self, lease_id: int, connection: int, tokens_restored: int = 0) -> bool | None:
        """End lease ``lease_id`` of connection generation ``connection``: True if the
        supervisor says it was never revoked, False if it was, None if the connection is
        gone (the lease is void). Never raises, never reconnects."""
        with self._lock:
            if (
                self._sock is None
                or connection != self.generation
                or os.getpid() != self._pid
                or self._closed
            ):
                return None
            msg = {"op": "release", "lease": lease_id, "tokens_restored": tokens_restored}
            try:
                reply, rfds = self._roundtrip(msg)
            except ShmkvError:
                return None
            for fd in rfds:
                os.close(fd)
            return reply.get("valid") is True

    @property
    def connected(self) -> bool:
        return self._sock is not None and os.getpid() == self._pid

    @property
    def view(self) -> ArenaView:
        return self.ensure()

    def close(self) -> None:
        with self._lock:
            if os.getpid() == self._pid:
                self._drop()
            self._closed = True

    def __enter__(self) -> Self:
        self._ensure_connected()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Client(Connection):
    """A worker's handle on one supervisor and its arena: reads, writes and admin ops."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Takes :class:`Connection`'s arguments."""
        super().__init__(*args, **kwargs)
        self._pool = _MemfdPool()

    def close(self) -> None:
        with self._lock:
            super().close()
            self._pool.close()

    # ------------------------------------------------------------------ reads
    def lookup(self, digests: Sequence[bytes]) -> Hit | None:
        """Longest indexed chunk prefix among ``digests`` (lock-free, no round trip)."""
        view = self.ensure()
        found = view.find_longest(digests)
        return None if found is None else Hit(found[0], found[1])

    def acquire(self, hit: Hit) -> Lease:
        """Lease the record behind ``hit`` and validate its header and metadata."""
        with self._lock:
            self.ensure()
            reply = self.request(
                {"op": "acquire", "offset": hit.slot.rec_offset, "gen": hit.slot.rec_gen}
            )
            # (the request may have reconnected: the lease and view are the current ones)
            view, connection = self._view, self.generation
            lease_id = reply.get("lease")
            if not isinstance(lease_id, int) or view is None:
                raise ProtocolError("malformed acquire reply")
            try:
                rec = view.read_record(hit.slot.rec_offset, hit.slot.rec_gen)
                view.verify_meta(rec)
            except ArenaCorruptError:
                self.release(lease_id, connection)
                raise
            return Lease(self, view, lease_id, connection, rec)

    # ----------------------------------------------------------------- writes
    def prepare(self, size: int, fill: Callable[[int, int], None]) -> Blob:
        """Write a blob into a memfd: ``fill(address, size)`` writes it in place.

        This is the only part of a publish that must run where the data is (e.g. on
        the thread that owns a llama context); :meth:`put_blob` may run anywhere.
        The memfd comes from a small pool of mapped ones (their pages released between puts).
        """
        memfd = self._pool.take(size)
        try:
            fill(memfd.address(), size)
        except BaseException:
            self._pool.give_back(memfd)
            raise
        return Blob(memfd, size, self._pool)

    def put_blob(
        self,
        root: bytes,
        tokens: np.ndarray | Sequence[int],
        fingerprint: bytes,
        blob: Blob,
        pin: bool = False,
    ) -> dict[str, Any]:
        """Hand a prepared blob to the supervisor (its fd, not its bytes); closes the blob.

        The supervisor copies the bytes and checks them against the checksum before
        it replies, so the memfd can be reused as soon as the reply is here.
        """
        tok = np.ascontiguousarray(tokens, dtype="<i4")
        try:
            return self.request(
                {
                    "op": "put",
                    "root": root,
                    "tokens": tok.tobytes(),
                    "fingerprint": fingerprint,
                    "payload_len": blob.size,
                    "checksum": blob.checksum(),
                    "pin": pin,
                },
                [blob.fd],
            )
        finally:
            blob.close()

    def put(
        self,
        root: bytes,
        tokens: np.ndarray | Sequence[int],
        fingerprint: bytes,
        size: int,
        fill: Callable[[int, int], None],
        pin: bool = False,
    ) -> dict[str, Any]:
        """Publish a blob of ``size`` bytes that ``fill(address, size)`` writes in place.

        The bytes go into a memfd whose descriptor is passed to the supervisor; they
        never travel through the socket.
        """
        self.ensure()
        return self.put_blob(root, tokens, fingerprint, self.prepare(size, fill), pin=pin)

    def put_bytes(
        self,
        root: bytes,
        tokens: np.ndarray | Sequence[int],
        fingerprint: bytes,
        data: bytes | memoryview,
        pin: bool = False,
    ) -> dict[str, Any]:
        """Publish a blob held in Python memory (tests, tools)."""
        src = np.frombuffer(data, dtype=np.uint8)

        def fill(addr: int, size: int) -> None:
            np.copyto(np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(addr)), src)

        return self.put(root, tokens, fingerprint, len(src), fill, pin=pin)

    # ------------------------------------------------------------------ admin
    def stats(self) -> dict[str, Any]:
        return self.request({"op": "stats"})

    def ls(self, limit: int = 1000, key_prefix: bytes | None = None) -> dict[str, Any]:
        """Entries, most recently used first (only those whose key starts with
        ``key_prefix``, if given)."""
        msg: dict[str, Any] = {"op": "ls", "limit": limit}
        if key_prefix is not None:
            msg["key_prefix"] = key_prefix
        return self.request(msg)

    def clear(self) -> int:
        return int(self.request({"op": "clear"}).get("removed", 0))

    def pin(
        self,
        key: bytes,
        pinned: bool = True,
        ttl: float | None = None,
        n_tokens: int | None = None,
    ) -> int:
        """Pin (or unpin) the records of ``key`` (those of ``n_tokens`` tokens, if given);
        ``ttl``: the pin ends, and the records go, once they went unused this many
        seconds. Returns how many records."""
        msg: dict[str, Any] = {"op": "pin" if pinned else "unpin", "key": key}
        if ttl is not None:
            msg["ttl"] = float(ttl)
        if n_tokens is not None:
            msg["n_tokens"] = n_tokens
        return int(self.request(msg)["count"])

    def report(self, **counters: int) -> None:
        """Report running totals (reporter 0 of this connection; see
        ``supervisor/worker_counters.py``)."""
        counters = {k: v for k, v in counters.items() if v}
        if counters:
            self.request({"op": "report", "counters": counters})

    def send_report(self, fields: dict[str, Any]) -> None:
        """Send a ``report`` made by ``Ledger.report`` (reporter id, labels, totals)."""
        self.request({"op": "report", **fields})

    def claim(self, digests: Sequence[bytes], wait: float) -> str:
        """Claim the chunk digests this worker is about to prefill.

        Returns "go" (prefill; the claims end when a put indexes them), or, after
        waiting up to ``wait`` seconds for another worker that claimed ``digests[0]``
        first: "ready" (look up again), "retry" or "timeout".
        """
        reply = self.request(
            {"op": "claim", "digests": b"".join(digests[:4096]), "wait": float(wait)},
            timeout=wait + self.timeout,
        )
        status = reply.get("status")
        return status if isinstance(status, str) else "go"

    def fetch(
        self,
        root: bytes,
        tokens: np.ndarray,
        have: int,
        wait: float,
        prefill_tps: float,
        cut: bool = False,
    ) -> str:
        """Ask the supervisor to fetch a longer prefix of ``tokens`` than ``have`` from
        ``--remote``; waits at most ``wait`` seconds (plus the usual timeout if the
        supervisor is slow to answer). ``cut``: the caller can cut a state back, so a
        record that shares only part of ``tokens`` and goes on past it will do. Returns
        "fetched" (look up again), "none", "not_worth", "timeout", "down", "busy" or "off".
        """
        reply = self.request(
            {
                "op": "fetch",
                "root": root,
                "tokens": np.ascontiguousarray(tokens, dtype="<i4").tobytes(),
                "have": int(have),
                "wait": float(wait),
                "prefill_tps": float(min(max(prefill_tps, 0.0), 1e9)),
                "cut": bool(cut),
            },
            timeout=wait + self.timeout,
        )
        status = reply.get("status")
        return status if isinstance(status, str) else "none"

    def unclaim(self, digests: Sequence[bytes]) -> None:
        self.request({"op": "unclaim", "digests": b"".join(digests[:4096])})

    def owners(
        self, digest: bytes, tokens: np.ndarray, publishers: Sequence[int] | None = None
    ) -> list[tuple[int, int, int, int]]:
        """Records under chunk prefix ``digest``: (offset, gen, n_tokens, tokens matched);
        only those published by ``publishers`` (uids) if given."""
        msg: dict[str, Any] = {
            "op": "owners",
            "digest": digest,
            "tokens": np.ascontiguousarray(tokens, dtype="<i4").tobytes(),
        }
        if publishers is not None and len(publishers) <= MAX_PUBLISHERS:
            msg["publishers"] = np.asarray(publishers, dtype="<u4").tobytes()
        reply = self.request(msg)
        rows = reply.get("owners")
        if not isinstance(rows, list):
            raise ProtocolError("malformed owners reply")
        out = []
        for row in rows[:64]:
            if (
                not isinstance(row, list)
                or len(row) != 4
                or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in row)
            ):
                raise ProtocolError("malformed owners reply")
            off, gen, n, common = row
            out.append((off, gen, n, min(common, n, len(tokens))))
        return out

    def worker_exit(self, pid: int) -> int:
        return int(self.request({"op": "worker_exit", "pid": pid}).get("released", 0))
