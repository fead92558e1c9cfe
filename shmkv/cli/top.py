"""``shmkv top``: a live terminal view of the cache, refreshed in place.

Runs in the user's process (the CLI). Every ``--interval`` seconds it asks the
supervisor for ``stats`` and ``ls`` over its socket (as ``shmkv stats`` does,
without attaching) and draws one screen with curses: the hit rate and the
prefill tokens saved per second over the last interval (and since the start),
the arena's memory, and the hottest prefixes (entries by hits). ``q`` or Ctrl-C
quits. :func:`frame` builds the screen's lines from two samples, so ``--once``
prints the same text without a terminal.
"""

from __future__ import annotations

import curses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shmkv.core.config import format_size
from shmkv.core.errors import ShmkvError

if TYPE_CHECKING:
    from shmkv.core.client import Client


@dataclass
class Sample:
    """What one refresh read: the ``stats`` reply, the entries, and when."""

    at: float
    stats: dict[str, Any]
    entries: list[dict[str, Any]]


def sample(client: Client, limit: int = 1000) -> Sample:
    st = client.stats()
    return Sample(time.monotonic(), st, client.ls(limit=limit)["entries"])


def _saved(st: dict[str, Any]) -> int:
    """Prompt tokens not prefilled thanks to the cache (restored, or reused locally)."""
    return int(st.get("tokens_restored", 0)) + int(st.get("tokens_reused_local", 0))


def _rate(hits: float, calls: float) -> str:
    return f"{100 * hits / calls:5.1f}%" if calls > 0 else "  n/a"


def frame(prev: Sample | None, cur: Sample, width: int = 100, rows: int = 10) -> list[str]:
    """The lines of one screen: ``prev`` (None: the first) and ``cur`` samples."""
    st, w = cur.stats, cur.stats.get("workers", {})
    calls, hits = int(w.get("calls", 0)), int(w.get("hits", 0))
    if prev is not None and cur.at > prev.at:
        pw, dt = prev.stats.get("workers", {}), cur.at - prev.at
        d_calls, d_hits = calls - int(pw.get("calls", 0)), hits - int(pw.get("hits", 0))
        saved_s = (_saved(st) - _saved(prev.stats)) / dt
        req_s = d_calls / dt
        window = f"last {dt:.0f}s"
    else:
        d_calls = d_hits = 0
        saved_s = req_s = 0.0
        window = "last -s"
    used, cap = int(st.get("bytes_used", 0)), max(1, int(st.get("bytes_capacity", 1)))
    lines = [
        f"shmkv top: arena {st.get('name')} (supervisor pid {st.get('pid')}, "
        f"up {float(st.get('uptime', 0)):.0f}s)   q: quit",
        "",
        f"  hit rate      {_rate(d_hits, d_calls)} {window}   {_rate(hits, calls)} since start "
        f"({hits} of {calls} requests)",
        f"  tokens saved  {saved_s:,.0f}/s   {_saved(st):,} since start "
        f"({int(st.get('tokens_restored', 0)):,} restored, "
        f"{int(st.get('tokens_reused_local', 0)):,} reused locally)",
        f"  prefilled     {int(st.get('tokens_evaluated', 0)):,} tokens since start   "
        f"requests {req_s:,.1f}/s",
        f"  memory        {format_size(used)} of {format_size(cap)} ({100 * used / cap:.1f}%)   "
        f"largest free {format_size(int(st.get('bytes_free_largest', 0)))}",
        f"  entries       {st.get('entries', 0)} ({st.get('pinned', 0)} pinned, "
        f"{format_size(int(st.get('pinned_bytes', 0)))})   workers "
        f"{st.get('workers_connected', 0)}   leases {st.get('leases_active', 0)}",
        f"  puts          {st.get('puts', 0)} ({st.get('rejected_puts', 0)} rejected)   "
        f"evictions {st.get('evictions', 0)}   revocations {st.get('revocations', 0)}",
        "",
        "  hottest prefixes (by hits)",
        f"  {'KEY':16}  {'TOKENS':>7}  {'SIZE':>10}  {'HITS':>6}  PIN  LAST USED",
    ]
    now = time.time()
    hot = sorted(cur.entries, key=lambda e: (-int(e["hits"]), -float(e["last_used"])))
    for e in hot[:rows]:
        lines.append(
            f"  {e['key'][:16]}  {e['tokens']:>7}  {format_size(e['bytes']):>10}  "
            f"{e['hits']:>6}  {'yes' if e['pinned'] else '   '}  "
            f"{max(0.0, now - e['last_used']):.0f}s ago"
        )
    if not hot:
        lines.append("  (no entries yet)")
    return [ln[:width] for ln in lines]


def run(client: Client, interval: float = 2.0, rows: int = 10) -> None:
    """Draw until ``q`` or Ctrl-C."""
    try:
        curses.wrapper(_loop, client, interval, rows)
    except KeyboardInterrupt:
        pass


def _loop(scr: Any, client: Client, interval: float, rows: int) -> None:
    curses.curs_set(0)
    scr.timeout(max(50, int(interval * 1000)))
    prev: Sample | None = None
    while True:
        height, width = scr.getmaxyx()
        try:
            cur = sample(client)
            lines = frame(prev, cur, width - 1, rows=max(1, min(rows, height - 12)))
            prev = cur
        except ShmkvError as e:
            lines = ["shmkv top   q: quit", "", f"  supervisor unavailable: {e}"[: width - 1]]
            prev = None
        scr.erase()
        for y, line in enumerate(lines[: height - 1]):
            scr.addstr(y, 0, line)
        scr.refresh()
        key = scr.getch()
        if key in (ord("q"), ord("Q"), 27):
            return
