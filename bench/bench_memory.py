"""Memory per worker: where a `shmkv serve` worker's memory goes, against llama-server's.

Two parts. ``served``: `shmkv serve` with ``--workers`` workers (on a supervisor of its own)
and llama.cpp's ``llama-server`` with as many slots (bench/llama_server.py builds it), each
warmed up and given the same short workload (bench_serve's system prompts, ``--workers`` at
a time); then every server process's mappings from /proc/PID/smaps, by what they hold: code
(the interpreter, libraries and other files), the model's weights (the GGUF mapping), the
arena mapping, other shared memory, and anonymous memory (heap: llama.cpp's KV cache,
compute and output buffers, repacked weights, Python objects). ``stages``: one process
per variant of the worker's llama settings that imports what a worker imports, loads the
model as a worker does, and prefills a system prompt, with its anonymous memory after each
step, llama.cpp's own buffer sizes (from its log), the prefill time and the greedy text
(a cut that changes the text is no cut). Runs in the benchmark's orchestrating process; the
stage probes are this script run with ``_probe``.

    python bench/bench_memory.py                       # both parts (~5 min)
    python bench/bench_memory.py --parts stages --variants default,swa_full=false
    python bench/bench_memory.py --parts served --workers 4 --requests 16
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
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

log = logging.getLogger("bench_memory")

KINDS = ("code", "weights", "arena", "shm", "anon")
#: a variant is "default" (as `shmkv serve` loads a model) or key=value;key=value of Llama
#: keyword arguments that change it
VARIANTS = "default,swa_full=true,n_ubatch=256,n_ubatch=128"
BUFFERS = {  # llama.cpp's log lines of the buffers it allocates (MiB)
    "weights_mapped": r"CPU_Mapped model buffer size =\s*([\d.]+) MiB",
    "weights_repacked": r"CPU_REPACK model buffer size =\s*([\d.]+) MiB",
    "kv": r"CPU KV buffer size =\s*([\d.]+) MiB",
    "output": r"CPU\s+output buffer size =\s*([\d.]+) MiB",
    "compute": r"CPU compute buffer size =\s*([\d.]+) MiB",
}


# =================================================================== smaps


def kind_of(path: str, model: str, arena: str | None) -> str:
    if path == model:
        return "weights"
    if arena and path == arena:
        return "arena"
    if path.startswith(("/dev/shm/", "/memfd:", "/SYSV")):
        return "shm"
    if path.startswith("/") or path in ("[vdso]", "[vvar]", "[vsyscall]"):
        return "code"
    return "anon"  # [heap], [stack], [anon:...], no name


def smaps_by_kind(
    pid: int | str, model: str, arena: str | None, shm_paths: dict[str, int] | None = None
) -> dict[str, dict[str, int]]:
    """RSS, PSS and private bytes of ``pid``'s mappings by kind (KINDS), in bytes; the PSS
    of each other shared-memory file is added to ``shm_paths``."""
    out = {k: {"rss": 0, "pss": 0, "private": 0} for k in KINDS}
    cur, path = out["anon"], ""
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):
                parts = line.split(None, 5)
                path = parts[5].strip().removesuffix(" (deleted)") if len(parts) > 5 else ""
                cur = out[kind_of(path, model, arena)]
            elif line.startswith(("Rss:", "Pss:", "Private_Clean:", "Private_Dirty:")):
                key = line.split(":")[0].lower()
                key = "private" if key.startswith("private") else key
                cur[key] += int(line.split()[1]) * 1024
                if key == "pss" and shm_paths is not None and cur is out["shm"]:
                    shm_paths[path] = shm_paths.get(path, 0) + int(line.split()[1]) * 1024
    return out


def add(a: dict[str, dict[str, int]], b: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    return {k: {m: a[k][m] + b[k][m] for m in a[k]} for k in a}


# ================================================================== served


def served(kind: str, cfg: dict[str, Any], wl: Any, workdir: Path) -> dict[str, Any]:
    """Start ``kind`` (shmkv or llama-server), run the workload, and take its smaps."""
    import bench_serve

    arm = "shmkv" if kind == "shmkv" else "llama-server"
    with contextlib.ExitStack() as stack:
        sup = None
        if kind == "shmkv":
            sup = stack.enter_context(common.supervisor(workdir, "--size", cfg["arena_size"]))
        srv = bench_serve.start_server(arm, cfg, workdir, sup)
        stack.push(lambda exc_type, _e, _tb: srv.stop(kill=exc_type is not None))
        srv.wait_ready(logged=None if sup is None else "Application startup complete")
        bench_serve.warm_up(srv)
        cc = cfg["workers"]
        results, wall = bench_serve.run_load(srv, wl, len(wl.requests), cc, cfg, _never())
        if sup is not None:
            time.sleep(1.0)  # the last puts reach the arena
        errors = [r["error"] for r in results if r["error"]]
        if errors:
            raise click.ClickException(f"{kind}: {len(errors)} requests failed: {errors[:3]}")
        roles = {"server": [srv.child.pid]}
        if sup is not None:
            roles = {"worker": srv.worker_pids(), "master": [srv.master_pid()]}
            roles |= {"watcher": [srv.child.pid], "supervisor": [sup.child.pid]}
        arena, shm = (str(sup.arena) if sup else None), {}
        procs = {
            str(pid): {"role": role, "kinds": smaps_by_kind(pid, cfg["model"], arena, shm)}
            for role, pids in roles.items()
            for pid in pids
        }
        out: dict[str, Any] = {"kind": kind, "wall_s": wall, "processes": procs}
        out["other_shm_pss_by_path"] = shm
        out["ttft"] = common.summary([r["ttft"] for r in results])
        total = {k: {"rss": 0, "pss": 0, "private": 0} for k in KINDS}
        for p in procs.values():
            total = add(total, p["kinds"])
        out["total"] = total
        out["total_pss"] = sum(v["pss"] for v in total.values())
        st = sup.stats() if sup else {}
        out["arena_used"], out["arena_capacity"] = st.get("bytes_used", 0), arena_bytes(arena)
        out["total_pss_minus_arena_used"] = out["total_pss"] - out["arena_used"]
        # what the arena mapping costs (all of --size with --reserve; else what it holds)
        out["total_pss_without_arena"] = out["total_pss"] - total["arena"]["pss"]
        return out


def arena_bytes(path: str | None) -> int:
    """The arena file's allocated bytes (0 for none)."""
    with contextlib.suppress(OSError, TypeError):
        return os.stat(path).st_blocks * 512  # type: ignore[arg-type]
    return 0


