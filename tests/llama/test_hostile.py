"""Hostile arena contents and hostile HTTP requests, with real llama.cpp on the tiny model.

Arena: a corrupted header, a truncated file, flipped blob bytes, a blob of
another model, token ids that do not match their digest. Each must be
detected, counted (the worker's ``totals`` and, where the worker can still
reach it, the supervisor's ``restore_failures``), never restored, and the
output must equal a cold run's. Nothing may die of a signal (SIGBUS). The
corruptions and truncations run in both arena modes (``--reserve true`` and
``false``: the ``reserve_mode`` fixture).

HTTP: oversize bodies, invalid JSON, prompts longer than the context, token
ids outside the vocabulary, against real gunicorn workers: each a clear 4xx,
and the same workers stay healthy and correct afterwards.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import llama_cpp
import numpy as np
import pytest

from shmkv.core import arena as A
from shmkv.core.errors import ArenaCorruptError
from shmkv.core.keys import chain_digests
from shmkv.llama import key_root, model_fingerprint
from shmkv.supervisor.loop import EXIT_ARENA_LOST
from tests.support import SHM
from tests.support.blobs import each_record, flip_payload_bytes
from tests.support.llama_workers import KW, SYSTEM, BarrierWorker, completion, run_worker, texts
from tests.support.servers import EXTRA, SAMPLING, Server
from tests.support.supervisors import start_supervisor
from tests.support.waiting import no_signal_deaths

log = logging.getLogger(__name__)

pytestmark = pytest.mark.timeout(240)


# ------------------------------------------------------------------- helpers
def records(arena: Path) -> list[A.Record]:
    """Every record the index points at, read through a fresh read-only view."""
    return each_record(arena, lambda view, off, gen: view.read_record(off, gen))


def payload_of(arena: Path, rec: A.Record) -> bytes:
    """The payload of ``rec`` (a chunked record's assembled), read without a lease."""
    (payload,) = [
        p
        for p in each_record(
            arena, lambda view, off, gen: view.read_payload(rec) if off == rec.offset else None
        )
        if p is not None
    ]
    return payload


def record_for(arena: Path, tokens: list[int]) -> A.Record:
    """The record holding the longest prefix of ``tokens`` (by its stored token ids)."""
    best, best_n = None, -1
    with open(arena, "rb") as f:
        for rec in records(arena):
            f.seek(rec.tokens_off)
            toks = np.frombuffer(f.read(4 * rec.n_tokens), dtype="<i4")
            n = len(toks) if np.array_equal(toks, tokens[: len(toks)]) else -1
            if n > best_n:
                best, best_n = rec, n
    assert best is not None and best_n > 0, "no record of this prompt in the arena"
    return best


def tokenize(model: str, prompt: str) -> list[int]:
    llm = llama_cpp.Llama(model_path=model, verbose=False, **KW)
    return llm.tokenize(prompt.encode())


# ------------------------------------------------------------- arena: header
@pytest.mark.parametrize("pos", [0, 8, 16, 40, 56, 76, 92, 127, 128])
def test_corrupted_header_byte_refuses_every_new_attach(supervisor, pos: int) -> None:
    """Any flipped byte of the immutable header (or its checksum) fails a new attach."""
    with supervisor.client() as c:  # attached before: keeps working, geometry is cached
        c.stats()
        fd = os.open(supervisor.arena, os.O_RDWR)
        try:
            (b,) = os.pread(fd, 1, pos)
            os.pwrite(fd, bytes([b ^ 0x41]), pos)
            with pytest.raises(ArenaCorruptError):
                with supervisor.client() as fresh:
                    fresh.ensure()
            assert c.stats()["ok"]
            os.pwrite(fd, bytes([b]), pos)
        finally:
            os.close(fd)
    with supervisor.client() as fresh:
        assert fresh.view.geometry.arena_size > 0
    assert supervisor.proc.poll() is None


@pytest.mark.usefixtures("reserve_mode")  # (the arena's pages: both modes)
def test_corrupted_header_new_worker_runs_cold_and_counts_it(supervisor, models) -> None:
    prompt = SYSTEM + " Question: is the header sane?"
    jobs = [completion(prompt), completion(prompt + " Again?")]
    cold = run_worker(None, models["seed0"], jobs, mode="cold")
    warm = run_worker(supervisor, models["seed0"], jobs[:1])
    assert warm["totals"]["publishes"] >= 1
    fd = os.open(supervisor.arena, os.O_RDWR)
    try:
        for pos in (3, 50, 111):  # magic, geometry, arena id
            (b,) = os.pread(fd, 1, pos)
            os.pwrite(fd, bytes([b ^ 0xFF]), pos)
    finally:
        os.close(fd)
    got = run_worker(supervisor, models["seed0"], jobs)
    assert texts(got) == texts(cold)
    assert got["totals"]["tokens_restored"] == 0 and got["totals"]["hits"] == 0
    errors = got["totals"]["errors"]
    assert errors.get("corrupt arena", 0) >= 1, errors
    log.info("corrupted header: new worker ran cold, errors %s", errors)
    assert supervisor.proc.poll() is None  # the supervisor itself is unaffected


# ---------------------------------------------------------- arena: truncated
@pytest.mark.usefixtures("reserve_mode")  # (the arena's pages: both modes)
@pytest.mark.parametrize("keep", ["nothing", "header", "half"])
def test_truncated_arena_worker_runs_cold_supervisor_exits_7_no_sigbus(
    make_supervisor, models, keep: str
) -> None:
    sup = make_supervisor("--size", "32M")
    prompt = SYSTEM + " Question: where did the arena go?"
    jobs = [completion(prompt), completion(prompt + " And now?", stream=True)]
    cold = run_worker(None, models["seed0"], jobs, mode="cold")
    warm = run_worker(sup, models["seed0"], jobs[:1])
    assert warm["totals"]["publishes"] >= 1
    # a lease held across the truncation: its release must not make the supervisor write
    holder = sup.client()
    rec = records(sup.arena)[0]
    lease_reply = holder.request({"op": "acquire", "offset": rec.offset, "gen": rec.gen})
    assert lease_reply["ok"]
    worker = BarrierWorker(sup, models["seed0"], jobs)
    assert worker.state == "attached"
    size = {"nothing": 0, "header": A.HEADER_SIZE, "half": 16 << 20}[keep]
    os.truncate(sup.arena, size)
    t0 = time.monotonic()
    holder.close()
    got = worker.go()
    rc = sup.proc.wait(10)
    exit_after = time.monotonic() - t0
    no_signal_deaths(sup.proc)
    assert rc == EXIT_ARENA_LOST, sup.log()
    assert exit_after < 3.0, exit_after
    assert texts(got) == texts(cold)
    totals = got["totals"]
    assert totals["tokens_restored"] == 0 and totals["hits"] == 0
    # it saw the truncation itself, or the supervisor had already exited over it
    seen = totals["errors"].get("corrupt arena", 0) + totals["errors"].get(
        "supervisor unavailable", 0
    )
    assert seen >= 1, totals["errors"]
    assert "truncated" in sup.log() and "Traceback" not in sup.log()
    log.info(
        "truncated to %s: supervisor exited %d after %.2fs; worker errors %s",
        keep,
        rc,
        exit_after,
        totals["errors"],
    )
    assert not list(SHM.glob(f"shmkv-{sup.name}*"))


@pytest.mark.usefixtures("reserve_mode")  # (the arena's pages: both modes)
def test_truncated_arena_idle_supervisor_exits_7_within_2s(make_supervisor) -> None:
    """No request arrives: the supervisor's own once-a-second check notices."""
    sup = make_supervisor("--size", "16M")
    with sup.client() as c:
        c.put_bytes(os.urandom(16), np.arange(64, dtype=np.int32), b"fp", b"x" * 100_000)
    os.truncate(sup.arena, 0)
    t0 = time.monotonic()
    rc = sup.proc.wait(10)
    took = time.monotonic() - t0
    no_signal_deaths(sup.proc)
    assert rc == EXIT_ARENA_LOST and took < 2.0, (rc, took, sup.log())
    log.info("idle supervisor noticed the truncation and exited %d after %.2fs", rc, took)


@pytest.mark.usefixtures("reserve_mode")  # (the arena's pages: both modes)
@pytest.mark.parametrize("then", ["close-with-lease", "clear", "release-doomed"])
def test_arena_writes_after_truncation_never_sigbus_the_supervisor(
    make_supervisor, then: str
) -> None:
    """Within the second before its periodic check, a request or a closing connection made
    the supervisor write to the truncated mapping: it died of SIGBUS instead of exit 7."""
    sup = make_supervisor("--size", "16M")
    c = sup.client()
    root, toks = os.urandom(16), np.arange(64, dtype=np.int32)
    c.put_bytes(root, toks, b"fp", os.urandom(100_000))
    lease = c.acquire(c.lookup(chain_digests(root, toks, 64)))
    if then == "release-doomed":
        with sup.client(attach=False) as admin:
            admin.clear()  # the leased entry is doomed: its release frees (writes) it
    os.truncate(sup.arena, 0)
    if then == "close-with-lease":
        c.close()  # its lease ends with the connection
    elif then == "clear":
        with pytest.raises(ArenaCorruptError, match="truncated"):
            with sup.client(attach=False) as admin:
                admin.clear()
    else:
        with pytest.raises(ArenaCorruptError, match="truncated"):
            c.request({"op": "release", "lease": lease.id})
    rc = sup.proc.wait(10)
    no_signal_deaths(sup.proc)
    assert rc == EXIT_ARENA_LOST, sup.log()
    c.close()


# -------------------------------------------------------- arena: flipped blob
@pytest.mark.usefixtures("reserve_mode")  # (the arena's pages: both modes)
def test_flipped_blob_bytes_are_counted_in_shmkv_stats_and_never_restored(supervisor, models):
    prompt = SYSTEM + " Question: is this blob intact?"
    jobs = [completion(prompt), completion(prompt + " Really?"), completion(prompt[:-10])]
    cold = run_worker(None, models["seed0"], jobs, mode="cold")
    run_worker(supervisor, models["seed0"], jobs[:1])
    flipped = flip_payload_bytes(supervisor.arena)
    before = supervisor.stats_json()
    got = run_worker(supervisor, models["seed0"], jobs)
    after = supervisor.stats_json()
    assert texts(got) == texts(cold)
    assert all(r["last"]["tokens_restored"] == 0 for r in got["results"])
    # (after the first cold prefill the worker's own context may serve the others)
    fails = got["totals"]["restore_failures"]
    assert fails >= 1, got["totals"]
    assert got["totals"]["errors"].get("corrupt record", 0) == fails
    assert after["restore_failures"] - before["restore_failures"] == fails
    log.info(
        "flipped %d record(s): %d restores refused, shmkv stats restore_failures %d -> %d",
        flipped,
        fails,
        before["restore_failures"],
        after["restore_failures"],
    )


# ------------------------------------------------------ arena: another model
def test_blob_of_another_model_under_this_models_key_is_never_restored(supervisor, models):
    """seed1's real state for the same token ids, filed under seed0's key chain."""
    prompt = SYSTEM + " Question: which weights made this?"
    jobs = [completion(prompt)]
    cold0 = run_worker(None, models["seed0"], jobs, mode="cold")
    one = run_worker(supervisor, models["seed1"], jobs)  # publishes under seed1's root
    assert one["totals"]["publishes"] >= 1
    tokens = tokenize(models["seed0"], prompt)
    assert tokens == tokenize(models["seed1"], prompt)  # same vocabulary and token ids
    rec = record_for(supervisor.arena, tokens)
    with open(supervisor.arena, "rb") as f:
        f.seek(rec.fp_off)
        fp1 = f.read(rec.fp_len)
        f.seek(rec.tokens_off)
        rec_tokens = np.frombuffer(f.read(4 * rec.n_tokens), dtype="<i4").copy()
    payload = payload_of(supervisor.arena, rec)
    # seed0 does not even find seed1's records: another fingerprint, another key chain
    plain = run_worker(supervisor, models["seed0"], jobs)
    assert texts(plain) == texts(cold0)
    assert plain["totals"]["hits"] == 0 and not plain["totals"]["errors"], plain["totals"]
    with supervisor.client(attach=False) as c:
        c.clear()  # what seed0 published for itself would otherwise win the lookup
    fp0 = model_fingerprint(llama_cpp.Llama(model_path=models["seed0"], verbose=False, **KW))
    assert fp0 != fp1
    with supervisor.client() as c:
        c.put_bytes(key_root(fp0, ""), rec_tokens, fp1, payload)
    before = supervisor.stats_json()
    got = run_worker(supervisor, models["seed0"], jobs)
    after = supervisor.stats_json()
    assert texts(got) == texts(cold0)
    assert got["totals"]["tokens_restored"] == 0
    assert got["totals"]["errors"].get("model mismatch", 0) >= 1, got["totals"]
    assert after["restore_failures"] > before["restore_failures"]
    log.info("another model's blob under our key: refused (%s)", got["totals"]["errors"])


# ---------------------------------------------- arena: tokens vs their digest
def test_record_of_other_token_ids_is_never_found(supervisor, models):
    """A put of the right root/fingerprint but token ids differing inside the first chunk:
    its digests are its own, so the prompt never even finds it."""
    prompt = SYSTEM + " Question: whose tokens are these?"
    cold = run_worker(None, models["seed0"], [completion(prompt)], mode="cold")
    tokens = np.array(tokenize(models["seed0"], prompt), dtype=np.int32)
    fp = model_fingerprint(llama_cpp.Llama(model_path=models["seed0"], verbose=False, **KW))
    forged = tokens.copy()
    forged[5] = (forged[5] + 1) % 500
    with supervisor.client() as c:
        c.put_bytes(key_root(fp, ""), forged, fp, np.random.default_rng(2).bytes(300_000))
    before = supervisor.stats_json()
    got = run_worker(supervisor, models["seed0"], [completion(prompt)])
    after = supervisor.stats_json()
    assert texts(got) == texts(cold)
    assert got["totals"]["tokens_restored"] == 0 and not got["totals"]["errors"]
    assert after["hits"] == before["hits"]  # never leased


@pytest.mark.parametrize("where", [0, 5, 70])
@pytest.mark.parametrize("reseal", [False, True], ids=["meta-checksum-broken", "resealed"])
def test_token_ids_not_matching_the_digest_are_detected_and_counted(
    supervisor, models, where: int, reseal: bool
):
    """Flip a stored token id of a real record (first or second chunk). Plain, the
    metadata checksum catches it; resealed (the checksum rewritten, as a stray writer that
    knows the format would), the token comparison does. Never restored, always counted."""
    prompt = SYSTEM + f" Question: token {where} {reseal}?"
    jobs = [completion(prompt)]
    cold = run_worker(None, models["seed0"], jobs, mode="cold")
    run_worker(supervisor, models["seed0"], jobs)
    tokens = tokenize(models["seed0"], prompt)
    fd = os.open(supervisor.arena, os.O_RDWR)
    try:
        for rec in records(supervisor.arena):  # every record of this prompt (and completion)
            n = min(rec.n_tokens, len(tokens))
            raw = os.pread(fd, 4 * n, rec.tokens_off)
            if raw != np.asarray(tokens[:n], dtype="<i4").tobytes():
                continue
            pos = rec.tokens_off + 4 * where
            (t,) = np.frombuffer(os.pread(fd, 4, pos), dtype="<i4")
            os.pwrite(fd, np.array([(t + 1) % 500], dtype="<i4").tobytes(), pos)
            if reseal:
                hdr = os.pread(fd, A.REC_HEADER_SIZE, rec.offset)
                fp = os.pread(fd, rec.fp_len, rec.fp_off)
                toks = os.pread(fd, 4 * rec.n_tokens, rec.tokens_off)
                meta = A.meta_checksum(hdr, fp, toks)
                os.pwrite(fd, A._U64.pack(meta), rec.offset + A._META_CSUM_OFF)
    finally:
        os.close(fd)
    before = supervisor.stats_json()
    got = run_worker(supervisor, models["seed0"], jobs)
    after = supervisor.stats_json()
    assert texts(got) == texts(cold)
    totals = got["totals"]
    assert totals["tokens_restored"] == 0, totals
    assert totals["restore_failures"] >= 1, totals
    assert totals["errors"].get("corrupt record", 0) >= 1, totals["errors"]
    assert after["restore_failures"] - before["restore_failures"] == totals["restore_failures"]


# ------------------------------------------------------------------- HTTP layer
MAX_BODY = 64 << 10


@pytest.fixture(scope="module")
def http(tmp_path_factory, serve_model) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("hostile-http")
    sup = start_supervisor(
        tmp, "--size", "64M", env_extra={"SHMKV_MAX_REQUEST_BYTES": str(MAX_BODY)}
    )
    srv = Server(sup, serve_model, workers=2, tmp_path=tmp)
    try:
        yield srv
    finally:
        srv.stop()
        sup.stop()


def assert_workers_healthy(srv: Server, pids: set[int], reference, i: int) -> None:
    """The same workers (no restart), /health 200 on them, and a completion equal to cold."""
    assert srv.proc.poll() is None
    assert srv.worker_pids() == pids, "a worker was restarted"
    seen = set()
    for _ in range(6):
        r = httpx.get(srv.base + "/health", timeout=10)
        assert r.status_code == 200 and r.json()["status"] == "ok"
        seen.add(r.json()["worker_pid"])
    assert seen <= pids
    prompt = SYSTEM + f" After hostile request {i}: which mat?"
    text, _ = srv.complete(prompt)
    assert text == reference(prompt)


def post(srv: Server, path: str, **kw) -> httpx.Response:
    with httpx.Client(timeout=60, limits=httpx.Limits(max_keepalive_connections=0)) as c:
        return c.post(srv.base + path, **kw)


def error_message(r: httpx.Response) -> str:
    body = r.json()
    if "error" in body:
        return body["error"]["message"]
    return json.dumps(body["detail"])  # FastAPI's validation errors


def test_http_hostile_requests_get_a_clear_4xx_and_workers_stay_healthy(http, serve_reference):
    srv = http
    pids = srv.worker_pids()
    assert len(pids) == 2
    assert_workers_healthy(srv, pids, serve_reference, 0)
    long_text = (SYSTEM + " ") * 8  # well over n_ctx tokens, under the body cap
    assert len(long_text.encode()) < MAX_BODY
    cases: list[tuple[str, str, dict, set[int], str]] = [
        (
            "oversize body",
            "/v1/completions",
            {"json": {"prompt": "x" * (MAX_BODY + 10), "max_tokens": 4}},
            {413},
            "max-request-bytes",
        ),
        (
            "oversize chunked body",
            "/v1/completions",
            {
                "content": iter([b'{"prompt": "', b"x" * (MAX_BODY + 10), b'"}']),
                "headers": {"content-type": "application/json"},
            },
            {413},
            "max-request-bytes",
        ),
        (
            "invalid JSON",
            "/v1/completions",
            {"content": b'{"prompt": "hi", ', "headers": {"content-type": "application/json"}},
            {422},
            "json",
        ),
        ("JSON array", "/v1/completions", {"json": [1, 2, 3]}, {422}, ""),
        (
            "wrong field types",
            "/v1/completions",
            {"json": {"prompt": "hi", "max_tokens": "many", "temperature": "hot"}},
            {422},
            "",
        ),
        (
            "invalid JSON (chat)",
            "/v1/chat/completions",
            {"content": b"\xff\xfe not json", "headers": {"content-type": "application/json"}},
            {422},
            "",
        ),
        (
            "prompt longer than the context (text)",
            "/v1/completions",
            {"json": {"prompt": long_text, "max_tokens": 4}},
            {400},
            "context",
        ),
        (
            "prompt longer than the context (stream)",
            "/v1/completions",
            {"json": {"prompt": long_text, "max_tokens": 4, "stream": True}},
            {400},
            "context",
        ),
        (
            "chat longer than the context",
            "/v1/chat/completions",
            {"json": {"messages": [{"role": "user", "content": long_text}], "max_tokens": 4}},
            {400},
            "context",
        ),
        # the server takes text prompts only: token ids (even out-of-vocabulary ones,
        # which llama.cpp would refuse) never reach the model
        (
            "token ids as the prompt",
            "/v1/completions",
            {"json": {"prompt": [5, 6, 10**6], "max_tokens": 4}},
            {422},
            "prompt",
        ),
        (
            "chat longer than the context (stream)",
            "/v1/chat/completions",
            {
                "json": {
                    "messages": [{"role": "user", "content": long_text}],
                    "max_tokens": 4,
                    "stream": True,
                }
            },
            {400},
            "context",
        ),
        (
            "huge max_tokens (clamped to the context)",
            "/v1/completions",
            {"json": {"prompt": "hi", "max_tokens": 10**12, "temperature": 0}},
            {200},
            "",
        ),
    ]
    for i, (what, path, kw, want, needle) in enumerate(cases, 1):
        r = post(srv, path, **kw)
        assert r.status_code in want, (what, r.status_code, r.text[:500])
        msg = error_message(r) if r.status_code >= 400 else ""
        assert needle.lower() in msg.lower(), (what, msg)
        log.info("%s -> %d %s", what, r.status_code, msg[:120])
        assert_workers_healthy(srv, pids, serve_reference, i)
    # a normal stream still works (its headers are held until its first event now), and
    # its first chunk still carries what the cache did
    prompt = SYSTEM + " A normal stream at the end."
    chunks = list(
        srv.client.completions.create(
            model="tiny", prompt=prompt, stream=True, extra_body=EXTRA, **SAMPLING
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == serve_reference(prompt)
    assert chunks[0].model_extra["shmkv"]["prompt_tokens"] > 500
    text = srv.log_path.read_text()
    assert "Traceback" not in text, text[-4000:]
