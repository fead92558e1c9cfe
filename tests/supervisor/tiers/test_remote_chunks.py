"""``--remote`` keeps each shared token group once: chunked records in Redis.

Two supervisors (two nodes, two arenas) and one real ``redis-server``. States in
llama.cpp's format (``tests/support/kvblobs.py``; a real model's in ``test_remote.py``)
that share a ~1,000-token system prompt: Redis holds the prompt's groups once, a node
sends only the chunks Redis lacks and fetches only those its arena lacks, and a chunk
damaged, replaced or gone in Redis costs a miss, never a wrong state.
"""

from __future__ import annotations

import hashlib

import msgpack
import numpy as np
import pytest

from shmkv.core import kvformat
from shmkv.core.keys import remote_id
from shmkv.supervisor.tiers.redis import layout as fmt
from tests.support.blobs import Blob, blob
from tests.support.kvblobs import hybrid_state, kv_state
from tests.support.redis import (
    NO_REDIS,
    REDIS,
    fetch_blob,
    key_file,
    put_written,
    received_by,
    sent_by,
)
from tests.support.supervisors import no_internal_errors
from tests.support.waiting import wait_until

pytestmark = pytest.mark.skipif(REDIS is None, reason=NO_REDIS)

CHUNK = 64
ROOT = hashlib.blake2b(b"remote-chunks", digest_size=16).digest()
#: the shared system prompt, then each conversation's own question
PREFIX = np.arange(1000, dtype="<i4") + 7


def conversation(i: int, n: int = 40) -> Blob:
    tokens = np.concatenate([PREFIX, np.arange(n, dtype="<i4") + 50_000 + 100 * i])
    return Blob(ROOT, tokens, kv_state(tokens))


def chunk_names(b: Blob) -> list[bytes]:
    """The BLAKE2b-128 of each full group of ``b``'s state: its chunks' names in Redis."""
    layout, groups = kvformat.split(b.data, CHUNK)
    return [fmt.chunk_digest(g) for g, full in zip(groups, layout.group_full, strict=True) if full]


def chunk_keys(r) -> set[str]:
    return {k.decode() for k in r.scan_iter("shmkv:*:c")}


def test_records_that_share_a_prefix_share_its_chunks_in_redis(make_supervisor, redis_server):
    """Three conversations on one system prompt: Redis holds each distinct group once (the
    prompt's groups once for all three), the second and third send only their own, and
    every chunk outlives the manifests that name it."""
    sup = make_supervisor("--size", "64M", "--remote", redis_server.url, "--remote-ttl", "600")
    r = redis_server.client()
    convs = [conversation(i) for i in range(3)]
    names = [chunk_names(b) for b in convs]
    shared = len(set(names[0]) & set(names[1]))
    assert 0 < shared < len(names[0])  # (the question's own groups differ)
    put_written(sup, convs[0])
    first = received_by(r)
    st = sup.stats()
    assert st["remote_chunks_sent"] == len(set(names[0])) and st["remote_chunks_present"] == 0
    put_written(sup, convs[1], convs[2])
    st = sup.stats()
    distinct = set().union(*names)
    assert st["remote_chunks_sent"] == len(distinct), st
    assert st["remote_chunks_present"] == sum(map(len, names)) - len(distinct), st
    assert chunk_keys(r) == {fmt.chunk_key(ROOT, d) for d in distinct}
    # the two later records cost Redis their own groups, not the system prompt's again
    later = received_by(r) - first
    assert later < 2 * (len(convs[0].data) - shared * CHUNK * 1024) + (256 << 10), later
    manifests = [k for k in r.scan_iter("shmkv:*:m")]
    assert len(manifests) == 3
    longest = max(r.pttl(k) for k in manifests)
    assert all(longest < r.pttl(k) <= 660_000 for k in r.scan_iter("shmkv:*:c"))
    no_internal_errors(sup)


