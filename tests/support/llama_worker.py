"""A worker process for the llama tests: runs jobs through shmkv (or cold) and prints JSON.

Input (stdin, JSON): model, kw (Llama kwargs), name, socket, namespace, mode
("shmkv", "attach" or "cold"; kw's "projector": a file, gives each Llama the stock
multimodal chat handler of ``tests/support/mtmd.py``), jobs: [{kind: completion|chat,
prompt|messages, max_tokens, stream}; kind media: ``tests/support/media.py``]. Output
(stdout, JSON):
one result per job with the text and what the cache did.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys

import llama_cpp

from shmkv.llama import SharedCacheLlama, attach
from tests.support.media import run_media


def run_job(llm: llama_cpp.Llama, job: dict) -> str:
    if job["kind"] == "media":
        return run_media(llm, job)
    stream = job.get("stream", False)
    common = dict(max_tokens=job.get("max_tokens", 16), temperature=0.0, seed=0)
    if job["kind"] == "chat":
        out = llm.create_chat_completion(job["messages"], stream=stream, **common)
        if stream:
            return "".join(c["choices"][0]["delta"].get("content", "") or "" for c in out)
        return out["choices"][0]["message"]["content"]
    out = llm.create_completion(job["prompt"], stream=stream, **common)
    if stream:
        return "".join(c["choices"][0]["text"] for c in out)
    return out["choices"][0]["text"]


def main() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    spec = json.load(sys.stdin)
    kw = dict(model_path=spec["model"], verbose=False, **spec.get("kw", {}))
    projector = kw.pop("projector", None)
    if projector:
        from tests.support.mtmd import Handler

        kw["chat_handler"] = Handler(projector)
    mode = spec.get("mode", "shmkv")
    if mode == "shmkv":
        llm = SharedCacheLlama(
            **kw,
            shmkv_name=spec["name"],
            shmkv_socket=spec["socket"],
            shmkv_namespace=spec.get("namespace", ""),
        )
        cache = llm.shmkv
    else:
        llm = llama_cpp.Llama(**kw)
        cache = (
            attach(
                llm,
                name=spec["name"],
                socket_path=spec["socket"],
                namespace=spec.get("namespace", ""),
            )
            if mode == "attach"
            else None
        )
    results = []
    for job in spec["jobs"]:
        if mode == "cold":  # a fresh Llama per job: the reference a cached run must equal
            if projector:
                kw["chat_handler"] = Handler(projector)
            llm = llama_cpp.Llama(**kw)
        text = run_job(llm, job)
        results.append(
            {
                "text": text,
                "context": [int(t) for t in llm.input_ids[: llm.n_tokens]],
                "last": dataclasses.asdict(cache.last) if cache else None,
            }
        )
        if cache is not None:
            cache.flush()
    if cache is not None:
        cache.close()
    json.dump(
        {"results": results, "totals": dataclasses.asdict(cache.totals) if cache else None},
        sys.stdout,
    )


if __name__ == "__main__":
    main()
