"""The remote tier's layout in Redis / Valkey: key names and the manifest, both ways.

Runs in the supervisor (its remote writer and fetcher threads). Nobody else builds
these keys or packs a manifest.

One record, named by its remote id ``rid = BLAKE2b-128(root | fingerprint | token ids)``
(no publisher: two nodes that publish the same prompt share one copy), is::

    shmkv:{<rid hex>}:p<i>   piece i of the payload (``PIECE`` bytes, the last shorter),
                             zstd-compressed as a whole first if the manifest says so
    shmkv:{<rid hex>}:m      the manifest (msgpack, below), written after every piece:
                             ``{"v": 2, "m": <body>, "mac": <HMAC-SHA256 or b"">}``, the
                             body a msgpack map of the fields of :class:`Manifest`

A record whose state splits into token groups (``shmkv.core.kvformat``: a KV cache's
state, not a recurrent one) is written in format 3: its pieces hold its **body** (the
group layout and the groups that are not full, :func:`pack_body`), and each full group
is a **chunk** stored once for every record and node that has the same bytes::

    shmkv:{<root hex>.<chunk hex>}:c   one full group's data (a codec byte, then the
                                       bytes, zstd-compressed if that is smaller)

``chunk`` being the BLAKE2b-128 of the group's data; the manifest names each chunk by
that digest and by its XXH3-128 (how the arena finds a chunk it already holds: a node
fetches only the chunks its arena lacks, and a writer sends only those Redis lacks).
The chunk keys are rooted in the record's root (model, context settings, tenant): a
tenant never learns whether another computed the same bytes. A whole record (format 2)
has no chunks: its pieces hold its payload.

and each record is findable from a prompt through one hash per chunk prefix::

    shmkv:{<root hex>}:x<chunk>:<digest hex>   HASH  rid -> "<token count>:<tokens tag>"

where ``digest`` is the chained digest of the record's last full chunk prefix
(``keys.chain_digests``, the keys the arena itself uses, rooted in the model's
fingerprint, context settings and tenant namespace), and findable from a prompt that
shares only part of it (a system prompt, then another question) through one string per
chunk boundary of the record::

    shmkv:{<root hex>}:y<chunk>:<digest hex>   STRING "<rid hex>:<token count>"

``digest`` being the chained digest of each full chunk prefix of the record (at most
:data:`MAX_BOUNDARIES` of them, evenly spaced, the last always), pointing at the latest
record written through it: every record through one boundary shares its prefix, so one
pointer is enough, and a system prompt shared by a thousand conversations costs one key
per boundary, not a thousand. Only a worker whose model can cut a state back (no sliding
window, no recurrent layer: ``shmkv.llama.policy``) follows them; the others fetch only
records that are a whole prefix of their prompt.

``{...}`` is a Redis Cluster hash tag: a record's pieces and manifest share one slot,
and all index keys of one root share one slot, so a lookup is one pipelined round trip
on one node. Every key has a TTL (``--remote-ttl``; a boundary pointer the remaining
TTL of the record it points at). The tokens tag (:func:`tokens_tag`, 8 bytes of BLAKE2b
of the record's token ids) lets a lookup keep only the records that are a prefix of its
prompt before it reads a manifest: many prompts that share a system prompt and differ in
their question share one index hash, and are told apart without a round trip each.

A reader trusts nothing it reads here beyond what it checks: :func:`unpack_manifest`
bounds every field and checks that root, fingerprint and tokens hash to the key it was
read under; each piece and each chunk is checked against its BLAKE2b-128 digest in the
manifest as it arrives (a chunk taken from the local arena, against its XXH3-128), the
payload against the manifest's XXH3 once assembled; the arena's put checks it again,
and the worker checks fingerprint, tokens and checksum before it restores, as for any
local record. With ``--remote-key-file`` the manifest's body (which names every piece's
digest, the payload's length, the publisher's uid and a chunked record's chunk
digests) carries an HMAC-SHA256 under the key: a node with keys takes only records
whose MAC verifies under one of them, so nobody who can merely write to Redis can make
it restore a state they computed.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import msgpack

from shmkv.core import kvformat
from shmkv.core.arena import DIGEST_SIZE, MAX_FINGERPRINT, MAX_TOKENS
from shmkv.core.errors import ArenaCorruptError, TierError
from shmkv.core.keys import remote_id
from shmkv.supervisor.tiers.base import RecordMeta

#: a whole record's manifest (its pieces hold the payload), and a chunked record's
VERSION, CHUNKED_VERSION = 2, 3
#: bytes per piece: one command per MiB keeps Redis responsive to other clients
PIECE = 1 << 20
#: the largest payload a manifest may describe (a 1M-token state of a big model fits)
MAX_PAYLOAD = 1 << 34
MAX_PIECES = MAX_PAYLOAD // PIECE
CODECS = ("none", "zstd")
PREFIX = "shmkv"
#: bytes of each piece's digest (BLAKE2b) in a manifest
PIECE_DIGEST = 16
#: the least key length of --remote-key-file, bytes
MIN_KEY = 32
#: boundary pointers one record writes at most (a 16k-token record at 64-token chunks
#: has one per chunk; a longer one, one every few chunks)
MAX_BOUNDARIES = 256
#: bytes a chunked record's manifest keeps per chunk: BLAKE2b-128, then XXH3-128
CHUNK_REF = 32
#: the most chunks one record may name (a state with more is written whole)
MAX_CHUNKS = 1 << 16
#: the longest manifest a reader accepts (token ids, piece and chunk digests dominate)
MAX_MANIFEST = 4 * MAX_TOKENS + PIECE_DIGEST * MAX_PIECES + CHUNK_REF * MAX_CHUNKS + 4096
#: a chunk value's first byte: how the rest is stored
CHUNK_RAW, CHUNK_ZSTD = 0, 1
_BODY_HEAD = struct.Struct("<I")


def piece_digest(piece: bytes | memoryview) -> bytes:
    """What a manifest holds for one stored piece."""
    return hashlib.blake2b(piece, digest_size=PIECE_DIGEST).digest()


def mac(key: bytes, rid: bytes, body: bytes) -> bytes:
    """The manifest MAC: HMAC-SHA256 of the record id and the manifest's body."""
    return hmac.new(key, rid + body, hashlib.sha256).digest()


