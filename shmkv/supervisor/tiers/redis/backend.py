"""``--remote URL``: the arena's records written behind to Redis / Valkey, and fetched back.

Runs in the supervisor, off its loop, on two threads with a connection each:

* :class:`RedisWriter` is the :class:`~shmkv.supervisor.tiers.base.Backend` of a write-behind: each
  record the arena accepts is copied from the arena (read-only mapping, XXH3-checked
  copy), optionally zstd-compressed, and written as pieces, then, once every piece is
  stored, its manifest, then its index entries (``tiers/redis/layout.py``), all with a TTL. A
  record is visible only through its manifest, so a Redis that dies (or fills up)
  between the pieces and the manifest leaves nothing a reader can take for a record.
* :class:`Fetcher` answers "does the remote tier hold a longer prefix of this prompt?"
  (or, for a worker that can cut a state back, a record that shares more of it and goes
  on past it: one pipelined round trip to the index, one to the candidates' manifests),
  reads a record once for every request that finds it while it is being put, decides
  whether fetching beats prefilling (measured fetch bandwidth against the worker's
  measured prefill speed), fetches the pieces and checks the payload; the loop
  (``tiers/redis/tier.py``) then puts it into the arena like any other record.

Every Redis failure (refused, timed out, ``OOM`` under ``maxmemory``, cluster down) is
a :class:`~shmkv.core.errors.TierError`: counted by kind, the tier paused with a growing
delay, never raised into the loop, never waited on by a worker beyond its bound. One
key of the wrong type (``WRONGTYPE``) is a miss for the lookup that read it, counted,
never an outage.

Trust: a record leaves the machine only if its publisher is trusted by this supervisor
(its own uid and ``--trust-publishers``); the manifest carries the publisher's uid, and
a fetched record is put into the arena under that uid (never re-labelled as ours), and
only if this supervisor trusts it too. With ``--remote-key-file`` every manifest is
MACed and only records whose MAC verifies are fetched (``tiers/redis/layout.py``).
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from shmkv.core import kvformat
from shmkv.core.arena import DIGEST_SIZE, common_prefix, record_layout
from shmkv.core.errors import ArenaCorruptError, ConfigError, TierError, UnsafePathError
from shmkv.core.keys import chain_digests, remote_id
from shmkv.supervisor.tiers.base import FIRST_BACKOFF, MAX_BACKOFF, Accepted, Event, PayloadSource
from shmkv.supervisor.tiers.redis import layout as fmt
from shmkv.supervisor.tiers.redis.bulk import BulkReader, is_wrongtype

log = logging.getLogger(__name__)

#: candidate records whose manifests one lookup reads
MAX_CANDIDATES = 4
#: index hashes one lookup reads (the deepest chunk prefixes first)
MAX_PROBES = 256
#: fetch requests waiting for the fetcher thread; past it a request is answered "busy"
MAX_FETCH_QUEUE = 64
#: assumed fetch bandwidth (bytes/s) before one was measured
DEFAULT_BANDWIDTH = 200e6
#: pieces one round trip reads
PIECES_PER_READ = 8
#: chunk bytes one round trip reads at most (beyond the record, the fetch holds no more)
READ_BATCH = 8 << 20
#: refused records remembered (their ids), and for how long (seconds)
MAX_REFUSED, REFUSED_TTL = 4096, 60.0
#: records just put into the arena (their ids), and for how long (seconds): a fetch that
#: finds one of them joins it instead of reading it again
MAX_LANDED, LANDED_TTL = 1024, 30.0
#: keys a --remote-key-file holds: the current one (signs), and the previous one
MAX_KEYS = 2
#: how much longer than its manifest a record's pieces and chunks live, ms (a reader
#: that found the manifest finds them)
PIECE_GRACE_MS = 60_000
#: chunk bytes one pipeline sends at most
SEND_BATCH = 8 << 20


def load_keys(path: str) -> tuple[bytes, ...]:
    """The keys of ``--remote-key-file``: one per line, current first, at most two, each
    of at least :data:`~shmkv.supervisor.tiers.redis.layout.MIN_KEY` bytes (whitespace at
    their ends ignored).
    The file must be ours and closed to others (UnsafePathError, exit 8)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise ConfigError(f"--remote-key-file {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        mode = stat.S_IMODE(st.st_mode)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or mode & 0o077:
            raise UnsafePathError(
                f"--remote-key-file {path}: must be a regular file owned by uid "
                f"{os.geteuid()} with mode 0600 (it is uid {st.st_uid}, mode {mode:04o}): "
                f"chown {os.geteuid()} {path}; chmod 600 {path}"
            )
        raw = os.read(fd, 4096)
    finally:
        os.close(fd)
    keys = tuple(line.strip() for line in raw.splitlines() if line.strip())
    if not keys or len(keys) > MAX_KEYS or any(len(k) < fmt.MIN_KEY for k in keys):
        raise ConfigError(
            f"--remote-key-file {path}: write one key of at least {fmt.MIN_KEY} bytes "
            f"(e.g. `head -c 32 /dev/urandom | base64 > {path}`), or two lines for a "
            f"rotation: the current key first, the previous one second"
        )
    return keys


def connect(url: str, cluster: bool, timeout: float) -> Any:
    """A redis-py client for ``url`` (``redis://``, ``rediss://``, ``unix://``; a
    ``+cluster`` scheme such as ``redis+cluster://`` or ``cluster`` means Redis Cluster).

    No retries inside redis-py: a failure comes back at once, and the tier's own
    backoff decides when to try again.
    """
    try:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry
    except ImportError:  # pragma: no cover (an extra)
        raise ConfigError("--remote needs the redis package: pip install 'shmkv[remote]'") from None
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.removesuffix("+cluster") not in ("redis", "rediss", "unix"):
        raise ConfigError(
            f"--remote {url!r}: use redis://HOST:PORT/DB, rediss://... (TLS), "
            f"unix:///path/to/redis.sock, or redis+cluster://HOST:PORT"
        )
    if scheme.endswith("+cluster"):
        cluster, url = True, scheme.removesuffix("+cluster") + "://" + rest
    common: dict[str, Any] = {
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        "retry": Retry(NoBackoff(), 0),
    }
    if cluster:
        if scheme.startswith("unix"):
            raise ConfigError("--remote-cluster needs redis:// or rediss:// addresses")
        from redis.cluster import RedisCluster

        return RedisCluster.from_url(url, cluster_error_retry_attempts=1, **common)
    return redis.Redis.from_url(url, **common)


def classify(e: Exception) -> TierError:
    """A TierError of the right kind for a redis-py (or socket) failure."""
    import redis.exceptions as rex

    text = str(e) or type(e).__name__
    if isinstance(e, TierError):
        return e
    # (a pipeline's error quotes the failed command, a piece's bytes among them: drop it)
    text = text.rsplit("caused error:", 1)[-1].strip()[:200]
    if isinstance(e, rex.ResponseError) and ("OOM" in text or "maxmemory" in text):
        return TierError(f"remote tier full ({text}); raise its maxmemory", "full")
    if isinstance(e, rex.TimeoutError | TimeoutError | socket.timeout):
        return TierError(f"remote tier timed out: {text}", "timeout")
    if isinstance(e, rex.ConnectionError | ConnectionError | OSError):
        return TierError(f"remote tier unreachable: {text}", "down")
    if isinstance(e, rex.RedisError):
        return TierError(f"remote tier error: {text}", "error")
    return TierError(f"remote tier: {type(e).__name__}: {text}", "internal")


@dataclass(frozen=True)
class RemoteConf:
    url: str
    cluster: bool
    ttl: int
    chunk: int
    codec: str
    timeout: float
    #: "hostname/uid" written into manifests (informative)
    node: str
    #: the supervisor's uid and --trust-publishers (None: everyone): whose records go
    #: to Redis, and whose fetched records come into the arena
    trusted: frozenset[int] | None = None
    #: --remote-key-file: manifests are signed with the first, verified under any
    keys: tuple[bytes, ...] = field(default=(), repr=False)

    def trusts(self, uid: int) -> bool:
        return self.trusted is None or uid in self.trusted


def _decompress(codec: str, data: bytearray, payload_len: int) -> bytearray | bytes:
    """The payload of ``data``: never more than ``payload_len`` bytes are produced (the
    manifest's length, checked against the arena before anything was read)."""
    if codec == "none":
        return data
    import zstandard

    try:
        if zstandard.frame_content_size(data) != payload_len:
            raise TierError("remote payload's frame size does not match its manifest", "corrupt")
        # (the frame says its size, checked equal to payload_len: zstd allocates that
        # much and fails past it, never more)
        out: bytes = zstandard.ZstdDecompressor().decompress(data, max_output_size=payload_len)
        return out
    except zstandard.ZstdError as e:
        raise TierError(f"remote payload undecodable: {e}", "corrupt") from None


class RedisWriter:
    """The write-behind's backend: records in pieces, then manifest, then index; a TTL."""

    name = "remote"

    def __init__(self, conf: RemoteConf) -> None:
        self.conf = conf
        self.r: Any = None
        self.written = self.written_bytes = self.stored_bytes = self.gone = self.present = 0
        #: chunks of chunked records sent, and found in Redis already (not sent)
        self.chunks_sent = self.chunks_present = 0
        #: records not written: their publisher is not trusted; keys of the wrong type
        self.untrusted = self.bad_keys = 0

    def open(self) -> None:
        try:
            if self.r is None:
                self.r = connect(self.conf.url, self.conf.cluster, self.conf.timeout)
            self.r.ping()
        except Exception as e:
            raise classify(e) from None

    def apply(self, batch: list[Event], source: PayloadSource) -> None:
        try:
            for ev in batch:  # (uses and pins stay local: a remote record lives its TTL)
                if isinstance(ev, Accepted):
                    self._write(ev, source)
        except Exception as e:
            raise classify(e) from None

    def _held(self, rid: bytes) -> int | None:
        """Milliseconds left to a record ``rid`` that Redis holds and that we would write
        ourselves: whole, signed with our current key (if we have keys), by a publisher
        we trust; None if it holds none. Anything else (another writer's, unsigned, of an
        untrusted publisher, garbage) is replaced."""
        pipe = self.r.pipeline(transaction=False)
        pipe.get(fmt.manifest_key(rid))
        pipe.pttl(fmt.manifest_key(rid))
        raw, left = pipe.execute(raise_on_error=False)
        if isinstance(raw, Exception):
            if not is_wrongtype(raw):
                raise raw
            self.bad_keys += 1
            return None
        if raw is None or not isinstance(left, int) or left <= 0:
            return None
        try:
            man = fmt.unpack_manifest(rid, raw, self.conf.keys[:1])
        except TierError:
            return None
        return left if self.conf.trusts(man.uid) else None

    def _write(self, ev: Accepted, source: PayloadSource) -> None:
        conf = self.conf
        if not conf.trusts(ev.publisher):  # (a --group member's state stays here)
            self.untrusted += 1
            return
        rid = remote_id(ev.root, ev.fingerprint, ev.tokens)
        chain = chain_digests(ev.root, np.frombuffer(ev.tokens, dtype="<i4"), conf.chunk)
        left = self._held(rid)
        if left is not None:  # (another node, or we, stored it)
            self._index(ev, rid, chain, left)
            self.present += 1  # (counted once indexed: a reader of the count sees it done)
            return
        data = source.payload(ev)  # the one copy: checked below, then sent from
        if data is None:
            self.gone += 1
            return
        if len(data) != ev.payload_len or xxhash.xxh3_64_intdigest(data) != ev.payload_xxh3:
            self.gone += 1  # evicted and reused while we copied
            return
        ttl_ms = conf.ttl * 1000
        layout = kvformat.plan(data, conf.chunk)
        if layout is not None and sum(layout.group_full) > fmt.MAX_CHUNKS:
            layout = None
        body, chunks, sent = data, b"", 0
        if layout is not None:  # (chunks first: Redis keeps each once)
            body, chunks, sent = self._write_chunks(ev.root, layout, data, ttl_ms)
        stored = fmt.compress(conf.codec, body)
        codec = conf.codec
        if codec != "none" and len(stored) >= len(body):  # (incompressible: store as is)
            stored, codec = body, "none"
        parts = fmt.split(stored)
        man = fmt.Manifest(
            ev.root,
            ev.fingerprint,
            ev.tokens,
            ev.payload_len,
            ev.payload_xxh3,
            codec,
            len(stored),
            ev.created,
            f"{conf.node}/{ev.publisher}",
            ev.publisher,
            b"".join(fmt.piece_digest(p) for p in parts),
            len(body) if chunks else 0,
            chunks,
        )
        pipe = self.r.pipeline(transaction=False)
        for i, part in enumerate(parts):
            pipe.set(fmt.piece_key(rid, i), bytes(part), px=ttl_ms + PIECE_GRACE_MS)
        pipe.execute()  # every piece and chunk stored before the manifest makes them a record
        pipe = self.r.pipeline(transaction=False)
        pipe.set(fmt.manifest_key(rid), man.pack(conf.keys[0] if conf.keys else None), px=ttl_ms)
        pipe.execute()
        self._index(ev, rid, chain, ttl_ms)
        self.written += 1
        self.written_bytes += ev.payload_len
        self.stored_bytes += len(stored) + sent

    def _write_chunks(
        self, root: bytes, layout: kvformat.Manifest, data: bytes, ttl_ms: int
    ) -> tuple[bytes, bytes, int]:
        """Store each full group of ``data`` (planned as ``layout``) that Redis lacks as a
        chunk, and make each one it holds live at least as long as this record's pieces
        (a TTL is only ever raised). Returns the record's body, its chunk list for the
        manifest, and the bytes sent. Each group is gathered twice (to name it, then to
        send it if Redis lacks it), never all at once: the thread holds the payload and
        at most :data:`SEND_BATCH` bytes of chunks."""
        life = ttl_ms + PIECE_GRACE_MS
        full = [i for i, f in enumerate(layout.group_full) if f]
        names: list[tuple[bytes, bytes]] = []
        inline: list[bytes] = []
        for i, view in kvformat.gathered(layout, data):
            if layout.group_full[i]:
                names.append((fmt.chunk_digest(view), xxhash.xxh3_128_digest(view)))
            else:
                inline.append(bytes(view))
        keys = [fmt.chunk_key(root, b) for b, _ in names]
        pipe = self.r.pipeline(transaction=False)
        for k in keys:
            pipe.pttl(k)
        left = pipe.execute()
        lacking = [j for j, ms in enumerate(left) if not isinstance(ms, int) or ms == -2]
        longer = [j for j, ms in enumerate(left) if isinstance(ms, int) and 0 <= ms < life]
        if longer:
            pipe = self.r.pipeline(transaction=False)
            for j in longer:
                pipe.pexpire(keys[j], life)
            # (one that expired since: sent below)
            lacking += [j for j, ok in zip(longer, pipe.execute(), strict=True) if not ok]
        sent = 0
        pipe, batch = self.r.pipeline(transaction=False), 0
        scratch = np.empty(max(layout.group_sizes, default=0), dtype=np.uint8)
        for j in sorted(lacking):
            i = full[j]
            view = scratch[: layout.group_sizes[i]].data
            kvformat.gather(layout, data, i, view)
            value = fmt.chunk_value(self.conf.codec, view)
            pipe.set(keys[j], value, px=life)
            sent += len(value)
            batch += len(value)
            if batch >= SEND_BATCH:
                pipe.execute()
                pipe, batch = self.r.pipeline(transaction=False), 0
        pipe.execute()
        self.chunks_sent += len(lacking)
        self.chunks_present += len(names) - len(lacking)
        body = fmt.pack_body(layout, inline)
        return body, b"".join(b + x for b, x in names), sent

    def _index(self, ev: Accepted, rid: bytes, chain: list[bytes], ttl_ms: int) -> None:
        """Make record ``rid`` (of ``ev``, whose digest chain is ``chain``) findable: in
        the index hash of its last full chunk prefix, and by a pointer at each of its
        chunk boundaries (``layout.boundaries``) that lives as long as it does (``ttl_ms``).
        A key of another type in the index hash's place (not ours) is replaced."""
        conf = self.conf
        idx = fmt.index_key(ev.root, conf.chunk, chain[-1] if chain else ev.root)
        pointer = fmt.boundary_value(rid, len(ev.tokens) // 4)
        for _ in range(2):
            pipe = self.r.pipeline(transaction=False)
            pipe.hset(idx, rid.hex(), fmt.index_value(ev.tokens))
            pipe.expire(idx, conf.ttl)
            for k in fmt.boundaries(len(chain)):  # (SET replaces a key of any type)
                pipe.set(fmt.boundary_key(ev.root, conf.chunk, chain[k - 1]), pointer, px=ttl_ms)
            res = pipe.execute(raise_on_error=False)
            err = next((x for x in res if isinstance(x, Exception)), None)
            if err is None:
                return
            if not is_wrongtype(err):
                raise err
            self.bad_keys += 1
            self.r.delete(idx)

    def close(self) -> None:
        if self.r is not None:
            try:
                self.r.close()
            except Exception:  # closing: nothing to do about it
                pass
            self.r = None


@dataclass
class FetchReq:
    """What a worker asked: the longest remote prefix of ``prompt`` beyond ``have`` tokens."""

    key: int
    root: bytes
    prompt: np.ndarray
    have: int
    #: the worker's measured prefill speed, tokens/s (0: not measured yet)
    prefill_tps: float
    #: the worker can cut a state back (no sliding window, no recurrent layer): a record
    #: that goes on past where it parts from the prompt is of use to it
    cut: bool = False


@dataclass
class FetchResult:
    key: int
    #: "found", "joined" (a fetch of the same record is being put into the arena, or
    #: was just put: answered with it), "none", "not_worth", "down", "corrupt"; misses
    #: counted apart:
    #: "untrusted" (a publisher we do not trust), "unverified" (no MAC under our keys),
    #: "too_big" (more than this arena can hold)
    status: str
    manifest: fmt.Manifest | None = None
    payload: bytes | bytearray | None = None
    #: the request, with "joined" (the loop sends it back if the record is gone meanwhile)
    req: FetchReq | None = None


class Fetcher:
    """The fetcher thread: lookups and fetches, one at a time, results to the loop."""

    def __init__(self, conf: RemoteConf) -> None:
        self.conf = conf
        self.r: Any = None
        #: pieces and chunks are read through it, on a connection of its own
        self.bulk: BulkReader | None = None
        #: the data region's size: a record whose extent is larger is refused unread
        self.capacity = 0
        #: records refused (rid -> until, monotonic): not read again for a while
        self._refused: OrderedDict[bytes, float] = OrderedDict()
        #: records found and handed to the loop, not yet put (rid); records put lately
        #: (rid -> until, monotonic): shared with the loop (``landed``), under ``_lock``
        self._lock = threading.Lock()
        self._landing: set[bytes] = set()
        self._landed: OrderedDict[bytes, float] = OrderedDict()
        self._q: queue.Queue[FetchReq | None] = queue.Queue(MAX_FETCH_QUEUE)
        self.results: queue.Queue[FetchResult] = queue.Queue()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._stop = threading.Event()
        self._down_until = 0.0
        self._backoff = FIRST_BACKOFF
        #: measured: bytes/s of piece reads (EWMA), seconds of a lookup round trip
        self.bandwidth = 0.0
        self.rtt = 0.0
        #: counted on this thread, read by the loop's ``stats``
        self.errors: dict[str, int] = {}
        self.corrupt = self.bad_keys = self.refused_skipped = 0
        self.fetched_bytes = 0
        self.fetch_seconds = 0.0
        #: chunks of fetched records taken from this arena, and read from Redis
        self.chunks_local = self.chunks_pulled = 0
        #: where this arena keeps a chunk (``Chunks.where``), and this thread's read-only
        #: view to copy it from (``attach``): without them every chunk is read from Redis
        self.locate: Callable[[tuple[int, bytes, bytes]], tuple[int, int, int] | None] | None
        self.source: PayloadSource | None
        self.locate, self.source = None, None
        self._thread = threading.Thread(target=self._run, name="shmkv-fetch", daemon=True)

    def attach(
        self,
        locate: Callable[[tuple[int, bytes, bytes]], tuple[int, int, int] | None],
        source: PayloadSource,
    ) -> None:
        """Take the chunks of a fetched record that this arena holds from it (``locate``
        says where one is, ``source`` reads it), not from Redis. Before :meth:`start`."""
        self.locate, self.source = locate, source

    def start(self) -> None:
        self._thread.start()

    def fileno(self) -> int:
        return self._wake_r

    def down(self) -> bool:
        return time.monotonic() < self._down_until

    def submit(self, req: FetchReq) -> bool:
        """Queue ``req``; False if the queue is full (never blocks)."""
        try:
            self._q.put_nowait(req)
            return True
        except queue.Full:
            return False

    def drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    # ------------------------------------------------------------- the thread
    def _run(self) -> None:
        while not self._stop.is_set():
            req = self._q.get()
            if req is None:
                return
            if self.down():
                res = FetchResult(req.key, "down")
            else:
                try:
                    if self.r is None:
                        self.r = connect(self.conf.url, self.conf.cluster, self.conf.timeout)
                        self.bulk = BulkReader(self.r)
                    res = self._fetch(req)
                    self._backoff = FIRST_BACKOFF
                except Exception as e:
                    res = FetchResult(req.key, "down")
                    self._failed(classify(e))
            self.results.put(res)
            del res  # (the loop holds the payload while it puts it; we do not)
            try:
                os.write(self._wake_w, b"\0")
            except BlockingIOError:
                pass

    def _failed(self, err: TierError) -> None:
        self.errors[err.kind] = self.errors.get(err.kind, 0) + 1
        if not self.down():
            log.warning("remote fetch: paused %.1f s (%s): %s", self._backoff, err.kind, err)
        self._down_until = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, MAX_BACKOFF)

    def _results(self, pipe: Any) -> list[Any]:
        """A pipeline's replies; one of a key of the wrong type is None (a miss, counted),
        any other error is raised (the server's, not one key's)."""
        out = []
        for x in pipe.execute(raise_on_error=False):
            if isinstance(x, Exception):
                if not is_wrongtype(x):
                    raise x
                self.bad_keys += 1
                x = None
            out.append(x)
        return out

    def _known_bad(self, rid: bytes) -> bool:
        until = self._refused.get(rid)
        if until is None:
            return False
        if until < time.monotonic():
            del self._refused[rid]
            return False
        self.refused_skipped += 1
        return True

    def _refuse(self, rid: bytes) -> None:
        self._refused[rid] = time.monotonic() + REFUSED_TTL
        self._refused.move_to_end(rid)
        while len(self._refused) > MAX_REFUSED:
            self._refused.popitem(last=False)

    def _fits(self, man: fmt.Manifest) -> bool:
        *_, extent = record_layout(man.n_tokens, len(man.fingerprint), man.payload_len)
        return extent <= self.capacity

    def _lookup(self, req: FetchReq) -> list[tuple[int, bytes]]:
        """Candidate records for ``req``, as (tokens they surely share with its prompt,
        rid), from one pipelined round trip: the index hashes of the prompt's chunk
        prefixes (records that are a whole prefix of it, told by their tokens tag) and,
        if the worker can cut a state back, the pointers at those prefixes (records that
        go on past them)."""
        conf, r = self.conf, self.r
        n_prompt = len(req.prompt)
        first = max(0, req.have // conf.chunk - 1)
        chain = chain_digests(req.root, req.prompt, conf.chunk)
        first = max(first, len(chain) - MAX_PROBES)
        digests = chain[first:]
        pipe = r.pipeline(transaction=False)
        for d in digests:
            pipe.hgetall(fmt.index_key(req.root, conf.chunk, d))
            if req.cut:
                pipe.get(fmt.boundary_key(req.root, conf.chunk, d))
        replies = self._results(pipe)
        hashes = replies[:: 2 if req.cut else 1]
        pointers = replies[1::2] if req.cut else []
        cands: dict[bytes, int] = {}
        prompt_bytes = np.ascontiguousarray(req.prompt, dtype="<i4").tobytes()
        tags: dict[int, str] = {}  # (the prompt's own tag at each length asked)
        for h in hashes:
            for k, v in (h or {}).items():
                parsed = fmt.parse_index_value(v)
                try:
                    rid = bytes.fromhex(k.decode())
                except (ValueError, UnicodeDecodeError):
                    continue
                if parsed is None or len(rid) != DIGEST_SIZE:
                    continue
                n, tag = parsed
                if not req.have < n <= n_prompt:
                    continue
                if n not in tags:
                    tags[n] = fmt.tokens_tag(prompt_bytes[: 4 * n])
                if tag == tags[n] and not self._known_bad(rid):  # (a prefix of this prompt)
                    cands[rid] = max(cands.get(rid, 0), n)
        for i, raw in enumerate(pointers):
            shared = (first + i + 1) * conf.chunk  # (the digest of that many tokens matched)
            found = None if raw is None else fmt.parse_boundary_value(raw)
            if found is not None and shared > req.have and not self._known_bad(found[0]):
                cands[found[0]] = max(cands.get(found[0], 0), shared)
        best = sorted(((n, rid) for rid, n in cands.items()), reverse=True)
        return best[:MAX_CANDIDATES]

    def _fetch(self, req: FetchReq) -> FetchResult:
        conf, r = self.conf, self.r
        n_prompt = len(req.prompt)
        t0 = time.perf_counter()
        cands = self._lookup(req)
        self.rtt = time.perf_counter() - t0
        if not cands:
            return FetchResult(req.key, "none")
        pipe = r.pipeline(transaction=False)
        for _, rid in cands:
            pipe.get(fmt.manifest_key(rid))
        man, useful = None, 0
        miss = "none"
        for (_, rid), raw in zip(cands, self._results(pipe), strict=True):
            if raw is None:
                continue
            try:
                m = fmt.unpack_manifest(rid, raw, conf.keys)
            except TierError as e:
                if e.kind == "unverified":  # (maybe another key's: not ours to delete)
                    self._refuse(rid)
                    miss = "unverified"
                else:
                    self._corrupt(rid, e)
                continue
            if m.root != req.root:
                continue
            # what it gives this prompt: all of it if it is a prefix, else what the worker
            # keeps once it cuts it back (only a worker that can asked for such records)
            common = common_prefix(np.frombuffer(m.tokens, dtype="<i4"), req.prompt)
            whole = common == m.n_tokens <= n_prompt
            if not (whole or req.cut) or common <= req.have or common < conf.chunk:
                continue
            if man is not None and (common, -m.stored_len) <= (useful, -man.stored_len):
                continue  # (the longest shared part wins; of equals, the fewest bytes)
            if not conf.trusts(m.uid):
                self._refuse(rid)
                miss = "untrusted"
                continue
            if not self._fits(m):  # (before a byte of it is read)
                log.info(
                    "remote record %s refused unread: %d bytes can never fit this arena",
                    rid.hex()[:12],
                    m.payload_len,
                )
                self._refuse(rid)
                miss = "too_big"
                continue
            man, useful = m, common
        if man is None:
            return FetchResult(req.key, miss)
        rid = man.rid()
        if self.joinable(rid):  # (being put into the arena, or just put: read once)
            return FetchResult(req.key, "joined", man, req=req)
        # (fetching beats prefilling what it saves? For a chunked record, decided once its
        # body says which chunks this arena lacks)
        worth = self._worth(req, useful)
        if not man.chunks and not worth(man.stored_len):
            return FetchResult(req.key, "not_worth", man)
        try:
            stored = self._read_pieces(rid, man)
            if stored is None:
                return FetchResult(req.key, "none")  # expired or evicted under maxmemory
            payload: bytes | bytearray | None = _decompress(man.codec, stored, man.stored_of)
            del stored
            status = "found"
            if man.chunks and payload is not None:
                status, payload = self._chunked(rid, man, payload, worth)
            if payload is None:
                return FetchResult(req.key, status, man if status == "not_worth" else None)
            if (
                len(payload) != man.payload_len
                or xxhash.xxh3_64_intdigest(payload) != man.payload_xxh3
            ):
                raise TierError("remote payload checksum mismatch", "corrupt")
        except TierError as e:
            if e.kind != "corrupt":
                raise
            self._corrupt(rid, e)
            return FetchResult(req.key, "corrupt")
        with self._lock:
            self._landing.add(rid)
        return FetchResult(req.key, "found", man, payload)

    def _worth(self, req: FetchReq, useful: int) -> Callable[[int], bool]:
        """Whether reading ``n`` more bytes from Redis takes less time than prefilling the
        ``useful - have`` tokens it saves (at the worker's measured speed; unmeasured:
        yes)."""
        bw = self.bandwidth or DEFAULT_BANDWIDTH

        def worth(n: int) -> bool:
            tps = req.prefill_tps
            return tps <= 0 or self.rtt + n / bw < (useful - req.have) / tps

        return worth

    def _chunked(
        self, rid: bytes, man: fmt.Manifest, body: bytes | bytearray, worth: Callable[[int], bool]
    ) -> tuple[str, bytearray | None]:
        """Chunked record ``man``'s payload, put together from its ``body`` and its chunks:
        those this arena holds copied from it (under the record's publisher uid, checked
        by XXH3-128), the others read from Redis (checked by BLAKE2b-128). ("found",
        payload), or (status, None): "not_worth" (the chunks to read take longer than the
        prefill), "none" (a chunk is gone: the record is forgotten)."""
        layout, inline = fmt.parse_body(body, man)
        full = [i for i, f in enumerate(layout.group_full) if f]
        groups: list[bytes | memoryview | None] = [None] * len(layout.group_sizes)
        it = iter(inline)
        for i, f in enumerate(layout.group_full):
            if not f:
                groups[i] = next(it)
        need: list[tuple[int, int]] = []  # (chunk, group)
        for j, i in enumerate(full):
            _, xxh = man.chunk(j)
            got = None
            if self.locate is not None and self.source is not None:
                where = self.locate((man.uid, layout.group_sigs[i], xxh))
                if where is not None and where[2] == layout.group_sizes[i]:
                    got = self.source.chunk(where, xxh)
            if got is None:
                need.append((j, i))
            else:
                groups[i] = got
        self.chunks_local += len(full) - len(need)
        if not worth(sum(layout.group_sizes[i] for _, i in need)):
            return "not_worth", None
        pulled = len(need)
        t1, nbytes = time.perf_counter(), 0
        keyed = bool(self.conf.keys)
        assert self.bulk is not None
        while need:
            batch: list[tuple[int, int]] = []
            size = 0
            while need and (not batch or size + layout.group_sizes[need[0][1]] <= READ_BATCH):
                batch.append(need.pop(0))
                size += layout.group_sizes[batch[-1][1]]
            # (never more than a chunk of its size can take, and one byte to tell)
            bufs = [bytearray(fmt.chunk_room(layout.group_sizes[i]) + 1) for _, i in batch]
            reads = [
                (fmt.chunk_key(man.root, man.chunk(j)[0]), memoryview(buf))
                for (j, _), buf in zip(batch, bufs, strict=True)
            ]
            for (j, i), buf, n in zip(batch, bufs, self.bulk.read(reads), strict=True):
                if n is None:
                    self.bad_keys += 1
                if not n:  # (expired or evicted: the record can never be read again)
                    log.info("remote record %s lost a chunk: forgotten", rid.hex()[:12])
                    self._forget(rid)
                    return "none", None
                blake, xxh = man.chunk(j)
                # (signed manifests: each chunk checked by the BLAKE2b the MAC covers; else
                # by its XXH3-128, as local chunks are: either catches damage, and without
                # a key whoever writes to Redis writes manifests too)
                raw = memoryview(buf)[:n]
                data = fmt.chunk_data(raw, layout.group_sizes[i], blake if keyed else None)
                if xxhash.xxh3_128_digest(data) != xxh:
                    raise TierError("remote chunk's two digests disagree", "corrupt")
                groups[i] = data
                nbytes += n
        self.chunks_pulled += pulled
        self.fetched_bytes += nbytes
        if pulled:
            self._measured(nbytes, time.perf_counter() - t1)
        out = bytearray(man.payload_len)
        try:
            kvformat.assemble(layout, groups, memoryview(out))  # type: ignore[arg-type]
        except ArenaCorruptError as e:
            raise TierError(f"remote record does not assemble: {e}", "corrupt") from None
        return "found", out

    def _measured(self, nbytes: int, dt: float) -> None:
        """``nbytes`` were read from Redis in ``dt`` seconds: the bandwidth estimate."""
        self.fetch_seconds += dt
        if dt > 0:
            got = nbytes / dt
            self.bandwidth = got if not self.bandwidth else 0.7 * self.bandwidth + 0.3 * got

    # ------------------------------------------------------------- merging
    def joinable(self, rid: bytes) -> bool:
        """Record ``rid`` is being put into the arena, or was put moments ago."""
        with self._lock:
            if rid in self._landing:
                return True
            until = self._landed.get(rid)
            if until is not None and until < time.monotonic():
                del self._landed[rid]
                return False
            return until is not None

    def landed(self, rid: bytes, ok: bool) -> None:
        """The loop is done putting ``rid`` into the arena (``ok``: it is there now; else
        it is not, and a later fetch reads it again)."""
        with self._lock:
            self._landing.discard(rid)
            self._landed.pop(rid, None)
            if ok:
                self._landed[rid] = time.monotonic() + LANDED_TTL
                self._landed.move_to_end(rid)
                while len(self._landed) > MAX_LANDED:
                    self._landed.popitem(last=False)

    def _read_pieces(self, rid: bytes, man: fmt.Manifest) -> bytearray | None:
        """The stored bytes of ``man``'s record, a few pieces per round trip, read into
        one buffer; each piece checked against its digest as it arrives where the
        manifest is signed (else the payload's XXH3 is the check); None if a piece is
        missing."""
        # (one byte more than the record, so that each read may take one byte more than
        # its piece: one that does is damaged)
        out = bytearray(man.stored_len + 1)
        t1 = time.perf_counter()
        with memoryview(out) as view:
            for lo in range(0, man.pieces, PIECES_PER_READ):
                if not self._read_batch(rid, man, view, lo, min(man.pieces, lo + PIECES_PER_READ)):
                    return None
        self._measured(man.stored_len, time.perf_counter() - t1)
        del out[man.stored_len :]
        return out

    def _read_batch(
        self, rid: bytes, man: fmt.Manifest, view: memoryview, lo: int, hi: int
    ) -> bool:
        """Pieces ``lo`` to ``hi`` of ``man``'s record into their place in ``view``: one
        round trip; False if one is missing."""
        keyed, d = bool(self.conf.keys), fmt.PIECE_DIGEST
        assert self.bulk is not None
        reads = []
        for i in range(lo, hi):
            pos = i * fmt.PIECE
            want = min(fmt.PIECE, man.stored_len - pos)
            reads.append((fmt.piece_key(rid, i), view[pos : pos + want + 1]))
        # (the views of ``view`` die with this call, before the caller resizes its buffer)
        for i, (_, part), got in zip(range(lo, hi), reads, self.bulk.read(reads), strict=True):
            if got is None:
                self.bad_keys += 1
            if not got:
                return False
            if got != len(part) - 1 or (
                keyed and fmt.piece_digest(part[:got]) != man.digests[i * d : i * d + d]
            ):
                raise TierError(f"remote piece {i} does not match its manifest", "corrupt")
            self.fetched_bytes += got
        return True

    def _corrupt(self, rid: bytes, e: TierError) -> None:
        self.corrupt += 1
        self._refuse(rid)
        log.warning("remote record %s rejected: %s", rid.hex()[:12], e)
        self._forget(rid)

    def _forget(self, rid: bytes) -> None:
        """Delete record ``rid``'s manifest: nobody fetches it again, and the next node
        that publishes its prompt writes it anew."""
        try:
            self.r.delete(fmt.manifest_key(rid))
        except Exception as e:
            log.debug("cannot delete the remote record: %s", e)

    def close(self) -> None:
        self._stop.set()
        try:
            self._q.put_nowait(None)
        except queue.Full:
            pass
        if self._thread.is_alive():
            self._thread.join(self.conf.timeout * 3 + 1.0)
        if self.r is not None and not self._thread.is_alive():
            if self.bulk is not None:
                self.bulk.close()
            try:
                self.r.close()
            except Exception:  # closing: nothing to do about it
                pass
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
        self._wake_r = self._wake_w = -1
