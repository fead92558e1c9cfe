"""Wire protocol between workers and the supervisor; imported on both sides.

Framing, on a SOCK_STREAM Unix socket::

    +----------------------+----------------------------------+
    | length: u32 big-end. | body: one msgpack map, `length`  |
    |  1 <= length <= 4 MiB| bytes                            |
    +----------------------+----------------------------------+

A request is ``{"op": str, "id": int, ...fields}``; the reply echoes ``id`` and
is ``{"ok": True, ...}`` or ``{"ok": False, "error": {"code", "message"}}``.
File descriptors travel as SCM_RIGHTS ancillary data on the first byte of a
frame: the arena's read-only fd on the ``attach`` reply, a sealed-size memfd
holding the payload on ``put``. Large blobs never travel as bytes.

Every field of every request is checked here (type, size, bounds) before the
supervisor acts on it; an unknown op, a missing field, a wrong type or an
out-of-range value is a :class:`BadRequest` reply, never a crash. Token ids
travel as raw little-endian int32 bytes.
"""

from __future__ import annotations

import array
import math
import re
import socket
import struct
from dataclasses import dataclass
from typing import Any

import msgpack

from shmkv.core.arena import DIGEST_SIZE, MAX_FINGERPRINT, MAX_TOKENS
from shmkv.core.errors import BadRequest, ProtocolError
from shmkv.core.stats import REPORTED, WorkerCounters

MAX_FRAME = 4 << 20
_LEN = struct.Struct(">I")
MAX_U64 = (1 << 64) - 1
MAX_COUNTER = 1 << 48
#: publisher uids an ``owners`` request may filter on (a client with more sends none)
MAX_PUBLISHERS = 1024

#: Counters a worker may report, added to the supervisor's stats (declared in ``stats.py``).
REPORTABLE = REPORTED
#: kinds one report may count failures under (``WorkerCounters.errors``)
MAX_KINDS = 32
#: a failure kind or a label value (model alias, tenant): short and printable, so that it
#: can be a Prometheus label value as it is
LABEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9 ._:@+-]{0,63}$")
_SHAPES = {k: type(getattr(WorkerCounters(), k)) for k in REPORTED}


def encode(msg: dict[str, Any]) -> bytes:
    body: bytes = msgpack.packb(msg, use_bin_type=True)
    if len(body) > MAX_FRAME:
        raise ProtocolError(f"message of {len(body)} bytes exceeds the {MAX_FRAME}-byte cap")
    return _LEN.pack(len(body)) + body


@dataclass(frozen=True)
class Limits:
    """What one decoded frame may hold, checked while msgpack decodes it.

    A frame of a few MiB of tiny containers (``{}`` is one byte) would otherwise
    decode into hundreds of MiB of Python objects before any field is looked at.
    """

    max_map_len: int
    max_array_len: int
    #: maps and arrays in the whole frame (None: no count)
    max_containers: int | None
    max_str_len: int = MAX_FRAME
    max_bin_len: int = MAX_FRAME


#: A request is one flat map of fields; only ``counters`` is a map inside it (holding one
#: histogram's array and one map of counts by kind), and no other field is an array (a few
#: small ones are decoded, so that a wrong type gets a BadRequest that names the field).
#: Strings and byte strings are one object each, bounded by the frame.
REQUEST = Limits(max_map_len=64, max_array_len=64, max_containers=16)
#: A reply (read by a client from its supervisor) may list up to ``ls``'s rows; the
#: ``stats`` reply is one flat map of every counter and gauge of ``stats.py`` (over 64).
REPLY = Limits(max_map_len=256, max_array_len=65536, max_containers=None)


