"""Every key shmkv derives, in one place: pure hashes, imported by every process.

* :func:`key_root`: the root of a prompt's key chain, from the model's fingerprint
  (``shmkv.llama.fingerprint.model_fingerprint``, plus a variant) and the tenant's
  namespace. Two processes share state only under the same root.
* :func:`chain_digests`: the key of each full chunk prefix of a prompt, chained from its
  root: ``d1 = H(root, chunk 1)``, ``dk = H(d(k-1), chunk k)``, H = BLAKE2b-128. The
  arena's index (``arena.py``), the Redis tier's index and a state file use these.
* :func:`content_digest`: what makes two puts the same record (root, fingerprint,
  token ids, publisher): the store keeps one of each; the disk tier's key.
* :func:`remote_id`: a record's name in the Redis tier (no publisher: two nodes that
  publish the same prompt share one copy).

Changing any of these changes every stored key: the arena's, the disk tier's, the Redis
tier's and those of exported state files.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from shmkv.core.arena import DIGEST_SIZE


def key_root(fingerprint: bytes, namespace: str) -> bytes:
    """Root digest of every key chain: fingerprint plus tenant namespace."""
    h = hashlib.blake2b(fingerprint, digest_size=DIGEST_SIZE, person=b"shmkv-root")
    h.update(namespace.encode())
    return h.digest()


def chain_digests(root: bytes, tokens: np.ndarray | Sequence[int], chunk: int) -> list[bytes]:
    """Digests of every full chunk prefix of ``tokens``, chained from ``root``."""
    arr = np.asarray(tokens, dtype="<i4")
    out: list[bytes] = []
    prev = root
    raw = arr.tobytes()
    step = chunk * 4
    for k in range(len(arr) // chunk):
        h = hashlib.blake2b(prev, digest_size=DIGEST_SIZE)
        h.update(raw[k * step : (k + 1) * step])
        prev = h.digest()
        out.append(prev)
    return out


def content_digest(root: bytes, fingerprint: bytes, tok_bytes: bytes, publisher: int) -> bytes:
    """What makes two puts the same record: root, fingerprint, token ids and publisher."""
    return hashlib.blake2b(
        root + fingerprint + tok_bytes + publisher.to_bytes(4, "little"), digest_size=16
    ).digest()


def remote_id(root: bytes, fingerprint: bytes, tokens: bytes) -> bytes:
    """A record's name in the Redis tier (``tiers/redis/layout.py``): root, fingerprint and
    token ids (little-endian int32 bytes)."""
    return hashlib.blake2b(root + fingerprint + tokens, digest_size=DIGEST_SIZE).digest()
