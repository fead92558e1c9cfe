"""Conversations on one system prompt hold its KV once in the arena (chunked records).

Real llama worker processes on the tiny models: twelve completions that share a
~1,100-token system prompt, each with its own question. Every state they publish is
split into token groups and its full groups stored once (``kvformat.py``,
``supervisor/chunks.py``); a restore assembles the blob again and checks it whole.
Greedy text equals a cold run's.
"""

from __future__ import annotations

import json

from tests.support.blobs import each_record
from tests.support.llama_workers import SYSTEM, completion, run_worker, texts

QUESTIONS = [f" Question {i}: what does rule {3 * i + 1} say about the cat?" for i in range(12)]


def arena_bytes(sup) -> tuple[int, int]:
    """(bytes the data region uses, payload bytes of the records it holds: what whole
    records would take at least)."""
    rows = json.loads(sup.cli("ls", "--json").stdout)
    return sup.stats_json()["bytes_used"], sum(r["bytes"] for r in rows)


def twelve(sup, model: str) -> tuple[float, float, dict]:
    """Run the twelve conversations (the first alone); (bytes after all / after the first,
    the same if every record were whole / after the first, the supervisor's stats)."""
    jobs = [completion(SYSTEM + q) for q in QUESTIONS]
    cold = run_worker(None, model, jobs, mode="cold")
    first = run_worker(sup, model, jobs[:1])
    one, _ = arena_bytes(sup)
    rest = run_worker(sup, model, jobs[1:])
    assert texts(first) + texts(rest) == texts(cold)
    assert rest["results"][0]["last"]["hit"]  # (an arena hit; the others reuse the context)
    used, whole = arena_bytes(sup)
    print(f"{model}: {used / one:.2f}x after twelve, whole {whole / one:.2f}x")
    return used / one, whole / one, sup.stats_json()


def test_twelve_conversations_on_one_prompt_hold_it_once_on_llama(supervisor, models):
    ratio, whole, st = twelve(supervisor, models["seed0"])
    assert st["chunked_puts"] == st["puts"] and st["chunk_bytes_shared"] > 0
    assert ratio <= 2.0 and whole >= 10, (ratio, whole)


def test_twelve_conversations_on_one_prompt_on_a_window_model(supervisor, models):
    """Gemma 3: the window layers' part keeps only the window (not shared), the others'
    full groups are."""
    ratio, whole, st = twelve(supervisor, models["swa"])
    assert st["chunked_puts"] > 0 and st["chunk_bytes_shared"] > 0
    assert ratio < whole / 2, (ratio, whole)


def test_a_corrupt_chunk_costs_a_miss_never_a_wrong_state(supervisor, models):
    """A flipped byte in a chunk the records share: the next hit fails its whole-blob
    check, is reported and dropped, and the text equals the cold run's."""
    model = models["seed0"]
    jobs = [completion(SYSTEM + q) for q in QUESTIONS[:2]]
    cold = run_worker(None, model, jobs, mode="cold")
    first = run_worker(supervisor, model, jobs[:1])

    def chunk_offsets(view, off, gen):
        rec, _ = view.peek(off, gen)
        return [i.data_off for i in view.peek_chunks(rec)[2] if i is not None]

    offsets = sorted({o for found in each_record(supervisor.arena, chunk_offsets) for o in found})
    assert offsets
    with open(supervisor.arena, "r+b") as f:
        f.seek(offsets[0] + 100)
        b = f.read(1)
        f.seek(offsets[0] + 100)
        f.write(bytes([b[0] ^ 0x40]))
    second = run_worker(supervisor, model, jobs[1:])
    assert texts(first) + texts(second) == texts(cold)
    last = second["results"][0]["last"]
    assert last["tokens_restored"] == 0
    assert second["totals"]["restore_failures"] >= 1
    assert supervisor.stats_json()["corrupt_removed"] >= 1
