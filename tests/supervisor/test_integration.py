"""Where two features meet: adoption and ``--ttl``, ``--persist`` and ``--ttl``, adoption
and ``--persist``'s pins, the tiers that a refilled or fetched record reaches, and the
exporter's view of the newer stats groups.

Each feature has its own test file; these are the cases that only break when two of
them run in one supervisor. Real supervisors (and a real redis-server where the remote
tier is involved), real sockets and shared memory, blobs put through the client.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import fields

import httpx
import pytest
import redis

import shmkv.llama.tenant
from shmkv import Client
from shmkv.core.keys import key_root
from shmkv.core.stats import PersistStats, RemoteStats, metric_name
from tests.support.blobs import Blob, blob, put_blob, stored_keys, use_blob
from tests.support.servers import free_port, scrape
from tests.support.supervisors import (
    Sup,
    kill9,
    no_internal_errors,
    persisted_all,
    restart,
    start_supervisor,
)
from tests.support.waiting import wait_until


# ------------------------------------------------------------------ adopt x --ttl
def test_adopted_states_do_not_all_expire_at_the_first_tick(make_supervisor) -> None:
    """A state in use for longer than --ttl when its supervisor is killed: the arena keeps
    no last use, so adoption must not take the record's age for idle time (every state
    older than --ttl would go at the new supervisor's first tick). It counts as used at
    adoption, and expires --ttl after that if nobody uses it."""
    args = ("--size", "32M", "--ttl", "3")
    sup = make_supervisor(*args)
    b = blob(31, 20_000)
    with sup.client() as c:
        key = put_blob(c, b)
        deadline = time.monotonic() + 4.5  # older than --ttl, never idle for it
        while time.monotonic() < deadline:
            use_blob(c, b)
            time.sleep(0.4)
        assert key in stored_keys(c)
    kill9(sup)
    new = restart(make_supervisor, sup, *args)
    adopted = time.monotonic()
    with new.client() as c:
        assert c.stats()["adopted"] == 1
        # a tick of the new supervisor passed: a marker pinned with a 1 ms TTL goes at the
        # first one (the same tick looks at the adopted state first)
        marker = put_blob(c, blob(32, 1000), pin=True)
        assert c.pin(bytes.fromhex(marker), ttl=0.001) == 1
        wait_until(lambda: marker not in stored_keys(c), 10, "a tick of the new supervisor")
        assert key in stored_keys(c), new.log()
        assert c.stats()["expired"] == 1
        # nobody uses it: it goes --ttl after the adoption
        wait_until(lambda: key not in stored_keys(c), 8, "the adopted state to expire")
        assert time.monotonic() - adopted > 2.5
        assert c.stats()["expired"] == 2
    no_internal_errors(new)


# ------------------------------------------------------------ --persist x --ttl
def test_an_expired_state_does_not_come_back_after_a_reboot(make_supervisor, tmp_path) -> None:
    """--ttl releases a state nobody used; with --persist it must go from disk too, or the
    next reboot's refill brings it back (and it expires again, a zombie every boot)."""
    disk = tmp_path / "persist"
    sup = make_supervisor("--size", "32M", "--persist", str(disk), "--ttl", "1.5")
    idle, used = blob(41, 20_000), blob(42, 20_000)
    with sup.client() as c:
        idle_key, used_key = put_blob(c, idle), put_blob(c, used)
        wait_until(lambda: persisted_all(sup), 20, "the write-behind")

        def idle_expired() -> bool:  # keep `used` in use until `idle` expired
            gone = c.stats()["expired"] > 0  # (a request first: see test_ttl)
            use_blob(c, used)
            return gone

        wait_until(idle_expired, 15, "the idle state to expire", step=0.3)
        assert idle_key not in stored_keys(c) and used_key in stored_keys(c)
        wait_until(lambda: sup.stats()["persist_records"] == 1, 10, "the disk to forget it")
    assert sup.stop() == 0, sup.log()
    sup.arena.unlink(missing_ok=True)  # what a reboot does to /dev/shm
    again = start_supervisor(tmp_path, "--size", "32M", "--persist", str(disk), name=sup.name)
    try:
        st = wait_until(lambda: (s := again.stats())["refilling"] == 0 and s, 30, "the refill")
        assert st["refilled"] == 1, st
        with again.client() as c:
            assert stored_keys(c) == {used_key}
            assert c.lookup(idle.digests()) is None
            use_blob(c, used)
    finally:
        assert again.stop() == 0
    no_internal_errors(sup, again)


# ------------------------------------------------- adopt x --persist, pins x --persist
def pins(c: Client) -> dict[str, bool]:
    return {r["key"]: r["pinned"] for r in c.ls()["entries"]}


