"""Checkpoints where chats diverge: what the 2nd and 3rd chat on a new system prompt restore.

Gemma 3 270M Q4_K_M (a sliding-window model: its states are restored only whole), Gemma 3's
own chat template as `shmkv serve` renders it (``shmkv-gemma3``), a ~1,000-token system
message, user messages short (below ``--checkpoint-tail``) or long (above it). Each chat
runs in a fresh process (another worker) on one real ``shmkv supervise``; each arm and case
under a namespace of its own, so nothing carries over. Streaming ``create_chat_completion``
timed to its first chunk (TTFT).

* before: chat message boundaries not hinted (``hint_boundaries`` a no-op): what shmkv did
  before them (the 2nd chat restores the tail checkpoint, or nothing past a long message);
* after: the hooked ``create_chat_completion`` hints them: the 1st chat publishes a state at
  the end of its system message, the 2nd restores it whole;
* cold: a plain ``Llama`` per chat, the reference every cached chat's text must equal.

    python bench/bench_chat_checkpoints.py            # ~1-2 minutes
    python bench/bench_chat_checkpoints.py --quick    # smoke run (a ~600-token system message)
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # the harness, and the shmkv of this checkout
import common  # noqa: E402

log = logging.getLogger("bench_chat_checkpoints")

ARENA_SIZE = "512M"
CHATS = 3  # per arm and case: the 1st on a new system message, then two more
opt = common.option


# ============================================ one chat (`bench_chat_checkpoints.py _chat SPEC`)
def one_chat(spec: dict[str, Any]) -> dict[str, Any]:
    """Load the model, run one streaming chat, say what the cache did."""
    import llama_cpp

    from shmkv.serving.chat_template import GEMMA3_FORMAT, register_gemma3

    register_gemma3()
    kw = dict(model_path=spec["model"], chat_format=GEMMA3_FORMAT, **spec["ctx"])
    if spec["arm"] == "cold":
        llm, cache = llama_cpp.Llama(**kw), None
    else:
        from shmkv.llama import SharedCacheLlama, SharedPrefixCache

        if spec["arm"] == "before":  # no hints: the cache as it was without them
            SharedPrefixCache.hint_boundaries = lambda self, prefixes: None  # type: ignore[method-assign]
        llm = SharedCacheLlama(
            **kw,
            shmkv_name=spec["name"],
            shmkv_socket=spec["socket"],
            shmkv_namespace=spec["namespace"],
        )
        cache = llm.shmkv
    t0 = time.perf_counter()
    ttft, parts = None, []
    for chunk in llm.create_chat_completion(spec["messages"], stream=True, **spec["gen"]):
        delta = chunk["choices"][0]["delta"]
        if ttft is None and "role" not in delta:
            ttft = time.perf_counter() - t0
        parts.append(delta.get("content") or "")
    out: dict[str, Any] = {"ttft": ttft, "text": "".join(parts)}
    if cache is not None:
        cache.flush()
        last = cache.last
        out |= common.pick(
            vars(last), "prompt_tokens tokens_restored tokens_evaluated checkpoints published"
        )
        cache.close()
    return out


def run_chat(spec: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """One chat in a process of its own."""
    path = workdir / f"chat-{time.monotonic_ns()}.json"
    path.write_text(json.dumps(spec))
    proc = subprocess.run(
        [sys.executable, __file__, "_chat", str(path)],
        env=common.child_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        tail = proc.stderr[-3000:]
        raise click.ClickException(f"a chat failed (exit {proc.returncode}):\n{tail}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ================================================================ the orchestrator
def make_chats(model: Path, system_tokens: int) -> dict[str, Any]:
    """A system message of about ``system_tokens`` tokens; short and long user messages."""
    tok = common.tokenizer(model)

    def count(text: str) -> int:
        return len(tok(text))

    words = common.WORDS

    def rule(i: int) -> str:
        a, b = words[i % len(words)], words[(7 * i) % len(words)]
        return f" Rule {i}: the {a} goes with the {b}."

    system = common.fill_to(system_tokens, count, "You are the support bot of ACME.", rule)

    def ask(i: int, long: bool) -> str:
        head = f"{words[(11 * i + 3) % len(words)].title()} question {i}:"
        if not long:
            return f"{head} which rule covers the {words[i % len(words)]}?"
        return common.fill_to(
            150, count, head, lambda j: f" what of the {words[(i * 13 + j) % len(words)]} {j}?"
        )

    return {
        "system": system,
        "system_tokens": count(system),
        "asks": {
            case: [ask(i, case == "long") for i in range(CHATS)] for case in ("short", "long")
        },
    }


def table(res: dict[str, Any]) -> str:
    lines = [["case", "chat", "arm", "restored", "evaluated", "TTFT", "checkpoints", "= cold"]]
    for case, arms in res["runs"].items():
        for i in range(CHATS):
            for arm in ("before", "after"):
                r = arms[arm][i]
                lines.append(
                    [
                        case,
                        str(i + 1),
                        arm,
                        str(r["tokens_restored"]),
                        str(r["tokens_evaluated"]),
                        common.fmt_s(r["ttft"]),
                        ",".join(map(str, r["checkpoints"])) or "-",
                        "yes" if r["text"] == arms["cold"][i]["text"] else "NO",
                    ]
                )
            lines.append(["", "", "cold", "0", "-", common.fmt_s(arms["cold"][i]["ttft"]), "", ""])
    return common.grid(lines, left=3)


def plot(plt: Any, res: dict[str, Any]) -> Any:
    fig, ax = plt.subplots(figsize=(7, 3))
    items = [
        (f"{case} {arm}", arms[arm][1]["ttft"], None)
        for case, arms in res["runs"].items()
        for arm in ("cold", "before", "after")
    ]
    title = f"{common.title(res, 'chat checkpoints')}\n2nd chat on a new system message"
    common.hbars(ax, items, common.fmt_s, title, "TTFT (s)")
    fig.tight_layout()
    return fig


@common.command("chat_checkpoints")
@opt("--system-tokens", type=int, help="System message length in tokens [1000; quick 600].")
@opt("--threads", default=2, help="n_threads and n_threads_batch of every context.")
@opt("--max-tokens", default=8, help="Tokens generated per chat.")
@opt("--model", help="GGUF to use [Gemma 3 270M Q4_K_M, as `shmkv serve`].")
@opt("--quick", is_flag=True, help="Smoke run (a ~600-token system message).")
def main(report: common.Report, o: Any) -> None:
    """What the 2nd chat on a new system message restores, with and without checkpoints at
    chat message boundaries."""
    model = common.model_path(o.model)
    chats = make_chats(model, o.system_tokens or (600 if o.quick else 1000))
    log.info("system message: %d tokens", chats["system_tokens"])
    ctx = dict(n_ctx=4096, n_threads=o.threads, n_threads_batch=o.threads, seed=0, verbose=False)
    gen = dict(max_tokens=o.max_tokens, temperature=0.0, seed=0)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    system = {"role": "system", "content": chats["system"]}
    with (
        tempfile.TemporaryDirectory(prefix="shmkv-bench-chat-") as tmp,
        common.supervisor(Path(tmp), "--size", ARENA_SIZE) as sup,
    ):
        base = dict(model=str(model), ctx=ctx, gen=gen, name=sup.name, socket=sup.socket)
        for case, asks in chats["asks"].items():
            runs[case] = {}
            for arm in ("cold", "before", "after"):
                runs[case][arm] = [
                    run_chat(
                        {
                            **base,
                            "arm": arm,
                            "namespace": f"{arm}-{case}",
                            "messages": [system, {"role": "user", "content": ask}],
                        },
                        Path(tmp),
                    )
                    for ask in asks
                ]
                log.info("%s %s done", case, arm)
    res = {
        **report.header(common.llama_versions()),
        "git": common.code_state(),
        "loadavg_end": common.loadavg(),
        "config": dict(
            quick=o.quick,
            model=str(model),
            ctx=ctx,
            gen=gen,
            system_tokens=chats["system_tokens"],
            chats=CHATS,
        ),
        "runs": runs,
    }
    click.echo(f"\n{common.title(res, 'chat checkpoints')}; load {res['loadavg_end'][0]:.2f}")
    click.echo(table(res))
    report.write(res, plot)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "_chat":
        logging.basicConfig(level=logging.WARNING)
        print(json.dumps(one_chat(json.loads(Path(sys.argv[2]).read_text()))))
    else:
        main()