def tokens_tag(tokens: bytes) -> str:
    """A short tag of a record's token ids (little-endian int32 bytes), kept in the index."""
    return hashlib.blake2b(tokens, digest_size=8).hexdigest()


def index_value(tokens: bytes) -> str:
    """What the index hash holds for a record of ``tokens``: its length and tag."""
    return f"{len(tokens) // 4}:{tokens_tag(tokens)}"


def parse_index_value(raw: bytes) -> tuple[int, str] | None:
    """``(token count, tag)`` of an index value, or None if it is not one."""
    try:
        n, _, tag = raw.decode("ascii").partition(":")
        count = int(n)
    except (UnicodeDecodeError, ValueError):
        return None
    if not 0 < count <= MAX_TOKENS or len(tag) != 16:
        return None
    return count, tag


def manifest_key(rid: bytes) -> str:
    return f"{PREFIX}:{{{rid.hex()}}}:m"


def piece_key(rid: bytes, i: int) -> str:
    return f"{PREFIX}:{{{rid.hex()}}}:p{i}"


def index_key(root: bytes, chunk: int, digest: bytes) -> str:
    return f"{PREFIX}:{{{root.hex()}}}:x{chunk}:{digest.hex()}"


def boundary_key(root: bytes, chunk: int, digest: bytes) -> str:
    return f"{PREFIX}:{{{root.hex()}}}:y{chunk}:{digest.hex()}"


def chunk_key(root: bytes, digest: bytes) -> str:
    """Where the chunk of BLAKE2b-128 ``digest`` of a record rooted in ``root`` is."""
    return f"{PREFIX}:{{{root.hex()}.{digest.hex()}}}:c"


def chunk_digest(data: bytes | memoryview) -> bytes:
    """A chunk's name in Redis and in the manifest: BLAKE2b-128 of its data."""
    return hashlib.blake2b(data, digest_size=DIGEST_SIZE).digest()


