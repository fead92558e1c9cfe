"""Restore and publish through the arena with real llama.cpp on a tiny model.

Correctness is judged against llama.cpp itself: every cached run's greedy text
must equal a fresh plain ``Llama``'s with the same settings.
"""

from __future__ import annotations

import numpy as np

from tests.support.blobs import flip_payload_bytes
from tests.support.llama_workers import KW, SYSTEM, completion, run_worker, texts


def test_shared_system_prompt_different_suffixes_across_processes(supervisor, models):
    jobs_a = [completion(SYSTEM + " Question: who sits?")]
    jobs_b = [
        completion(SYSTEM + " Question: where is the mat?"),
        completion(SYSTEM + " Question: how many cats?", stream=True),
    ]
    cold = run_worker(None, models["seed0"], jobs_a + jobs_b, mode="cold")
    a = run_worker(supervisor, models["seed0"], jobs_a)
    assert a["results"][0]["last"]["tokens_restored"] == 0
    assert a["totals"]["publishes"] >= 1
    b = run_worker(supervisor, models["seed0"], jobs_b)
    assert texts(a) + texts(b) == texts(cold)
    first = b["results"][0]["last"]
    assert first["hit"] and first["tokens_restored"] > 500
    assert first["tokens_evaluated"] < 40
    st = supervisor.stats_json()
    assert st["tokens_restored"] >= first["tokens_restored"]
    assert st["hits"] >= 1 and st["puts"] >= 1


def test_exact_same_prompt_and_shorter_prompt(supervisor, models):
    long_prompt = SYSTEM + " Question: what is the rule about mats and cats exactly?"
    short_prompt = SYSTEM[: len(SYSTEM) // 2]
    jobs = [completion(long_prompt)]
    again = [completion(long_prompt), completion(short_prompt, stream=True)]
    cold = run_worker(None, models["seed0"], jobs + again, mode="cold")
    run_worker(supervisor, models["seed0"], jobs)
    b = run_worker(supervisor, models["seed0"], again)
    assert texts(b) == texts(cold)[1:]
    exact, shorter = (r["last"] for r in b["results"])
    assert exact["hit"] and exact["tokens_evaluated"] == 1
    assert exact["tokens_restored"] == exact["prompt_tokens"]
    assert (
        shorter["tokens_restored"] + shorter["tokens_reused_local"] >= shorter["prompt_tokens"] - 1
    )


def test_multi_turn_chat_second_turn_in_another_process(supervisor, models):
    sys_msg = {"role": "system", "content": SYSTEM}
    turn1 = [sys_msg, {"role": "user", "content": "Tell me about the cats."}]
    cold1 = run_worker(
        None, models["seed0"], [{"kind": "chat", "messages": turn1, "max_tokens": 24}], mode="cold"
    )
    reply = texts(cold1)[0]
    turn2 = turn1 + [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "And the mats?"},
    ]
    jobs2 = [{"kind": "chat", "messages": turn2, "max_tokens": 16, "stream": True}]
    cold2 = run_worker(None, models["seed0"], jobs2, mode="cold")
    a = run_worker(
        supervisor,
        models["seed0"],
        [{"kind": "chat", "messages": turn1, "max_tokens": 24}],
        mode="attach",
    )
    assert texts(a) == texts(cold1)
    b = run_worker(supervisor, models["seed0"], jobs2, mode="attach")
    assert texts(b) == texts(cold2)
    last = b["results"][0]["last"]
    # turn 2 starts from turn 1's state, computed in another process (how far past the
    # reply it goes depends on how the template re-tokenizes the reply)
    turn1_prompt_tokens = a["results"][0]["last"]["prompt_tokens"]
    assert last["hit"] and last["tokens_restored"] >= turn1_prompt_tokens


def test_prompt_plus_completion_is_published_for_the_next_turn(supervisor, models):
    """The end-of-generation state lets a token-exact continuation skip the reply too."""
    a = run_worker(supervisor, models["seed0"], [completion(SYSTEM + " Story:", max_tokens=80)])
    context = a["results"][0]["context"]  # prompt + completion - 1, as in the KV cache
    assert a["totals"]["publishes"] >= 2
    turn2 = {"kind": "completion", "prompt": context + [29, 30, 31], "max_tokens": 12}
    cold = run_worker(None, models["seed0"], [turn2], mode="cold")
    b = run_worker(supervisor, models["seed0"], [turn2])
    assert texts(b) == texts(cold)
    last = b["results"][0]["last"]
    assert last["tokens_restored"] == len(context)
    assert last["tokens_evaluated"] == 3


def test_models_and_kv_types_and_namespaces_never_mix(supervisor, models):
    prompt = SYSTEM + " Question: which model am I?"
    run_worker(supervisor, models["seed0"], [completion(prompt)])
    for model, ns, kw in [
        (models["seed1"], "", None),  # other weights, same shapes
        (models["seed0"], "", {"type_k": 0, "type_v": 0}),  # f32 KV
        (models["seed0"], "tenant-b", None),
    ]:  # other namespace
        cold = run_worker(None, model, [completion(prompt)], mode="cold", kw=kw)
        got = run_worker(supervisor, model, [completion(prompt)], namespace=ns, kw=kw)
        assert texts(got) == texts(cold)
        last = got["results"][0]["last"]
        assert last["tokens_restored"] == 0 and not last["hit"], (model, ns, kw)
        assert not got["totals"]["errors"], got["totals"]  # not even found, not rejected


