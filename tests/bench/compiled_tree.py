"""A copy of this checkout with detproxy's hot modules compiled by mypyc, for the benchmarks.

Run: ``.venv/bin/python tests/bench/compiled_tree.py DIR [--modules M,M,...]``
(about a minute on 2 cores; needs a C compiler and mypy, both in the test environment).

Why: detproxy's cost per token and per request is mostly the interpreter's (``perf``: half
of the proxy's samples in ``libpython``; ``bench_wire.py``: a non-streamed request is some
500,000 instructions of Python). mypyc compiles typed Python modules to C extensions; the code
is already mypy-strict. This tool measures what that buys before the build ships it: it copies
``proxy/``, ``policies/`` and ``tests/`` to DIR, compiles ``--modules`` there in place (their
``.so`` files sit beside the sources, and Python imports them first), and prints the commands
that compare the two trees in the same interleaved rounds:

- in memory: ``DIR/tests/bench/bench_wire.py --baseline CHECKOUT`` ("this" is the compiled
  copy, "baseline" this checkout's source; the ratios are source over compiled);
- live: ``tests/bench/bench_paced.py --baseline DIR`` (each ``NAME@base`` target runs the
  compiled copy) and ``tests/bench/bench_proxy.py --baseline DIR``.

Not every module compiles as it is: mypyc has no async generators (``proxy.http.front``'s
``body_chunks``, ``proxy.http.h1``'s ``chunks``, and others), and a dataclass whose annotations
name types imported only for type checking fails at import (``proxy.exchange``,
``proxy.attempts``, ``proxy.events``). The default list leaves those out. Test helpers that
subclass or patch a compiled class (``tests.helpers.GeneralRelay``) do not work on the copy.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# The request and token path, less what mypyc cannot compile yet (see the docstring).
HOT_MODULES = (
    "proxy/answer.py",
    "proxy/classify.py",
    "proxy/forward.py",
    "proxy/streaming.py",
    "proxy/http/coalesce.py",
    "proxy/http/h1conn.py",
    "proxy/http/headers.py",
    "proxy/http/sse.py",
    "proxy/loops/detector.py",
    "proxy/loops/watch.py",
    "proxy/relay/inspectors.py",
    "proxy/relay/raw.py",
    "proxy/relay/result.py",
    "proxy/relay/simple.py",
    "proxy/relay/stream.py",
    "proxy/relay/template.py",
)
# pyproject.toml's [tool.mypy], as an ini file: mypyc's build reads the options from there.
MYPY_INI = """[mypy]
python_version = 3.11
strict = True
plugins = pydantic.mypy

[mypy-xxhash.*]
ignore_missing_imports = True
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dest", type=Path, help="where the compiled copy goes (created or replaced)")
    ap.add_argument(
        "--modules",
        default=",".join(HOT_MODULES),
        help="comma-separated paths of the modules to compile (default: the hot path)",
    )
    args = ap.parse_args()
    dest: Path = args.dest.resolve()
    if dest == ROOT or ROOT in dest.parents:
        print("DIR must be outside this checkout", file=sys.stderr)
        return 2
    modules = [m for m in args.modules.split(",") if m]
    if shutil.which("gcc") is None and shutil.which("cc") is None:
        print("no C compiler (gcc) on PATH", file=sys.stderr)
        return 2
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.so", ".hypothesis", "results")
    for part in ("proxy", "policies", "tests"):
        shutil.copytree(ROOT / part, dest / part, ignore=ignore)
    (dest / "mypy.ini").write_text(MYPY_INI)
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "mypyc", "--config-file", "mypy.ini", *modules],
        cwd=dest,
        capture_output=True,
        text=True,
        check=False,
    )
    shutil.rmtree(dest / "build", ignore_errors=True)  # the C sources and objects
    if done.returncode != 0:
        print(done.stdout[-4000:], done.stderr[-4000:], sep="\n", file=sys.stderr)
        return 1
    built = sorted(dest.glob("**/*.so"))
    print(f"compiled {len(modules)} modules in {time.monotonic() - started:.0f}s into {dest}:")
    for path in built:
        print(f"  {path.relative_to(dest)}")
    python = sys.executable
    print("\ncompare, in the same interleaved rounds:")
    print(f"  in memory: {python} {dest}/tests/bench/bench_wire.py --baseline {ROOT}")
    print("             (this: compiled; baseline: this checkout's source)")
    print(f"  live:      {python} {ROOT}/tests/bench/bench_paced.py --baseline {dest}")
    print(f"             {python} {ROOT}/tests/bench/bench_proxy.py --baseline {dest}")
    print("             (NAME@base: compiled)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
