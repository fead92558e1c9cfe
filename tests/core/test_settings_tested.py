"""Every setting and every subcommand option is named by some test.

A net under the rule that each setting has a test that shows its effect: a setting of
``config.SETTINGS`` (by its flag, its ``SHMKV_*`` variable or its config file key) or an
option of a ``shmkv`` subcommand (taken from the click command tree) that no test module
names at all cannot have one. Only test modules count (``test_*.py``, not the helpers in
tests/support, which set some settings for every test), and not this one.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

import click

from shmkv.cli.main import main
from shmkv.core.config import ENV_PREFIX, SETTINGS
from tests.support import TESTS

HOW = (
    "add a test that sets it (through the real process where cheap: the flag or its SHMKV_* "
    "variable) and asserts what it changes, in the test file of its area, and check that "
    "the test fails with the setting's effect removed"
)


def modules() -> list[Path]:
    """The test modules under tests/, this one left out."""
    me = Path(__file__).resolve()
    return sorted(p for p in TESTS.rglob("test_*.py") if p.resolve() != me)


def _token(text: str) -> re.Pattern[str]:
    """``text`` as a whole token: ``--remote`` does not match ``--remote-ttl``."""
    return re.compile(r"(?<![\w-])" + re.escape(text) + r"(?![\w-])")


def _toml_key(name: str) -> re.Pattern[str]:
    """A config file line setting ``name`` (in a test's TOML text)."""
    return re.compile(r"^\s*" + re.escape(name) + r"\s*=", re.MULTILINE)


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the docstring constants of ``tree``'s module, classes and functions."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def code_strings(text: str) -> list[str]:
    """The string constants of a module's code: what it passes to a command, puts in an
    environment or writes to a config file (docstrings and comments left out: a test that
    only talks about a setting does not set it)."""
    tree = ast.parse(text)
    docs = _docstrings(tree)
    return [
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
    ]


def untested_settings(sources: dict[Path, str]) -> list[str]:
    """``--flag (SHMKV_VAR)`` of each setting that no module's code names by its flag, its
    variable or as a config file key."""
    strings = [s for text in sources.values() for s in code_strings(text)]
    out = []
    for s in SETTINGS.values():
        patterns = [_token(s.flag), _token(s.env), _toml_key(s.name)]
        if not any(p.search(x) for x in strings for p in patterns):
            out.append(f"{s.flag} ({s.env})")
    return out


@dataclass
class Scope:
    """What one test function (its decorators included) names: string constants and the
    functions it calls by name."""

    strings: set[str] = field(default_factory=set)
    calls: set[str] = field(default_factory=set)

    def names_option(self, opts: list[str]) -> bool:
        return any(s == o or s.startswith(o + "=") for s in self.strings for o in opts)


def scopes(sources: dict[Path, str]) -> list[Scope]:
    out = []
    for text in sources.values():
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            sc = Scope()
            for sub in ast.walk(node):
                if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                    sc.strings.add(sub.value)
                elif isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name):
                    sc.calls.add(sub.func.id)
            out.append(sc)
    return out


def subcommand_options(group: click.Group = main, path: str = "") -> list[tuple[str, list[str]]]:
    """(command path, the option's flags) of every option of every subcommand that is not a
    setting (those are checked as settings) nor --config."""
    out = []
    for name, cmd in sorted(group.commands.items()):
        full = f"{path} {name}".strip()
        if isinstance(cmd, click.Group):
            out += subcommand_options(cmd, full)
            continue
        for p in cmd.params:
            if isinstance(p, click.Option) and p.name not in SETTINGS and p.name != "config_file":
                out.append((full, list(p.opts)))
    return out


def untested_options(sources: dict[Path, str]) -> list[str]:
    """``shmkv CMD --opt`` of each subcommand option that no test function names together
    with its command (the command's name as a string, or a call of a helper of that name)."""
    found = scopes(sources)
    out = []
    for cmd, opts in subcommand_options():
        last = cmd.split()[-1]
        if not any(
            sc.names_option(opts) and (last in sc.strings or last in sc.calls) for sc in found
        ):
            out.append(f"shmkv {cmd} {'/'.join(opts)}")
    return out


def test_every_setting_is_named_by_a_test() -> None:
    sources = {p: p.read_text() for p in modules()}
    missing = untested_settings(sources)
    config = [_token("--config"), _token(f"{ENV_PREFIX}CONFIG")]
    if not any(
        c.search(x) for text in sources.values() for x in code_strings(text) for c in config
    ):
        missing.append("--config (SHMKV_CONFIG)")
    assert not missing, f"settings no test names: {', '.join(missing)}; for each, {HOW}"


def test_every_subcommand_option_is_named_by_a_test() -> None:
    sources = {p: p.read_text() for p in modules()}
    assert len(subcommand_options()) >= 10  # (the tree is read: not an empty list)
    missing = untested_options(sources)
    assert not missing, f"subcommand options no test names: {', '.join(missing)}; for each, {HOW}"
