"""A llama worker for the chaos tests: serves requests in a loop until it is killed or told to stop.

Heavy imports happen first, then the worker blocks on one JSON line on stdin (so the test
can start it ahead of time). Spec: model, kw (Llama kwargs), name, socket, flags (path of a
small file shared with the test), prompts (list of str), max_tokens, seed, requests (how
many; 0: until the STOP flag is set).

Before each step of a request the worker raises a flag byte in the flags file (and lowers it
after), so the test can kill it in a chosen phase and read, after the kill, exactly which
phases were in progress when it died. One JSON line per finished request goes to stdout.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import mmap
import os
import random
import signal
import struct
import sys

import llama_cpp

import shmkv.core.client as SC
import shmkv.llama as SL
from shmkv.core.arena import ArenaView

# flag bytes (read by harness.Worker in the test process)
PHASES = [
    "request",
    "restore",
    "lease",
    "set_data",
    "prefill",
    "capture",
    "get_data",
    "put",
    "decode",
    "claim",
]
FLAG = {name: i for i, name in enumerate(PHASES)}
READY, STOP = 14, 15
COUNT_OFF = 16  # u32: requests finished
#: the last line of what SIGUSR1 prints (the replaced arena views still referenced)
VIEWS_LISTED = "old views listed"
FLAGS_SIZE = 32


def main() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    spec = json.loads(sys.stdin.readline())
    fd = os.open(spec["flags"], os.O_RDWR)
    flags = mmap.mmap(fd, FLAGS_SIZE)
    os.close(fd)

    def hook(obj, attr: str, phase: str, after: bool = False) -> None:
        orig, i = getattr(obj, attr), FLAG[phase]

        def wrapped(*a, **kw):
            flags[i] = 1
            try:
                return orig(*a, **kw)
            finally:
                flags[i] = 0

        setattr(obj, attr, wrapped)

    C = llama_cpp.llama_cpp
    hook(C, "llama_state_seq_set_data", "set_data")
    hook(C, "llama_state_seq_get_data", "get_data")
    orig_finish = SC.Lease.finish

    def finish(self, *a, **kw):
        try:
            return orig_finish(self, *a, **kw)
        finally:
            flags[FLAG["lease"]] = 0

    SC.Lease.finish = finish

    llm = SL.SharedCacheLlama(
        model_path=spec["model"],
        verbose=False,
        **spec["kw"],
        shmkv_name=spec["name"],
        shmkv_socket=spec["socket"],
    )
    cache = llm.shmkv
    hook(cache, "restore", "restore")
    hook(cache, "capture", "capture")
    hook(cache.writer, "put_blob", "put")
    hook(cache.reader, "claim", "claim")
    orig_acquire = cache.reader.acquire

    def acquire(hit):
        flags[FLAG["lease"]] = 1  # the lease is granted while this request is in flight
        try:
            return orig_acquire(hit)
        except BaseException:
            flags[FLAG["lease"]] = 0
            raise

    cache.reader.acquire = acquire
    orig_restore_or_claim = cache.restore_or_claim

    def restore_or_claim(tokens):
        n = orig_restore_or_claim(tokens)
        flags[FLAG["prefill"]] = 1
        return n

    cache.restore_or_claim = restore_or_claim

    def on_prefill(_cache) -> None:
        flags[FLAG["prefill"]] = 0
        flags[FLAG["decode"]] = 1

    cache.on_prefill = on_prefill

    def who_holds_old_views(_sig, _frame) -> None:
        """SIGUSR1: print what still references an arena view other than the current ones."""
        current = {id(cache.reader._view), id(cache.writer._view)}
        gc.collect()
        for v in [o for o in gc.get_objects() if isinstance(o, ArenaView)]:
            if id(v) in current:
                continue
            print(f"old view of arena {v.geometry.arena_id.hex()}:", file=sys.stderr)
            for r in gc.get_referrers(v):
                print(f"  held by {type(r).__name__} {getattr(r, 'f_code', '')}", file=sys.stderr)
                for r2 in gc.get_referrers(r):
                    print(f"    held by {type(r2).__name__} {str(r2)[:160]}", file=sys.stderr)
        print(VIEWS_LISTED, file=sys.stderr, flush=True)

    signal.signal(signal.SIGUSR1, who_holds_old_views)
    flags[READY] = 1
    rnd = random.Random(spec["seed"])
    prompts = spec["prompts"]
    done = 0
    parent = os.getppid()
    while not flags[STOP] and (not spec["requests"] or done < spec["requests"]):
        if os.getppid() != parent:  # the test died: never outlive it
            break
        p = rnd.randrange(len(prompts))
        flags[FLAG["request"]] = 1
        out = llm.create_completion(
            prompts[p], max_tokens=spec["max_tokens"], temperature=0.0, seed=0
        )
        flags[FLAG["decode"]] = flags[FLAG["prefill"]] = flags[FLAG["request"]] = 0
        done += 1
        struct.pack_into("<I", flags, COUNT_OFF, done)
        arena = cache.reader.attach_info.get("arena_id", b"")
        line = {
            "i": done,
            "p": p,
            "text": out["choices"][0]["text"],
            "last": dataclasses.asdict(cache.last),
            "arena": arena.hex(),
            "pid": os.getpid(),
        }
        sys.stdout.write(json.dumps(line) + "\n")
        sys.stdout.flush()
    cache.close()
    sys.stdout.write(
        json.dumps(
            {
                "done": done,
                "totals": dataclasses.asdict(cache.totals),
                "llama_cpp": llama_cpp.__version__,
            }
        )
        + "\n"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
