"""Fixtures of the chaos files: cold references of the chaos prompts and the summary of
every kill (both from harness.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session")
def chaos_refs(models):
    """Cold greedy outputs of the chaos prompts, computed on demand (tests/chaos/harness.py)."""
    from tests.chaos.harness import Refs

    return Refs(models["seed0"])


@pytest.fixture(scope="session")
def chaos_summary() -> Iterator[None]:
    """One summary line of every chaos test that ran, logged when the session ends."""
    yield
    from tests.chaos.harness import log_summary

    log_summary()
