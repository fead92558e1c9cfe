"""Hostile and malformed input on the supervisor's socket, against a real `shmkv supervise`.

Each case speaks the wire protocol by hand on a raw Unix socket, checks the error
reply (or the clean close, for framing errors), and then checks that the
supervisor is still alive and that a well-behaved Client can still put a blob
and read it back.
"""

from __future__ import annotations

import gc
import os
import socket
import struct
import tempfile
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shmkv.core import arena as A
from shmkv.core import protocol as P
from shmkv.core.errors import ArenaFullError, BadRequest, NotFound
from shmkv.core.keys import chain_digests
from shmkv.supervisor.ops import OPS
from tests.support import SHM
from tests.support.peer import Raw, memfd_with, put_msg
from tests.support.supervisors import Sup, assert_healthy, no_internal_errors, start_supervisor
from tests.support.waiting import deleted_arena_fds, fd_count, wait_until

pytestmark = pytest.mark.timeout(30)


def error_code(reply: dict[str, Any] | None) -> str | None:
    assert reply is not None, "expected an error reply, got a closed connection"
    assert reply["ok"] is False, f"expected an error, got {reply!r}"
    assert isinstance(reply["error"]["message"], str) and reply["error"]["message"]
    return reply["error"]["code"]


def _connection(sup: Sup) -> Iterator[Raw]:
    """A raw connection to ``sup`` for one test, closed after it."""
    r = Raw(sup.socket)
    yield r
    r.close()


@pytest.fixture
def raw(supervisor) -> Iterator[Raw]:
    yield from _connection(supervisor)


@pytest.fixture
def attached(raw: Raw) -> Raw:
    raw.attach()
    return raw


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sup]:
    """One supervisor (64 MiB arena) for the module's many single-message cases: each sends
    one bad message on a connection of its own and checks the supervisor healthy after it,
    so a case that hurt it fails where it did. At the end: no traceback or internal error in
    its log over all of them, a clean exit, and nothing left in /dev/shm."""
    sup = start_supervisor(tmp_path_factory.mktemp("shared"), "--size", "64M")
    try:
        yield sup
    finally:
        rc = sup.stop()
    no_internal_errors(sup)
    assert rc == 0, sup.log()[-3000:]
    assert not list(SHM.glob(f"shmkv-{sup.name}*")), "the shared supervisor left its arena"


@pytest.fixture
def sraw(shared: Sup) -> Iterator[Raw]:
    """A raw connection of this test's own to the module's shared supervisor."""
    yield from _connection(shared)


@pytest.fixture
def sattached(sraw: Raw) -> Raw:
    sraw.attach()
    return sraw


def tokens_for(r: Raw, chunks: int = 1) -> np.ndarray:
    assert r.geometry is not None
    return np.arange(chunks * r.geometry.chunk_tokens, dtype=np.int32)


# ------------------------------------------------------------------------- framing
def test_truncated_frame_then_close(supervisor, raw: Raw) -> None:
    raw.send_raw(struct.pack(">I", 100) + b"\x82" + b"x" * 9)
    raw.close()
    assert_healthy(supervisor)


def test_truncated_frame_left_open_does_not_block_others(supervisor, raw: Raw) -> None:
    raw.send_raw(struct.pack(">I", 1000) + b"\x81")  # half a frame, then silence
    assert_healthy(supervisor)
    raw.send_raw(b"\x00" * 3)  # still incomplete
    assert_healthy(supervisor)


def test_truncated_length_prefix_then_close(supervisor, raw: Raw) -> None:
    raw.send_raw(b"\x00\x00")
    raw.close()
    assert_healthy(supervisor)


@pytest.mark.parametrize("length", [P.MAX_FRAME + 1, 0xFFFFFFFF, 0])
def test_bad_length_prefix_gets_protocol_error_and_close(
    shared: Sup, sraw: Raw, length: int
) -> None:
    sraw.send_raw(struct.pack(">I", length) + b"\x80")
    assert error_code(sraw.recv()) == "protocol"
    assert sraw.closed_by_peer()
    assert_healthy(shared)