def test_a_restart_that_adopts_keeps_the_pins_the_disk_keeps(make_supervisor, tmp_path) -> None:
    """The arena file keeps no pins, --persist does: a kill -9 restart (which adopts, and
    so does not refill) must not lose a pin that a reboot (which refills) would keep."""
    args = ("--size", "32M", "--persist", str(tmp_path / "persist"))
    sup = make_supervisor(*args)
    pinned, plain = blob(71, 20_000), blob(72, 20_000)
    with sup.client() as c:
        pinned_key, plain_key = put_blob(c, pinned, pin=True), put_blob(c, plain)
    wait_until(lambda: persisted_all(sup), 20, "the write-behind")
    kill9(sup)
    new = restart(make_supervisor, sup, *args)
    with new.client() as c:
        assert c.stats()["adopted"] == 2 and c.stats()["refilled"] == 0
        wait_until(lambda: pins(c) == {pinned_key: True, plain_key: False}, 10, "the pin")
        assert c.stats()["pinned_bytes"] > 0
    no_internal_errors(new)


def test_a_pin_with_a_ttl_does_not_come_back_for_ever(make_supervisor, tmp_path) -> None:
    """`shmkv pin --ttl` (warm/import --pin-ttl) pins a state until it went unused that
    long. Kept on disk as a plain pin, it came back after a reboot pinned with no TTL,
    never to be released: such a pin is not kept on disk (the state is, unpinned)."""
    disk = tmp_path / "persist"
    sup = make_supervisor("--size", "32M", "--persist", str(disk))
    short, kept = blob(73, 20_000), blob(74, 20_000)
    with sup.client() as c:
        short_key, kept_key = put_blob(c, short, pin=True), put_blob(c, kept, pin=True)
        assert c.pin(bytes.fromhex(short_key), ttl=3600) == 1
        assert pins(c) == {short_key: True, kept_key: True}
    wait_until(lambda: persisted_all(sup), 20, "the write-behind")
    assert sup.stop() == 0, sup.log()  # (a clean stop writes what is queued)
    sup.arena.unlink(missing_ok=True)
    again = start_supervisor(tmp_path, "--size", "32M", "--persist", str(disk), name=sup.name)
    try:
        wait_until(lambda: again.stats()["refilled"] == 2, 20, "the refill")
        with again.client() as c:
            assert pins(c) == {short_key: False, kept_key: True}
    finally:
        assert again.stop() == 0
    no_internal_errors(sup, again)


# ------------------------------------------------------ /metrics x --persist, --remote
def test_metrics_and_stats_show_the_persist_and_remote_groups(make_supervisor, tmp_path) -> None:
    """`shmkv stats` has the persist_* and remote_* numbers; /metrics derives from the same
    schema, so it must have them too (counters as _total, by-kind failures labelled)."""
    port, dead = free_port(), free_port()  # (nothing listens on `dead`: Redis is down)
    sup = make_supervisor(
        "--size", "16M", "--metrics-port", str(port),
        "--persist", str(tmp_path / "persist"),
        "--remote", f"redis://127.0.0.1:{dead}/0", "--remote-timeout", "0.5",
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}/metrics"
    with sup.client() as c:
        put_blob(c, blob(51, 30_000))
    wait_until(lambda: persisted_all(sup), 20, "the write-behind")
    st = wait_until(lambda: (s := sup.stats())["remote_errors"] and s, 20, "a remote failure")
    s = wait_until(lambda: _scrape_or_none(url), 10, "the metrics port")
    assert s["shmkv_persisted_total{}"] == ("counter", 1)
    assert s["shmkv_persisted_bytes_total{}"] == ("counter", 30_000)
    assert s["shmkv_persist_records{}"] == ("gauge", 1)
    assert s["shmkv_persist_on{}"] == ("gauge", 1)
    assert s["shmkv_refill_duration_seconds{}"][0] == "gauge"
    assert s["shmkv_remote_on{}"] == ("gauge", 0)
    assert "shmkv_remote_bandwidth_bytes_per_second{}" in s
    kinds = {k: v for k, v in s.items() if k.startswith("shmkv_remote_errors_total{kind=")}
    assert kinds and all(t == "counter" for t, _ in kinds.values()), s.keys()
    assert sum(v for _, v in kinds.values()) >= sum(st["remote_errors"].values())
    # every plain number of both groups is there, under its schema name
    for group in (PersistStats, RemoteStats):
        for f in fields(group):
            if isinstance(getattr(group(), f.name), dict):
                continue
            suffix = "_total" if f.metadata["kind"] == "counter" else ""
            assert f"shmkv_{metric_name(f)}{suffix}{{}}" in s, f.name
    # and `shmkv stats` (no --json) says what the tiers do, as the README's grep expects
    out = sup.cli("stats").stdout
    assert "persist: 1 states (29.3 KiB) on disk, 1 written" in out, out
    assert "remote: on 0, 0 written, 0 fetched of 0 asked" in out, out
    assert "refill:" not in out and "adopted:" not in out, out  # (not in use: no row)
    no_internal_errors(sup)


