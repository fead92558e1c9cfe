"""Read leases end one at a time: one connection's close, or one stale lease's revocation,
must not void the reads of anyone else.

A lease protects a record's bytes while a worker copies them. A connection's close
releases that connection's leases only; a lease held past ``--lease-timeout`` may be
revoked when space is needed, which voids that lease only and is counted. The reader
learns the verdict of each lease from its own release (and treats every lease of a
connection it lost as void).
"""

from __future__ import annotations

import signal
import struct
import time

import numpy as np
import pytest

from shmkv.core import arena as A
from tests.support.blobs import blob
from tests.support.peer import Raw
from tests.support.supervisors import assert_healthy, wait_ready
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(60)


def put_and_find(c, seed: int, size: int) -> A.Hit:
    b = blob(seed, size)
    c.put_bytes(b.root, b.tokens, b"fp", b.data)
    hit = c.lookup(b.digests())
    assert hit is not None
    return hit


def test_a_peer_looping_attach_acquire_close_does_not_void_other_leases(supervisor) -> None:
    c = supervisor.client()
    hits = [put_and_find(c, seed, 4096) for seed in range(40)]
    leases = [c.acquire(h) for h in hits]
    for i in range(50):  # the hostile peer: attach, lease, hang up; again and again
        r = Raw(supervisor.socket)
        r.attach()
        slot = hits[i % len(hits)].slot
        assert r.call({"op": "acquire", "offset": slot.rec_offset, "gen": slot.rec_gen})["ok"]
        r.close()
    wait_until(lambda: supervisor.stats()["leases_active"] == 40, what="the peer's leases' end")
    valid = sum(lease.finish() for lease in leases)
    assert valid == 40, f"{valid}/40 leases survived another connection's close"
    st = supervisor.stats()
    assert st["revocations"] == 0 and st["leases_closed"] == 50, st
    c.close()
    assert_healthy(supervisor)


def test_a_stale_lease_revocation_voids_only_that_lease_and_is_counted(make_supervisor) -> None:
    sup = make_supervisor("--size", "16M", "--lease-timeout", "0.5")
    c = sup.client()
    stale = c.acquire(put_and_find(c, 1, 8 << 20))
    before = bytes(stale.payload[:4096])
    time.sleep(0.7)  # the first lease is now older than --lease-timeout
    fresh = c.acquire(put_and_find(c, 2, 1 << 20))
    put_and_find(c, 3, 8 << 20)  # needs the stale lease's record: it is revoked
    assert bytes(stale.payload[:4096]) != before  # (its space was reused)
    assert stale.finish() is False
    assert fresh.finish() is True, "a revocation voided a lease that was not revoked"
    st = sup.stats()
    assert st["revocations"] == 1 and st["leases_active"] == 0, st
    c.close()
    assert_healthy(sup)


def test_a_lease_from_a_previous_supervisor_never_releases_a_new_lease(make_supervisor) -> None:
    """Lease ids start again in a restarted supervisor: the release of a lease granted by the
    one before must not end a lease of the same id the new one granted."""
    sup = make_supervisor("--size", "16M")
    c = sup.client()
    old = c.acquire(put_and_find(c, 1, 4096))
    sup.proc.send_signal(signal.SIGKILL)
    sup.proc.wait(10)
    sup2 = wait_ready(make_supervisor("--size", "16M", name=sup.name))
    wait_until(lambda: _reconnected(c, sup2.proc.pid), 15, "the client's reconnect")
    new = c.acquire(put_and_find(c, 2, 4096))
    assert new.id == old.id  # (the case in question)
    assert old.finish() is False  # granted by a supervisor that is gone
    assert sup2.stats()["leases_active"] == 1, "the old lease's release ended the new one"
    assert new.finish() is True
    c.close()


def _reconnected(c, pid: int) -> bool:
    try:
        c.ensure()
        return c.attach_info.get("supervisor_pid") == pid
    except Exception:
        return False


def test_a_lease_of_a_connection_the_supervisor_closed_is_void(supervisor) -> None:
    """The supervisor dropped the reader's connection (here for a framing error): its
    leases are released there and their space may be reused, so the reader voids them."""
    c = supervisor.client()
    lease = c.acquire(put_and_find(c, 1, 4096))
    c._sock.sendall(struct.pack(">I", 0))  # a frame length the supervisor hangs up on
    wait_until(lambda: supervisor.stats()["leases_active"] == 0, what="the lease's release")
    assert lease.finish() is False
    hit = c.lookup(blob(1, 4096).digests())  # the client reconnects and reads again
    with c.acquire(hit) as again:
        assert np.array_equal(again.tokens(), blob(1, 4096).tokens)
        assert again.finish() is True
    c.close()
    assert_healthy(supervisor)