def test_max_size_frame_is_accepted(supervisor, raw: Raw) -> None:
    """A frame of exactly MAX_FRAME bytes is within the cap (and is an unknown-op error)."""
    pad = b"x" * (P.MAX_FRAME - 64)
    body = msgpack.packb({"op": "nope", "id": 5, "pad": pad}, use_bin_type=True)
    body = msgpack.packb(
        {"op": "nope", "id": 5, "pad": pad + b"x" * (P.MAX_FRAME - len(body))}, use_bin_type=True
    )
    assert len(body) == P.MAX_FRAME
    raw.send_body(body)
    reply = raw.recv()
    assert error_code(reply) == "bad_request" and reply["id"] == 5
    assert_healthy(supervisor)


@pytest.mark.parametrize(
    "body",
    [
        b"\xc1",  # the one byte msgpack never uses
        b"\x82\xa2op",  # map of 2 with half a key
        b"\x91" * 5000 + b"\xc0",  # absurdly deep nesting
        b"\xdd\xff\xff\xff\xff",  # array claiming 4 G items
        b"\x81\x01\x02",  # a map with an int key (strict_map_key)
        b"\xa4ping\xa4ping",  # two objects in one frame
    ],
    ids=["reserved-byte", "truncated-map", "deep-nesting", "huge-array", "int-key", "trailing"],
)
def test_garbage_msgpack_gets_protocol_error(shared: Sup, sraw: Raw, body: bytes) -> None:
    sraw.send_body(body)
    assert error_code(sraw.recv()) == "protocol"
    # the frame boundary held: the same connection still works
    assert sraw.call({"op": "ping"})["ok"] is True
    assert_healthy(shared)


@pytest.mark.parametrize(
    "obj", [[1, 2, 3], "ping", 42, None, b"\x00" * 8], ids=["list", "str", "int", "nil", "bin"]
)
def test_non_map_body_gets_protocol_error(shared: Sup, sraw: Raw, obj: Any) -> None:
    sraw.send_body(msgpack.packb(obj, use_bin_type=True))
    assert error_code(sraw.recv()) == "protocol"
    assert sraw.call({"op": "ping"})["ok"] is True
    assert_healthy(shared)


@pytest.mark.parametrize("op", ["nope", "", "ATTACH", 7, None, b"attach", ["put"], "x" * 10000])
def test_unknown_op_gets_bad_request(shared: Sup, sraw: Raw, op: Any) -> None:
    reply = sraw.call({"op": op, "id": 77})
    assert error_code(reply) == "bad_request" and reply["id"] == 77
    assert len(reply["error"]["message"]) < 200  # a hostile op is not echoed in full
    assert_healthy(shared)


def test_missing_op_gets_bad_request(shared: Sup, sraw: Raw) -> None:
    assert error_code(sraw.call({"id": 3})) == "bad_request"
    assert_healthy(shared)


@pytest.mark.parametrize("rid", ["1", -1, -(1 << 63), 1.5, True, None, b"\x01"])
def test_bad_request_id_gets_bad_request_with_id_zero(shared: Sup, sraw: Raw, rid: Any) -> None:
    reply = sraw.call({"op": "ping", "id": rid})
    assert error_code(reply) == "bad_request" and reply["id"] == 0
    assert_healthy(shared)


# ---------------------------------------------------------------------- field types
# admin ops (ping, stats, ls, clear, pin, unpin, worker_exit) work without attaching, so
# that tools and the gunicorn master are not counted as workers
@pytest.mark.parametrize("op_before", ["acquire", "release", "put", "report"])
def test_op_before_attach_gets_bad_request(shared: Sup, sraw: Raw, op_before: str) -> None:
    reply = sraw.call(
        {
            "op": op_before,
            "offset": 8192,
            "gen": 1,
            "lease": 1,
            "key": b"k" * 16,
            "counters": {},
            "pid": 1,
        }
    )
    assert error_code(reply) == "bad_request"
    assert "before attach" in reply["error"]["message"]
    assert_healthy(shared)


