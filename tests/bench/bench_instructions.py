"""Instructions per request on detproxy's whole Python path, counted by valgrind: no noise.

Run: ``.venv/bin/python tests/bench/bench_instructions.py [--configs "defaults,raw relay"]
[--kinds "json,64 tokens"] [--tree DIR]`` (about a minute per cell on 2 cores; needs
``valgrind``, Debian's package). Prints figures only.

Why: this machine's speed drifts by 1.5x within minutes, and timed comparisons need
interleaved rounds (``bench_wire.py --baseline``) and still move by a tenth. Callgrind counts
the instructions a process executes, the same count on every run of the same code and
inputs whatever else the machine does. Each cell runs ``bench_wire.py``'s setup (the front,
the real upstream pool over in-memory transports, ``--streams`` clients at once) under
callgrind twice, with ``--small`` and with ``--large`` requests after the same warm-up, and
prints the difference over the difference in requests: instructions per request, start-up
and warm-up cancelled out. Instructions are not time (cache misses and the kernel are not in
them), but fewer of them for the same work is less work.

``--tree DIR`` counts another checkout (or ``tests/compiled_tree.py``'s compiled copy)
instead of this one; run it for both and compare.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# kind: (tokens, streamed, every event in one read: a whole answer read at once, as from a
# server that wrote it whole)
KINDS = {
    "json": (1, False, False),
    "1 token": (1, True, False),
    "64 tokens": (64, True, False),
    "200 whole": (200, True, True),
}


async def child(tree_root: Path, config: str, kind: str, n: int, streams: int) -> None:
    """What runs under callgrind: a warm-up, then ``n`` requests."""
    sys.path[:0] = [str(tree_root / "tests" / "bench"), str(tree_root)]
    import bench_wire

    tokens, stream, whole = KINDS[kind]
    tree = bench_wire.load_tree(None)
    setup = bench_wire.Setup(tree, bench_wire.CONFIGS[config], tokens, streams)
    if whole:  # on the engine of any tree's bench_wire: its frames, fed in one read
        engine = setup.engine

        def at_once(loop: asyncio.AbstractEventLoop, conn: object, at: int) -> None:
            loop.call_soon(conn.data_received, b"".join(engine.frames[at:]))  # type: ignore[attr-defined]

        engine._paced = at_once
    await setup.start()
    server = tree.load_settings(env={}, flags={"upstream": "http://x:1"}).server
    tree.settle(server.gc_freeze, server.gc_threshold)  # as ``serve`` does
    for count in (300, n):  # the same warm-up in every run: only ``n`` differs
        batch = bench_wire.requests(count, stream)
        for at in range(0, count, streams):
            chunk = zip(setup.clients, batch[at : at + streams], strict=False)
            await asyncio.gather(*(client.ask(request) for client, request in chunk))
    await setup.stop()


def count(tree_root: Path, config: str, kind: str, n: int, streams: int, out: Path) -> int:
    """Instructions of one child run."""
    profile = out / f"callgrind.{n}"
    argv = [
        "valgrind",
        "--tool=callgrind",
        f"--callgrind-out-file={profile}",
        sys.executable,
        __file__,
        "--child",
        "--tree",
        str(tree_root),
        "--configs",
        config,
        "--kinds",
        kind,
        "--small",
        str(n),
        "--streams",
        str(streams),
    ]
    # One hash seed: the same dict and set orders, hence the same instructions, on every run.
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    done = subprocess.run(argv, capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"callgrind run failed:\n{done.stderr[-3000:]}")
    for line in profile.read_text().splitlines():
        if line.startswith(("totals:", "summary:")):
            return int(line.split()[1])
    raise RuntimeError(f"no totals in {profile}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="defaults,raw relay", help="bench_wire's configurations")
    ap.add_argument("--kinds", default="json,64 tokens", help=f"of {', '.join(KINDS)}")
    ap.add_argument("--tree", type=Path, default=ROOT, help="the checkout to count (default: this)")
    ap.add_argument("--small", type=int, default=200, help="requests in the first run")
    ap.add_argument("--large", type=int, default=1200, help="requests in the second run")
    ap.add_argument("--streams", type=int, default=100, help="requests at once")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    configs = [c for c in args.configs.split(",") if c]
    kinds = [k for k in args.kinds.split(",") if k]
    tree_root = args.tree.resolve()
    if args.child:
        import uvloop

        uvloop.run(child(tree_root, configs[0], kinds[0], args.small, args.streams))
        return 0
    if shutil.which("valgrind") is None:
        print("valgrind not found on PATH: apt-get install -y valgrind", file=sys.stderr)
        return 2
    print(f"{tree_root}: instructions per request ({args.large} - {args.small} requests,")
    print(f"{args.streams} at once, after the same warm-up)")
    for config in configs:
        for kind in kinds:
            with tempfile.TemporaryDirectory(prefix="detproxy-instr-") as out:
                small, large = (
                    count(tree_root, config, kind, n, args.streams, Path(out))
                    for n in (args.small, args.large)
                )
            per = (large - small) / (args.large - args.small)
            print(f"  {config:<12}{kind:<11}{per:>12,.0f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
