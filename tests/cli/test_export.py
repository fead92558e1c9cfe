"""`shmkv export` / `shmkv import` between two real supervisors (two arenas: two machines
with the same model): the moved state restores on the second with a cold run's text;
corrupt, altered and foreign files are refused whole, with one line saying why."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import subprocess
import sys
import uuid
from pathlib import Path

import msgpack
import pytest

from shmkv.cli import statefile
from shmkv.core.keys import key_root
from tests.support.blobs import blob
from tests.support.cli import assert_one_error_line, shmkv
from tests.support.llama_workers import SYSTEM, completion, run_worker, texts
from tests.support.supervisors import wait_for_socket
from tests.support.users import GROUP, publish_as, system_user

PROMPT = SYSTEM + " Question: where does the cat sit?"


def cli(sup, *args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "shmkv", *args],
        env=sup.env,
        input=stdin,
        capture_output=True,
        timeout=300,
    )


def text(res: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """``res`` with its output decoded (for assert_one_error_line)."""
    return subprocess.CompletedProcess(
        res.args, res.returncode, res.stdout.decode(errors="replace"), res.stderr.decode()
    )


@pytest.fixture
def exported(make_supervisor, models, tmp_path) -> tuple[Path, dict]:
    """Arena A with PROMPT's state published by a real worker; that state exported by
    its key as `shmkv ls` shows it (16 hex digits)."""
    a = make_supervisor("--size", "64M")
    first = run_worker(a, models["seed0"], [completion(PROMPT)])
    n = first["results"][0]["last"]["prompt_tokens"]
    row = next(r for r in a.client(attach=False).ls()["entries"] if r["tokens"] == n)
    out = tmp_path / "state.shmkv"
    res = cli(a, "export", row["key"][:16], "--tokens", str(n), "-o", str(out))
    assert res.returncode == 0, res.stderr
    assert out.stat().st_mode & 0o777 == 0o600
    return out, {"row": row, "text": texts(first)[0], "tokens": n, "sup": a}


def test_moved_state_restores_on_another_arena(exported, make_supervisor, models) -> None:
    path, info = exported
    b = make_supervisor("--size", "64M")
    res = cli(b, "import", str(path))
    assert res.returncode == 0, res.stderr
    assert info["row"]["key"] in res.stdout.decode()
    rows = b.client(attach=False).ls()["entries"]
    assert [(r["key"], r["tokens"]) for r in rows] == [(info["row"]["key"], info["tokens"])]
    jobs = [completion(PROMPT)]
    hot = run_worker(b, models["seed0"], jobs)
    last = hot["results"][0]["last"]
    assert last["tokens_restored"] >= info["tokens"] - 1
    cold = run_worker(None, models["seed0"], jobs, mode="cold")
    assert texts(hot) == texts(cold) == [info["text"]]
    # importing it again is a duplicate, not a second copy
    assert cli(b, "import", str(path)).returncode == 0
    assert b.stats()["entries"] == 1


def test_export_by_prompt_and_through_stdout(make_supervisor, models, tmp_path) -> None:
    """By the prompt it covers (the model loaded as `shmkv serve` would): a prompt not
    cached yet is prefilled first; the file goes to stdout and comes in on stdin."""
    a, b = make_supervisor("--size", "64M"), make_supervisor("--size", "64M")
    args = ("--model", models["seed0"], "--n-ctx", "2048")
    res = cli(a, "export", "--prompt", PROMPT, *args)
    assert res.returncode == 0, res.stderr
    assert res.stdout[:8] == statefile.MAGIC
    imp = cli(b, "import", "-", "--pin", *args, stdin=res.stdout)  # --model: checked too
    assert imp.returncode == 0, imp.stderr
    assert b.stats()["pinned"] == 1
    hot = run_worker(b, models["seed0"], [completion(PROMPT)])
    assert hot["results"][0]["last"]["tokens_restored"] > 1000
    assert texts(hot) == texts(run_worker(None, models["seed0"], [completion(PROMPT)], "cold"))


def test_export_messages_and_import_pin_ttl(make_supervisor, models, tmp_path) -> None:
    """``export --messages``: the chat rendered as a served worker renders it, prefilled and
    exported; ``import --pin-ttl 60`` pins it with that TTL; a chat worker on the second
    arena restores it, with a cold run's text."""
    chat = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Where does the cat sit?"},
    ]
    a, b = make_supervisor("--size", "64M"), make_supervisor("--size", "64M")
    args = ("--model", models["seed0"], "--n-ctx", "2048")
    out = tmp_path / "chat.shmkv"
    res = cli(a, "export", "--messages", json.dumps(chat), *args, "-o", str(out))
    assert res.returncode == 0, res.stderr
    imp = cli(b, "import", str(out), "--pin-ttl", "60")
    assert imp.returncode == 0 and b", pinned" in imp.stdout, imp.stderr
    rows = b.client(attach=False).ls()["entries"]
    assert [(r["pinned"], r["pin_ttl"]) for r in rows] == [(True, 60.0)], rows
    job = {"kind": "chat", "messages": chat, "max_tokens": 16}
    hot = run_worker(b, models["seed0"], [job])
    last = hot["results"][0]["last"]
    assert last["tokens_restored"] >= last["prompt_tokens"] - 1 > 500, last
    assert rows[0]["tokens"] == last["prompt_tokens"]
    assert texts(hot) == texts(run_worker(None, models["seed0"], [job], "cold"))