def _never() -> Any:
    import threading

    return threading.Event()


# ================================================================== stages


def probe(spec: dict[str, Any]) -> None:
    """In a process of its own: what a worker imports, the model as a worker loads it (with
    the variant's keyword arguments), a prefill; anonymous memory after each (JSON lines on
    stdout; llama.cpp logs on stderr)."""
    import functools

    def mark(stage: str, **kw: Any) -> None:
        kinds = smaps_by_kind("self", spec["model"], None)
        print(json.dumps({"stage": stage, "kinds": kinds, **kw}), flush=True)

    mark("interpreter")
    import llama_cpp
    import shmkv_workers.app  # noqa: F401  (what a served worker imports)
    from llama_cpp.server.model import LlamaProxy
    from llama_cpp.server.settings import ModelSettings

    from shmkv.core.config import resolve
    from shmkv.serving.model_settings import model_settings

    mark("imports")
    settings = resolve("serve", {"n_ctx": spec["n_ctx"]})
    ms = model_settings(settings, spec["model"], threads=spec["threads"])
    variant = spec["variant"]
    fields = {k: v for k, v in variant.items() if k in ModelSettings.model_fields}
    extra = {"swa_full": settings.swa_full}  # (as shmkv.serving.model_settings.load_with)
    extra |= {k: v for k, v in variant.items() if k not in fields}  # Llama() arguments only
    ms = ms.model_copy(update=fields | {"verbose": True})
    plain = llama_cpp.Llama
    llama_cpp.Llama = functools.partial(plain, **extra)  # type: ignore[misc]
    try:
        llm = LlamaProxy.load_llama_from_model_settings(ms)
    finally:
        llama_cpp.Llama = plain  # type: ignore[misc]
    mark("model")
    texts, times = [], []
    for prompt in spec["prompts"]:
        llm.reset()  # cold, every time: outputs compared across variants
        t = time.perf_counter()
        out = llm.create_completion(prompt, max_tokens=16, temperature=0.0, seed=11)
        times.append(time.perf_counter() - t)
        texts.append(out["choices"][0]["text"])  # type: ignore[index]
    mark("prefill", texts=texts, seconds=times, n_prompt=llm.n_tokens)