def test_node_b_fetches_only_the_chunks_its_arena_lacks(make_supervisor, redis_server):
    """Node B fetches one conversation (every chunk from Redis), then another on the same
    system prompt: the prompt's chunks come from B's own arena, only the new question's
    from Redis; both land byte for byte."""
    args = ("--size", "64M", "--remote", redis_server.url)
    a, b = make_supervisor(*args), make_supervisor(*args)
    one, two = conversation(1), conversation(2)
    put_written(a, one, two)
    r = redis_server.client()
    wait_until(lambda: b.stats()["remote_on"], 10, "node B to reach Redis")
    assert fetch_blob(b, one) == ("fetched", one.data)
    st = b.stats()
    assert st["remote_chunks_pulled"] == len(chunk_names(one)) and st["remote_chunks_local"] == 0
    before = sent_by(r)
    assert fetch_blob(b, two) == ("fetched", two.data)
    st = b.stats()
    shared = len(set(chunk_names(one)) & set(chunk_names(two)))
    assert st["remote_chunks_local"] == shared, st
    assert st["remote_chunks_pulled"] == 2 * len(chunk_names(one)) - shared, st
    # what Redis sent for the second: its own groups and body, not the system prompt's
    assert sent_by(r) - before < len(two.data) - shared * CHUNK * 1024 + (256 << 10)
    # and B's arena shares those groups between the two records as a local put would
    assert b.stats()["chunk_bytes_shared"] >= shared * CHUNK * 1024, b.stats()
    no_internal_errors(a, b)


def test_a_hybrids_states_share_their_attention_chunks_across_nodes(make_supervisor, redis_server):
    """A hybrid's states (attention cells, then a recurrent state): node A's two
    conversations on the system prompt send its chunks to Redis once; node B fetches
    both byte for byte, the second's shared chunks from its own arena, each with its own
    recurrent state."""
    args = ("--size", "64M", "--remote", redis_server.url)
    a, b = make_supervisor(*args), make_supervisor(*args)
    one, two = (
        Blob(ROOT, c.tokens, hybrid_state(c.tokens)) for c in (conversation(1), conversation(2))
    )
    names = [chunk_names(x) for x in (one, two)]
    shared = len(set(names[0]) & set(names[1]))
    assert shared == len(PREFIX) // CHUNK
    put_written(a, one, two)
    st = a.stats()
    assert st["chunked_puts"] == 2 and st["remote_chunks_sent"] == len(set(names[0] + names[1]))
    wait_until(lambda: b.stats()["remote_on"], 10, "node B to reach Redis")
    assert fetch_blob(b, one) == ("fetched", one.data)
    assert fetch_blob(b, two) == ("fetched", two.data)
    assert b.stats()["remote_chunks_local"] == shared
    no_internal_errors(a, b)


def test_a_chunk_damaged_replaced_or_gone_in_redis_is_a_miss(make_supervisor, redis_server):
    """A chunk of a record flipped in Redis, another chunk's bytes (a valid chunk, the
    wrong one) in its place, or the chunk deleted: node B answers a miss each time, puts
    nothing into its arena, and drops the manifest so the next publisher writes it anew."""
    args = ("--size", "64M", "--remote", redis_server.url)
    a = make_supervisor(*args)
    r = redis_server.client()
    convs = [conversation(10 + i) for i in range(3)]
    put_written(a, *convs)
    names = [chunk_names(c) for c in convs]
    own = [next(d for d in n if all(d not in m for m in names if m is not n)) for n in names]

    key = fmt.chunk_key(ROOT, own[0])  # one byte flipped
    mid = r.strlen(key) // 2
    r.setrange(key, mid, bytes([r.getrange(key, mid, mid)[0] ^ 0x40]))
    r.set(fmt.chunk_key(ROOT, own[1]), r.get(fmt.chunk_key(ROOT, names[1][0])))  # another's
    r.delete(fmt.chunk_key(ROOT, own[2]))  # gone (expired, evicted)
    for i, (c, want) in enumerate(zip(convs, ("corrupt", "corrupt", "none"), strict=True)):
        b = make_supervisor(*args)
        wait_until(lambda b=b: b.stats()["remote_on"], 10, "node B to reach Redis")
        status, data = fetch_blob(b, c)
        assert (status, data) == (want, None), i
        st = b.stats()
        assert st["remote_fetched"] == 0 and st["entries"] == 0, st
        assert st["remote_corrupt"] == (want == "corrupt"), st
        no_internal_errors(b)
    assert not list(r.scan_iter("shmkv:*:m")), "a manifest naming a bad chunk was kept"
    no_internal_errors(a)


