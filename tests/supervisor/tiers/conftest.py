"""Fixtures of the tiers' tests: a real redis-server for ``--remote``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.redis import NO_REDIS, REDIS, RedisProc


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisProc]:
    """One redis-server on a loopback port, killed at teardown (the test skips without one)."""
    if REDIS is None:
        pytest.skip(NO_REDIS)
    srv = RedisProc(tmp_path / "redis")
    yield srv
    srv.kill()