def resign(data: bytes) -> bytes:
    """``data`` with its trailing digest recomputed (a forger's file, not a corrupt one)."""
    body = data[: -statefile.DIGEST_LEN]
    return body + hashlib.blake2b(body, digest_size=statefile.DIGEST_LEN).digest()


def with_meta(data: bytes, **changes) -> bytes:
    """``data`` with metadata fields changed, lengths and digest made consistent."""
    _magic, _version, meta_len = struct.unpack_from("<8sII", data)
    meta = msgpack.unpackb(data[16 : 16 + meta_len], raw=False)
    meta.update(changes)
    raw = msgpack.packb(meta, use_bin_type=True)
    return resign(data[:12] + struct.pack("<I", len(raw)) + raw + data[16 + meta_len :])


def flip(data: bytes, pos: int) -> bytes:
    return data[:pos] + bytes([data[pos] ^ 0x01]) + data[pos + 1 :]


def test_damaged_or_altered_files_are_refused(exported, make_supervisor, tmp_path) -> None:
    path, _ = exported
    good = path.read_bytes()
    meta_len = struct.unpack_from("<I", good, 12)[0]
    n_tok_bytes = 4 * statefile.StateReader(open(path, "rb")).open().n_tokens
    tokens_at = 16 + meta_len
    payload_at = tokens_at + n_tok_bytes
    meta = msgpack.unpackb(good[16:tokens_at], raw=False)
    fake_fp = bytes(32)
    cases = {
        "payload byte flipped": (flip(good, payload_at + 1000), "checksum"),
        "token byte flipped": (flip(good, tokens_at + 8), "does not match"),
        "digest byte flipped": (flip(good, len(good) - 1), "checksum"),
        "truncated": (good[:-100], "bytes"),
        "truncated header": (good[:10], "truncated"),
        "a byte appended": (good + b"\0", "bytes"),
        "not a state file": (b"GGUF" + good[4:], "not a shmkv state file"),
        "future format": (resign(good[:8] + struct.pack("<I", 99) + good[12:]), "format 99"),
        "token altered, re-signed": (resign(flip(good, tokens_at + 8)), "key does not match"),
        "other fingerprint, re-signed": (with_meta(good, fingerprint=fake_fp), "key root"),
        "other namespace, re-signed": (with_meta(good, namespace="tenant-b"), "key root"),
        "huge payload claimed": (with_meta(good, payload_len=1 << 50), "invalid"),
        "huge n_tokens claimed": (with_meta(good, n_tokens=1 << 30), "invalid"),
        "metadata not msgpack": (resign(good[:16] + b"\xc1" * meta_len + good[tokens_at:]), ""),
        # a consistent forgery (root and key derived from a fake fingerprint): the file
        # checks out; only a --model check tells, below
    }
    b = make_supervisor("--size", "64M")
    for name, (data, needle) in cases.items():
        bad = tmp_path / "bad.shmkv"
        bad.write_bytes(data)
        for res in (cli(b, "import", str(bad)), cli(b, "import", "-", stdin=data)):
            if name.startswith("truncated") or name == "a byte appended":
                needle_here = needle if res.args[-1] != "-" else ""
            else:
                needle_here = needle
            line = assert_one_error_line(text(res), needle_here)
            assert "not imported" in line or "not a shmkv" in line, (name, line)
        assert b.stats()["entries"] == 0, name
    # and the file they were all made from imports: the refusals are of what was altered
    assert meta["fingerprint"] != fake_fp
    ok = cli(b, "import", str(path))
    assert ok.returncode == 0, ok.stderr
    assert b.stats()["entries"] == 1