def _acquire_cases():
    return [
        ({"offset": "8192", "gen": 1}, "str-for-int"),
        ({"offset": -1, "gen": 1}, "negative"),
        ({"offset": (1 << 64) - 1, "gen": 1}, "huge"),
        ({"offset": -(1 << 63), "gen": 1}, "huge-negative"),
        ({"offset": True, "gen": 1}, "bool-for-int"),
        ({"offset": 8192.0, "gen": 1}, "float-for-int"),
        ({"offset": None, "gen": 1}, "nil"),
        ({"gen": 1}, "missing-offset"),
        ({"offset": 0, "gen": 1}, "offset-in-header"),
        ({"offset": "DATA", "gen": 0}, "gen-zero"),
        ({"offset": "DATA", "gen": False}, "gen-bool"),
        ({"offset": "DATA", "gen": [1]}, "gen-list"),
    ]


@pytest.mark.parametrize(
    "fields", [c[0] for c in _acquire_cases()], ids=[c[1] for c in _acquire_cases()]
)
def test_acquire_wrong_field_types(shared: Sup, sattached: Raw, fields: dict) -> None:
    if fields.get("offset") == "DATA":
        fields = {**fields, "offset": sattached.geometry.data_offset}
    reply = sattached.call({"op": "acquire", **fields})
    assert error_code(reply) == "bad_request"
    assert_healthy(shared)


def _put_cases():
    return [
        ({"root": b"r" * 15}, "short-digest"),
        ({"root": b"r" * 17}, "long-digest"),
        ({"root": "r" * 16}, "str-digest"),
        ({"tokens": b"\x00" * 10}, "tokens-not-multiple-of-4"),
        ({"tokens": b""}, "no-tokens"),
        ({"tokens": list(range(64))}, "tokens-as-list"),
        ({"tokens": b"\x00\x00\x00\x00"}, "fewer-than-a-chunk"),
        ({"fingerprint": b"f" * (A.MAX_FINGERPRINT + 1)}, "long-fingerprint"),
        ({"fingerprint": 3}, "int-fingerprint"),
        ({"payload_len": 0}, "zero-length"),
        ({"payload_len": -5}, "negative-length"),
        ({"payload_len": "100"}, "str-length"),
        ({"payload_len": True}, "bool-length"),
        ({"checksum": -1}, "negative-checksum"),
        ({"checksum": 1.0}, "float-checksum"),
        ({"pin": 1}, "int-for-bool"),
        ({"payload_len": 1 << 20}, "memfd-smaller-than-length"),
    ]


@pytest.mark.parametrize("over", [c[0] for c in _put_cases()], ids=[c[1] for c in _put_cases()])
def test_put_wrong_field_types(shared: Sup, sattached: Raw, over: dict) -> None:
    data = b"d" * 1000
    fd = memfd_with(data)
    try:
        reply = sattached.call(put_msg(tokens_for(sattached), data, **over), [fd])
    finally:
        os.close(fd)
    assert error_code(reply) == "bad_request"
    assert_healthy(shared)


@pytest.mark.parametrize(
    "msg",
    [
        {"op": "pin", "key": b"k" * 15},
        {"op": "unpin", "key": 5},
        {"op": "ls", "limit": 0},
        {"op": "ls", "limit": "10"},
        {"op": "release", "lease": "1"},
        {"op": "release", "lease": 0},
        {"op": "release", "lease": 1, "tokens_restored": -1},
        {"op": "report", "counters": []},
        {"op": "report", "counters": {"misses": -1}},
        {"op": "report", "counters": {"misses": True}},
        {"op": "report", "counters": {"misses": 1 << 60}},
        {"op": "report", "counters": {"misses": "1"}},
        {"op": "worker_exit", "pid": 0},
        {"op": "worker_exit", "pid": "1"},
        {"op": "attach", "pid": "me"},
    ],
    ids=lambda m: f"{m['op']}-{'-'.join(f'{k}={v!r:.12}' for k, v in m.items() if k != 'op')}",
)
def test_other_ops_wrong_field_types(shared: Sup, sattached: Raw, msg: dict) -> None:
    assert error_code(sattached.call(msg)) == "bad_request"
    assert_healthy(shared)


def test_report_with_unknown_counter(supervisor, attached: Raw) -> None:
    before = supervisor.stats()
    reply = attached.call({"op": "report", "counters": {"misses": 1, "bogus": 1000}})
    assert error_code(reply) == "bad_request"
    assert "bogus" in reply["error"]["message"]
    after = supervisor.stats()
    assert after["misses"] == before["misses"] == 0 and after["workers"] == before["workers"]
    # a valid report counts (a report carries the connection's running totals)
    assert attached.call({"op": "report", "counters": {"misses": 2}})["ok"]
    assert supervisor.stats()["misses"] == 2
    assert_healthy(supervisor)


