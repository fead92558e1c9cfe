"""The tests' Redis: real ``redis-server`` processes on loopback ports, and what the remote
tier's tests ask of a node and of Redis (``--remote``)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import redis

from tests.support.servers import free_port
from tests.support.supervisors import Sup
from tests.support.waiting import wait_until

REDIS = shutil.which("redis-server")
#: why a test that needs redis-server skips without it
NO_REDIS = "needs redis-server (apt-get install redis-server; .ci/run does)"


class RedisProc:
    """One redis-server on a loopback port, its files in ``dir``."""

    def __init__(self, dir: Path, port: int | None = None, *extra: str) -> None:
        self.dir, self.port, self.extra = dir, port or free_port(), extra
        dir.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        assert REDIS is not None, NO_REDIS
        self.proc = subprocess.Popen(
            [REDIS, "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
            + ["--dir", str(self.dir), "--daemonize", "no", "--loglevel", "warning"]
            + list(self.extra or ("--appendonly", "no")),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        r = redis.Redis(port=self.port, socket_timeout=1)
        try:
            wait_until(lambda: self._pings(r), 15, f"redis-server on port {self.port}")
        except AssertionError:
            self.kill()
            raise
        finally:
            r.close()

    @staticmethod
    def _pings(r: redis.Redis) -> bool:
        try:
            return bool(r.ping())
        except redis.RedisError:
            return False

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=5)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def written(sup: Sup, n: int = 1) -> dict:
    """``sup``'s stats once its write-behind wrote ``n`` records and has none queued."""
    return wait_until(
        lambda: (st := sup.stats())["remote_written"] >= n and st["remote_queue"] == 0 and st,
        20,
        "the remote write-behind",
    )


def settled(sup: Sup, n: int) -> dict:
    """``sup``'s stats once its write-behind took ``n`` accepted records (written,
    present or not trusted) and has none queued."""

    def done():
        st = sup.stats()
        took = st["remote_written"] + st["remote_present"] + st.get("remote_untrusted", 0)
        return took >= n and st["remote_queue"] == 0 and st

    return wait_until(done, 20, "the remote write-behind")


def put_written(sup: Sup, *blobs) -> None:
    """Put ``blobs`` (``tests/support/blobs.py``) into ``sup``'s arena; return once its
    write-behind wrote them (``remote_written`` counts every record so far: a second call
    waits for its own, not for the first call's count again)."""
    before = sup.stats()["remote_written"]
    with sup.client() as c:
        for b in blobs:
            c.put_bytes(b.root, b.tokens, b"fp", b.data)
    written(sup, before + len(blobs))


def fetch_blob(sup: Sup, b, wait: float = 5.0) -> tuple[str, bytes | None]:
    """Ask ``sup`` to fetch blob ``b`` from Redis; (status, payload now in its arena)."""
    with sup.client() as c:
        status = c.fetch(b.root, b.tokens, 0, wait, 0.0)
        hit = c.lookup(b.digests())
        if hit is None:
            return status, None
        with c.acquire(hit) as lease:
            data = bytes(lease.payload)
            assert lease.finish()
        return status, data


def redis_keys(r: redis.Redis) -> dict[str, int]:
    """Every shmkv key in ``r`` and its PTTL in ms (-1: it never expires)."""
    return {k.decode(): r.pttl(k) for k in r.scan_iter("shmkv:*")}


def received_by(r: redis.Redis) -> int:
    """Bytes Redis has received from its clients so far."""
    return int(r.info("stats")["total_net_input_bytes"])


def sent_by(r: redis.Redis) -> int:
    """Bytes Redis has sent to its clients so far."""
    return int(r.info("stats")["total_net_output_bytes"])


def key_file(dir: Path, name: str, *keys: bytes, mode: int = 0o600) -> str:
    """A ``--remote-key-file`` in ``dir`` holding ``keys``, one per line."""
    path = dir / name
    path.write_bytes(b"\n".join(keys) + b"\n")
    path.chmod(mode)
    return str(path)
