"""Shared fixtures: real `shmkv supervise` processes on private names and sockets, and the
tiny models the test session writes. Plain helpers live in the support package (tests/support/)."""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support import SHM
from tests.support.servers import EXTRA, N_CTX, SAMPLING
from tests.support.supervisors import Sup, start_supervisor
from tests.support.tmpfs import mounted_tmpfs
from tests.support.waiting import deleted_arena_fds


def pytest_sessionstart(session: pytest.Session) -> None:
    """A llama-cpp-python compiled for AMX crashes the tests that load Gemma's Q4_K weights
    into a plain ``Llama`` (llama.cpp#20824): stop at once with the rebuild that runs them."""
    from shmkv.llama import offload

    if offload.amx_weight_buffers():
        pytest.exit(
            "this llama-cpp-python was compiled for AMX, whose weight buffers crash on the "
            "test model's Q4_K weights (llama.cpp#20824): rebuild it without AMX, "
            'CMAKE_ARGS="$(.ci/cmake-args)" .venv/bin/pip install --force-reinstall '
            "--no-deps --no-cache-dir 'llama-cpp-python[server]>=0.3.32,<0.4'",
            returncode=4,
        )


#: descriptors of unlinked arenas (and put memfds) the test process may hold between modules
HELD_ARENA_FDS = 8


@pytest.fixture(scope="module", autouse=True)
def no_arena_descriptors_held(request: pytest.FixtureRequest) -> Iterator[None]:
    """A module that leaves the test process holding more than HELD_ARENA_FDS descriptors
    of unlinked arenas fails: each pins its arena's tmpfs memory until the session ends
    (once ~2,600 of them, ~15 GB). One /proc/self/fd scan per module."""
    before = deleted_arena_fds(os.getpid()).total()
    yield
    held = deleted_arena_fds(os.getpid())
    if held.total() > max(before, HELD_ARENA_FDS):
        gc.collect()  # (a cycle, e.g. a failed test's traceback, may still hold a Client)
        held = deleted_arena_fds(os.getpid())
    if held.total() > max(before, HELD_ARENA_FDS):
        top = ", ".join(f"{n} x {path}" for path, n in held.most_common(5))
        pytest.fail(
            f"{request.node.name} left the test process holding {held.total()} descriptors of "
            f"unlinked arenas (was {before}; at most {HELD_ARENA_FDS}): {top}. Close the "
            f"Clients, ArenaViews and received fds it opens (with `with`, or in a finally)"
        )


@pytest.fixture
def make_supervisor(tmp_path: Path) -> Iterator:
    """Factory: start supervisors; all are stopped and checked for leftovers at teardown."""
    started: list[Sup] = []

    def make(*args: str, **kw) -> Sup:
        sup = start_supervisor(tmp_path, *args, **kw)
        started.append(sup)
        return sup

    yield make
    for sup in started:
        if sup.proc.poll() is None:
            sup.stop()
        if "--keep" not in sup.proc.args:
            leftovers = [p for p in SHM.glob(f"shmkv-{sup.name}*")]
            for p in leftovers:
                p.unlink()
            assert sup.proc.returncode != 0 or not leftovers, f"left behind {leftovers}"


@pytest.fixture
def small_tmpfs(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    """A 64 MiB tmpfs (root only: skips without), unmounted at teardown; another size or
    mode with ``@pytest.mark.small_tmpfs(size="2m", mode="0700")``."""
    marker = request.node.get_closest_marker("small_tmpfs")
    with mounted_tmpfs(tmp_path / "smallshm", **(marker.kwargs if marker else {})) as d:
        yield d


@pytest.fixture
def public_dir() -> Iterator[Path]:
    """A directory every user can traverse (pytest's tmp_path is 0700 root)."""
    d = Path(tempfile.mkdtemp(prefix="shmkv-public-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(params=["true", "false"], ids=["reserve-true", "reserve-false"])
def reserve_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each arena mode in turn (``--reserve true`` and ``false``) for every supervisor the
    test starts: SHMKV_RESERVE in the environment, which they inherit (``start_supervisor``)
    and read unless given ``--reserve`` themselves. The hostile and chaos files use it."""
    monkeypatch.setenv("SHMKV_RESERVE", request.param)
    return str(request.param)


@pytest.fixture
def supervisor(make_supervisor) -> Sup:
    """One supervisor with a 64 MiB arena."""
    return make_supervisor("--size", "64M")


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict[str, str]:
    """Tiny random-weight GGUFs: two llamas with the same shapes and different weights
    (seed0, seed1) and a Gemma 3 with a 32-token sliding window (swa)."""
    from tests.support.tinymodel import write_tiny_gemma3, write_tiny_llama

    d = tmp_path_factory.mktemp("models")
    out = {}
    for seed in (0, 1):
        path = d / f"tiny{seed}.gguf"
        write_tiny_llama(path, seed=seed)
        out[f"seed{seed}"] = str(path)
    write_tiny_gemma3(d / "tiny-swa.gguf", n_swa=32)
    out["swa"] = str(d / "tiny-swa.gguf")
    return out


@pytest.fixture(scope="session")
def serve_model(tmp_path_factory) -> str:
    """The tiny llama the gunicorn tests serve (its own weights: seed 3)."""
    from tests.support.tinymodel import write_tiny_llama

    path = tmp_path_factory.mktemp("serve-model") / "tiny.gguf"
    write_tiny_llama(path, seed=3)
    return str(path)


@pytest.fixture(scope="session")
def serve_reference(serve_model) -> Callable[..., str]:
    """Cold greedy output from a fresh plain Llama with the gunicorn workers' settings:
    ``run(prompt)`` or ``run(messages=[...])``, sampling overrides as keywords."""
    import llama_cpp

    kw = dict(model_path=serve_model, n_ctx=N_CTX, n_threads=1, n_threads_batch=1, verbose=False)

    def run(prompt: str | None = None, messages: list | None = None, **over) -> str:
        llm = llama_cpp.Llama(**kw)
        params = {**SAMPLING, **EXTRA, **over}
        if messages is not None:
            return llm.create_chat_completion(messages, **params)["choices"][0]["message"][
                "content"
            ]
        return llm.create_completion(prompt, **params)["choices"][0]["text"]

    return run
