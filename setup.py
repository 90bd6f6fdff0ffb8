"""detproxy's build: pure Python by default, or its hot path compiled by mypyc.

``DETPROXY_COMPILE=1 pip install .`` compiles the modules that ``[tool.detproxy] compiled``
lists in pyproject.toml into C extensions (mypyc, with gcc; the build environment fetches mypy
and detproxy's dependencies for the type analysis). README.md's "Performance" says what it buys.
An editable install (``-e``) refuses to compile: the compiled modules would sit beside the
sources and shadow every later edit of them.
"""

from __future__ import annotations

import os
import sys
import tomllib
from pathlib import Path
from typing import Any

from setuptools import setup

HERE = Path(__file__).resolve().parent


def _pyproject() -> dict[str, Any]:
    return tomllib.loads((HERE / "pyproject.toml").read_text())


def _compiled() -> dict[str, Any]:
    """What ``setup`` needs to compile: the build requirements, then the extensions."""
    if os.environ.get("DETPROXY_COMPILE", "") != "1":
        return {}
    if "editable_wheel" in sys.argv:
        raise SystemExit(
            "DETPROXY_COMPILE=1 builds a wheel: use 'pip install .', not 'pip install -e .'"
        )
    project = _pyproject()
    needs = ["mypy>=1.10", *project["project"]["dependencies"]]
    try:
        from mypyc.build import mypycify
    except ImportError:  # asked for the build requirements: they come first
        return {"setup_requires": needs}
    modules = project["tool"]["detproxy"]["compiled"]
    return {"setup_requires": needs, "ext_modules": mypycify(modules, opt_level="3")}


setup(**_compiled())