def chunk_room(length: int) -> int:
    """The longest value a chunk of ``length`` data bytes may be stored as: its codec byte,
    then the data or a smaller zstd frame of it. A reader reads at most one byte more,
    and a value that long is damaged."""
    return 1 + length


def compress(codec: str, data: bytes | memoryview) -> bytes | memoryview:
    """``data`` as ``--remote-compress`` stores it: zstd level 1, or as is."""
    if codec == "zstd":
        import zstandard

        out: bytes = zstandard.ZstdCompressor(level=1).compress(data)
        return out
    return data


def chunk_value(codec: str, data: bytes | memoryview) -> bytes:
    """What a chunk's key holds: a codec byte, then ``data`` (zstd if ``codec`` says so
    and that is smaller)."""
    packed = compress(codec, data)
    if codec == "zstd" and len(packed) < len(data):
        return bytes([CHUNK_ZSTD]) + bytes(packed)
    return bytes([CHUNK_RAW]) + bytes(data)


def chunk_data(raw: memoryview, length: int, digest: bytes | None) -> bytes | memoryview:
    """The data of a chunk value read from Redis, which must be ``length`` bytes (and, if
    ``digest`` is given, of that BLAKE2b-128); TierError("corrupt") if not (never more
    than ``length`` bytes are produced). A stored-as-is chunk's data is a view of ``raw``."""
    if not raw or len(raw) > chunk_room(length) or raw[0] not in (CHUNK_RAW, CHUNK_ZSTD):
        raise TierError("remote chunk of an unknown codec", "corrupt")
    data: bytes | memoryview = raw[1:]
    if raw[0] == CHUNK_ZSTD:
        import zstandard

        try:
            if zstandard.frame_content_size(data) != length:
                raise TierError("remote chunk's frame size does not match its record", "corrupt")
            data = zstandard.ZstdDecompressor().decompress(data, max_output_size=length)
        except zstandard.ZstdError as e:
            raise TierError(f"remote chunk undecodable: {e}", "corrupt") from None
    if len(data) != length or (digest is not None and chunk_digest(data) != digest):
        raise TierError("remote chunk does not match its manifest", "corrupt")
    return data


def pack_body(layout: kvformat.Manifest, inline: Sequence[bytes | memoryview]) -> bytes:
    """A chunked record's body: the length of its packed group layout, the layout, then
    the data of each group that is not full (in blob order)."""
    packed = layout.pack()
    return b"".join([_BODY_HEAD.pack(len(packed)), packed, *inline])


def parse_body(
    body: bytes | bytearray, man: Manifest
) -> tuple[kvformat.Manifest, list[memoryview]]:
    """A chunked record's group layout and the data of its groups that are not full, read
    from its ``body`` and checked against ``man`` (the blob's length, one chunk per full
    group, the lengths adding up); TierError("corrupt") if anything disagrees."""
    mv = memoryview(body)
    if len(mv) < _BODY_HEAD.size:
        raise TierError("remote record's body is shorter than its header", "corrupt")
    (n,) = _BODY_HEAD.unpack_from(mv)
    if n > len(mv) - _BODY_HEAD.size:
        raise TierError("remote record's layout runs past its body", "corrupt")
    try:
        layout = kvformat.Manifest.unpack(mv[_BODY_HEAD.size : _BODY_HEAD.size + n])
    except ArenaCorruptError as e:
        raise TierError(f"remote record's layout is unreadable: {e}", "corrupt") from None
    if layout.blob_len != man.payload_len or sum(layout.group_full) != man.n_chunks:
        raise TierError("remote record's layout does not match its manifest", "corrupt")
    inline = layout.partial_groups(mv, _BODY_HEAD.size + n)
    if inline is None:
        raise TierError("remote record's groups do not add up to its body", "corrupt")
    return layout, inline


def boundary_value(rid: bytes, n_tokens: int) -> str:
    """What a boundary pointer holds: the record it points at, and its length."""
    return f"{rid.hex()}:{n_tokens}"