def parse_variant(text: str) -> dict[str, Any]:
    if text == "default":
        return {}
    out: dict[str, Any] = {}
    for item in text.split(";"):
        k, v = item.split("=", 1)
        out[k.strip()] = {"true": True, "false": False}.get(v.lower(), v)
        with contextlib.suppress(ValueError):
            out[k.strip()] = int(v)
    return out


def stages(variant: str, cfg: dict[str, Any], prompts: list[str], workdir: Path) -> dict[str, Any]:
    spec = dict(model=cfg["model"], n_ctx=cfg["n_ctx"], threads=cfg["threads"])
    spec |= dict(variant=parse_variant(variant), prompts=prompts)
    err = workdir / "probe.log"
    with open(err, "wb") as f:
        proc = subprocess.run(
            [sys.executable, __file__, "_probe", json.dumps(spec)],
            stdout=subprocess.PIPE,
            stderr=f,
            env=common.child_env(),
            check=False,
        )
    logtext = err.read_text(errors="replace")
    if proc.returncode:
        raise click.ClickException(f"probe {variant} failed:\n{logtext[-3000:]}")
    marks = [json.loads(line) for line in proc.stdout.decode().splitlines() if line.startswith("{")]
    buffers = {
        k: sum(float(x) for x in re.findall(rx, logtext)) * 2**20 for k, rx in BUFFERS.items()
    }
    anon = {m["stage"]: m["kinds"]["anon"]["rss"] for m in marks}
    last = marks[-1]
    return {
        "variant": variant,
        "kwargs": spec["variant"],
        "anon_rss": anon,
        "code_rss": marks[-1]["kinds"]["code"]["rss"],
        "weights_rss": marks[-1]["kinds"]["weights"]["rss"],
        "llama_buffers": buffers,
        "prompt_seconds": last["seconds"],
        "texts": last["texts"],
    }


# ================================================================== reports


def served_table(runs: list[dict[str, Any]]) -> str:
    b, rows = common.fmt_b, []
    for r in runs:
        groups: dict[str, list[dict[str, Any]]] = {}
        for p in r["processes"].values():
            groups.setdefault(p["role"], []).append(p["kinds"])
        for role, kinds in groups.items():
            n = len(kinds)
            total = kinds[0]
            for k in kinds[1:]:
                total = add(total, k)
            row = {"server": r["kind"], "process": role + (f" (x{n}, each)" if n > 1 else "")}
            row |= {f"{k} PSS": b(total[k]["pss"] / n) for k in KINDS}
            row["anon private"] = b(total["anon"]["private"] / n)
            row["PSS"] = b(sum(v["pss"] for v in total.values()) / n)
            rows.append(row)
        tot = {"server": r["kind"], "process": "all"}
        tot |= {f"{k} PSS": b(r["total"][k]["pss"]) for k in KINDS}
        tot["anon private"] = b(r["total"]["anon"]["private"])
        tot["PSS"] = b(r["total_pss"])
        rows.append(tot)
    return common.dict_table(rows, left=2)


def stages_table(rows: list[dict[str, Any]]) -> str:
    b, base = common.fmt_b, rows[0]
    out = []
    for r in rows:
        a, buf = r["anon_rss"], r["llama_buffers"]
        out.append(
            {
                "variant": r["variant"],
                "anon: python": b(a["interpreter"]),
                "+ imports": b(a["imports"] - a["interpreter"]),
                "+ model & context": b(a["model"] - a["imports"]),
                "+ prefill": b(a["prefill"] - a["model"]),
                "anon total": b(a["prefill"]),
                "vs default": b(a["prefill"] - base["anon_rss"]["prefill"]),
                "KV buf": b(buf["kv"]),
                "compute buf": b(buf["compute"]),
                "repacked": b(buf["weights_repacked"]),
                "prompt s": common.fmt_s(min(r["prompt_seconds"])),
                "same text": "yes" if r["texts"] == base["texts"] else "NO",
            }
        )
    return common.dict_table(out, left=1)