def test_a_state_of_another_model_is_refused_with_model(
    exported, make_supervisor, models, tmp_path
) -> None:
    """A consistent file (root and key derived from its fingerprint) made for another
    model, or the right model with other context settings: `import --model` refuses it."""
    path, _ = exported
    good = path.read_bytes()
    b = make_supervisor("--size", "64M")
    res = cli(b, "import", str(path), "--model", models["seed1"], "--n-ctx", "2048")
    assert_one_error_line(text(res), "another model or other settings")
    res = cli(b, "import", str(path), "--model", models["seed0"], "--n-ctx", "1024")
    assert_one_error_line(text(res), "another model or other settings")
    # a forged fingerprint with everything re-derived from it passes the file's checks
    meta = msgpack.unpackb(good[16 : 16 + struct.unpack_from("<I", good, 12)[0]], raw=False)
    fake = bytes(32)
    root = key_root(fake + meta["variant"], meta["namespace"])
    tokens = statefile.StateReader(open(path, "rb"))
    tokens.open()
    from shmkv.core.keys import chain_digests

    key = chain_digests(root, tokens.tokens, meta["chunk_tokens"])[-1]
    forged = tmp_path / "forged.shmkv"
    forged.write_bytes(with_meta(good, fingerprint=fake, root=root, key=key))
    res = cli(b, "import", str(forged), "--model", models["seed0"], "--n-ctx", "2048")
    assert_one_error_line(text(res), "another model or other settings")
    assert b.stats()["entries"] == 0
    ok = cli(b, "import", str(path), "--model", models["seed0"], "--n-ctx", "2048")
    assert ok.returncode == 0, ok.stderr
    assert b.stats()["entries"] == 1


def test_export_needs_the_namespace_and_a_key(exported) -> None:
    path, info = exported
    a, key = info["sup"], info["row"]["key"]
    res = cli(a, "export", key[:16], "--namespace", "tenant-b", "-o", str(path) + ".x")
    assert_one_error_line(text(res), "not published under namespace 'tenant-b'")
    res = cli(a, "export", "0123456789abcdef", "-o", str(path) + ".x")
    assert_one_error_line(text(res), "no entry with key")
    res = cli(a, "export", "xyz", "-o", str(path) + ".x")
    assert_one_error_line(text(res), "not a key")
    assert not Path(str(path) + ".x").exists()


def test_the_state_file_code_needs_no_llama_cpp() -> None:
    """Reading, checking and moving a state file derives keys (``shmkv.core.keys``) without
    loading llama.cpp: a machine that only moves files needs no model runtime."""
    code = (
        "import sys, shmkv.cli.statefile, shmkv.cli.transfer; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'llama_cpp'))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


def test_export_refuses_a_state_of_a_publisher_it_does_not_trust(make_supervisor, tmp_path):
    """A --group member's state: export refuses it (import would make it the importer's,
    trusted where it was not), in one line naming the uid; trusting the uid exports it."""
    evil = system_user("shmkv-test-evil", GROUP)
    d = Path(f"/tmp/shmkv-exp-{uuid.uuid4().hex[:10]}")
    sock = d / "exp.sock"
    sup = make_supervisor(
        "--size", "16M", "--group", GROUP, env_extra={"SHMKV_SOCKET": str(sock)}, wait=False
    )
    sup.socket = str(sock)
    try:
        wait_for_socket(str(sock), sup.proc)
        fp, b = b"fingerprint of some model", blob(90, 10_000)
        publish_as(evil, sup, tmp_path, key_root(fp, ""), b.tokens, fp, b.data)
        (row,) = sup.client(attach=False).ls()["entries"]
        out = tmp_path / "evil.shmkv"
        refused = shmkv("export", row["key"], "-o", str(out), env=sup.env)
        assert_one_error_line(refused, f"uid {evil[0]}", "--trust-publishers")
        assert not out.exists()
        env = {**sup.env, "SHMKV_TRUST_PUBLISHERS": str(evil[0])}
        ok = shmkv("export", row["key"], "-o", str(out), env=env)
        assert ok.returncode == 0, ok.stderr
        assert out.stat().st_size > len(b.data)
    finally:
        sup.stop()
        shutil.rmtree(d, ignore_errors=True)