# --------------------------------------------------------------------------- puts
def test_put_without_fd(supervisor, attached: Raw) -> None:
    data = b"x" * 100
    reply = attached.call(put_msg(tokens_for(attached), data))
    assert error_code(reply) == "bad_request" and "memfd" in reply["error"]["message"]
    assert_healthy(supervisor)


def test_put_with_a_pipe_fd(supervisor, attached: Raw) -> None:
    r, w = os.pipe()
    try:
        os.write(w, b"x" * 100)
        reply = attached.call(put_msg(tokens_for(attached), b"x" * 100), [r])
    finally:
        os.close(r)
        os.close(w)
    assert error_code(reply) == "bad_request"
    assert_healthy(supervisor)


def test_put_with_a_socket_fd(supervisor, attached: Raw) -> None:
    a, b = socket.socketpair()
    try:
        reply = attached.call(put_msg(tokens_for(attached), b"x" * 100), [a.fileno()])
    finally:
        a.close()
        b.close()
    assert error_code(reply) == "bad_request"
    assert_healthy(supervisor)


def test_put_with_a_regular_disk_file_fd(supervisor, attached: Raw) -> None:
    data = b"y" * 4096
    with tempfile.TemporaryFile(dir="/var/tmp") as f:
        f.write(data)
        f.flush()
        reply = attached.call(put_msg(tokens_for(attached), data), [f.fileno()])
    assert error_code(reply) == "bad_request" and "memfd" in reply["error"]["message"]
    assert_healthy(supervisor)


def test_put_with_a_directory_fd(supervisor, attached: Raw) -> None:
    fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY)
    try:
        reply = attached.call(put_msg(tokens_for(attached), b"x" * 10), [fd])
    finally:
        os.close(fd)
    assert error_code(reply) == "bad_request"
    assert_healthy(supervisor)


def test_put_whose_checksum_does_not_match(supervisor, attached: Raw) -> None:
    data = os.urandom(20000)
    fd = memfd_with(data)
    tokens = tokens_for(attached, 2)
    try:
        reply = attached.call(
            put_msg(tokens, data, checksum=xxhash.xxh3_64_intdigest(data) ^ 1), [fd]
        )
    finally:
        os.close(fd)
    assert error_code(reply) == "checksum"
    st = supervisor.stats()
    assert st["entries"] == 0 and st["bytes_used"] == 0 and st["rejected_puts"] == 1
    # and nothing was indexed: a lookup for those tokens misses
    with supervisor.client() as c:
        assert c.lookup(chain_digests(b"r" * 16, tokens, c.view.geometry.chunk_tokens)) is None
    assert_healthy(supervisor)


def test_put_of_a_valid_memfd_by_hand(supervisor, attached: Raw) -> None:
    data = os.urandom(3000)
    fd = memfd_with(data)
    try:
        reply = attached.call(put_msg(tokens_for(attached), data), [fd])
    finally:
        os.close(fd)
    assert reply["ok"] and reply["n_tokens"] == attached.geometry.chunk_tokens
    assert_healthy(supervisor)


def test_put_larger_than_the_arena_names_size(make_supervisor) -> None:
    """A blob that can never fit is refused with an error naming --size, whatever its size."""
    sup = make_supervisor("--size", "8M")
    with sup.client() as c:
        data_size = c.view.geometry.data_size
        chunk = c.view.geometry.chunk_tokens
        for size in (data_size - 100, data_size + 1, 2 * data_size):
            with pytest.raises(ArenaFullError, match="--size"):
                c.put_bytes(os.urandom(16), np.arange(chunk, dtype=np.int32), b"fp", b"z" * size)
        assert c.stats()["rejected_puts"] == 3
    assert_healthy(sup)


# ------------------------------------------------------------------------- leases
def test_acquire_of_a_random_offset_and_gen(supervisor, attached: Raw) -> None:
    g = attached.geometry
    for offset, gen in [
        (g.data_offset, 1),
        (g.data_offset + 12345, 99),
        (g.data_offset + g.data_size, (1 << 64) - 1),
    ]:
        reply = attached.call({"op": "acquire", "offset": offset, "gen": gen})
        assert error_code(reply) == "not_found"
    assert supervisor.stats()["leases_active"] == 0
    assert_healthy(supervisor)


