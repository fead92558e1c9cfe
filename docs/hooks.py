"""MkDocs hook: the settings reference is generated from ``shmkv.core.config.SETTINGS``.

A page that holds the line ``<!-- settings-table -->`` gets the table in its place, so the
reference cannot drift from the one declaration of each setting.
"""

from __future__ import annotations

from typing import Any

MARKER = "<!-- settings-table -->"
SCOPES = {"supervise": "supervise", "serve": "serve", "client": "workers"}


def _default(setting: Any) -> str:
    from shmkv.core.config import format_size, parse_size

    value = setting.default
    if value is None or value == [] or value == ():
        return "none"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if setting.parse is parse_size and isinstance(value, int):
        return f"`{format_size(value)}`"
    if isinstance(value, list | tuple):
        return ", ".join(f"`{v}`" for v in value)
    return f"`{value}`"


def settings_table() -> str:
    from shmkv.core.config import SETTINGS

    rows = [
        "| flag | environment / config key | default | used by | what it does |",
        "|---|---|---|---|---|",
    ]
    for s in sorted(SETTINGS.values(), key=lambda s: s.name):
        flag = s.flag if s.is_flag else f"{s.flag} {s.metavar}"
        used = ", ".join(SCOPES[c] for c in sorted(s.scopes) if c in SCOPES)
        text = " ".join(s.help.split()).replace("|", "\\|")
        if s.multiple:
            text += " (repeatable)"
        rows.append(f"| `{flag}` | `{s.env}` / `{s.name}` | {_default(s)} | {used} | {text} |")
    return "\n".join(rows)


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    if MARKER in markdown:
        return markdown.replace(MARKER, settings_table())
    return markdown
