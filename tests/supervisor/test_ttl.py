"""Idle release (`shmkv supervise --ttl`, `shmkv pin --ttl`) against a real supervisor:
unused states go, used, leased and pinned ones stay, a pin's own TTL ends it; then a
real llama worker finds nothing left of an expired conversation and runs cold."""

from __future__ import annotations

import json
import time

from tests.support.blobs import blob, put_blob, stored_keys, use_blob
from tests.support.llama_workers import SYSTEM, completion, run_worker, texts
from tests.support.waiting import wait_until


def test_ttl_releases_unused_states_and_keeps_used_ones(make_supervisor) -> None:
    sup = make_supervisor("--size", "32M", "--ttl", "1.5")
    idle, used, marker = blob(1, 20_000), blob(2, 20_000), blob(8, 20_000)
    with sup.client() as c:
        idle_key, used_key = put_blob(c, idle), put_blob(c, used)
        marker_key = put_blob(c, marker)  # (put after both, never used: it expires after them)

        def marker_expired() -> bool:
            # (ls first: the supervisor's once-a-second expiry runs at the first turn of
            # its loop after a request woke it, which must not find `used` leased)
            gone = marker_key not in stored_keys(c)
            use_blob(c, used)  # hit `used` every 0.3 s: never idle 1.5 s
            return gone

        wait_until(marker_expired, 10, "the marker state to expire", step=0.3)
        left = stored_keys(c)
        assert idle_key not in left and used_key in left
        assert c.lookup(idle.digests()) is None
        use_blob(c, used)
        assert c.stats()["expired"] == 2
        # and once nobody uses it, the used one goes too
        wait_until(lambda: used_key not in stored_keys(c), 6, "the second state to expire")
        assert c.stats()["expired"] == 3 and c.stats()["entries"] == 0


def test_ttl_never_releases_a_leased_state(make_supervisor) -> None:
    """A lease held past --ttl: the state stays, the lease stays valid; it expires only
    --ttl after its release (a lease is a use until it ends)."""
    sup = make_supervisor("--size", "32M", "--ttl", "1")
    b = blob(3, 30_000)
    with sup.client() as c:
        key = put_blob(c, b)
        hit = c.lookup(b.digests())
        assert hit is not None
        lease = c.acquire(hit)
        marker = put_blob(c, blob(9, 30_000))  # (put after the grant, never used)
        wait_until(lambda: marker not in stored_keys(c), 10, "the marker state to expire")
        assert key in stored_keys(c)  # idle as long as the marker, and leased
        assert bytes(lease.payload) == b.data
        assert lease.finish() is True  # never revoked
        released = time.monotonic()
        assert key in stored_keys(c)  # idle from the release on, not from the grant
        wait_until(lambda: key not in stored_keys(c), 5, "the released state to expire")
        assert time.monotonic() - released > 0.9
        st = c.stats()
        assert st["expired"] == 2 and st["revocations"] == 0 and st["leases_active"] == 0


def test_pins_outlive_ttl_unless_they_carry_their_own(make_supervisor) -> None:
    sup = make_supervisor("--size", "32M", "--ttl", "2")
    plain, pinned, short = blob(4, 10_000), blob(5, 10_000), blob(6, 10_000)
    with sup.client() as c:  # (pinned at once: a CLI's start-up may take longer than --ttl)
        plain_key, pinned_key, short_key = (
            put_blob(c, plain),
            put_blob(c, pinned),
            put_blob(c, short),
        )
        assert c.pin(bytes.fromhex(pinned_key)) == 1
        assert c.pin(bytes.fromhex(short_key), ttl=4.0) == 1
    rows = {r["key"]: r for r in json.loads(sup.cli("ls", "--json").stdout)}
    assert rows[short_key]["pin_ttl"] == 4.0 and rows[pinned_key]["pin_ttl"] is None
    with sup.client() as c:
        wait_until(lambda: plain_key not in stored_keys(c), 6, "the unpinned state to expire")
        assert {pinned_key, short_key} <= stored_keys(c)  # --ttl passed: pins keep them
        wait_until(lambda: short_key not in stored_keys(c), 8, "the pin's own TTL to end it")
        assert c.lookup(short.digests()) is None
        marker = put_blob(c, blob(10, 10_000))  # (never used: it expires, the pin stays)
        wait_until(lambda: marker not in stored_keys(c), 8, "the marker state to expire")
        assert stored_keys(c) == {pinned_key}
        st = c.stats()
        assert st["expired"] == 3 and st["pinned"] == 1
    # unpinned, it is as idle as its last use says (seconds ago): it goes at the next tick
    sup.cli("unpin", pinned_key)
    with sup.client() as c:
        wait_until(lambda: not stored_keys(c), 5, "the unpinned state to expire")


def test_pin_ttl_is_validated(supervisor) -> None:
    b = blob(7, 5000)
    with supervisor.client() as c:
        key = put_blob(c, b)
    bad = supervisor.cli("pin", "--ttl", "0", key, check=False)
    assert bad.returncode != 0 and "--ttl" in bad.stderr
    from shmkv.core.errors import BadRequest

    with supervisor.client() as c:
        for ttl in (float("nan"), -1.0, 1e12):
            try:
                c.request({"op": "pin", "key": bytes.fromhex(key), "ttl": ttl})
            except BadRequest as e:
                assert "ttl" in str(e)
            else:
                raise AssertionError(f"pin with ttl={ttl} accepted")
        assert c.stats()["pinned"] == 0
    out = supervisor.cli("pin", "--ttl", "60", key)
    assert out.stdout.strip() == "pinned 1 entry"
    rows = json.loads(supervisor.cli("ls", "--json").stdout)
    assert [(r["pinned"], r["pin_ttl"]) for r in rows] == [(True, 60.0)]


def test_an_expired_conversation_runs_cold(make_supervisor, models) -> None:
    """A llama worker's published states expire; the next worker restores nothing and
    its text equals a cold run's."""
    sup = make_supervisor("--size", "64M", "--ttl", "1")
    prompt = SYSTEM + " Question: where is the cat?"
    jobs = [completion(prompt)]
    first = run_worker(sup, models["seed0"], jobs)
    assert first["results"][0]["last"]["published"] >= 1
    with sup.client() as c:
        assert c.stats()["entries"] >= 1
        wait_until(lambda: c.stats()["entries"] == 0, 6, "the worker's states to expire")
        assert c.stats()["expired"] >= 1
    again = run_worker(sup, models["seed0"], jobs)
    assert again["results"][0]["last"]["tokens_restored"] == 0
    cold = run_worker(None, models["seed0"], jobs, mode="cold")
    assert texts(again) == texts(cold) == texts(first)
    cold_run, now = first["results"][0]["last"], again["results"][0]["last"]
    assert not now["hit"] and now["tokens_evaluated"] == cold_run["tokens_evaluated"] > 0, now