def _scrape_or_none(url: str) -> dict | None:
    try:
        return scrape(url, kinds=True)
    except httpx.HTTPError:
        return None


# ------------------------------------------------- --remote x --persist (x refill)
REDIS = shutil.which("redis-server")
needs_redis = pytest.mark.skipif(
    REDIS is None, reason="needs redis-server (apt-get install redis-server; .ci/run does)"
)


@pytest.fixture
def redis_url(tmp_path):
    """One redis-server on a loopback port (no persistence), killed at teardown."""
    port = free_port()
    proc = subprocess.Popen(
        [REDIS or "redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        + ["--appendonly", "no", "--dir", str(tmp_path), "--loglevel", "warning"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    r = redis.Redis(port=port, socket_timeout=1)

    def pings() -> bool:
        try:
            return bool(r.ping())
        except redis.RedisError:
            return False

    try:
        wait_until(pings, 15, "redis-server")
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        r.close()
        proc.kill()
        proc.wait(10)


def fetch(sup: Sup, b: Blob) -> str:
    """Ask ``sup`` to fetch ``b`` from Redis; its status, after checking the arena has it."""
    with sup.client() as c:
        status = c.fetch(b.root, b.tokens, 0, 5.0, 0.0)
        if status == "fetched":
            use_blob(c, b)
        return status


@needs_redis
def test_a_state_from_one_tier_reaches_the_other(make_supervisor, tmp_path, redis_url) -> None:
    """A state fetched from --remote is written to --persist (so it survives a reboot
    without Redis), and a state refilled from --persist is written to --remote (a new or
    flushed Redis learns it): each tier is skipped only for what came from it."""
    a = make_supervisor("--size", "32M", "--remote", redis_url)
    b = make_supervisor(
        "--size", "32M", "--remote", redis_url, "--persist", str(tmp_path / "b")
    )  # fmt: skip
    shared = blob(61, 40_000, n_tokens=256)
    with a.client() as c:
        put_blob(c, shared)
    wait_until(lambda: a.stats()["remote_written"] == 1, 20, "A's write to Redis")
    wait_until(lambda: b.stats()["remote_on"] == 1, 20, "B's connection to Redis")
    assert fetch(b, shared) == "fetched"
    st = wait_until(
        lambda: (s := b.stats())["persist_queue"] == 0 and s["persisted"] and s,
        10,
        "B to write the fetched state to disk",
    )
    assert st["persisted"] == 1 and st["remote_written"] == 0, st  # (not written back)

    # a state only on disk: refilled after a reboot, then written to Redis
    disk = tmp_path / "c"
    c0 = make_supervisor("--size", "32M", "--persist", str(disk))
    local = blob(62, 40_000, n_tokens=256)
    with c0.client() as c:
        put_blob(c, local)
    wait_until(lambda: persisted_all(c0), 20, "C's write-behind")
    assert c0.stop() == 0, c0.log()
    c0.arena.unlink(missing_ok=True)  # a reboot
    c1 = start_supervisor(
        tmp_path, "--size", "32M", "--persist", str(disk), "--remote", redis_url, name=c0.name
    )
    try:
        wait_until(lambda: c1.stats()["refilled"] == 1, 20, "the refill")
        wait_until(lambda: c1.stats()["remote_written"] == 1, 20, "the refilled state in Redis")
    finally:
        assert c1.stop() == 0
    wait_until(lambda: a.stats()["remote_on"] == 1, 20, "A's connection to Redis")
    assert fetch(a, local) == "fetched"  # another node finds it there
    no_internal_errors(a, b, c0, c1)


# ------------------------------------------------------------- tenants x export
def test_export_of_a_tenants_entry_says_why_it_cannot(make_supervisor) -> None:
    """export/import move the deployment's own states only; a cache tenant's entry (its key
    root narrowed by a salt) is refused by export with a line that says so."""
    sup = make_supervisor("--size", "16M")
    fp = b"fingerprint of some model"
    root = shmkv.llama.tenant.make("user-42").root(key_root(fp, ""))
    b = blob(81, 10_000)
    with sup.client() as c:
        key = c.put_bytes(root, b.tokens, fp, b.data)["key"].hex()
    got = sup.cli("export", key, "-o", "/dev/null", check=False)
    assert got.returncode != 0
    assert "cache tenant" in got.stderr and len(got.stderr.strip().splitlines()) == 1, got.stderr
