"""The compiled build as a user installs it: ``DETPROXY_COMPILE=1 pip wheel .`` (mypyc, in
pip's isolated build environment), the wheel in a fresh virtualenv, its console script run.

The unit tests run on the same compiled modules (``tests/run.sh``, ``tests/compiled_tree.py``);
this checks the packaging: that the wheel carries the extensions, that they import from
site-packages, and that a refused editable build says why.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration


def _run(argv: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv,
        cwd=cwd,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )


def docker_context(into: Path) -> Path:
    """A copy of what the image's build stage is sent: the entries Dockerfile.dockerignore
    lets through (tests/deploy/test_docker.py checks that they are what it copies)."""
    ignore = ROOT / "deploy" / "docker" / "Dockerfile.dockerignore"
    for line in ignore.read_text(encoding="utf-8").splitlines():
        if line.startswith("!"):
            name = line[1:].rstrip("/")
            source = ROOT / name
            if source.is_dir():
                shutil.copytree(source, into / name, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                into.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, into / name)
    return into


def test_the_compiled_wheel_installs_and_serves_the_demo(tmp_path: Path) -> None:
    # Built from the files the Docker image is built from, as its build stage builds it.
    context = docker_context(tmp_path / "context")
    built = _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "-w",
            str(tmp_path),
            str(context),
        ],
        tmp_path,
        DETPROXY_COMPILE="1",
    )
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = tmp_path.glob("detproxy-*.whl")
    assert "linux" in wheel.name  # a platform wheel: it carries compiled code

    venv = tmp_path / "venv"
    assert _run([sys.executable, "-m", "venv", str(venv)], tmp_path).returncode == 0
    python = venv / "bin" / "python"
    installed = _run([str(python), "-m", "pip", "install", "-q", str(wheel)], tmp_path)
    assert installed.returncode == 0, installed.stderr[-3000:]

    # Every module the build lists is an extension in the installed package.
    listed = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["detproxy"]["compiled"]
    names = [m.removesuffix(".py").replace("/", ".") for m in listed]
    probe = (
        "import importlib, sys\n"
        "for name in sys.argv[1:]: print(importlib.import_module(name).__file__)"
    )
    files = _run([str(python), "-c", probe, *names], tmp_path)
    assert files.returncode == 0, files.stderr[-3000:]
    paths = files.stdout.split()
    assert len(paths) == len(names) and all(p.endswith(".so") for p in paths), paths

    demo = _run([str(venv / "bin" / "detproxy"), "demo"], tmp_path)
    assert demo.returncode == 0, demo.stdout[-2000:] + demo.stderr[-2000:]
    assert "\nAudits: " in demo.stdout and "\nLoops: " in demo.stdout, demo.stdout[-2000:]


def test_an_editable_compiled_build_is_refused_with_the_reason(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    assert _run([sys.executable, "-m", "venv", str(venv)], tmp_path).returncode == 0
    refused = _run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--no-deps", "-e", str(ROOT)],
        tmp_path,
        DETPROXY_COMPILE="1",
    )
    assert refused.returncode != 0
    assert "use 'pip install .', not 'pip install -e .'" in refused.stdout + refused.stderr
    assert not list(ROOT.glob("proxy/**/*.so"))  # nothing compiled beside the sources