def test_release_of_a_lease_not_held(supervisor, attached: Raw) -> None:
    assert error_code(attached.call({"op": "release", "lease": 12345})) == "not_found"
    # a lease held by another connection cannot be released from here
    root = os.urandom(16)
    with supervisor.client() as c:
        chunk = c.view.geometry.chunk_tokens
        tokens = np.arange(chunk, dtype=np.int32)
        c.put_bytes(root, tokens, b"fp", b"q" * 500)
        hit = c.lookup(chain_digests(root, tokens, chunk))
        lease = c.acquire(hit)
        assert error_code(attached.call({"op": "release", "lease": lease.id})) == "not_found"
        assert c.stats()["leases_active"] == 1
        assert lease.finish() is True
        # and a lease cannot be released twice
        with pytest.raises(NotFound):
            c.request({"op": "release", "lease": lease.id})
    assert_healthy(supervisor)


def test_leases_of_a_closed_raw_connection_are_released(supervisor, attached: Raw) -> None:
    root = os.urandom(16)
    with supervisor.client() as c:
        chunk = c.view.geometry.chunk_tokens
        tokens = np.arange(chunk, dtype=np.int32)
        c.put_bytes(root, tokens, b"fp", b"q" * 500)
        slot = c.lookup(chain_digests(root, tokens, chunk)).slot
    for _ in range(3):
        assert attached.call({"op": "acquire", "offset": slot.rec_offset, "gen": slot.rec_gen})[
            "ok"
        ]
    assert supervisor.stats()["leases_active"] == 3
    attached.close()
    wait_until(lambda: supervisor.stats()["leases_active"] == 0, what="the leases' release")
    assert_healthy(supervisor)


# ---------------------------------------------------------------- descriptors
def test_extra_fds_are_closed(supervisor) -> None:
    """Descriptors sent with non-put frames, or beyond the one a put uses, are closed."""
    pid = supervisor.proc.pid
    r = Raw(supervisor.socket)
    r.attach()
    base = fd_count(pid)
    data = b"p" * 64
    for _ in range(30):
        fds = [memfd_with(b"a" * 10) for _ in range(3)]
        fds2 = [memfd_with(data), *(memfd_with(b"b") for _ in range(2))]
        try:
            assert r.call({"op": "ping"}, fds)["ok"]
            assert r.call(put_msg(tokens_for(r), data), fds2)["ok"]
            assert r.call({"op": "stats"}, [fds[0]])["ok"]
            assert error_code(r.call({"op": "nope"}, fds)) == "bad_request"
        finally:
            for fd in fds + fds2:
                os.close(fd)
    # (closed off the loop, by the supervisor's closer thread)
    wait_until(
        lambda: fd_count(pid) <= base, what=f"the fds' close: {os.listdir(f'/proc/{pid}/fd')}"
    )
    r.close()
    assert_healthy(supervisor)


def test_too_many_fds_at_once_close_the_connection_and_leak_nothing(supervisor) -> None:
    pid = supervisor.proc.pid
    with supervisor.client() as c:  # warm up: the fds a first client costs
        c.stats()
    base = fd_count(pid)
    for n in (5, 16, 64):
        r = Raw(supervisor.socket)
        fds = [memfd_with(b"x") for _ in range(n)]
        try:
            r.send({"op": "ping"}, fds)
            assert r.closed_by_peer()
        finally:
            for fd in fds:
                os.close(fd)
            r.close()
    wait_until(lambda: fd_count(pid) <= base, what="the descriptors to be closed")
    assert_healthy(supervisor)


def test_fds_sent_with_a_truncated_frame_are_closed_at_disconnect(supervisor) -> None:
    pid = supervisor.proc.pid
    with supervisor.client() as c:
        c.stats()
    base = fd_count(pid)
    for _ in range(10):
        r = Raw(supervisor.socket)
        fds = [memfd_with(b"x") for _ in range(4)]
        r.send_raw(struct.pack(">I", 500) + b"\x85", fds)
        for fd in fds:
            os.close(fd)
        r.sock.shutdown(socket.SHUT_WR)
        assert r.closed_by_peer()
        r.close()
    wait_until(lambda: fd_count(pid) <= base, what="the descriptors to be closed")
    assert_healthy(supervisor)


