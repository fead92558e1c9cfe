"""Served workers give a sliding-window model's window layers KV cells for the window plus
one batch, not for the whole context (``--swa-full`` off, as llama-server does): a worker's
context then no longer holds the window before a far cut, and must never reuse its own
tokens there. Real gunicorn and supervisor, the tiny Gemma 3 with a 32-token window, prompts
longer than its window cache (768 cells); every greedy text equals a fresh plain Llama's.
"""

from __future__ import annotations

import llama_cpp
import pytest

from shmkv.core.config import resolve
from shmkv.serving.model_settings import load_llama
from tests.support.servers import EXTRA, N_CTX, SAMPLING, Server

LONG = " ".join(f"Rule {i}: the cat {i % 7} sits on mat {i % 5}." for i in range(50))
SHORT = " ".join(f"Rule {i}: the cat {i % 7} sits on mat {i % 5}." for i in range(12))
# one worker in turn: a long prompt, a short cut (the window holds it), a far cut (it does
# not: the cells before the cut's window are gone), the first prompt again
PROMPTS = [
    LONG + " Question: who sits?",
    LONG + " Question: where is the mat?",
    SHORT + " Question: why?",
    LONG + " Question: who sits?",
]


@pytest.fixture(scope="module")
def references(models) -> list[str]:
    """Cold greedy texts of a plain Llama with llama-cpp-python's full window cache."""
    out = []
    for p in PROMPTS:
        llm = llama_cpp.Llama(
            models["swa"], n_ctx=N_CTX, n_threads=1, n_threads_batch=1, verbose=False
        )
        assert len(llm.tokenize(p.encode())) > 1000 or p.startswith(SHORT + " ")
        out.append(llm.create_completion(p, **{**SAMPLING, **EXTRA})["choices"][0]["text"])
    return out


def test_a_served_window_model_gets_a_window_sized_cache(models):
    plain = resolve("serve", env={})
    assert plain.swa_full is False
    llm = load_llama(plain, models["swa"], threads=1)
    assert llm.context_params.swa_full is False
    full = load_llama(resolve("serve", env={"SHMKV_SWA_FULL": "true"}), models["swa"], 1)
    assert full.context_params.swa_full is True


def test_the_setting_keys_states_only_of_window_models(models):
    """A window-sized cache holds other states than a full one: never the same key. A model
    without window layers is the same either way, and keyed as a default Llama's."""
    from shmkv.llama.fingerprint import model_fingerprint

    def fp(model: str, **kw: bool) -> bytes:
        llm = llama_cpp.Llama(model, n_ctx=N_CTX, n_threads=1, verbose=False, **kw)
        return model_fingerprint(llm)

    assert fp(models["swa"], swa_full=False) != fp(models["swa"], swa_full=True)
    assert fp(models["seed0"], swa_full=False) == fp(models["seed0"]) == fp(models["seed0"])


def test_far_cuts_on_a_window_sized_cache_equal_cold_runs(
    tmp_path, models, make_supervisor, references
):
    sup = make_supervisor("--size", "64M")
    srv = Server(sup, models["swa"], workers=1, tmp_path=tmp_path)
    try:
        got = [srv.complete(p) for p in PROMPTS]
    finally:
        srv.stop()
    assert [text for text, _ in got] == references
    long_again = got[3][1]
    assert long_again["restored_tokens"] > 0  # (from the arena: the context moved on)


def test_without_the_supervisor_far_cuts_equal_cold_runs(
    tmp_path, models, make_supervisor, references
):
    """No supervisor: the worker serves cold, and its cache still decides which of its own
    tokens the context keeps (plain llama-cpp-python would keep them all)."""
    sup = make_supervisor("--size", "64M")
    sup.stop()
    srv = Server(sup, models["swa"], workers=1, tmp_path=tmp_path)
    try:
        got = [srv.complete(p)[0] for p in PROMPTS]
        log = srv.log_path.read_text()
    finally:
        srv.stop()
    assert "supervisor unavailable" in log
    assert got == references


def test_a_worker_serving_without_shmkv_reloads_with_a_full_window_cache(models, monkeypatch):
    """No cache attached (an error, injected here) leaves plain llama-cpp-python, which
    keeps its context's tokens without asking the window: the worker reloads its window
    model with a full window cache, and keeps a model without window layers as it is."""
    import shmkv_workers.app as app

    from shmkv.core.errors import ShmkvError
    from shmkv.serving.model_settings import model_settings

    def no_cache(*_args, **_kw):
        raise ShmkvError("injected: no cache")

    monkeypatch.setattr(app, "attach", no_cache)
    settings = resolve("serve", env={})
    load = app.make_loader(settings)
    window = load(model_settings(settings, models["swa"], threads=1))
    assert window.context_params.swa_full is True
    plain = load(model_settings(settings, models["seed0"], threads=1))
    assert plain.context_params.swa_full is False
