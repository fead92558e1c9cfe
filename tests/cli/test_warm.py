"""`shmkv warm` against a real supervisor and real llama.cpp on the tiny models: a warmed
prompt is a hit for a fresh worker process and for a served request (completion and
chat), with the text of a cold run; pins; bad input lines."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support.llama_workers import KW, SYSTEM, completion, run_worker, texts
from tests.support.servers import EXTRA, N_CTX, SAMPLING, Server

PROMPT = SYSTEM + " Question: which mat is the cat on?"
CHAT = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Which mat is the cat on?"},
]


def warm(sup, path: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "shmkv", "warm", *args, str(path)],
        env={**sup.env, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )


def jsonl(tmp_path: Path, *lines: object) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def test_warmed_prompt_is_a_hit_for_a_fresh_worker(make_supervisor, models, tmp_path) -> None:
    sup = make_supervisor("--size", "64M")
    path = jsonl(tmp_path, json.dumps(PROMPT))  # (a line that is a JSON string)
    res = warm(sup, path, "--model", models["seed0"], "--n-ctx", str(KW["n_ctx"]), "--json")
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    assert summary["warmed"] == 1 and summary["skipped"] == 0
    assert summary["tokens_prefilled"] > 1000 and summary["tokens_restored"] == 0
    assert summary["states_stored"] >= 1 and summary["bytes_stored"] > 0
    # a fresh process (SharedCacheLlama) restores the whole prompt but the last token
    jobs = [completion(PROMPT)]
    hot = run_worker(sup, models["seed0"], jobs)
    last = hot["results"][0]["last"]
    assert last["tokens_restored"] >= last["prompt_tokens"] - 1 > 1000
    assert last["tokens_evaluated"] <= 1
    cold = run_worker(None, models["seed0"], jobs, mode="cold")
    assert texts(hot) == texts(cold)
    # warming it again restores it instead of prefilling
    again = json.loads(
        warm(sup, path, "--model", models["seed0"], "--n-ctx", "2048", "--json").stdout
    )
    assert again["tokens_restored"] > 1000 and again["tokens_prefilled"] <= 1


def test_warm_keys_states_as_served_workers_do(
    make_supervisor, serve_model, serve_reference, tmp_path
):
    """Same settings (SHMKV_* as `shmkv serve` passes them) and same chat template: the
    first served request of a warmed prompt or chat is a hit, with a cold run's text."""
    sup = make_supervisor("--size", "64M")
    env = {"SHMKV_MODEL": serve_model, "SHMKV_N_CTX": str(N_CTX)}
    res = warm(sup, jsonl(tmp_path, {"prompt": PROMPT}, {"messages": CHAT}), env=env)
    assert res.returncode == 0, res.stderr
    assert "warmed 2 prompt(s), 0 skipped" in res.stdout
    server = Server(sup, serve_model, 1, tmp_path)
    try:
        text, info = server.complete(PROMPT)
        assert info["hit"] and info["restored_tokens"] > 1000, info
        assert info["evaluated_tokens"] <= 1
        assert text == serve_reference(PROMPT)
        raw = server.client.chat.completions.with_raw_response.create(
            model="tiny", messages=CHAT, extra_body=EXTRA, **SAMPLING
        )
        assert raw.headers["x-shmkv-hit"] == "true"
        assert int(raw.headers["x-shmkv-restored-tokens"]) > 1000
        assert raw.parse().choices[0].message.content == serve_reference(messages=CHAT)
    finally:
        server.stop()


def test_warm_pins_what_a_line_asks_for(make_supervisor, models, tmp_path) -> None:
    sup = make_supervisor("--size", "64M")
    other = PROMPT + " Answer in one word."  # a few tokens more: the same last full chunk
    path = jsonl(tmp_path, {"prompt": PROMPT, "pin": True}, {"prompt": other})
    res = warm(sup, path, "--model", models["seed0"], "--n-ctx", "2048", "--pin-ttl", "3600")
    assert res.returncode == 0, res.stderr
    assert "1 pinned" in res.stdout
    with sup.client(attach=False) as c:
        rows = c.ls()["entries"]
    pinned = [r for r in rows if r["pinned"]]
    assert len(pinned) == 1 and pinned[0]["pin_ttl"] == 3600
    # the two prompts' states share a key (their last full chunk); only the pinned
    # line's own state is pinned
    same_key = [r for r in rows if r["key"] == pinned[0]["key"]]
    assert len(same_key) == 2 and {r["pinned"] for r in same_key} == {True, False}
    assert pinned[0]["tokens"] < max(r["tokens"] for r in same_key)


def test_warm_reports_and_skips_bad_lines(make_supervisor, models, tmp_path) -> None:
    sup = make_supervisor("--size", "64M")
    path = jsonl(
        tmp_path,
        "# a comment",
        "",
        "{not json",
        {"prompt": 42},
        {"messages": "hello"},
        {"prompt": "a", "messages": []},
        {"prompt": PROMPT, "pin": "yes"},
        {"prompt": PROMPT},
        {"prompt": "word " * 5000},  # longer than the context
    )
    res = warm(sup, path, "--model", models["seed0"], "--n-ctx", "2048", "--json")
    assert res.returncode == 1
    assert "Traceback" not in res.stderr
    summary = json.loads(res.stdout)
    assert summary["warmed"] == 1 and summary["skipped"] == 6
    skipped = [ln for ln in res.stderr.splitlines() if "skipped line" in ln]
    assert [ln.split("skipped line ")[1].split(":")[0] for ln in skipped] == [
        "3",
        "4",
        "5",
        "6",
        "7",
        "9",
    ]
    assert sup.stats()["entries"] >= 1


def test_warm_without_a_supervisor_says_so(models, tmp_path) -> None:
    from tests.support.cli import assert_one_error_line, clean_env

    path = jsonl(tmp_path, json.dumps(PROMPT))  # (a line that is a JSON string)
    env = clean_env(SHMKV_SOCKET=str(tmp_path / "none.sock"))
    res = subprocess.run(
        [sys.executable, "-m", "shmkv", "warm", "--model", models["seed0"], str(path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert_one_error_line(res, "no shmkv supervisor", ignore_logs=True)
