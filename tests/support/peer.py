"""A raw connection to the supervisor: protocol frames written and read by hand."""

from __future__ import annotations

import array
import os
import socket
import struct
from typing import Any

import msgpack
import numpy as np
import xxhash

from shmkv.core import arena as A
from shmkv.core import protocol as P


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
            view = A.ArenaView(fds[0], populate=False)
        finally:
            for fd in fds:
                os.close(fd)
        self.geometry = view.geometry
        view.close()
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
