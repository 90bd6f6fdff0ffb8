"""A copy of this checkout whose hot path is compiled by mypyc, as the compiled build makes it.

Run: ``.venv/bin/python tests/compiled_tree.py DIR`` (about a minute and a half on 2
cores; needs gcc, and mypy and setuptools >= 77 in the venv, which ``tests/run.sh`` installs).

``DETPROXY_COMPILE=1 pip install .`` compiles the modules that pyproject.toml's
``[tool.detproxy] compiled`` lists (setup.py). This tool copies the checkout to DIR and runs
the same build there in place (``setup.py build_ext --inplace``: each module's ``.so`` beside
its source, which Python imports first), so that the compiled code can be tested and measured
beside the source:

- tests: ``cd DIR && CHECKOUT/.venv/bin/python -m pytest`` (``tests/run.sh`` does);
- in memory: ``DIR/tests/bench/bench_wire.py --baseline CHECKOUT`` ("this" is the compiled
  copy, "baseline" the source; the ratios are source over compiled), and
  ``tests/bench/bench_instructions.py --tree DIR``;
- live: ``tests/bench/bench_paced.py --baseline DIR`` and ``tests/bench/bench_proxy.py
  --baseline DIR`` (each ``NAME@base`` target runs the compiled copy).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COPIED = ("proxy", "policies", "tests", "deploy", "docs", "README.md", "pyproject.toml", "setup.py")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dest", type=Path, help="where the compiled copy goes (created or replaced)")
    args = ap.parse_args()
    dest: Path = args.dest.resolve()
    if dest == ROOT or ROOT in dest.parents:
        print("DIR must be outside this checkout", file=sys.stderr)
        return 2
    if shutil.which("gcc") is None and shutil.which("cc") is None:
        print("no C compiler (gcc) on PATH", file=sys.stderr)
        return 2
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.so", ".hypothesis", "results")
    for name in COPIED:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, dest / name, ignore=ignore)
        else:
            shutil.copy2(source, dest / name)
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "setup.py", "--quiet", "build_ext", "--inplace"],
        cwd=dest,
        env={**os.environ, "DETPROXY_COMPILE": "1"},
        capture_output=True,
        text=True,
        check=False,
    )
    shutil.rmtree(dest / "build", ignore_errors=True)  # the C sources and objects
    if done.returncode != 0:
        print(done.stdout[-4000:], done.stderr[-4000:], sep="\n", file=sys.stderr)
        return 1
    built = sorted(path.relative_to(dest) for path in dest.glob("**/*.so"))
    print(f"compiled {len(built)} extensions in {time.monotonic() - started:.0f}s into {dest}:")
    for path in built:
        print(f"  {path}")
    python = sys.executable
    print("\ncompare, in the same interleaved rounds:")
    print(f"  in memory: {python} {dest}/tests/bench/bench_wire.py --baseline {ROOT}")
    print("             (this: compiled; baseline: this checkout's source)")
    print(f"             {python} {ROOT}/tests/bench/bench_instructions.py --tree {dest}")
    print(f"  live:      {python} {ROOT}/tests/bench/bench_paced.py --baseline {dest}")
    print(f"             {python} {ROOT}/tests/bench/bench_proxy.py --baseline {dest}")
    print("             (NAME@base: compiled)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
