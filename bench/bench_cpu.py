"""CPU budget benchmark: a cold prompt on an idle deployment vs one process on all cores.

Arms: ``plain`` (one ``llama_cpp.Llama`` in this process, ``n_threads`` = ``n_threads_batch``
= all cores: the fastest a cold prompt can be here), ``budget`` (``shmkv serve`` with
``--workers`` workers sharing the CPU budget, the default) and ``static`` (the same with
``--static-threads``: each worker on cores // workers threads, as before the budget). Each
round sends one prompt of ``--prompt-tokens`` that no worker has seen (distinct from its
first token), streamed, one at a time with the deployment idle in between, and records the
time to the first chunk. The goal: ``budget`` within 10 % of ``plain``.

In-process rows time the budget's own overhead on one context: a prompt and single-token
decode steps through ``cpubudget.evaluate`` (batches re-negotiated, threads set per call)
against plain ``Llama.eval`` on all cores.

    python bench/bench_cpu.py                # 5 rounds per arm (~3 min on 2 cores)
    python bench/bench_cpu.py --quick        # 2 rounds, 400-token prompts
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import click
import httpx

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # the harness, and the shmkv of this checkout
import common  # noqa: E402

log = logging.getLogger("bench_cpu")
GOAL_RATIO = 1.10  # budget's mean cold TTFT / plain's
ARMS = {"plain": "one Llama, all cores", "budget": "shmkv serve", "static": "--static-threads"}


def prompts(model: Path, n: int, tokens: int) -> list[str]:
    """``n`` prompts of about ``tokens`` tokens, each different from its first token on."""
    import random

    tok = common.tokenizer(model)
    rng = random.Random(5)

    def line(i: int) -> str:
        return " ".join(rng.sample(common.WORDS, 8)) + f" ({i}).\n"

    return [
        common.fill_to(tokens, lambda t: len(tok(t)), f"{uuid.uuid4().hex} Notes:\n", line)
        for _ in range(n)
    ]


def run_plain(model: Path, texts: list[str], cfg: dict[str, Any]) -> dict[str, Any]:
    """Cold TTFT of a plain Llama on all cores, and the budget's in-process overhead."""
    import llama_cpp

    from shmkv.llama.cpu import budget as cpubudget

    cores = cfg["cores"]
    llm = llama_cpp.Llama(
        model_path=str(model),
        n_ctx=cfg["n_ctx"],
        n_threads=cores,
        n_threads_batch=cores,
        verbose=False,
    )
    plain_eval = llm.eval
    ttft, prefill, prefill_budget, step, step_budget = [], [], [], [], []
    name = f"bench{uuid.uuid4().hex[:8]}"
    budget = cpubudget.CpuBudget(str(common.SHM), name, cores)

    def fresh() -> None:
        llm.reset()
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llm._ctx.ctx), True)

    def decode(evaluate: Any, out: list[float]) -> None:
        for _ in range(16):
            t = time.perf_counter()
            evaluate([llm.input_ids[llm.n_tokens - 1]])
            out.append(time.perf_counter() - t)

    try:
        for text in texts:
            fresh()
            llama_cpp.llama_set_n_threads(llm._ctx.ctx, cores, cores)
            llm._shmkv_threads = None  # (what cpubudget.set_threads last set is void)
            t = time.perf_counter()
            next(iter(llm.create_completion(text, max_tokens=4, temperature=0.0, stream=True)))
            ttft.append(time.perf_counter() - t)
            toks = llm.tokenize(text.encode())
            for budgeted in (False, True):
                fresh()
                llama_cpp.llama_set_n_threads(llm._ctx.ctx, cores, cores)
                llm._shmkv_threads = None
                t = time.perf_counter()
                if budgeted:
                    cpubudget.evaluate(budget, llm, plain_eval, toks)
                    prefill_budget.append(time.perf_counter() - t)
                    decode(lambda x: cpubudget.evaluate(budget, llm, plain_eval, x), step_budget)
                else:
                    plain_eval(toks)
                    prefill.append(time.perf_counter() - t)
                    decode(plain_eval, step)
            time.sleep(cfg["idle"])
    finally:
        budget.close()
        cpubudget.remove(str(common.SHM), name)
    S = common.summary
    return {
        "ttft": S(ttft),
        "in_process": {
            "prefill_plain": S(prefill),
            "prefill_budget": S(prefill_budget),
            "decode_step_plain": S(step),
            "decode_step_budget": S(step_budget),
        },
    }


