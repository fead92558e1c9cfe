"""Where two features meet: adoption and ``--ttl``, ``--persist`` and ``--ttl``, adoption
and ``--persist``'s pins, the tiers that a refilled or fetched record reaches, and the
exporter's view of the newer stats groups.

Each feature has its own test file; these are the cases that only break when two of
them run in one supervisor. Real supervisors (and a real redis-server where the remote
tier is involved), real sockets and shared memory, blobs put through the client.
"""

from __future__ import annotations

import signal
import time

from helpers import Blob, Sup, blob, start_supervisor, wait_ready, wait_until

from shmkv import Client


def keys(c: Client) -> set[str]:
    return {r["key"] for r in c.ls()["entries"]}


def put(c: Client, b: Blob, pin: bool = False) -> str:
    return c.put_bytes(b.root, b.tokens, b"fp", b.data, pin=pin)["key"].hex()


def use(c: Client, b: Blob) -> None:
    """What a worker's hit does: look the state up, lease it, read it, release it."""
    hit = c.lookup(b.digests())
    assert hit is not None
    with c.acquire(hit) as lease:
        assert bytes(lease.payload) == b.data
        assert lease.finish()


def kill9(sup: Sup) -> None:
    sup.proc.kill()
    assert sup.proc.wait(10) == -signal.SIGKILL


def restart(make_supervisor, sup: Sup, *args: str) -> Sup:
    return wait_ready(make_supervisor(*args, name=sup.name, wait=False))


def persisted_all(sup: Sup) -> bool:
    st = sup.stats()
    return st["persist_queue"] == 0 and st["persisted"] + st["persist_gone"] >= st["puts"] > 0


def no_internal_errors(*sups: Sup) -> None:
    for sup in sups:
        log = sup.log()
        assert "Traceback" not in log and "internal error" not in log, log[-3000:]


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
        key = put(c, b)
        deadline = time.monotonic() + 4.5  # older than --ttl, never idle for it
        while time.monotonic() < deadline:
            use(c, b)
            time.sleep(0.4)
        assert key in keys(c)
    kill9(sup)
    new = restart(make_supervisor, sup, *args)
    adopted = time.monotonic()
    with new.client() as c:
        assert c.stats()["adopted"] == 1
        time.sleep(1.6)  # at least one tick of the new supervisor
        assert key in keys(c), new.log()
        assert c.stats()["expired"] == 0
        # nobody uses it: it goes --ttl after the adoption
        wait_until(lambda: key not in keys(c), 8, "the adopted state to expire")
        assert time.monotonic() - adopted > 2.5
        assert c.stats()["expired"] == 1
    no_internal_errors(new)


# ------------------------------------------------------------ --persist x --ttl
def test_an_expired_state_does_not_come_back_after_a_reboot(make_supervisor, tmp_path) -> None:
    """--ttl releases a state nobody used; with --persist it must go from disk too, or the
    next reboot's refill brings it back (and it expires again, a zombie every boot)."""
    disk = tmp_path / "persist"
    sup = make_supervisor("--size", "32M", "--persist", str(disk), "--ttl", "1.5")
    idle, used = blob(41, 20_000), blob(42, 20_000)
    with sup.client() as c:
        idle_key, used_key = put(c, idle), put(c, used)
        wait_until(lambda: persisted_all(sup), 20, "the write-behind")
        while c.stats()["expired"] == 0:  # keep `used` in use until `idle` expired
            use(c, used)
            time.sleep(0.3)
        assert idle_key not in keys(c) and used_key in keys(c)
        wait_until(lambda: sup.stats()["persist_records"] == 1, 10, "the disk to forget it")
    assert sup.stop() == 0, sup.log()
    sup.arena.unlink(missing_ok=True)  # what a reboot does to /dev/shm
    again = start_supervisor(tmp_path, "--size", "32M", "--persist", str(disk), name=sup.name)
    try:
        st = wait_until(lambda: (s := again.stats())["refilling"] == 0 and s, 30, "the refill")
        assert st["refilled"] == 1, st
        with again.client() as c:
            assert keys(c) == {used_key}
            assert c.lookup(idle.digests()) is None
            use(c, used)
    finally:
        assert again.stop() == 0
    no_internal_errors(sup, again)
