"""Who may publish what: with ``--group``, other users publish too, and a worker restores only
what it trusts.

A record carries its publisher's uid, which the supervisor takes from the put's
connection (SO_PEERCRED), never from the message. A worker restores, by default, only
records published by its own uid or the supervisor's (``--trust-publishers`` widens that);
a record of anyone else is a miss, counted, never a restore. A put of a state someone else
already published under the same key is stored beside it, so a group member's garbage
cannot keep the real state out. Real users: a group ``shmkv-test-grp`` with members
``shmkv-test-evil`` and ``shmkv-test-friend``, created as root.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import llama_cpp
import numpy as np
import pytest

from shmkv.core.keys import chain_digests
from shmkv.llama import key_root, model_fingerprint
from tests.support.blobs import CHUNK
from tests.support.kvblobs import kv_state
from tests.support.llama_workers import KW, SYSTEM, completion, run_worker, texts
from tests.support.supervisors import Sup, wait_for_socket
from tests.support.users import GROUP, publish_as, system_user

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def users() -> dict[str, tuple[int, int]]:
    return {
        "evil": system_user("shmkv-test-evil", GROUP),
        "friend": system_user("shmkv-test-friend", GROUP),
    }


@pytest.fixture
def group_sup(make_supervisor, users) -> Iterator[Sup]:
    """A supervisor (as root) with --group, its socket in a directory it creates for the
    group (pytest's tmp_path is closed to other users)."""
    d = Path(f"/tmp/shmkv-pub-{uuid.uuid4().hex[:10]}")
    sock = d / "pub.sock"
    sup = make_supervisor(
        "--size", "64M", "--group", GROUP, env_extra={"SHMKV_SOCKET": str(sock)}, wait=False
    )
    sup.socket = str(sock)
    wait_for_socket(str(sock), sup.proc)
    try:
        yield sup
    finally:
        sup.stop()
        shutil.rmtree(d, ignore_errors=True)


def test_a_put_records_its_publishers_uid_and_garbage_never_shadows_the_real_copy(
    group_sup: Sup, users, tmp_path: Path
) -> None:
    root, tokens, fp = os.urandom(16), np.arange(2 * CHUNK, dtype=np.int32), b"fp"
    garbage, real = os.urandom(50_000), os.urandom(50_000)
    evil = publish_as(users["evil"], group_sup, tmp_path, root, tokens, fp, garbage)
    friend = publish_as(users["friend"], group_sup, tmp_path, root, tokens, fp, real)
    assert friend["gen"] != evil["gen"], "a group member's copy was dropped as a duplicate"
    with group_sup.client() as c:
        mine = c.put_bytes(root, tokens, fp, real)
        assert mine["gen"] not in (evil["gen"], friend["gen"]), "dropped as a duplicate"
        assert c.put_bytes(root, tokens, fp, real)["gen"] == mine["gen"]  # (same publisher)
        rows = c.ls()["entries"]
        assert sorted(e["publisher"] for e in rows) == sorted(
            [users["evil"][0], users["friend"][0], os.geteuid()]
        )
        # the index points the supervisor's own users at their copy
        hit = c.lookup(chain_digests(root, tokens, CHUNK))
        with c.acquire(hit) as lease:
            assert lease.record.publisher == os.geteuid()
            assert bytes(lease.payload) == real
            assert lease.finish()


# ------------------------------------------------------------------ with llama.cpp
@pytest.fixture(scope="module")
def tiny(models) -> dict:
    llm = llama_cpp.Llama(model_path=models["seed0"], verbose=False, **KW)
    fp = model_fingerprint(llm)
    return {"model": models["seed0"], "fp": fp, "root": key_root(fp, ""), "llm": llm}


def genuine_state(sup: Sup, tiny: dict, prompt: str) -> tuple[list[int], bytes]:
    """Token ids and the real state of ``prompt``, published by a worker of our uid (then
    cleared from the arena)."""
    tokens = tiny["llm"].tokenize(prompt.encode())
    run_worker(sup, tiny["model"], [completion(prompt)])
    with sup.client() as c:
        hit = c.lookup(chain_digests(tiny["root"], tokens, CHUNK))
        with c.acquire(hit) as lease:
            assert lease.record.n_tokens == len(tokens)
            state = bytes(lease.payload)
            assert lease.finish()
        c.clear()
    return tokens, state


def test_a_group_member_publishing_garbage_under_the_victims_root_is_never_restored(
    group_sup: Sup, users, tiny: dict, tmp_path: Path
) -> None:
    """The garbage is a real state, of another prompt, filed under the victim's root and
    prompt tokens: llama.cpp would accept it. The victim never restores it, runs cold, and
    its own copy, stored beside the garbage, serves its next request."""
    prompt = SYSTEM + " Question: who published this state?"
    other = " ".join(f"Note {i}: the dog {i % 3} runs to park {i % 4}." for i in range(30))
    jobs = [completion(prompt)]
    cold = run_worker(None, tiny["model"], jobs, mode="cold")
    other_tokens, state = genuine_state(group_sup, tiny, other)
    tokens = tiny["llm"].tokenize(prompt.encode())
    assert len(other_tokens) < len(tokens)
    publish_as(
        users["evil"],
        group_sup,
        tmp_path,
        tiny["root"],
        tokens[: len(other_tokens)],
        tiny["fp"],
        state,
    )
    got = run_worker(group_sup, tiny["model"], jobs)
    assert got["results"][0]["last"]["tokens_restored"] == 0, "restored a group member's state"
    assert texts(got) == texts(cold)
    assert got["totals"]["untrusted"] >= 1 and got["totals"]["misses"] >= 1, got["totals"]
    again = run_worker(group_sup, tiny["model"], jobs)
    assert again["results"][0]["last"]["tokens_restored"] > 0, again["totals"]
    assert texts(again) == texts(cold)
    assert group_sup.stats_json()["untrusted"] >= 1


def test_trust_publishers_widens_whose_records_a_worker_restores(
    group_sup: Sup, users, tiny: dict, tmp_path: Path
) -> None:
    """A group member publishes the right state: restored only by a worker told to trust it."""
    prompt = SYSTEM + " Question: whom do you trust?"
    jobs = [completion(prompt)]
    cold = run_worker(None, tiny["model"], jobs, mode="cold")
    tokens, state = genuine_state(group_sup, tiny, prompt)
    args = (group_sup, tmp_path, tiny["root"], tokens, tiny["fp"], state)
    publish_as(users["friend"], *args)
    plain = run_worker(group_sup, tiny["model"], jobs)
    assert plain["results"][0]["last"]["tokens_restored"] == 0
    assert plain["totals"]["untrusted"] >= 1
    assert texts(plain) == texts(cold)
    with group_sup.client(attach=False) as c:
        c.clear()
    publish_as(users["friend"], *args)
    trusting = run_worker(
        group_sup, tiny["model"], jobs, env={"SHMKV_TRUST_PUBLISHERS": "shmkv-test-friend"}
    )
    assert trusting["results"][0]["last"]["tokens_restored"] > 0, trusting["totals"]
    assert trusting["totals"]["untrusted"] == 0
    assert texts(trusting) == texts(cold)


def test_another_uid_cannot_share_a_chunk_into_our_records(
    group_sup: Sup, users, tmp_path: Path
) -> None:
    """A group member publishes first the states we are about to (the same bytes, and a
    forged one that differs in one byte of a shared group): our records name only chunks
    we wrote, and read back as ours."""
    root, fp = os.urandom(16), b"fp"
    prefix = np.arange(700, dtype="<i4")
    prompts = [np.concatenate([prefix, np.arange(20, dtype="<i4") + 5000 * i]) for i in (1, 2)]
    ours = [kv_state(t) for t in prompts]
    forged = bytearray(ours[1])
    forged[len(forged) // 3] ^= 1  # (inside a full group of the shared prefix)
    publish_as(users["evil"], group_sup, tmp_path, root, prompts[0], fp, ours[0])
    publish_as(users["evil"], group_sup, tmp_path, root, prompts[1], fp, bytes(forged))
    st = group_sup.stats_json()
    theirs = st["chunks"]
    assert st["chunked_puts"] == 2 and theirs > 0
    with group_sup.client() as c:
        for t, d in zip(prompts, ours, strict=True):
            c.put_bytes(root, t, fp, d)
    assert group_sup.stats_json()["chunks"] > theirs
    # each record names chunks of its own publisher only, and ours share among themselves
    named: dict[int, set[int]] = {}
    with group_sup.client() as c:  # (every record: the index names ours first)
        for row in c.ls()["entries"]:
            publisher, chunks = _chunks_of(c.view, row["offset"], row["gen"])
            assert publisher == row["publisher"] and {p for p, _ in chunks} == {publisher}
            named.setdefault(publisher, set()).update(off for _, off in chunks)
    assert set(named) == {os.geteuid(), users["evil"][0]}
    assert not named[os.geteuid()] & named[users["evil"][0]]
    with group_sup.client() as c:
        for t, d in zip(prompts, ours, strict=True):
            hit = c.lookup(chain_digests(root, t, CHUNK))
            with c.acquire(hit) as lease:
                assert lease.record.publisher == os.geteuid()
                assert bytes(lease.payload) == d and lease.finish()


def _chunks_of(view, off, gen) -> tuple[int, set[tuple[int, int]]]:
    """(publisher, {(publisher, offset) of each chunk it names}) of a record."""
    rec, _ = view.peek(off, gen)
    return rec.publisher, {(i.publisher, i.offset) for i in view.peek_chunks(rec)[2] if i}