def run_served(arm: str, model: Path, texts: list[str], cfg: dict[str, Any], tmp: Path) -> Any:
    """Cold TTFT through ``shmkv serve`` (``budget`` or ``static``), one request at a time."""
    env = {"SHMKV_MODEL": str(model), "SHMKV_N_CTX": str(cfg["n_ctx"])}
    env |= {"SHMKV_LOG_LEVEL": "warning", "SHMKV_WORKER_TIMEOUT": "900"}
    if arm == "static":
        env["SHMKV_STATIC_THREADS"] = "true"
    with common.supervisor(tmp, "--size", "512M") as sup:
        srv = common.Server.shmkv(sup, env, tmp, cfg["workers"])
        try:
            srv.wait_ready()
            warm_up(srv)
            out, threads = [], []
            with httpx.Client(timeout=600, limits=httpx.Limits(max_keepalive_connections=0)) as c:
                for text in texts:
                    time.sleep(cfg["idle"])  # idle: every worker's threads asleep
                    body = {"prompt": text, "max_tokens": 4, "temperature": 0.0, "stream": True}
                    r = common.stream_completion(c, srv.base + "/v1/completions", body)
                    if r["error"]:
                        raise click.ClickException(f"{arm}: {r['error']}")
                    info = r["shmkv"] or {}
                    if info.get("restored_tokens"):
                        raise click.ClickException(f"{arm}: a prompt was not cold: {info}")
                    out.append(r["first_chunk"])
                    threads.append(info.get("prefill_threads", 0))
        finally:
            srv.stop()
    return {"ttft": common.summary(out), "prefill_threads": threads}