def plot(plt: Any, res: dict[str, Any]) -> Any:
    fig, ax = plt.subplots(figsize=(9, 4.5))
    bars = []
    for r in res.get("served", []):
        groups: dict[str, list[Any]] = {}
        for p in r["processes"].values():
            groups.setdefault(p["role"], []).append(p["kinds"])
        for role, kinds in groups.items():
            bars.append((f"{r['kind']}\n{role} x{len(kinds)}", kinds))
    colours = dict(code="#888888", weights="#cc8844", arena="#2266cc", shm="#99bb33")
    colours["anon"] = "#dd4444"
    for i, (_label, kinds) in enumerate(bars):
        bottom = 0.0
        for k in KINDS:
            v = sum(x[k]["pss"] for x in kinds) / 2**20
            ax.bar(i, v, bottom=bottom, color=colours[k], label=k if i == 0 else None)
            bottom += v
        ax.text(i, bottom, f"{bottom:.0f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(bars)), [b[0] for b in bars], fontsize=8)
    ax.set(ylabel="PSS, MiB (summed over the role's processes)")
    if bars:
        ax.legend(fontsize=8)
    ax.set_title(common.title(res, "memory per worker"), fontsize=9)
    fig.tight_layout()
    return fig


opt = common.option


@common.command("memory")
@opt("--parts", default="stages,served", help="stages, served, or both.")
@opt("--variants", default=VARIANTS, help="Comma-separated; key=value;key=value each.")
@opt("--workers", default=4, help="shmkv workers and llama-server slots.")
@opt("--requests", default=16, help="Requests of the served workload.")
@opt("--prompts", default=4, help="System prompts of the served workload.")
@opt("--prompt-tokens", default=1000, help="Tokens per system prompt.")
@opt("--threads", default=1, help="Threads of the stage probes.")
@opt("--n-ctx", default=4096)
@opt("--arena-size", default="1G")
@opt("--llama-server", "llama_server_binary", help="llama-server binary [built and cached].")
@opt("--no-llama-server", is_flag=True, help="Only shmkv in the served part.")
@opt("--model", help="GGUF [Gemma 3 270M Q4_K_M, as `shmkv serve`].")
def main(report: common.Report, o: Any) -> None:
    """Where a worker's memory goes (smaps by mapping, llama.cpp buffers), against llama-server."""
    import bench_serve

    from shmkv.core.config import parse_size

    model = common.model_path(o.model)
    parts = {p.strip() for p in o.parts.split(",")}
    cfg: dict[str, Any] = dict(model=str(model), arena_size=o.arena_size, max_tokens=16)
    cfg |= common.pick(vars(o), "workers threads n_ctx requests prompts prompt_tokens")
    cfg |= dict(budget_threads=0, timeout=900.0, llama_server_cache_ram_mib=0)
    cfg["llama_server_cache_ram_mib"] = parse_size(o.arena_size) >> 20
    wl = bench_serve.make_workload(model, o.prompts, o.prompt_tokens, o.requests)
    res: dict[str, Any] = {**report.header(common.llama_versions()), "config": cfg}
    with tempfile.TemporaryDirectory(prefix="shmkv-bench-memory-") as tmp:
        if "stages" in parts:
            prompts = [wl.prompt(0), wl.prompt(1)]
            res["stages"] = []
            for v in o.variants.split(","):
                log.info("stages: %s", v)
                res["stages"].append(stages(v, cfg, prompts, Path(tmp)))
        if "served" in parts:
            kinds = ["shmkv"]
            if not o.no_llama_server:
                import llama_server

                cfg["llama_server_binary"] = str(o.llama_server_binary or llama_server.build())
                kinds.append("llama-server")
            res["served"] = []
            for kind in kinds:
                log.info("served: %s, %d workers, %d requests", kind, o.workers, o.requests)
                res["served"].append(served(kind, cfg, wl, Path(tmp)))
    click.echo(f"\n{common.title(res, 'memory per worker')}")
    if res.get("stages"):
        click.echo("\none worker's llama.cpp context, by step (anonymous RSS):")
        click.echo(stages_table(res["stages"]))
    if res.get("served"):
        click.echo(f"\nserved ({o.workers} workers / slots, {o.requests} requests), PSS by kind:")
        click.echo(served_table(res["served"]))
        by = {r["kind"]: r for r in res["served"]}
        s = by["shmkv"]
        click.echo(
            f"shmkv arena: {common.fmt_b(s['arena_capacity'])} resident (allocated), "
            f"{common.fmt_b(s['arena_used'])} used"
        )
        if "llama-server" in by:
            ref = by["llama-server"]["total_pss"]
            for key in ("total_pss_minus_arena_used", "total_pss_without_arena"):
                res[f"shmkv_{key}_vs_llama_server"] = ratio = s[key] / ref
                what = key.removeprefix("total_pss_").replace("_", " ")
                click.echo(f"shmkv PSS {what} / llama-server PSS: {ratio:.2f}x")
    report.write(res, plot)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "_probe":
        probe(json.loads(sys.argv[2]))
    else:
        main()
