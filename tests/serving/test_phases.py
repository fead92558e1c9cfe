"""Where a request's time to first token goes: the phases a worker reports (``workers/app.py``
``cache_field``), set against the client's own clock.

Real ``shmkv serve`` (2 gunicorn workers, the tiny model): a cold streamed request, then,
while that stream still holds its worker, the same system prompt with another question on
the other worker, which restores it from the arena. ``time.monotonic()`` is one clock for
every process of the machine, so the worker's ``*_at`` times fall between the client's
send time and the arrival of the first chunk.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import httpx

from tests.support.servers import EXTRA, Server

log = logging.getLogger(__name__)
SYSTEM = " ".join(f"Rule {i}: the owl {i % 7} watches tower {i % 5}." for i in range(45))
PHASES = ("coalesce_wait_ms", "remote_wait_ms", "restore_ms", "prefill_ms", "first_decode_ms")
SLACK_S = 0.002  # the client reads its clock a little before sending / after receiving


class Stream:
    """One streamed completion, opened: the client's send time, its first chunk's arrival
    time and ``shmkv`` field; :meth:`close` reads the rest."""

    def __init__(self, srv: Server, prompt: str, max_tokens: int) -> None:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "stream": True}
        body |= {"temperature": 0.0, **EXTRA}
        self.client = httpx.Client(timeout=60)
        self.sent = time.monotonic()
        self.ctx = self.client.stream("POST", srv.base + "/v1/completions", json=body)
        resp = self.ctx.__enter__()
        assert resp.status_code == 200, resp.read()
        self.lines = resp.iter_lines()
        for line in self.lines:
            if line.startswith("data: {"):
                self.first = time.monotonic()
                self.field: dict[str, Any] = json.loads(line[len("data: ") :])["shmkv"]
                break

    def close(self) -> None:
        for _ in self.lines:
            pass
        self.ctx.__exit__(None, None, None)
        self.client.close()


def check_phases(s: Stream) -> dict[str, float]:
    """The phases are there, not negative, in order, and within the client's TTFT."""
    f = s.field
    for k in (*PHASES, "cpu_wait_ms"):
        assert f[k] >= 0, (k, f)
    assert s.sent - SLACK_S <= f["received_at"] <= f["started_at"] <= f["first_token_at"], f
    assert f["first_token_at"] <= s.first + SLACK_S, (f, s.first)
    assert f["cpu_wait_ms"] <= f["prefill_ms"], f
    phases = {k: f[k] / 1000 for k in PHASES}
    phases["app"] = f["started_at"] - f["received_at"]  # parsing, tokenizing
    in_worker = f["first_token_at"] - f["received_at"]
    assert sum(phases.values()) <= in_worker + SLACK_S, (phases, in_worker)
    assert sum(phases.values()) <= s.first - s.sent + SLACK_S
    log.info("TTFT %.1f ms: %s", (s.first - s.sent) * 1000, {k: f[k] for k in PHASES} | f)
    return phases


def test_phases_of_a_cold_request_and_a_hit_on_another_worker(
    tmp_path, serve_model, make_supervisor
):
    sup = make_supervisor("--size", "128M")
    srv = Server(sup, serve_model, workers=2, tmp_path=tmp_path)
    try:
        cold = Stream(srv, SYSTEM + " Question 1: which tower?", max_tokens=1500)
        phases = check_phases(cold)
        assert cold.field["restored_tokens"] == 0 and cold.field["evaluated_tokens"] > 500
        assert max(phases, key=phases.__getitem__) == "prefill_ms", phases
        deadline = time.monotonic() + 30  # its prompt's state reaches the arena
        while sup.stats_json()["entries"] == 0:
            assert time.monotonic() < deadline, "the cold prompt was never published"
            time.sleep(0.05)
        # the cold stream still holds its worker: this one goes to the other
        hit = Stream(srv, SYSTEM + " Question 2: which owl?", max_tokens=4)
        hit.close()
        cold.close()
        f = hit.field
        assert f["worker_pid"] != cold.field["worker_pid"]
        check_phases(hit)
        assert f["restored_tokens"] > 500 and f["restore_ms"] > 0, f
        assert f["evaluated_tokens"] == f["prompt_tokens"] - f["restored_tokens"] < 40, f
        assert f["prefill_ms"] < cold.field["prefill_ms"], (f, cold.field)
        # without a stream, the same figures are response headers
        _, info = srv.complete(SYSTEM + " Question 3: which watch?")
        assert info["received_at"] <= info["started_at"] <= info["first_token_at"], info
        assert info["prefill_ms"] > 0 and info["first_decode_ms"] >= 0, info
    finally:
        srv.stop()
