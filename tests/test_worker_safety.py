"""The worker side under a careless client or deployment: abandoned streams, idle
connections, prompt logits after a restore, states made for another context.

Real llama.cpp on the tiny models, real supervisors, real gunicorn workers on
127.0.0.1; outputs are compared with a plain ``llama_cpp.Llama``'s.
"""

from __future__ import annotations

import logging
import shutil

import numpy as np
from helpers import (
    KW,
    SYSTEM,
    completion,
    run_worker,
    texts,
)

from shmkv import arena as A

log = logging.getLogger(__name__)

RULES = [f"Rule {i}: the cat {i % 7} sits on mat {i % 5}." for i in range(50)]


def _plain(model: str, **kw):
    import llama_cpp

    return llama_cpp.Llama(model_path=model, verbose=False, **{**KW, **kw})


def _shared(sup, model: str, **kw):
    from shmkv.llama import SharedCacheLlama

    return SharedCacheLlama(
        model_path=model,
        verbose=False,
        shmkv_name=sup.name,
        shmkv_socket=sup.socket,
        **{**KW, **kw},
    )


# ------------------------------------------------ what a state means; states refused
def test_workers_with_different_n_ctx_never_restore_each_others_states(supervisor, models):
    prompt = " ".join(RULES[:20]) + " Question: who sits?"
    run_worker(supervisor, models["seed0"], [completion(prompt)], kw={"n_ctx": 2048})
    cold = run_worker(None, models["seed0"], [completion(prompt)], mode="cold", kw={"n_ctx": 1024})
    got = run_worker(supervisor, models["seed0"], [completion(prompt)], kw={"n_ctx": 1024})
    assert texts(got) == texts(cold)
    assert got["results"][0]["last"]["tokens_restored"] == 0
    assert not got["totals"]["errors"], got["totals"]  # not even found
    again = run_worker(supervisor, models["seed0"], [completion(prompt)], kw={"n_ctx": 2048})
    assert again["results"][0]["last"]["tokens_restored"] > 0  # its own kind still hits


def test_failed_set_data_is_a_miss_not_a_corruption_report(supervisor, models):
    """A state with a valid checksum and the right fingerprint that llama.cpp refuses
    (as a state made for a context of another size would be): counted as a refused
    state and a miss; the supervisor is not asked to re-check it, the record stays."""
    from shmkv.llama import key_root, model_fingerprint

    prompt = SYSTEM + " Question: does it fit?"
    llm = _plain(models["seed0"])
    tokens = np.array(llm.tokenize(prompt.encode()), dtype=np.int32)
    fp = model_fingerprint(llm)
    del llm
    root = key_root(fp, "")
    with supervisor.client() as c:
        c.put_bytes(root, tokens, fp, np.random.default_rng(1).bytes(200_000))
        chunk = c.view.geometry.chunk_tokens
    cold = run_worker(None, models["seed0"], [completion(prompt)], mode="cold")
    got = run_worker(supervisor, models["seed0"], [completion(prompt)])
    assert texts(got) == texts(cold)
    totals = got["totals"]
    assert got["results"][0]["last"]["tokens_restored"] == 0
    assert "corrupt record" not in totals["errors"], totals["errors"]
    assert totals["errors"].get("state refused") == 1, totals["errors"]
    assert totals["states_refused"] == 1 and totals["misses"] >= 1
    assert totals["restore_failures"] == 0
    st = supervisor.stats()
    assert st["corrupt_removed"] == 0 and st["restore_failures"] == 0
    assert st["states_refused"] == 1
    with supervisor.client() as c:  # the record is still there
        hit = c.lookup(A.chain_digests(root, tokens, chunk))
        assert hit is not None and hit.chunks == len(tokens) // chunk


def test_lora_is_identified_by_its_content_not_its_path(tmp_path, models):
    from tinymodel import write_tiny_lora

    from shmkv.fingerprint import model_fingerprint

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    write_tiny_lora(tmp_path / "a" / "adapter.gguf", seed=0)
    shutil.copy(tmp_path / "a" / "adapter.gguf", tmp_path / "b" / "renamed.gguf")
    write_tiny_lora(tmp_path / "other.gguf", seed=1)

    def fp(lora: str | None, **kw) -> bytes:
        return model_fingerprint(_plain(models["seed0"], lora_path=lora, **kw))

    same_a = fp(str(tmp_path / "a" / "adapter.gguf"))
    same_b = fp(str(tmp_path / "b" / "renamed.gguf"))
    other = fp(str(tmp_path / "other.gguf"))
    assert same_a == same_b
    assert other != same_a
    assert fp(None) not in (same_a, other)
    assert fp(str(tmp_path / "a" / "adapter.gguf"), lora_scale=0.5) != same_a
    assert fp(None, n_ctx=1024) != fp(None, n_ctx=2048)
