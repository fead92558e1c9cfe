"""Images and audio in prompts: positions filled by media never match text.

llama-cpp-python's multimodal chat handlers decode an image's embeddings straight into
the context and advance ``n_tokens`` without writing those positions into
``input_ids``; the prompt they complete is ``input_ids[:n_tokens]``, whatever ids an
earlier call left there. These tests decode embedding batches as the mtmd helper does
(``tests/support/media.py``; no projector) and require every answer to equal a cold
run's.
"""

from __future__ import annotations

from tests.support.llama_workers import SYSTEM, completion, run_worker, texts

TEXT = SYSTEM + " Question: who sits on the mat?"
#: a prefix of TEXT longer than the image's end: its ids are the stale ones the image leaves
HEAD = SYSTEM[: SYSTEM.index("Rule 30:")]
#: an "image" of 270 positions, decoded where TEXT's tokens 20..290 had been
IMAGE = {"at": 20, "n": 270, "seed": 1}


def media(images: list[dict], declared: bool = False, prompt: str = TEXT) -> dict:
    """A media job: ``prompt`` with ``images`` decoded over some of its positions."""
    return {
        "kind": "media",
        "prompt": prompt,
        "images": images,
        "declared": declared,
        "max_tokens": 16,
    }


def test_text_never_restores_an_image_published_by_another_worker(supervisor, models):
    """The issue's reproduction: a worker answers HEAD, then TEXT with an image decoded
    where HEAD had been (the handler's prompt carries HEAD's stale ids there); another
    worker asked TEXT restores no image cells: HEAD's state at most, and answers as cold."""
    jobs = [completion(HEAD), media([IMAGE]), completion(TEXT)]
    cold = run_worker(None, models["seed0"], jobs, mode="cold")
    a = run_worker(supervisor, models["seed0"], jobs[:2])
    assert texts(a) == texts(cold)[:2]
    head = len(a["results"][0]["context"])
    assert head > IMAGE["at"] + IMAGE["n"]
    b = run_worker(supervisor, models["seed0"], jobs[2:])
    assert texts(b) == texts(cold)[2:]
    assert b["results"][0]["last"]["tokens_restored"] <= head


def test_text_after_an_image_in_one_worker_never_reuses_its_cells(supervisor, models):
    """In one worker (attached to a plain Llama, whose reset is hooked on the instance),
    TEXT after the image prompt reuses none of the image's positions."""
    jobs = [completion(TEXT), media([IMAGE]), completion(TEXT)]
    cold = run_worker(None, models["seed0"], jobs, mode="cold")
    a = run_worker(supervisor, models["seed0"], jobs, mode="attach")
    assert texts(a) == texts(cold)
    assert texts(cold)[0] == texts(cold)[2] != texts(cold)[1]  # (the image changes the answer)
