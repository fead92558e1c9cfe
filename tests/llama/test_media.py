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


# llama-cpp-python's own MTMDChatHandler (tests/support/mtmd.py: its mtmd library without
# a projector), as a user of a vision model has it: shmkv keys its images by their bytes


def vision_chat(photo: bytes, question: str) -> dict:
    """A chat whose system message, then a photo, then ``question`` make the prompt."""
    from tests.support.mtmd import image_url

    user = [
        {"type": "image_url", "image_url": {"url": image_url(photo)}},
        {"type": "text", "text": " " + question},
    ]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
    return {"kind": "chat", "messages": messages, "max_tokens": 16}


@pytest.fixture(scope="module")
def projector(tmp_path_factory) -> dict:
    """Llama kwargs that give each worker's Llama the stock handler (a projector file)."""
    path = tmp_path_factory.mktemp("mmproj") / "mmproj.gguf"
    path.write_bytes(b"a projector's bytes")
    return {"projector": str(path)}


PHOTO, OTHER_PHOTO = b"\x07 a cat on a mat" * 40, b"\x07 a dog on a rug" * 40


def test_the_stock_handler_shares_the_same_image_across_workers(supervisor, models, projector):
    """Through llama-cpp-python's own MTMDChatHandler: another worker asked another
    question about the same photo after the same system message restores the photo's
    cells and the text before them, and answers as a cold run; asked the same chat, it
    evaluates at most the last token."""
    first = vision_chat(PHOTO, "Question: who sits on the mat?")
    other = vision_chat(PHOTO, "Question: why? Rule 99: the dog 3 sits on rug 4.")
    cold = run_worker(None, models["seed0"], [first, other], mode="cold", kw=projector)
    assert texts(cold)[0] != texts(cold)[1]
    a = run_worker(supervisor, models["seed0"], [first], kw=projector)
    assert a["totals"]["publishes"] >= 1
    context = a["results"][0]["context"]
    photo_end = max(i for i, t in enumerate(context) if t < 0) + 1  # (media ids are < 0)
    b = run_worker(supervisor, models["seed0"], [other, first], kw=projector)
    assert texts(a) + texts(b) == texts(cold) + texts(cold)[:1]
    again, exact = (r["last"] for r in b["results"])
    assert again["hit"] and again["tokens_restored"] >= photo_end
    assert exact["hit"] and exact["tokens_evaluated"] <= 1


def test_the_stock_handler_never_shares_another_image(supervisor, models, projector):
    """Another photo after the same system message: the system message is restored, the
    first photo's cells never, and the answer is a cold run's."""
    one, two = vision_chat(PHOTO, "What is it?"), vision_chat(OTHER_PHOTO, "What is it?")
    cold = run_worker(None, models["seed0"], [one, two], mode="cold", kw=projector)
    assert texts(cold)[0] != texts(cold)[1]
    a = run_worker(supervisor, models["seed0"], [one], kw=projector)
    b = run_worker(supervisor, models["seed0"], [two], kw=projector)
    assert texts(a) + texts(b) == texts(cold)
    image_at = next(i for i, t in enumerate(a["results"][0]["context"]) if t < 0)
    last = b["results"][0]["last"]
    assert 0 < last["tokens_restored"] <= image_at
