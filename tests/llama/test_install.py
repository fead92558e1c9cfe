"""Installing shmkv keeps a llama-cpp-python of the supported range that is already there.

A user's llama-cpp-python may be a CUDA, Metal or ROCm build; an exact pin on another
version made pip replace it with a fresh CPU build. This asks pip's own resolver, with
no build and no network: in a throwaway venv where a llama-cpp-python wheel from pip's
cache is installed (the oldest of the range that .ci/llama-versions built, if there), and
the other dependencies are visible from this venv (a .pth file), ``pip install
--dry-run`` of shmkv's requirements must install nothing, while the old exact pin would
have installed another llama-cpp-python. Skipped if pip's cache holds no wheel of the range.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

from shmkv.llama import compat

ROOT = Path(__file__).resolve().parents[2]
#: pyproject.toml's exact pin before the range
OLD_PIN = "llama-cpp-python==0.3.36"


def cached_wheels() -> dict[str, Path]:
    """llama-cpp-python wheels in pip's cache (pip caches what it builds from an sdist),
    by version, those of the range only."""
    out = subprocess.run(
        [sys.executable, "-m", "pip", "cache", "list", "--format=abspath", "llama_cpp_python"],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    wheels: dict[str, Path] = {}
    for line in out.split():
        m = re.match(r"llama_cpp_python-([^-]+)-", Path(line).name)
        if m and line.endswith(".whl") and compat.known(m.group(1)):
            wheels.setdefault(m.group(1), Path(line))
    return wheels


def shmkv_requirements() -> list[str]:
    """What ``pip install 'shmkv[serve]'`` asks for (the serve extra only where this venv
    has it installed, so that the dry run can be satisfied without an index)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    serve = project["optional-dependencies"]["serve"]
    try:
        for req in serve:
            importlib.metadata.version(re.split(r"[\[<>=!~ ]", req)[0])
        reqs += serve
    except importlib.metadata.PackageNotFoundError:
        pass
    return reqs


def pip(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """This venv's pip, ignoring the machine's pip configuration (no index, no links)."""
    cmd = [sys.executable, "-m", "pip", "--isolated", "--disable-pip-version-check"]
    return subprocess.run(
        [*cmd, *map(str, args)], capture_output=True, text=True, timeout=300, check=False
    )


def would_install(venv: Path, links: Path, requirements: list[str]) -> tuple[int, list[str], str]:
    """(pip's exit status, "name==version" of each package it would install, its stderr)."""
    report = venv / "report.json"
    report.unlink(missing_ok=True)
    got = pip(
        "--python",
        venv / "bin" / "python",
        "install",
        "--dry-run",
        "--no-index",
        "--find-links",
        links,
        "--report",
        report,
        *requirements,
    )
    if got.returncode != 0:
        return got.returncode, [], got.stderr
    items = json.loads(report.read_text())["install"]
    return 0, [f"{i['metadata']['name']}=={i['metadata']['version']}" for i in items], got.stderr


def test_installing_shmkv_keeps_the_llama_cpp_python_installed(tmp_path):
    wheels = cached_wheels()
    if not wheels:
        pytest.skip("no llama-cpp-python wheel of the supported range in pip's cache")
    old = OLD_PIN.split("==")[1]
    # the oldest wheel not the old pin's version: the case the pin broke
    version = min(wheels, key=lambda v: (v == old, compat._release(v)))  # noqa: SLF001
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True, timeout=120)
    site = Path(
        subprocess.run(
            [
                venv / "bin" / "python",
                "-c",
                "import sysconfig; print(sysconfig.get_path('purelib'))",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    ours = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
    (site / "zz-shmkv-deps.pth").write_text("\n".join(sorted(ours)) + "\n")
    got = pip(
        "--python",
        venv / "bin" / "python",
        "install",
        "--no-deps",
        "--no-index",
        "--ignore-installed",
        wheels[version],
    )
    assert got.returncode == 0, got.stderr
    seen = subprocess.run(
        [
            venv / "bin" / "python",
            "-c",
            "import importlib.metadata as m; print(m.version('llama-cpp-python'))",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert seen == version  # (the venv's own, ahead of this venv's on sys.path)
    links = tmp_path / "links"  # every cached wheel: pip could "upgrade" to any of them
    links.mkdir()
    for wheel in wheels.values():
        (links / wheel.name).symlink_to(wheel)

    reqs = shmkv_requirements()
    rc, install, err = would_install(venv, links, reqs)
    assert rc == 0, err
    assert not [p for p in install if p.startswith("llama")], install
    assert install == [], install

    # the old exact pin (or, with only its wheel cached, a pin on the range's oldest)
    # replaces it
    other = old if version != old else compat.KNOWN_VERSIONS[0]
    pinned = [re.sub(r"^(llama-cpp-python(\[\w+\])?).*", rf"\1=={other}", r) for r in reqs]
    assert pinned != reqs and f"llama-cpp-python=={other}" in pinned
    rc, install, err = would_install(venv, links, pinned)
    replaced = any(p.startswith("llama") for p in install) or (
        rc != 0 and "llama-cpp-python" in err
    )
    assert replaced, (rc, install, err)
