"""Collector pauses: detproxy's latency at concurrency 1, non-streamed, by collector setting.

Run: ``.venv/bin/python tests/bench/bench_gc.py [--duration 5] [--rounds 3]``. Needs ``nginx``
and ``wrk``. Prints figures only.

nginx serves bench_proxy.py's ~1 KB chat completion (the upstream, ``direct``); detproxy runs
with its defaults (loop inspection on, passive checks on, audit off) in front of it, once per
collector setting (``[server] gc_freeze`` and ``gc_threshold``):

- ``python``: no freeze, Python's thresholds (700, 10, 10): detproxy before issue 16;
- ``freeze``: start-up's objects frozen (``gc.freeze()`` once serving), Python's thresholds;
- ``thresh-N``: no freeze, thresholds (N, 50, 100);
- ``default``: detproxy's defaults (freeze, and the default thresholds);
- ``freeze-N``: freeze and thresholds (N, 50, 100).

wrk ``-c 1`` against each, ``--rounds`` rounds in a rotated order; per target the median over
the rounds of p50, p90 and p99 (wrk's ``--latency``), and p99 minus direct's p99.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_proxy import (
    HOST,
    NGINX_STATIC,
    PATH,
    Bench,
    Target,
    _ms,
    free_port,
    machine,
    make_json_answer,
    request_body,
    wait_port,
    wrk_script,
)

from proxy.config import ServerConfig

PYTHON_DEFAULT = (700, 10, 10)

# ``detproxy serve`` as LAUNCHER runs it, with every collection timed (gc.callbacks) and the
# list written at exit: (wall-clock start, generation, CPU seconds). CPU time of the thread, not
# wall time: on a loaded machine a collection can be descheduled for tens of ms.
TIMED_LAUNCHER = """\
import atexit, gc, json, sys, time
from proxy.cli import main
out, began = [], [0.0, 0.0]
def timed(phase, info):
    if phase == "start":
        began[:] = [time.time(), time.thread_time()]
    else:
        out.append((began[0], info["generation"], time.thread_time() - began[1]))
gc.callbacks.append(timed)
atexit.register(lambda: open(sys.argv[1], "w").write(json.dumps(out)))
sys.exit(main(sys.argv[2:]))
"""


def variants(sizes: list[int]) -> dict[str, tuple[bool, tuple[int, int, int] | None]]:
    """name -> (gc_freeze, gc_threshold); None: detproxy's defaults, not written."""
    out: dict[str, tuple[bool, tuple[int, int, int] | None]] = {
        "python": (False, PYTHON_DEFAULT),
        "freeze": (True, PYTHON_DEFAULT),
    }
    for n in sizes:
        out[f"thresh-{n}"] = (False, (n, 50, 100))
    out["default"] = (True, None)
    for n in sizes:
        if (n, 50, 100) != ServerConfig().gc_threshold:
            out[f"freeze-{n}"] = (True, (n, 50, 100))
    return out


Sample = tuple[float, float, float, float, int, float, float]  # rps, p50, p90, p99, n, t0, t1


def run(bench: Bench, target: Target, seconds: float) -> Sample:
    t0 = time.time()
    argv = ["wrk", "-t", "1", "-c", "1", "-d", f"{seconds:g}s", "--latency"]
    argv += ["-s", str(bench.tmp / "json.lua"), f"http://{HOST}:{target.port}{PATH}"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 30).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    p = [_ms(re.search(rf"^\s+{q}%\s+(\S+)", out, re.M).group(1)) for q in (50, 90, 99)]  # type: ignore[union-attr]
    n = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    return rps, p[0], p[1], p[2], n, t0, time.time()


def collections(path: Path, windows: list[tuple[float, float]]) -> list[tuple[int, float]]:
    """(generation, seconds) of the collections TIMED_LAUNCHER recorded that began in one of
    the ``windows`` (wall-clock start, end)."""
    if not path.exists():
        return []
    timed = json.loads(path.read_text())
    return [(g, d) for t, g, d in timed if any(a <= t <= b for a, b in windows)]


