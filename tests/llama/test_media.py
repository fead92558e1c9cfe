"""Images and audio in prompts: positions filled by media never match text.

llama-cpp-python's multimodal chat handlers decode an image's embeddings straight into
the context and advance ``n_tokens`` without writing those positions into
``input_ids``; the prompt they complete is ``input_ids[:n_tokens]``, whatever ids an
earlier call left there. These tests decode embedding batches as the mtmd helper does
(``tests/support/media.py``; no projector) and require every answer to equal a cold
run's.
"""

from __future__ import annotations

import pytest

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


@pytest.mark.parametrize("image", [IMAGE, {"at": 300, "n": None, "seed": 1}], ids=["mid", "end"])
def test_text_after_an_image_in_one_worker_never_reuses_its_cells(supervisor, models, image):
    """In one worker (attached to a plain Llama, whose reset is hooked on the instance),
    TEXT after the image prompt reuses none of the image's positions; an image that ends
    the prompt (no eval after it: the generate hook finds it) is completed on, too."""
    jobs = [completion(TEXT), media([image]), completion(TEXT)]
    cold = run_worker(None, models["seed0"], jobs, mode="cold")
    a = run_worker(supervisor, models["seed0"], jobs, mode="attach")
    assert texts(a) == texts(cold)
    assert texts(cold)[0] == texts(cold)[2] != texts(cold)[1]  # (the image changes the answer)
    again = a["results"][2]["last"]
    assert (
        again["tokens_restored"] + again["tokens_reused_local"] <= image["at"]
        or (
            again["hit"]  # (TEXT's own state, published by job 1)
        )
    )


def test_two_images_with_the_same_text_never_share(supervisor, models):
    """Declared media (``media.prefill``, keyed by digest): another image at the same place
    after the same text restores the text before it, never the first image."""
    one, two = media([IMAGE], declared=True), media([{**IMAGE, "seed": 2}], declared=True)
    cold = run_worker(None, models["seed0"], [one, two], mode="cold")
    assert texts(cold)[0] != texts(cold)[1]  # (the images change the answer)
    a = run_worker(supervisor, models["seed0"], [one])
    assert a["totals"]["publishes"] >= 1
    b = run_worker(supervisor, models["seed0"], [two])
    assert texts(a) + texts(b) == texts(cold)
    assert b["results"][0]["last"]["tokens_restored"] <= IMAGE["at"]


def test_the_same_image_after_the_same_text_is_shared(supervisor, models):
    """Declared media: the same image at the same place (a product photo in a system
    prompt) is restored from another worker's state, and the answer is a cold run's."""
    one = media([IMAGE], declared=True)
    other_question = media([IMAGE], declared=True, prompt=SYSTEM + " Question: why?")
    cold = run_worker(None, models["seed0"], [one, other_question], mode="cold")
    a = run_worker(supervisor, models["seed0"], [one])
    b = run_worker(supervisor, models["seed0"], [other_question, one])
    assert texts(a) + texts(b) == texts(cold) + texts(cold)[:1]
    first, exact = (r["last"] for r in b["results"])
    assert first["hit"] and first["tokens_restored"] > IMAGE["at"] + IMAGE["n"]
    assert exact["tokens_evaluated"] <= 1
