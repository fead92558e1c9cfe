"""Moving one cached state between an arena and a state file: ``shmkv export`` / ``import``.

Runs in the ``shmkv`` command's process, as a client of the supervisor: export
leases the record, copies and checks it (metadata and payload checksums) under
the lease and writes the file only if the lease held; import checks the whole
file (``statefile.py``) before anything reaches the arena, then puts it through
the same ``put`` every worker uses, so the supervisor's own checks (sizes,
payload checksum, publisher uid from the socket) apply as well. The imported
record is the importer's: workers restore it if they trust that uid (their own
and the supervisor's, by default).

A state published by someone the exporter does not trust (``--trust-publishers``)
is not exported: import would make it the importer's, trusted where it was not.
"""

from __future__ import annotations

import logging
import os
import time
from typing import IO, Any, BinaryIO

import numpy as np
import xxhash

from shmkv.cli.statefile import StateMeta, StateReader, write
from shmkv.core.arena import Hit, Slot
from shmkv.core.client import Client
from shmkv.core.config import Settings, trusted_uids
from shmkv.core.errors import (
    ConfigError,
    ModelMismatchError,
    NotFound,
    StateFileError,
    UntrustedPublisher,
)
from shmkv.core.keys import key_root

log = logging.getLogger(__name__)

#: what an exact-mode key root adds to the fingerprint, for the n_batch values tried when
#: exporting by key (the root is a digest: which one it is, is found by trying)
_BATCHES = sorted({1 << k for k in range(17)} | {64 * k for k in range(1, 129)})


def variants() -> list[bytes]:
    """Every fingerprint suffix a key root may carry: none, or exact mode's."""
    return [b""] + [b"|exact|%d" % n for n in _BATCHES]


def variant_of(fingerprint: bytes, root: bytes, namespace: str) -> bytes | None:
    """The suffix with which ``root`` derives from ``fingerprint`` in ``namespace``."""
    for v in variants():
        if key_root(fingerprint + v, namespace) == root:
            return v
    return None


def trusted(client: Client, settings: Settings) -> frozenset[int] | None:
    """Whose records may be exported: ours, the supervisor's, --trust-publishers (None:
    anyone)."""
    extra = trusted_uids(getattr(settings, "trust_publishers", "") or "")
    if extra is None:
        return None
    sup = client.supervisor_uid
    return frozenset({os.geteuid(), *extra, *([] if sup is None else [sup])})