def warm_up(srv: common.Server) -> None:
    """A short prompt on every worker at once, a few times, untimed."""

    def go(k: int) -> None:
        with httpx.Client(timeout=300, limits=httpx.Limits(max_keepalive_connections=0)) as c:
            for i in range(3):
                body = {"prompt": f"Warm up {k} {i}.", "max_tokens": 2, "stream": True}
                common.stream_completion(c, srv.base + "/v1/completions", body)

    threads = [threading.Thread(target=go, args=(k,)) for k in range(srv.workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def table(res: dict[str, Any]) -> str:
    arms, fmt = res["arms"], common.fmt_s
    rows = [["arm", "what", "mean TTFT", "p50", "min", "max", "vs plain"]]
    plain = arms.get("plain", {}).get("ttft", {}).get("mean")
    for arm, r in arms.items():
        t = r["ttft"]
        ratio = f"{t['mean'] / plain:.2f}x" if plain else "-"
        cells = [fmt(t.get(k)) for k in ("mean", "p50", "min", "max")]
        rows.append([arm, ARMS[arm], *cells, ratio])
    if "plain" in arms:
        rows.append(["in one process (the budget's own cost)"])
        ip = arms["plain"]["in_process"]
        for what in ("prefill", "decode_step"):
            p, b = ip[f"{what}_plain"]["mean"], ip[f"{what}_budget"]["mean"]
            rows.append([what, "Llama.eval vs cpubudget.evaluate", fmt(p), fmt(b), "", "", ""])
    return common.grid(rows, left=2)


def plot(plt: Any, res: dict[str, Any]) -> Any:
    fig, ax = plt.subplots(figsize=(6, 3.2))
    arms = list(res["arms"])
    means = [res["arms"][a]["ttft"]["mean"] for a in arms]
    ax.bar(arms, means, color=["#888888", "#33aa77", "#99bb33"][: len(arms)])
    ax.set_ylabel("cold TTFT, mean (s)")
    cfg = res["config"]
    ax.set_title(
        f"{common.title(res, 'CPU budget')}\n{cfg['workers']} workers, "
        f"{cfg['prompt_tokens']}-token prompts",
        fontsize=8,
    )
    fig.tight_layout()
    return fig


opt = common.option


@common.command("cpu")
@opt("--arms", default="plain,budget,static", help=f"Comma-separated, of {', '.join(ARMS)}.")
@opt("--rounds", type=int, help="Cold prompts per arm [5; quick 2].")
@opt("--prompt-tokens", type=int, help="Tokens per prompt [1000; quick 400].")
@opt("--workers", default=4, help="gunicorn workers of the served arms.")
@opt("--n-ctx", default=4096)
@opt("--idle", default=1.0, help="Seconds of idle before each prompt.")
@opt("--max-load", default=0.7, help="Wait until the 1-min load is below this.")
@opt("--max-wait", default=600.0, help="Seconds to wait for --max-load, then run anyway.")
@opt("--model", help="GGUF [Gemma 3 270M Q4_K_M, as `shmkv serve`].")
@opt("--quick", is_flag=True, help="Smoke run: 2 rounds of 400-token prompts.")
def main(report: common.Report, o: Any) -> None:
    """Cold TTFT on an idle deployment sharing the CPU budget vs one Llama on all cores."""
    from shmkv.llama.cpu.budget import default_cores

    arms = [a.strip() for a in o.arms.split(",") if a.strip()]
    if unknown := [a for a in arms if a not in ARMS]:
        raise click.BadParameter(f"unknown arms {unknown}; choose from {list(ARMS)}")
    model = common.model_path(o.model)
    rounds = o.rounds or (2 if o.quick else 5)
    cfg = dict(quick=o.quick, model=str(model), arms=arms, rounds=rounds, cores=default_cores())
    cfg |= common.pick(vars(o), "workers n_ctx idle max_load max_wait")
    cfg["prompt_tokens"] = o.prompt_tokens or (400 if o.quick else 1000)
    texts = prompts(model, rounds * len(arms), cfg["prompt_tokens"])
    for k in [k for k in os.environ if k.startswith("SHMKV_")]:
        del os.environ[k]
    res: dict[str, Any] = {"config": cfg, "arms": {}}
    with tempfile.TemporaryDirectory(prefix="shmkv-bench-cpu-") as tmp:
        for i, arm in enumerate(arms):
            quiet = common.wait_until_quiet(o.max_load, o.max_wait)
            mine = texts[i * rounds : (i + 1) * rounds]
            log.info("arm %s: %d cold prompts", arm, rounds)
            noise = common.Noise()
            if arm == "plain":
                r = run_plain(model, mine, cfg)
            else:
                r = run_served(arm, model, mine, cfg, Path(tmp))
            res["arms"][arm] = {**r, "quiet": quiet, "noise": noise.result()}
    res = {**report.header(common.llama_versions()), **res, "code": common.code_state()}
    goal: dict[str, Any] = {"budget_over_plain_max": GOAL_RATIO}
    if {"plain", "budget"} <= set(res["arms"]):
        ratio = res["arms"]["budget"]["ttft"]["mean"] / res["arms"]["plain"]["ttft"]["mean"]
        goal |= {"budget_over_plain": round(ratio, 3), "met": ratio <= GOAL_RATIO}
    res["goal"] = goal
    loads = {a: r["quiet"]["loadavg"][0] for a, r in res["arms"].items()}
    click.echo(f"\n{common.title(res, 'CPU budget')}; {cfg['cores']} cores; 1-min load {loads}")
    click.echo(table(res))
    if "met" in goal:
        met = "met" if goal["met"] else "MISSED"
        click.echo(f"goal (budget <= {GOAL_RATIO}x plain): {met} ({goal['budget_over_plain']}x)")
    report.write(res, plot)


if __name__ == "__main__":
    main()
