"""The llama-cpp-python versions shmkv runs on: one range, declared once, checked at attach.

shmkv/llama/compat.py names the range it was read from (``KNOWN_VERSIONS``,
``REQUIREMENT``); pyproject.toml must require exactly that range, and every C API
binding shmkv calls must be among those ``check()`` verifies on a version outside it.
.ci/llama-versions builds both ends of the range and runs tests/llama on each.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import llama_cpp
import pytest
from llama_cpp import llama_cpp as lc

from shmkv.core.errors import ConfigError
from shmkv.llama import attach, compat
from tests.support.llama_workers import KW

ROOT = Path(__file__).resolve().parents[2]


def lcp_requirements() -> list[str]:
    """pyproject.toml's llama-cpp-python requirements (dependencies and every extra)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        reqs += extra
    return [r for r in reqs if r.startswith("llama-cpp-python")]


def test_pyproject_requires_the_range_compat_was_read_from():
    reqs = lcp_requirements()
    assert len(reqs) == 2, reqs  # (the core dependency and the serve extra's [server])
    wanted = compat.REQUIREMENT.removeprefix("llama-cpp-python")
    for req in reqs:
        assert re.sub(r"\[\w+\]", "", req) == compat.REQUIREMENT, req
        assert req.endswith(wanted)
    assert compat.REQUIREMENT == "llama-cpp-python>=0.3.32,<0.4"


def test_the_range_ends_are_known_and_its_outside_is_not():
    for v in ("0.3.32", "0.3.34", "0.3.36", "0.3.36.post1"):
        assert compat.known(v), v
    for v in ("0.3.31", "0.3.17", "0.2.90", "0.3.37", "0.4.0", "1.0", "unknown", ""):
        assert not compat.known(v), v
    assert compat.known(llama_cpp.__version__)  # (what the rest of tests/llama ran on)


def test_every_binding_shmkv_calls_is_checked():
    """A binding called outside the list would fail on an older version with an
    AttributeError mid-request instead of check()'s one message at attach."""
    called: set[str] = set()
    for path in (ROOT / "shmkv").rglob("*.py"):
        text = path.read_text()
        called |= set(re.findall(r"\b(?:lc|llama_cpp)\.(llama_\w+)\(", text))
    assert called, "no binding found: the pattern no longer matches shmkv's calls"
    assert called <= set(compat.FUNCTIONS), sorted(called - set(compat.FUNCTIONS))
    assert all(callable(getattr(lc, f, None)) for f in compat.FUNCTIONS)


@pytest.mark.parametrize(
    ("version", "lacks"),
    [("0.3.31", "_requires_eval"), ("0.3.16", "llama_n_ctx_seq")],
    ids=["0.3.31", "0.3.16"],
)
def test_a_version_below_the_range_fails_at_attach_naming_what_it_lacks(
    models, monkeypatch, version, lacks
):
    """Read from their sdists: 0.3.17 to 0.3.31 have no ``Llama._requires_eval`` (their
    ``generate`` replays a prompt's last token, which shmkv's restores do not expect:
    0.3.17 failed tests/llama), 0.3.16 no ``llama_n_ctx_seq`` either. Attach says what
    is missing and how to install a version shmkv knows, before the first request."""
    llm = llama_cpp.Llama(models["seed0"], verbose=False, **KW)
    try:
        monkeypatch.setattr(llama_cpp, "__version__", version)
        monkeypatch.delattr(llm, "_requires_eval")  # (as both are: not there)
        if lacks == "llama_n_ctx_seq":
            monkeypatch.delattr(lc, "llama_n_ctx_seq")
        with pytest.raises(ConfigError) as err:
            attach(llm, name="old", socket_path="/tmp/shmkv-old-version-test.sock")
        message = str(err.value)
        assert f"llama-cpp-python {version} lacks {lacks}" in message, message
        assert "0.3.32 to 0.3.36" in message and compat.REQUIREMENT in message, message
        assert getattr(llm, "shmkv", None) is None
    finally:
        llm.close()


def test_a_version_in_the_range_is_trusted_without_looking(models, monkeypatch):
    """Inside the range, check() does not look: no error, no warning."""
    llm = llama_cpp.Llama(models["seed0"], verbose=False, **KW)
    try:
        monkeypatch.setattr(llama_cpp, "__version__", "0.3.33")
        monkeypatch.delattr(llm, "_requires_eval")  # (it would not notice)
        monkeypatch.setattr(compat, "_warned", False)
        compat.check(llm)
        assert compat._warned is False  # noqa: SLF001 (no warning either)
    finally:
        llm.close()
