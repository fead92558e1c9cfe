"""``--remote`` wired into the supervisor: the write-behind to Redis, and fetches into the arena.

Runs in the supervisor. :class:`Remote` is what ``loop.py`` holds: hooked into the
store (every record accepted goes to the write-behind, ``remote.RedisWriter``), asked by
the ``fetch`` op whether the remote tier holds a longer prefix of a prompt, and stepped
by the loop: a fetch request goes to the fetcher thread (``remote.Fetcher``) and its
peer's reply waits; what the thread found is put into the arena on the loop, a
``--put-slice`` at a time, through the same :class:`~shmkv.supervisor.put.PutJob` as a worker's
put (bounds, XXH3 of the payload), published under the uid its manifest names (the
publisher's on the node that wrote it; never re-labelled as ours) and not written back.
A fetch that finds a record already being put joins that put (one read from Redis for
all of them). The peer is answered when its record is indexed, or at its deadline,
whichever comes first: a fetch that outlives its deadline still lands in the arena
and warms it for the next request. Redis being down, slow or full costs an answer
("down", "timeout"), never a wait past the deadline.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from shmkv.core.config import Settings, trusted_uids
from shmkv.core.errors import ChecksumMismatch, ShmkvError
from shmkv.core.keys import content_digest
from shmkv.core.stats import RemoteStats
from shmkv.supervisor.put import PutJob
from shmkv.supervisor.store import Store
from shmkv.supervisor.tiers.base import PayloadSource, WriteBehind, merged_errors
from shmkv.supervisor.tiers.redis.backend import (
    Fetcher,
    FetchReq,
    FetchResult,
    RedisWriter,
    RemoteConf,
    load_keys,
)

log = logging.getLogger(__name__)

#: fetches one connection may have outstanding; more are answered "busy"
MAX_PER_PEER = 2

Answer = Callable[[int, int, dict[str, Any]], None]


@dataclass
class Pending:
    """A peer waiting for a fetch: its connection, request id and deadline (monotonic)."""

    conn_id: int
    rid: int
    deadline: float


@dataclass
class Landing:
    """A record found remotely, being put into the arena, and the requests waiting for it."""

    rid: bytes
    job: PutJob
    keys: list[int]


class Remote:
    """The write-behind to ``--remote`` and fetches from it."""

    def __init__(self, settings: Settings, ro_fd: int, chunk: int) -> None:
        extra = trusted_uids(getattr(settings, "trust_publishers", "") or "")
        key_file = getattr(settings, "remote_key_file", None)
        self.conf = RemoteConf(
            url=settings.remote,
            cluster=bool(settings.remote_cluster),
            ttl=int(settings.remote_ttl),
            chunk=chunk,
            codec=settings.remote_compress,
            timeout=float(settings.remote_timeout),
            node=socket.gethostname()[:64],
            trusted=None if extra is None else frozenset({os.geteuid(), *extra}),
            keys=load_keys(key_file) if key_file else (),
        )
        self.max_wait = float(settings.remote_wait)
        self.redis = RedisWriter(self.conf)
        self.writer = WriteBehind(self.redis, PayloadSource(ro_fd))
        self.fetcher = Fetcher(self.conf)
        #: the fetcher thread's own read-only view, to take chunks this arena holds
        self._chunk_source = PayloadSource(ro_fd)
        self.stats = RemoteStats()
        self.pending: dict[int, Pending] = {}
        self._next = 1
        #: records found remotely, being put into the arena, one job each, with the
        #: requests waiting for it (a fetch of the same record joins the first one's)
        self._jobs: list[Landing] = []
        self._store: Store | None = None
        self._answer: Answer | None = None
        self._indexed: Callable[[list[bytes]], None] | None = None

    def attach(self, store: Store, answer: Answer, indexed: Callable[[list[bytes]], None]) -> None:
        """Write what ``store`` accepts behind; answer peers through ``answer(conn, rid,
        reply)``; tell ``indexed(digests)`` of each fetched record (claims wait on it)."""
        self._store, self._answer, self._indexed = store, answer, indexed
        self.fetcher.capacity = store.geometry.data_size
        self.fetcher.attach(store.chunks.where, self._chunk_source)
        store.tiers.append(self.writer)
        self.writer.start()
        self.fetcher.start()

    def fileno(self) -> int:
        """Readable when the fetcher has results: the loop registers it."""
        return self.fetcher.fileno()

    # ------------------------------------------------------------- requests
    def request(
        self,
        conn_id: int,
        rid: int,
        root: bytes,
        prompt: np.ndarray,
        have: int,
        wait: float,
        prefill_tps: float,
        cut: bool = False,
    ) -> dict[str, Any] | None:
        """A peer's ``fetch``: an answer now, or None (answered later, by the deadline).
        ``cut``: the peer's model can cut a state back, so a record that goes on past
        where it parts from the prompt is of use to it."""
        self.stats.remote_fetches += 1
        if self.fetcher.down() or not self.writer.opened.is_set():
            self.stats.remote_fetch_down += 1
            return {"status": "down"}
        if sum(1 for p in self.pending.values() if p.conn_id == conn_id) >= MAX_PER_PEER:
            self.stats.remote_fetch_busy += 1
            return {"status": "busy"}
        key, self._next = self._next, self._next + 1
        if not self.fetcher.submit(FetchReq(key, root, prompt, have, prefill_tps, cut)):
            self.stats.remote_fetch_busy += 1
            return {"status": "busy"}
        self.pending[key] = Pending(conn_id, rid, time.monotonic() + min(wait, self.max_wait))
        return None

    def _reply(self, key: int, reply: dict[str, Any]) -> None:
        p = self.pending.pop(key, None)
        if p is not None and self._answer is not None:
            self._answer(p.conn_id, p.rid, reply)

    def drop_conn(self, conn_id: int) -> None:
        """The connection closed: forget its waits (its fetches still warm the arena)."""
        for key in [k for k, p in self.pending.items() if p.conn_id == conn_id]:
            del self.pending[key]

    # ------------------------------------------------------------- the loop
    @property
    def busy(self) -> bool:
        """A fetched record is being put, or results wait: step again without waiting."""
        return bool(self._jobs) or not self.fetcher.results.empty()

    def next_deadline(self) -> float | None:
        return min((p.deadline for p in self.pending.values()), default=None)

    def expire(self, now: float) -> None:
        """Answer "timeout" to every peer whose deadline passed."""
        for key in [k for k, p in self.pending.items() if p.deadline <= now]:
            self.stats.remote_fetch_late += 1
            self._reply(key, {"status": "timeout"})

    def step(self, deadline: float) -> None:
        """Take the fetcher's results; put found records, until ``deadline``."""
        self.fetcher.drain_wake()
        while not self.fetcher.results.empty():
            res = self.fetcher.results.get_nowait()
            if res.status == "found":
                self._begin(res)
            elif res.status == "joined":
                self._join(res)
            else:
                counter = f"remote_fetch_{res.status}"
                setattr(self.stats, counter, getattr(self.stats, counter) + 1)
                miss = res.status in ("untrusted", "unverified", "too_big")
                self._reply(res.key, {"status": "none" if miss else res.status})
        while self._jobs and time.monotonic() < deadline:
            land = self._jobs[0]
            try:
                entry = land.job.step(deadline)
            except ShmkvError as e:
                self._jobs.pop(0)
                if isinstance(e, ChecksumMismatch):
                    self.stats.remote_fetch_corrupt += 1
                else:
                    self.stats.remote_fetch_refused += 1
                log.info("remote record not put into the arena: %s", e)
                self._failed(land.rid, land.keys)
                continue
            if entry is None:
                return
            self._jobs.pop(0)
            self._done(land.rid, land.keys, entry.n_tokens, entry.payload_len, entry.digests)

    def _begin(self, res: FetchResult) -> None:
        man, payload = res.manifest, res.payload
        assert man is not None and payload is not None and self._store is not None
        rid = man.rid()
        try:
            # (the publisher's uid, trusted above: never ours instead; not written back to
            # Redis, to --persist yes)
            job = self._store.put_record(man.meta(), payload, self.writer)
        except ShmkvError as e:  # (too short for this arena's chunk, or can never fit)
            self.stats.remote_fetch_refused += 1
            log.info("remote record not put into the arena: %s", e)
            self._failed(rid, [res.key])
            return
        if job.done:  # a worker here published it meanwhile
            self._done(rid, [res.key], man.n_tokens, 0, [])
        else:
            self._jobs.append(Landing(rid, job, [res.key]))

    def _join(self, res: FetchResult) -> None:
        """A fetch found a record that another one is putting into the arena (or has just
        put): answered with it, read from Redis once."""
        assert res.manifest is not None
        rid = res.manifest.rid()
        self.stats.remote_fetch_joined += 1
        for land in self._jobs:
            if land.rid == rid:
                land.keys.append(res.key)
                return
        # put already: answered with it if the arena still holds it; else (evicted,
        # refused) forgotten, and this request goes back to the fetcher to read it
        man = res.manifest
        assert self._store is not None and res.req is not None
        if content_digest(man.root, man.fingerprint, man.tokens, man.uid) in self._store.by_content:
            self._reply(res.key, {"status": "fetched", "n_tokens": man.n_tokens})
            return
        self.fetcher.landed(rid, False)
        if not self.fetcher.submit(res.req):
            self.stats.remote_fetch_busy += 1
            self._reply(res.key, {"status": "busy"})

    def _failed(self, rid: bytes, keys: list[int]) -> None:
        self.fetcher.landed(rid, False)
        for key in keys:
            self._reply(key, {"status": "none"})

    def _done(
        self, rid: bytes, keys: list[int], n_tokens: int, nbytes: int, digests: list[bytes]
    ) -> None:
        self.fetcher.landed(rid, True)
        self.stats.remote_fetched += 1
        self.stats.remote_fetched_bytes += nbytes
        if digests and self._indexed is not None:
            self._indexed(digests)
        for key in keys:
            self._reply(key, {"status": "fetched", "n_tokens": n_tokens})

    # ------------------------------------------------------------- numbers
    def numbers(self) -> RemoteStats:
        s, w, r, f = self.stats, self.writer, self.redis, self.fetcher
        s.remote_on = int(w.opened.is_set())
        s.remote_paused = int(bool(w.paused) or f.down())
        s.remote_queue = w.queued()
        s.remote_written = r.written
        s.remote_written_bytes = r.written_bytes
        s.remote_stored_bytes = r.stored_bytes
        s.remote_present = r.present
        s.remote_dropped = w.dropped
        s.remote_gone = r.gone
        s.remote_corrupt = f.corrupt
        s.remote_untrusted = r.untrusted
        s.remote_bad_keys = r.bad_keys + f.bad_keys
        s.remote_refused_skipped = f.refused_skipped
        s.remote_pulled_bytes = f.fetched_bytes
        s.remote_pull_seconds = f.fetch_seconds
        s.remote_bandwidth = int(f.bandwidth)
        s.remote_chunks_sent = r.chunks_sent
        s.remote_chunks_present = r.chunks_present
        s.remote_chunks_local = f.chunks_local
        s.remote_chunks_pulled = f.chunks_pulled
        s.remote_errors = merged_errors(w.errors, f.errors)
        return s

    def close(self) -> None:
        """Stop fetching, write what is queued (a few seconds at most), close."""
        for key in list(self.pending):
            self._reply(key, {"status": "down"})
        for land in self._jobs:
            land.job.abort()
        self._jobs = []
        self.fetcher.close()
        self.writer.close()
        self._chunk_source.close()