def test_corrupted_blob_is_detected_and_output_unchanged(supervisor, models):
    prompt = SYSTEM + " Question: is this blob intact?"
    cold = run_worker(None, models["seed0"], [completion(prompt)], mode="cold")
    run_worker(supervisor, models["seed0"], [completion(prompt)])
    assert flip_payload_bytes(supervisor.arena) >= 1
    got = run_worker(supervisor, models["seed0"], [completion(prompt)])
    assert texts(got) == texts(cold)
    assert got["results"][0]["last"]["tokens_restored"] == 0
    assert got["totals"]["errors"].get("corrupt record", 0) >= 1
    st = supervisor.stats_json()
    assert st["restore_failures"] >= 1
    # the worker reported it, the supervisor re-checked and dropped it, a good copy replaced it
    assert st["corrupt_removed"] >= 1
    again = run_worker(supervisor, models["seed0"], [completion(prompt)])
    assert texts(again) == texts(cold)
    assert again["results"][0]["last"]["tokens_restored"] > 0


def test_set_data_rejecting_a_blob_falls_back_cold(supervisor, models):
    """A blob with a valid checksum that llama.cpp refuses: set_data returns 0."""
    import llama_cpp

    from shmkv.llama import key_root, model_fingerprint

    prompt = SYSTEM + " Question: garbage?"
    llm = llama_cpp.Llama(model_path=models["seed0"], verbose=False, **KW)
    tokens = llm.tokenize(prompt.encode())
    fp = model_fingerprint(llm)
    with supervisor.client() as c:
        c.put_bytes(
            key_root(fp, ""),
            np.array(tokens, dtype=np.int32),
            fp,
            np.random.default_rng(1).bytes(200_000),
        )
    del llm
    cold = run_worker(None, models["seed0"], [completion(prompt)], mode="cold")
    got = run_worker(supervisor, models["seed0"], [completion(prompt)])
    assert texts(got) == texts(cold)
    assert got["results"][0]["last"]["tokens_restored"] == 0
    assert sum(got["totals"]["errors"].values()) >= 1


def test_no_supervisor_runs_cold_and_logs_once(models):
    prompts = [completion(SYSTEM + f" Question {i}?") for i in range(3)]
    cold = run_worker(None, models["seed0"], prompts, mode="cold")
    from types import SimpleNamespace

    missing = SimpleNamespace(name="absent", socket="/tmp/shmkv-absent-test.sock")
    got = run_worker(missing, models["seed0"], prompts)
    assert texts(got) == texts(cold)
    assert got["totals"]["tokens_restored"] == 0
    # every request finds no supervisor...
    assert got["totals"]["errors"].get("supervisor unavailable", 0) >= len(prompts)
    # ...and the worker's log says so once, not once per request: the cache's own warning
    # once, and each of its two connections (reader, writer) at most once
    warnings = [
        ln for ln in got["stderr"].splitlines() if ln.startswith("WARNING") and missing.socket in ln
    ]
    assert sum("cold prefill" in ln for ln in warnings) == 1, got["stderr"]
    assert len(warnings) <= 3, got["stderr"]


def test_a_llama_cpp_python_without_an_internal_shmkv_uses_fails_at_attach(models, monkeypatch):
    """shmkv/llama/compat.py: on a version it was not read from, attach checks each
    llama-cpp-python internal it uses; one missing is one ConfigError naming the fix."""
    import logging

    import llama_cpp
    import pytest

    from shmkv.core.errors import ConfigError
    from shmkv.llama import attach, compat

    llm = llama_cpp.Llama(models["seed0"], verbose=False, **KW)
    try:
        monkeypatch.setattr(llama_cpp, "__version__", "9.9.9")
        monkeypatch.setattr(compat, "_warned", False)
        records: list[logging.LogRecord] = []
        handler = logging.Handler()
        handler.emit = records.append  # type: ignore[method-assign]
        compat.log.addHandler(handler)
        try:
            compat.check(llm)  # every internal still there: a warning, once
            compat.check(llm)
        finally:
            compat.log.removeHandler(handler)
        assert len(records) == 1 and "0.3.32 to 0.3.36" in records[0].getMessage()
        monkeypatch.delattr(llm, "_requires_eval")  # (as a version without it would be)
        with pytest.raises(ConfigError) as err:
            attach(llm, name="absent", socket_path="/tmp/shmkv-absent-test.sock")
        message = str(err.value)
        assert "9.9.9 lacks _requires_eval" in message and compat.REQUIREMENT in message
        assert getattr(llm, "shmkv", None) is None
    finally:
        llm.close()