def decode_body(body: bytes, limits: Limits = REQUEST) -> dict[str, Any]:
    """Decode one frame's msgpack map within ``limits``; ProtocolError otherwise."""
    hook = None
    if limits.max_containers is not None:
        left = limits.max_containers

        def hook(obj: Any) -> Any:
            nonlocal left
            left -= 1
            if left < 0:
                raise ValueError("too many maps and arrays")
            return obj

    try:
        msg = msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=True,
            max_bin_len=limits.max_bin_len,
            max_str_len=limits.max_str_len,
            max_array_len=limits.max_array_len,
            max_map_len=limits.max_map_len,
            max_ext_len=0,
            object_hook=hook,
            list_hook=hook,
        )
    except Exception as e:  # msgpack raises several unrelated types
        raise ProtocolError(f"undecodable frame: {type(e).__name__}") from None
    if not isinstance(msg, dict):
        raise ProtocolError("a frame must hold a msgpack map")
    return msg


class FrameBuffer:
    """Accumulates stream bytes and yields whole frame bodies."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> None:
        self._buf += data

    def frames(self) -> list[bytes]:
        out = []
        while len(self._buf) >= 4:
            (n,) = _LEN.unpack_from(self._buf)
            if n == 0 or n > MAX_FRAME:
                raise ProtocolError(f"frame length {n} outside 1..{MAX_FRAME}")
            if len(self._buf) < 4 + n:
                break
            out.append(bytes(self._buf[4 : 4 + n]))
            del self._buf[: 4 + n]
        return out

    def pending(self) -> int:
        return len(self._buf)


# --------------------------------------------------------------------- blocking I/O
def send_msg(sock: socket.socket, msg: dict[str, Any], fds: list[int] | None = None) -> None:
    data = encode(msg)
    if fds:
        sent = sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        data = data[sent:]
    if data:
        sock.sendall(data)


def _recv_exact(sock: socket.socket, n: int, fds: list[int]) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        data, anc, flags, _ = sock.recvmsg(n - len(buf), socket.CMSG_SPACE(4 * 4))
        for level, typ, cdata in anc:
            if level == socket.SOL_SOCKET and typ == socket.SCM_RIGHTS:
                a = array.array("i")
                a.frombytes(cdata[: len(cdata) - len(cdata) % 4])
                fds.extend(a)
        if not data:
            raise ConnectionResetError("supervisor closed the connection")
        buf += data
    return bytes(buf)


def recv_msg(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """Read one frame (blocking, honours the socket timeout); returns (message, fds)."""
    fds: list[int] = []
    (n,) = _LEN.unpack(_recv_exact(sock, 4, fds))
    if n == 0 or n > MAX_FRAME:
        raise ProtocolError(f"frame length {n} outside 1..{MAX_FRAME}")
    return decode_body(_recv_exact(sock, n, fds), REPLY), fds


_PEERCRED = struct.Struct("3i")


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """The (pid, uid, gid) of the process at the other end, from the kernel (SO_PEERCRED)."""
    pid, uid, gid = _PEERCRED.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    )
    return pid, uid, gid


# ------------------------------------------------------------------------ validation
def _get(
    msg: dict[str, Any],
    name: str,
    typ: type | tuple[type, ...],
    required: bool = True,
    default: Any = None,
) -> Any:
    if name not in msg:
        if required:
            raise BadRequest(f"missing field {name!r}")
        return default
    v = msg[name]
    if isinstance(v, bool) and typ is int:
        raise BadRequest(f"field {name!r} must be int, got bool")
    if not isinstance(v, typ):
        want = typ.__name__ if isinstance(typ, type) else "/".join(t.__name__ for t in typ)
        raise BadRequest(f"field {name!r} must be {want}, got {type(v).__name__}")
    return v


def get_int(
    msg: dict[str, Any],
    name: str,
    lo: int = 0,
    hi: int = MAX_U64,
    required: bool = True,
    default: int | None = None,
) -> int:
    v: int | None = _get(msg, name, int, required, default)
    if v is None:
        return v  # type: ignore[return-value]
    if not lo <= v <= hi:
        raise BadRequest(f"field {name!r}={v} outside [{lo}, {hi}]")
    return v


def get_bytes(
    msg: dict[str, Any],
    name: str,
    min_len: int = 0,
    max_len: int = MAX_FRAME,
    multiple: int = 1,
    required: bool = True,
) -> bytes:
    v: bytes = _get(msg, name, bytes, required, b"")
    if not min_len <= len(v) <= max_len or len(v) % multiple:
        raise BadRequest(
            f"field {name!r} has {len(v)} bytes; expected {min_len}..{max_len}"
            + (f" in multiples of {multiple}" if multiple > 1 else "")
        )
    return v


def get_bool(msg: dict[str, Any], name: str, default: bool = False) -> bool:
    return bool(_get(msg, name, bool, required=False, default=default))


def get_str(
    msg: dict[str, Any],
    name: str,
    max_len: int = 256,
    required: bool = True,
    default: str | None = None,
) -> str:
    v: str | None = _get(msg, name, str, required, default)
    if v is not None and len(v) > max_len:
        raise BadRequest(f"field {name!r} longer than {max_len} characters")
    return v  # type: ignore[return-value]


def get_digest(msg: dict[str, Any], name: str) -> bytes:
    return get_bytes(msg, name, DIGEST_SIZE, DIGEST_SIZE)


def get_digests(msg: dict[str, Any], name: str, max_count: int = 4096) -> list[bytes]:
    raw = get_bytes(msg, name, DIGEST_SIZE, DIGEST_SIZE * max_count, multiple=DIGEST_SIZE)
    return [raw[i : i + DIGEST_SIZE] for i in range(0, len(raw), DIGEST_SIZE)]


def get_float(msg: dict[str, Any], name: str, lo: float, hi: float) -> float:
    v = _get(msg, name, (int, float))
    if isinstance(v, bool) or not lo <= v <= hi:
        raise BadRequest(f"field {name!r}={v!r} outside [{lo}, {hi}]")
    return float(v)


def get_tokens(msg: dict[str, Any], name: str = "tokens") -> bytes:
    return get_bytes(msg, name, 4, 4 * MAX_TOKENS, multiple=4)


def get_fingerprint(msg: dict[str, Any]) -> bytes:
    return get_bytes(msg, "fingerprint", 0, MAX_FINGERPRINT)


def _count(name: str, v: Any) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_COUNTER:
        raise BadRequest(f"counter {name!r} must be an int in [0, {MAX_COUNTER}]")
    return v


def get_counters(msg: dict[str, Any]) -> dict[str, Any]:
    """A report's ``counters``: names from ``stats.REPORTED``, each of its field's shape
    (an int, seconds, a histogram's bucket counts, counts by kind), all within bounds."""
    raw = _get(msg, "counters", dict)
    out: dict[str, Any] = {}
    for k, v in raw.items():
        if k not in REPORTABLE:
            raise BadRequest(f"unknown counter {k!r:.40}; known: {', '.join(REPORTABLE)}")
        shape = _SHAPES[k]
        if shape is float:
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise BadRequest(f"counter {k!r} must be a number")
            if not (math.isfinite(v) and 0 <= v <= MAX_COUNTER):
                raise BadRequest(f"counter {k!r} must be in [0, {MAX_COUNTER}]")
            out[k] = float(v)
        elif shape is list:
            want = len(getattr(WorkerCounters(), k))
            if not isinstance(v, list) or len(v) != want:
                raise BadRequest(f"counter {k!r} must be a list of {want} ints")
            out[k] = [_count(k, x) for x in v]
        elif shape is dict:
            if not isinstance(v, dict) or len(v) > MAX_KINDS:
                raise BadRequest(f"counter {k!r} must map at most {MAX_KINDS} kinds to ints")
            for kind in v:
                if not isinstance(kind, str) or not LABEL_RE.match(kind):
                    raise BadRequest(f"counter {k!r}: kind {kind!r:.40} is not a short name")
            out[k] = {kind: _count(k, n) for kind, n in v.items()}
        else:
            out[k] = _count(k, v)
    return out


def get_label(msg: dict[str, Any], name: str) -> str:
    """An optional label value (``model``, ``tenant``) of a report: empty or short and
    printable."""
    v = get_str(msg, name, 64, required=False, default="")
    if v and not LABEL_RE.match(v):
        raise BadRequest(f"field {name!r} must match {LABEL_RE.pattern}")
    return v