def test_a_signed_chunk_list_cannot_be_swapped(make_supervisor, redis_server, tmp_path):
    """With ``--remote-key-file`` the manifest's MAC covers its chunk list: node B
    restores a signed chunked record; the same manifest with another record's chunk list
    in its body (re-packed by someone without the key) verifies under no key: a miss."""
    key = key_file(tmp_path, "k", b"k" * 32)
    args = ("--size", "64M", "--remote", redis_server.url, "--remote-key-file", key)
    a = make_supervisor(*args)
    one, two = conversation(20), conversation(21)
    put_written(a, one, two)
    r = redis_server.client()
    b = make_supervisor(*args)
    wait_until(lambda: b.stats()["remote_on"], 10, "node B to reach Redis")
    assert fetch_blob(b, one) == ("fetched", one.data)

    rid1, rid2 = (remote_id(ROOT, b"fp", c.tokens.tobytes()) for c in (one, two))
    m1 = fmt.unpack_manifest(rid1, r.get(fmt.manifest_key(rid1)), [b"k" * 32])
    m2 = fmt.unpack_manifest(rid2, r.get(fmt.manifest_key(rid2)), [b"k" * 32])
    assert m1.n_chunks and m1.chunks != m2.chunks
    env = msgpack.unpackb(r.get(fmt.manifest_key(rid2)))
    body = msgpack.unpackb(env["m"])
    body["chunks"] = m1.chunks[: len(m2.chunks)]  # (a chunk list of the attacker's choosing)
    env["m"] = msgpack.packb(body, use_bin_type=True)
    r.set(fmt.manifest_key(rid2), msgpack.packb(env, use_bin_type=True))
    c = make_supervisor(*args)
    wait_until(lambda: c.stats()["remote_on"], 10, "node C to reach Redis")
    assert fetch_blob(c, two) == ("none", None)
    st = c.stats()
    assert st["remote_fetch_unverified"] == 1 and st["remote_chunks_pulled"] == 0, st
    no_internal_errors(a, b, c)


def test_an_oversized_piece_or_chunk_is_read_no_further_than_its_length(
    make_supervisor, redis_server
):
    """Whoever can write to Redis replaces a chunk of a chunked record, and a piece of a
    whole one, with 64 MiB of junk: node B reads no more of either than the manifest
    allows (a byte past it), and both are misses."""
    args = ("--size", "64M", "--remote", redis_server.url)
    a = make_supervisor(*args)
    conv, whole = conversation(30), blob(31, 300_000)
    put_written(a, conv, whole)
    r = redis_server.client()
    junk = b"\x00" * (64 << 20)
    r.set(fmt.chunk_key(ROOT, chunk_names(conv)[0]), junk)
    r.set(fmt.piece_key(remote_id(whole.root, b"fp", whole.tokens.tobytes()), 0), junk)
    b = make_supervisor(*args)
    wait_until(lambda: b.stats()["remote_on"], 10, "node B to reach Redis")
    for x in (conv, whole):
        before = sent_by(r)
        assert fetch_blob(b, x) == ("corrupt", None)
        assert sent_by(r) - before < len(x.data) + (1 << 20), "read the junk"
    no_internal_errors(a, b)


def test_a_signed_manifest_has_each_chunk_checked_by_its_blake2b(
    make_supervisor, redis_server, tmp_path
):
    """With ``--remote-key-file`` a chunk is checked by the BLAKE2b-128 the MAC covers, not
    only by its XXH3-128 (a fast hash, not a proof against a chosen collision). A manifest
    signed with a chunk's BLAKE2b changed (that of other bytes), its XXH3-128 and its
    bytes as they were: a miss. Without the BLAKE2b check it would be fetched."""
    secret = b"k" * 32
    key = key_file(tmp_path, "k", secret)
    args = ("--size", "64M", "--remote", redis_server.url, "--remote-key-file", key)
    a = make_supervisor(*args)
    one = conversation(40)
    put_written(a, one)
    r = redis_server.client()
    rid = remote_id(ROOT, b"fp", one.tokens.tobytes())
    man = fmt.unpack_manifest(rid, r.get(fmt.manifest_key(rid)), [secret])
    blake, xxh = man.chunk(0)
    other = hashlib.blake2b(b"other bytes", digest_size=len(blake)).digest()
    r.set(fmt.chunk_key(ROOT, other), r.get(fmt.chunk_key(ROOT, blake)))
    env = msgpack.unpackb(r.get(fmt.manifest_key(rid)))
    body = msgpack.unpackb(env["m"])
    assert body["chunks"][: len(blake)] == blake
    body["chunks"] = other + body["chunks"][len(blake) :]
    env["m"] = msgpack.packb(body, use_bin_type=True)
    env["mac"] = fmt.mac(secret, rid, env["m"])
    r.set(fmt.manifest_key(rid), msgpack.packb(env, use_bin_type=True))
    assert fmt.unpack_manifest(rid, r.get(fmt.manifest_key(rid)), [secret]).chunk(0) == (
        other,
        xxh,
    )
    b = make_supervisor(*args)
    wait_until(lambda: b.stats()["remote_on"], 10, "node B to reach Redis")
    assert fetch_blob(b, one) == ("corrupt", None)
    st = b.stats()
    assert st["remote_corrupt"] == 1 and st["entries"] == 0, st
    no_internal_errors(a, b)
