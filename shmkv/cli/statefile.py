"""The state file of ``shmkv export`` / ``shmkv import``: its bytes, in both directions.

Runs in the ``shmkv`` command's process (``transfer.py`` moves states between it
and an arena). One file holds one cached state and says everything needed to
check it before it goes anywhere near an arena (all integers little-endian)::

    0        magic "SHMKVSTF", u32 format version, u32 metadata length M
    16       metadata: a msgpack map (root, key, fingerprint, namespace, variant,
             chunk_tokens, n_tokens, payload_len, payload_xxh3, model, description,
             shmkv_version, created); at most 64 KiB
    16 + M   token ids, n_tokens x int32
    ...      payload (the llama.cpp sequence state), payload_len bytes
    end - 32 BLAKE2b-256 of every byte before it

Reading trusts nothing: lengths are bounded before anything is allocated (and a
regular file's size must be exactly what the metadata adds up to), the metadata
is decoded within msgpack limits and every field is type- and range-checked, the
digest covers the whole file, and the claims are re-derived: the key root from
the fingerprint, namespace and variant (``keys.key_root``), the key from
the root and the token ids (``keys.chain_digests``). A file that fails any of it
is refused whole (:class:`StateFileError`), never imported in part.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import IO, Any, BinaryIO

import msgpack
import numpy as np

from shmkv import __version__
from shmkv.core.arena import DIGEST_SIZE, MAX_FINGERPRINT, MAX_TOKENS
from shmkv.core.errors import ProtocolError, StateFileError
from shmkv.core.keys import chain_digests, key_root
from shmkv.core.protocol import Limits, decode_body

MAGIC = b"SHMKVSTF"
FORMAT_VERSION = 1
_HEAD = struct.Struct("<8sII")
DIGEST_LEN = 32
MAX_META = 64 << 10
#: largest payload a file may claim (a state of a 1M-token context of a big model is
#: tens of GiB; the arena it goes to bounds it further)
MAX_PAYLOAD = 1 << 40
#: what the metadata map may hold (a context description is a few dozen fields)
_META_LIMITS = Limits(
    max_map_len=256,
    max_array_len=256,
    max_containers=64,
    max_str_len=4096,
    max_bin_len=MAX_FINGERPRINT,
)
#: payload bytes read or written per piece
PIECE = 8 << 20


@dataclass(frozen=True)
class StateMeta:
    """What a state file says about its state (its metadata map)."""

    root: bytes
    key: bytes
    fingerprint: bytes
    namespace: str
    #: what the key root adds to the fingerprint (exact mode: ``|exact|N_BATCH``)
    variant: bytes
    chunk_tokens: int
    n_tokens: int
    payload_len: int
    payload_xxh3: int
    #: the model file's name where it was exported (information only)
    model: str = ""
    #: ``fingerprint.context_description`` where it was exported, if known (to say
    #: what differs when a fingerprint does not match)
    description: dict[str, Any] | None = None
    shmkv_version: str = __version__
    created: float = 0.0

    def verify_claims(self, tokens: np.ndarray) -> None:
        """StateFileError unless the root and key derive from what the file says."""
        if key_root(self.fingerprint + self.variant, self.namespace) != self.root:
            raise StateFileError(
                "the state's key root does not derive from its model fingerprint and "
                f"namespace {self.namespace!r}: the file was altered or made by hand; "
                "not imported"
            )
        digests = chain_digests(self.root, tokens, self.chunk_tokens)
        if not digests or digests[-1] != self.key:
            raise StateFileError(
                "the state's key does not match its token ids: the file was altered or "
                "made by hand; not imported"
            )


def _pack_meta(meta: StateMeta) -> bytes:
    d = asdict(meta)
    raw: bytes = msgpack.packb(d, use_bin_type=True)
    try:  # a description we could not read back ourselves is left out, not written
        decode_body(raw, _META_LIMITS)
        ok = len(raw) <= MAX_META
    except ProtocolError:
        ok = False
    if not ok:
        d["description"] = None
        raw = msgpack.packb(d, use_bin_type=True)
    return raw


def write(out: IO[bytes], meta: StateMeta, tokens: np.ndarray, payload: memoryview) -> int:
    """Write one state file to ``out``; returns the bytes written."""
    tok = np.ascontiguousarray(tokens, dtype="<i4")
    if len(tok) != meta.n_tokens or len(payload) != meta.payload_len:
        raise ValueError("tokens or payload do not match the metadata")
    raw = _pack_meta(meta)
    h = hashlib.blake2b(digest_size=DIGEST_LEN)
    n = 0
    parts: list[bytes | memoryview] = [_HEAD.pack(MAGIC, FORMAT_VERSION, len(raw)), raw]
    parts.append(memoryview(tok.tobytes()))
    parts += [payload[i : i + PIECE] for i in range(0, len(payload), PIECE)]
    for part in parts:
        h.update(part)
        out.write(part)
        n += len(part)
    out.write(h.digest())
    return n + DIGEST_LEN


def file_size(meta: StateMeta, meta_len: int) -> int:
    """The exact size of a state file with this metadata."""
    return _HEAD.size + meta_len + 4 * meta.n_tokens + meta.payload_len + DIGEST_LEN


def _field(
    d: dict[str, Any], name: str, typ: type | tuple[type, ...], check: Callable[[Any], bool]
) -> Any:
    v = d.get(name)
    if not isinstance(v, typ) or isinstance(v, bool) or not check(v):
        raise StateFileError(f"state file field {name!r} is missing or invalid; not imported")
    return v


def _meta(d: dict[str, Any]) -> StateMeta:
    def digest(v: bytes) -> bool:
        return len(v) == DIGEST_SIZE

    chunk = _field(d, "chunk_tokens", int, lambda v: 1 <= v <= 1 << 16)
    description = d.get("description")
    if description is not None and not isinstance(description, dict):
        raise StateFileError("state file field 'description' is invalid; not imported")
    return StateMeta(
        root=_field(d, "root", bytes, digest),
        key=_field(d, "key", bytes, digest),
        fingerprint=_field(d, "fingerprint", bytes, lambda v: 1 <= len(v) <= MAX_FINGERPRINT),
        namespace=_field(d, "namespace", str, lambda v: len(v) <= 1024),
        variant=_field(d, "variant", bytes, lambda v: len(v) <= 64),
        chunk_tokens=chunk,
        n_tokens=_field(d, "n_tokens", int, lambda v: chunk <= v <= MAX_TOKENS),
        payload_len=_field(d, "payload_len", int, lambda v: 1 <= v <= MAX_PAYLOAD),
        payload_xxh3=_field(d, "payload_xxh3", int, lambda v: 0 <= v < 1 << 64),
        model=_field(d, "model", str, lambda v: True),
        description=description,
        shmkv_version=_field(d, "shmkv_version", str, lambda v: True),
        created=float(_field(d, "created", (int, float), lambda v: v == v)),
    )


class StateReader:
    """Reads and checks one state file, in order: :meth:`open` (header, metadata, token
    ids), :meth:`payload_into` (the payload, in pieces), :meth:`finish` (the digest)."""

    def __init__(self, f: BinaryIO, size: int | None = None) -> None:
        """``size``: the file's size if it is a regular file (checked exactly)."""
        self.f, self.size = f, size
        self.h = hashlib.blake2b(digest_size=DIGEST_LEN)
        self.meta: StateMeta
        self.tokens: np.ndarray

    def _read(self, n: int) -> bytes:
        buf = self._read_raw(n)
        self.h.update(buf)
        return buf

    def _read_raw(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            part = self.f.read(n - len(buf))
            if not part:
                raise StateFileError(
                    "the state file is truncated (it ends before what its header "
                    "announces); not imported"
                )
            buf += part
        return bytes(buf)

    def open(self) -> StateMeta:
        """Read and check everything before the payload; returns the metadata."""
        magic, version, meta_len = _HEAD.unpack(self._read(_HEAD.size))
        if magic != MAGIC:
            raise StateFileError("not a shmkv state file (write one with `shmkv export`)")
        if version != FORMAT_VERSION:
            raise StateFileError(
                f"state file format {version}; this shmkv reads format {FORMAT_VERSION}; "
                f"not imported: export it again with this version of shmkv"
            )
        if not 1 <= meta_len <= MAX_META:
            raise StateFileError(f"state file metadata of {meta_len} bytes; not imported")
        try:
            d = decode_body(self._read(meta_len), _META_LIMITS)
        except ProtocolError:
            msg = "the state file's metadata is not readable; not imported"
            raise StateFileError(msg) from None
        meta = _meta(d)
        if self.size is not None and self.size != file_size(meta, meta_len):
            raise StateFileError(
                f"the state file has {self.size} bytes, its header announces "
                f"{file_size(meta, meta_len)}: truncated or altered; not imported"
            )
        self.tokens = np.frombuffer(self._read(4 * meta.n_tokens), dtype="<i4")
        meta.verify_claims(self.tokens)
        self.meta = meta
        return meta

    def payload_into(self, view: memoryview) -> None:
        """Read the payload (exactly ``meta.payload_len`` bytes) into ``view``."""
        if len(view) != self.meta.payload_len:
            raise ValueError("view is not the payload's size")
        done = 0
        while done < len(view):
            n = self.f.readinto(view[done : done + PIECE])  # type: ignore[attr-defined]
            if not n:
                raise StateFileError("the state file is truncated in its payload; not imported")
            self.h.update(view[done : done + n])
            done += n

    def finish(self) -> None:
        """StateFileError unless the digest matches and nothing follows it."""
        want = self.h.digest()
        try:
            got = self._read_raw(DIGEST_LEN)
        except StateFileError:
            got = b""
        if got != want:
            raise StateFileError(
                "the state file's checksum does not match: it was corrupted or altered; "
                "not imported"
            )
        if self.f.read(1):
            raise StateFileError("the state file has bytes after its checksum; not imported")
