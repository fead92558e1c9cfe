"""What ``shmkv warm``, ``shmkv export`` and ``shmkv import`` do, below their click layer.

Runs in the ``shmkv`` command's process. ``warm.py`` loads a model as served
workers do and prefills; ``transfer.py`` moves one state between the arena and a
file (``statefile.py``); this module strings them together for the commands:
progress and summary, output files, pins.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable
from contextlib import contextmanager
from typing import IO, Any

import click

from shmkv.cli.statefile import StateMeta
from shmkv.cli.transfer import export_entry, find, import_state
from shmkv.cli.warm import Item, Summary, Warmer, model_name, parse, parse_chat, parse_line
from shmkv.core.client import Client
from shmkv.core.config import Settings
from shmkv.core.errors import ConfigError, ShmkvError
from shmkv.llama.fingerprint import context_description, model_fingerprint
from shmkv.serving.default_model import default_model_path

log = logging.getLogger(__name__)


def _admin(settings: Settings) -> Client:
    return Client(settings=settings, populate=False, attach=False)


def _threads(settings: Settings) -> int:
    """A one-off job: all cores unless --threads says otherwise (threads are not in the
    fingerprint)."""
    return int(settings.threads) or (os.cpu_count() or 1)


def warm_all(
    settings: Settings, lines: Iterable[str], pin_all: bool, pin_ttl: float | None
) -> Summary:
    """Warm every item of ``lines`` with every model ``shmkv serve`` would serve."""
    items, bad = parse(lines)
    summary = Summary(skipped=len(bad), errors=[])
    for msg in bad:
        click.echo(f"shmkv: skipped {msg}", err=True)
    models = settings.model or [default_model_path()]
    with _admin(settings) as admin:
        before = admin.stats()
        for model in models:
            _warm_model(settings, model, items, pin_all, pin_ttl, summary, admin)
        after = admin.stats()
    summary.states_stored = after["puts"] - before["puts"]
    summary.bytes_stored = after["bytes_put"] - before["bytes_put"]
    return summary


def _warm_model(
    settings: Settings,
    model: str,
    items: list[Item],
    pin_all: bool,
    pin_ttl: float | None,
    summary: Summary,
    admin: Client,
) -> None:
    warmer = Warmer(settings, model, _threads(settings))
    pins: list[tuple[bytes, int]] = []
    try:
        label = f"warming {model_name(model)}"
        with click.progressbar(items, label=label, file=sys.stderr) as bar:
            for item in bar:
                try:
                    done = warmer.run(item)
                except ShmkvError as e:
                    summary.skipped += 1
                    click.echo(f"\nshmkv: skipped {e}", err=True)
                    continue
                summary.warmed += 1
                summary.tokens_prefilled += done.evaluated
                summary.tokens_restored += done.restored
                summary.seconds += done.seconds
                if item.pin or pin_all:
                    ends = [len(done.tokens), *done.checkpoints]
                    keys = ((warmer.key(done.tokens[:n]), n) for n in ends)
                    pins += [(k, n) for k, n in keys if k is not None]
        warmer.flush()
    finally:
        warmer.close()
    for key, n in dict.fromkeys(pins):
        try:
            summary.pinned += admin.pin(key, True, ttl=pin_ttl, n_tokens=n)
        except ShmkvError as e:
            summary.errors.append(f"pin {key.hex()}: {e}")
            click.echo(f"shmkv: could not pin {key.hex()}: {e}", err=True)


@contextmanager
def _output(path: str | None) -> Any:
    """The file to write (created 0600, in place only once complete), or stdout."""
    if path is None:
        if sys.stdout.isatty():
            raise ConfigError("a state file is binary: give -o FILE or redirect stdout")
        yield sys.stdout.buffer
        sys.stdout.buffer.flush()
        return
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def export_to(
    settings: Settings,
    output: str | None,
    key: str | None,
    prompt: str | None,
    messages: str | None,
    n_tokens: int | None,
) -> StateMeta:
    """``shmkv export``: by key, or by the prompt (or chat) a state covers."""
    if key is not None:
        with Client(settings=settings, populate=False) as c:
            row = find(c, key, n_tokens)
            with _output(output) as out:
                return export_entry(c, settings, row, out)
    item = parse_chat(messages) if messages is not None else parse_line(0, _json_str(prompt or ""))
    if item is None:
        raise ConfigError("--prompt or --messages is empty")
    model = (settings.model or [default_model_path()])[0]
    warmer = Warmer(settings, model, _threads(settings))
    try:
        done = warmer.run(item)  # restores it (or prefills and publishes it)
        warmer.flush()
        offset, gen = warmer.record_of(done.tokens)
        key_bytes = warmer.key(done.tokens)
        assert key_bytes is not None
        cache = warmer.cache
        variant = b"|exact|%d" % cache.align if cache.exact else b""
        row = {"key": key_bytes.hex(), "offset": offset, "gen": gen}
        with _output(output) as out:
            return export_entry(
                cache.reader,
                settings,
                row,
                out,
                model=model_name(model),
                description=context_description(warmer.llm),
                variant=variant,
            )
    finally:
        warmer.close()


def _json_str(text: str) -> str:
    import json

    return json.dumps(text)


def import_from(
    settings: Settings, path: str, pin: bool, pin_ttl: float | None
) -> tuple[StateMeta, dict[str, Any], bool]:
    """``shmkv import``: check the file whole, put its state, pin it if asked."""
    fingerprint = description = None
    if settings.model:  # check the state against the model this machine serves
        from shmkv.serving.model_settings import load_llama

        llm = load_llama(settings, settings.model[0], threads=1)
        try:
            fingerprint, description = model_fingerprint(llm), context_description(llm)
        finally:
            llm.close()
    f: IO[bytes]
    if path == "-":
        f, size = sys.stdin.buffer, None
    else:
        try:
            f = open(path, "rb")  # noqa: SIM115 (closed below)
        except OSError as e:
            raise ConfigError(f"cannot read {path}: {e.strerror}") from None
        st = os.fstat(f.fileno())
        size = st.st_size if os.path.isfile(path) else None
    try:
        with Client(settings=settings, populate=False) as c:
            meta, reply = import_state(
                c, f, size, pin=pin, fingerprint=fingerprint, description=description
            )
            if pin and pin_ttl is not None:  # (the put pinned it; the pin op adds a TTL)
                c.pin(reply["key"], True, ttl=pin_ttl, n_tokens=meta.n_tokens)
    finally:
        if f is not sys.stdin.buffer:
            f.close()
    return meta, reply, pin