def pauses(path: Path, samples: list[Sample]) -> str:
    """The collections that ran during the measured runs: per 1000 requests by generation, the
    longest, and collector time per request."""
    if not path.exists():
        return "(no timings)"
    inside = collections(path, [(s[5], s[6]) for s in samples])
    n = sum(s[4] for s in samples)
    per_gen = [sum(1 for g, _ in inside if g == gen) * 1000 / n for gen in range(3)]
    longest = max((d for _, d in inside), default=0.0)
    total = sum(d for _, d in inside)
    return (
        f"{per_gen[0]:6.1f} {per_gen[1]:5.2f} {per_gen[2]:5.2f} {longest * 1e3:7.2f}"
        f" {total / n * 1e6:8.1f}"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=5.0, help="seconds per wrk run")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    ap.add_argument("--sizes", default="10000,50000", help="gen-0 thresholds to try")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    tmp = Path(tempfile.mkdtemp(prefix="detproxy-gc-"))
    tmp.chmod(0o755)
    bench = Bench(tmp)
    samples: dict[str, list[Sample]] = {}
    print("\n".join(machine()))
    print(
        f"detproxy's defaults: gc_freeze {ServerConfig().gc_freeze}, gc_threshold"
        f" {ServerConfig().gc_threshold}"
    )
    try:
        (tmp / "www").mkdir()
        (tmp / "tmp").mkdir()
        (tmp / "www" / "chat.json").write_bytes(make_json_answer())
        (tmp / "www" / "chat.sse").write_bytes(b"")
        (tmp / "www" / "chat-sse.json").write_bytes(b"")
        (tmp / "json.lua").write_text(wrk_script(request_body(False)))
        up, shadow = free_port(), free_port()
        body = NGINX_STATIC.format(host=HOST, port=up, shadow_port=shadow, dir=tmp, path=PATH)
        bench.nginx("static", body, up)
        bench.targets.append(Target("direct", up, "nginx static file (the upstream)"))
        for name, (freeze, threshold) in variants(sizes).items():
            port = free_port()
            conf = f"[server]\ngc_freeze = {str(freeze).lower()}\n"
            if threshold is not None:
                conf += f"gc_threshold = {list(threshold)}\n"
            (tmp / f"{name}.toml").write_text(conf)
            argv = [sys.executable, "-c", TIMED_LAUNCHER, str(tmp / f"{name}.gc.json")]
            argv += ["serve", "--config", str(tmp / f"{name}.toml")]
            argv += ["--upstream", f"http://{HOST}:{up}", "--port", str(port)]
            argv += ["--log-level", "WARNING"]
            argv += ["--workers", "1"]  # the timed collections are this process's alone
            proc = bench.spawn(argv, f"{name}.log")
            wait_port(port, proc, f"detproxy ({name})")
            bench.targets.append(Target(name, port, conf.replace("\n", " ").strip(), proc))
        for t in bench.targets:
            run(bench, t, 1)  # warm-up
        order = bench.targets
        for r in range(args.rounds):
            k = r % len(order)
            for t in order[k:] + order[:k]:
                samples.setdefault(t.name, []).append(run(bench, t, args.duration))
        print(f"\nwrk -c 1, non-streamed, {args.rounds} rounds of {args.duration:g}s; ms, medians")
        print(
            f"{'target':14} {'req/s':>7} {'p50':>6} {'p90':>6} {'p99':>6} {'+p99':>6}"
            "  p99 per round"
        )
        d99 = statistics.median(s[3] for s in samples["direct"])
        for t in bench.targets:
            s = samples[t.name]
            med = [statistics.median(x[i] for x in s) for i in range(4)]
            rounds = " ".join(f"{x[3]:.2f}" for x in s)
            print(
                f"{t.name:14} {med[0]:7.0f} {med[1]:6.2f} {med[2]:6.2f} {med[3]:6.2f}"
                f" {med[3] - d99:+6.2f}  {rounds}"
            )
        print(f"load    : {' '.join(Path('/proc/loadavg').read_text().split()[:3])}")
    finally:
        bench.stop()
        if bench.targets:
            print("\ncollections during the measured runs (TIMED_LAUNCHER): per 1000 requests by")
            print("generation, the longest (CPU ms), collector CPU time per request (us)")
            print(f"{'target':14} {'gen0':>6} {'gen1':>5} {'gen2':>5} {'longest':>7} {'us/req':>8}")
            for t in bench.targets[1:]:
                print(f"{t.name:14} {pauses(tmp / f'{t.name}.gc.json', samples.get(t.name, []))}")
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