def parse_boundary_value(raw: bytes) -> tuple[bytes, int] | None:
    """``(rid, token count)`` of a boundary pointer, or None if it is not one."""
    try:
        rid_hex, _, n = raw.decode("ascii").partition(":")
        rid, count = bytes.fromhex(rid_hex), int(n)
    except (UnicodeDecodeError, ValueError):
        return None
    if len(rid) != DIGEST_SIZE or not 0 < count <= MAX_TOKENS:
        return None
    return rid, count


def boundaries(n_chunks: int) -> list[int]:
    """Which full chunk prefixes of a record of ``n_chunks`` get a boundary pointer (their
    1-based chunk counts, ascending): every one up to :data:`MAX_BOUNDARIES`, else evenly
    spaced ones, the last always among them."""
    step = max(1, -(-n_chunks // MAX_BOUNDARIES))
    return list(range(n_chunks, 0, -step))[::-1]


def n_pieces(stored_len: int) -> int:
    return max(1, -(-stored_len // PIECE))


@dataclass(frozen=True)
class Manifest:
    """What a record is and how its payload is stored."""

    root: bytes
    fingerprint: bytes
    #: token ids, little-endian int32
    tokens: bytes
    #: payload length and XXH3-64 (of the payload itself, before compression)
    payload_len: int
    payload_xxh3: int
    codec: str
    #: bytes stored in the pieces (compressed length, or payload_len)
    stored_len: int
    created: float
    #: who published it: "hostname/uid" of the node's supervisor and worker (informative)
    publisher: str
    #: the uid that published it (the arena's publisher field): a fetched copy keeps it
    uid: int
    #: :func:`piece_digest` of each stored piece, concatenated
    digests: bytes
    #: a chunked record (format 3): its body's length (what the pieces hold, before
    #: compression), and per chunk its :func:`chunk_digest` and XXH3-128; 0 and b"" for
    #: a whole record (format 2: the pieces hold the payload)
    body_len: int = 0
    chunks: bytes = b""

    @property
    def n_tokens(self) -> int:
        return len(self.tokens) // 4

    @property
    def n_chunks(self) -> int:
        return len(self.chunks) // CHUNK_REF

    @property
    def version(self) -> int:
        return CHUNKED_VERSION if self.chunks else VERSION

    @property
    def stored_of(self) -> int:
        """What the pieces hold once decompressed: the body, or the payload."""
        return self.body_len if self.chunks else self.payload_len

    def chunk(self, j: int) -> tuple[bytes, bytes]:
        """Chunk ``j``'s (BLAKE2b-128, XXH3-128)."""
        ref = self.chunks[j * CHUNK_REF : (j + 1) * CHUNK_REF]
        return ref[:DIGEST_SIZE], ref[DIGEST_SIZE:]

    @property
    def pieces(self) -> int:
        return n_pieces(self.stored_len)

    def meta(self) -> RecordMeta:
        """The record's metadata for the arena (a pin is not shared between nodes)."""
        return RecordMeta(
            self.root,
            self.fingerprint,
            self.tokens,
            self.uid,
            False,
            self.payload_len,
            self.payload_xxh3,
            self.created,
        )

    def rid(self) -> bytes:
        return remote_id(self.root, self.fingerprint, self.tokens)

    def pack(self, key: bytes | None = None) -> bytes:
        """The stored manifest, MACed under ``key`` if given."""
        fields: dict[str, Any] = {}
        if self.chunks:
            fields = {"body": self.body_len, "chunks": self.chunks}
        body: bytes = msgpack.packb(
            {
                "v": self.version,
                **fields,
                "root": self.root,
                "fp": self.fingerprint,
                "tokens": self.tokens,
                "len": self.payload_len,
                "xxh3": self.payload_xxh3,
                "codec": self.codec,
                "stored": self.stored_len,
                "pieces": self.pieces,
                "created": self.created,
                "publisher": self.publisher,
                "uid": self.uid,
                "digests": self.digests,
            },
            use_bin_type=True,
        )
        tag = b"" if key is None else mac(key, self.rid(), body)
        out: bytes = msgpack.packb({"v": self.version, "m": body, "mac": tag}, use_bin_type=True)
        return out


def _unpack(raw: bytes) -> Any:
    try:
        return msgpack.unpackb(
            raw, raw=False, max_map_len=32, max_array_len=0, max_str_len=256, strict_map_key=True
        )
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise TierError(f"remote manifest undecodable: {e}", "corrupt") from None


def unpack_manifest(rid: bytes, raw: bytes, keys: Sequence[bytes] = ()) -> Manifest:
    """Check and read a manifest stored under ``rid``; TierError("corrupt") says what is
    wrong. With ``keys``, its MAC must verify under one of them, else TierError("unverified")."""
    if len(raw) > MAX_MANIFEST:
        raise TierError("remote manifest too large", "corrupt")
    env = _unpack(raw)
    version = env.get("v") if isinstance(env, dict) else None
    if version not in (VERSION, CHUNKED_VERSION):
        raise TierError("remote manifest of another format version", "corrupt")
    body, tag = env.get("m"), env.get("mac")
    if not isinstance(body, bytes) or not isinstance(tag, bytes):
        raise TierError("remote manifest's envelope is malformed", "corrupt")
    if keys and not any(hmac.compare_digest(mac(k, rid, body), tag) for k in keys):
        raise TierError("remote manifest not signed by any key of --remote-key-file", "unverified")
    m = _unpack(body)
    if not isinstance(m, dict) or m.get("v") != version:
        raise TierError("remote manifest of another format version", "corrupt")

    def field(name: str, typ: type, lo: int = 0, hi: int = 1 << 64) -> Any:
        v = m.get(name)
        if not isinstance(v, typ) or isinstance(v, bool):
            raise TierError(f"remote manifest field {name!r} missing or mistyped", "corrupt")
        n = len(v) if isinstance(v, bytes | str) else v
        if isinstance(n, int) and not lo <= n < hi:
            raise TierError(f"remote manifest field {name!r} out of range", "corrupt")
        return v

    man = Manifest(
        root=field("root", bytes, DIGEST_SIZE, DIGEST_SIZE + 1),
        fingerprint=field("fp", bytes, 0, MAX_FINGERPRINT + 1),
        tokens=field("tokens", bytes, 4, 4 * MAX_TOKENS + 1),
        payload_len=field("len", int, 1, MAX_PAYLOAD + 1),
        payload_xxh3=field("xxh3", int, 0, 1 << 64),
        codec=field("codec", str, 1, 16),
        stored_len=field("stored", int, 1, MAX_PAYLOAD + 1),
        created=float(field("created", float)),
        publisher=field("publisher", str, 0, 256),
        uid=field("uid", int, 0, 1 << 32),
        digests=field("digests", bytes, PIECE_DIGEST, PIECE_DIGEST * MAX_PIECES + 1),
    )
    if version == CHUNKED_VERSION:
        man = replace(
            man,
            body_len=field("body", int, 1, MAX_PAYLOAD + 1),
            chunks=field("chunks", bytes, CHUNK_REF, CHUNK_REF * MAX_CHUNKS + 1),
        )
        if len(man.chunks) % CHUNK_REF:
            raise TierError("remote manifest's chunk list is of an odd length", "corrupt")
    if len(man.tokens) % 4 or man.codec not in CODECS:
        raise TierError("remote manifest has odd tokens or an unknown codec", "corrupt")
    if field("pieces", int, 1, MAX_PIECES + 1) != man.pieces:
        raise TierError("remote manifest's piece count does not match its length", "corrupt")
    if len(man.digests) != PIECE_DIGEST * man.pieces:
        raise TierError("remote manifest's piece digests do not match its length", "corrupt")
    if man.codec == "none" and man.stored_len != man.stored_of:
        raise TierError("remote manifest's lengths disagree", "corrupt")
    if man.codec == "zstd" and man.stored_len >= man.stored_of:
        raise TierError("remote manifest's compressed length is not smaller", "corrupt")
    if man.rid() != rid:
        raise TierError("remote manifest does not match its key", "corrupt")
    return man


def split(data: bytes | memoryview) -> list[bytes | memoryview]:
    """``data`` in pieces of :data:`PIECE` bytes (views, no copy)."""
    view = memoryview(data)
    return [view[i : i + PIECE] for i in range(0, max(1, len(view)), PIECE)]


def now() -> float:
    return time.time()
