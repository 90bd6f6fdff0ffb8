"""The wheels pip users install, beside the image: ``deploy/docker/build_wheels.sh``.

Two wheels: the compiled build for this machine's Python and platform, and the pure-Python one.
``pip install --find-links DIR detproxy`` must pick the compiled wheel here (the fast build,
its modules C extensions) and the pure one where the compiled wheel does not fit (another
Python version). Marked ``integration``: it compiles (tests/run.sh runs it).
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "deploy" / "docker" / "build_wheels.sh"

pytestmark = pytest.mark.integration


def run(argv: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        argv,
        cwd=ROOT.parent,  # not the checkout: its proxy/ would shadow the installed one
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    assert done.returncode == 0, f"{' '.join(argv)} failed: {done.stderr[-3000:]}"
    return done


def test_pip_installs_the_compiled_wheel_where_it_fits_and_the_pure_one_elsewhere(
    tmp_path: Path,
) -> None:
    dist = tmp_path / "dist"
    run(["bash", str(BUILD), str(dist)], PYTHON=sys.executable)
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    (compiled,) = dist.glob(f"detproxy-*-{tag}-{tag}-linux_*.whl")
    (pure,) = dist.glob("detproxy-*-py3-none-any.whl")
    assert any(n.endswith(".so") for n in zipfile.ZipFile(compiled).namelist()), compiled
    assert not any(n.endswith(".so") for n in zipfile.ZipFile(pure).namelist()), pure

    # Here: the compiled wheel, its hot path C extensions.
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(venv)])
    python = str(venv / "bin" / "python")
    run([python, "-m", "pip", "install", "-q", "--find-links", str(dist), "detproxy"])
    probe = (
        "import proxy.forward, proxy.relay.stream as s; print(proxy.forward.__file__, s.__file__)"
    )
    files = run([python, "-c", probe]).stdout.split()
    assert files and all(f.endswith(".so") for f in files), f"not the compiled build: {files}"

    # Another Python (3.13): the compiled wheel does not fit, the pure one does.
    other = tmp_path / "other"
    run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-index",
         "--find-links", str(dist), "--only-binary=:all:", "--python-version", "3.13",
         "-d", str(other), "detproxy"],
    )  # fmt: skip
    assert [p.name for p in other.iterdir()] == [pure.name]