def find(client: Client, key_text: str, n_tokens: int | None = None) -> dict[str, Any]:
    """The entry named by ``key_text`` (its key, or the start of it as ``shmkv ls``
    shows it): the most recently used one, or the one of ``n_tokens`` tokens."""
    text = key_text.strip().lower()
    try:
        prefix = bytes.fromhex(text[: len(text) // 2 * 2])
    except ValueError:
        prefix = b""
    if len(text) < 8 or len(prefix) > 16:
        raise ConfigError(
            f"{key_text!r} is not a key: give at least 8 of its hex digits, as `shmkv ls` shows it"
        )
    rows = [r for r in client.ls(limit=100_000, key_prefix=prefix)["entries"]]
    rows = [r for r in rows if r["key"].startswith(text)]
    if len({r["key"] for r in rows}) > 1:
        raise ConfigError(f"{key_text!r} is the start of several keys: give more of it")
    if n_tokens is not None:
        rows = [r for r in rows if r["tokens"] == n_tokens]
    if not rows:
        raise NotFound(f"no entry with key {key_text} (see `shmkv ls`)")
    if len({r["tokens"] for r in rows}) > 1:
        log.warning(
            "key %s has entries of %s tokens: exporting the most recently used (%d); "
            "choose one with --tokens",
            key_text,
            sorted({r["tokens"] for r in rows}),
            rows[0]["tokens"],
        )
    row: dict[str, Any] = rows[0]
    return row


def read_entry(
    client: Client, offset: int, gen: int, uids: frozenset[int] | None
) -> tuple[bytes, bytes, np.ndarray, bytes, int]:
    """(root, fingerprint, tokens, payload, publisher) of record (offset, gen), copied and
    checked under a lease; NotFound if it went away, StateFileError if it is corrupt."""
    hit = Hit(0, Slot(b"", offset, gen, 0))  # (acquire needs only where and which)
    with client.acquire(hit) as lease:  # (validates the header and metadata checksum)
        rec = lease.record
        if uids is not None and rec.publisher not in uids:
            raise UntrustedPublisher(
                f"entry {rec.key.hex()} was published by uid {rec.publisher}, whom this "
                f"export does not trust: importing it would make it yours; add the uid to "
                f"--trust-publishers if you trust it"
            )
        payload = bytes(lease.payload)
        tokens = lease.tokens().copy()
        fp = lease.fingerprint()
        intact = xxhash.xxh3_64_intdigest(payload) == rec.payload_xxh3
        if not lease.finish():
            raise NotFound("the entry was reclaimed while it was being read: try again")
    if not intact:
        raise StateFileError(f"entry {rec.key.hex()} is corrupt in the arena: not exported")
    return rec.root, fp, tokens, payload, rec.publisher


def export_entry(
    client: Client,
    settings: Settings,
    row: dict[str, Any],
    out: IO[bytes],
    model: str = "",
    description: dict[str, Any] | None = None,
    variant: bytes | None = None,
) -> StateMeta:
    """Write the state of ``row`` (an ``ls`` row) to ``out`` as a state file.

    Its namespace is ``settings.namespace``; the entry must have been published under
    it (the key root derives from the fingerprint, the namespace and ``variant``, which
    is found by trying when not given).
    """
    uids = trusted(client, settings)
    root, fp, tokens, payload, _ = read_entry(client, row["offset"], row["gen"], uids)
    ns = settings.namespace
    if variant is None or key_root(fp + variant, ns) != root:
        variant = variant_of(fp, root, ns)
    if variant is None:
        raise ConfigError(
            f"entry {row['key']} was not published under namespace {ns!r} (its key root does "
            f"not derive from its model fingerprint and that namespace): pass the namespace "
            f"its workers use with --namespace (SHMKV_NAMESPACE); a cache tenant's entry "
            f"(a request's cache_salt, X-Shmkv-Cache-Salt or API key) cannot be exported: "
            f"export and import move the deployment's own states only"
        )
    meta = StateMeta(
        root=root,
        key=bytes.fromhex(row["key"]),
        fingerprint=fp,
        namespace=ns,
        variant=variant,
        chunk_tokens=client.ensure().geometry.chunk_tokens,
        n_tokens=len(tokens),
        payload_len=len(payload),
        payload_xxh3=xxhash.xxh3_64_intdigest(payload),
        model=model,
        description=description,
        created=time.time(),
    )
    meta.verify_claims(tokens)  # (what import will check: never write a file it refuses)
    write(out, meta, tokens, memoryview(payload))
    return meta


def describe_mismatch(meta: StateMeta, fingerprint: bytes, here: dict[str, Any] | None) -> str:
    """Why a state's fingerprint is not this model's, as far as the file says."""
    theirs = meta.description
    if not theirs or not here:
        return "another model file, llama.cpp version or context settings"
    diffs = []
    for k in sorted(set(theirs) | set(here)):
        a, b = theirs.get(k), here.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            diffs += [
                f"{k}.{j}: {a.get(j)!r} there, {b.get(j)!r} here"
                for j in sorted(set(a) | set(b))
                if a.get(j) != b.get(j)
            ]
        elif a != b:
            diffs.append(f"{k}: {a!r} there, {b!r} here")
    return "; ".join(diffs[:6]) or "the model file itself"


def import_state(
    client: Client,
    f: BinaryIO,
    size: int | None,
    pin: bool = False,
    fingerprint: bytes | None = None,
    description: dict[str, Any] | None = None,
) -> tuple[StateMeta, dict[str, Any]]:
    """Check the state file ``f`` whole, then put its state into the arena.

    ``size``: the file's size if it is a regular file. ``fingerprint``: refuse a state
    made for another model or context settings than this one's.
    """
    reader = StateReader(f, size)
    meta = reader.open()
    if fingerprint is not None and meta.fingerprint != fingerprint:
        raise ModelMismatchError(
            f"the state was made for another model or other settings than --model's "
            f"({describe_mismatch(meta, fingerprint, description)}): not imported"
        )
    view = client.ensure()
    if meta.payload_len > view.geometry.data_size:
        raise StateFileError(
            f"the state's {meta.payload_len} bytes can never fit this arena's data region: "
            f"restart `shmkv supervise` with a larger --size"
        )

    def fill(address: int, n: int) -> None:
        import ctypes

        reader.payload_into(memoryview((ctypes.c_char * n).from_address(address)).cast("B"))

    blob = client.prepare(meta.payload_len, fill)
    try:
        reader.finish()
        if blob.checksum() != meta.payload_xxh3:
            raise StateFileError("the state's payload does not match its checksum; not imported")
    except BaseException:
        blob.close()
        raise
    reply = client.put_blob(meta.root, reader.tokens, meta.fingerprint, blob, pin=pin)
    return meta, reply