def test_a_client_let_go_of_without_close_leaves_no_descriptor_open(supervisor) -> None:
    """A Client dropped unclosed (a worker's, replaced) left its arena view's descriptor and
    its warm put memfds open: ints, which nothing closed when their owners were collected."""
    base = fd_count(os.getpid())
    gc.disable()  # no collection needed: the last reference going is enough
    try:
        for i in range(3):
            c = supervisor.client()
            c.put_bytes(os.urandom(16), np.arange(64, dtype=np.int32), b"fp", b"x" * (i + 1))
            assert c.lookup([b"\0" * 16]) is None  # (attached: a mapping and two fds)
            del c
        assert fd_count(os.getpid()) <= base, deleted_arena_fds(os.getpid())
    finally:
        gc.enable()


def test_many_bad_requests_on_one_connection_keep_it_open(supervisor, attached: Raw) -> None:
    """Pipelined garbage: every frame gets its own error reply, in order."""
    bodies = [msgpack.packb({"op": "nope", "id": i}) for i in range(1, 51)]
    attached.send_raw(b"".join(struct.pack(">I", len(b)) + b for b in bodies))
    for i in range(1, 51):
        reply = attached.recv()
        assert error_code(reply) == "bad_request" and reply["id"] == i
    assert attached.call({"op": "ping"})["ok"]
    assert_healthy(supervisor)


def test_bad_requests_raise_the_matching_client_error(supervisor) -> None:
    """The error tree crosses the socket: a BadRequest reply is a BadRequest in the client."""
    with supervisor.client() as c:
        with pytest.raises(BadRequest, match="unknown op"):
            c.request({"op": "nope"})
        with pytest.raises(NotFound):
            c.request({"op": "acquire", "offset": c.view.geometry.data_offset, "gen": 5})
        assert c.stats()["ok"]
    assert_healthy(supervisor)


# ------------------------------------------------------------------------- fuzzing
_KNOWN_CODES = {"protocol", "bad_request", "checksum", "not_found", "arena_full"}
_FIELDS = [
    "offset",
    "gen",
    "lease",
    "tokens_restored",
    "root",
    "tokens",
    "fingerprint",
    "payload_len",
    "checksum",
    "pin",
    "key",
    "limit",
    "counters",
    "pid",
]
_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(1 << 63), (1 << 64) - 1),
    st.integers(0, 1 << 24),
    st.floats(allow_nan=True),
    st.text(max_size=20),
    st.binary(max_size=80),
    st.sampled_from([b"r" * 16, b"\x00" * 64, b"\x01" * 4]),
    st.lists(st.integers(0, 9), max_size=4),
    st.dictionaries(
        st.sampled_from(["misses", "hits", "tokens_restored", "x"]),
        st.one_of(st.integers(-5, 1 << 50), st.text(max_size=3)),
        max_size=3,
    ),
)
_requests = st.fixed_dictionaries(
    {"op": st.one_of(st.sampled_from(sorted(OPS)), st.text(max_size=8))},
    optional={"id": st.one_of(st.integers(0, 1 << 20), _values), **{f: _values for f in _FIELDS}},
)


def test_fuzzed_requests_never_cause_an_internal_error(supervisor) -> None:
    """Random ops and field values: each gets a reply that is ok or a known error code."""
    r = Raw(supervisor.socket)
    r.attach()

    @settings(
        max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(msg=_requests, with_fd=st.booleans())
    def one(msg: dict, with_fd: bool) -> None:
        if msg.get("op") == "worker_exit":
            msg = {**msg, "pid": 1 << 30}  # never close our own test connections
        fds = [memfd_with(b"f" * 256)] if with_fd else []
        try:
            reply = r.call(msg, fds)
        finally:
            for fd in fds:
                os.close(fd)
        if not reply["ok"]:
            assert error_code(reply) in _KNOWN_CODES, reply

    try:
        one()
    finally:
        r.close()
    assert_healthy(supervisor)
