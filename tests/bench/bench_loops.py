"""Benchmark of the repetition-loop detector (proxy/loops/detector.py).

Run: ``.venv/bin/python tests/bench/bench_loops.py``. Prints figures only (no assertions):

- cost per streamed token (a 4-char delta) of ``LoopDetector.feed`` on normal text (each corpus
  file of tests/loops/corpus, concatenated to about 1 MB) and on looping text (from a fresh
  detector until it fires), next to two baselines measured in the same run: appending the
  deltas to a list, and a no-op ``feed`` method (the call overhead any per-token hook pays);
- the 99.9th percentile of single ``feed`` calls (those that run a check) on each text;
- the detection lag in chars after the loop's onset, for several periods, next to
  ``required_chars`` (the run the thresholds ask for);
- the peak number of chars the detector holds (window plus pending deltas);
- a whole answer fed at once (a non-streamed answer: ``LoopWatch.on_answer``), for answers of
  0.5, 4 and 16 KB of the corpus (all files, as above), a fresh detector each; with
  ``--baseline FILE`` (another ``detector.py``, e.g. from ``git show
  REV:proxy/loops/detector.py > /tmp/old.py``) both are timed interleaved in this process, so
  that the machine's drift hits both alike.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import string
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from proxy.loops.detector import DetectorConfig, LoopDetector  # noqa: E402

CORPUS = ROOT / "tests" / "loops" / "corpus"
TARGET_CHARS = 1_000_000
DELTA = 4
REPEAT = 3


class NoopFeed:
    __slots__ = ("total",)

    def __init__(self) -> None:
        self.total = 0

    def feed(self, delta: str) -> None:
        self.total += len(delta)


def deltas_of(text: str, size: int = DELTA) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


def inflate(text: str) -> str:
    """Repeat a document (with a numbered separator, so it is never a loop) up to ~1 MB."""
    parts: list[str] = []
    total = 0
    n = 0
    while total < TARGET_CHARS:
        n += 1
        part = f"\n\n--- part {n} ---\n\n{text}"
        parts.append(part)
        total += len(part)
    return "".join(parts)


def best_ns(run: Callable[[], None]) -> int:
    best = 0
    for i in range(REPEAT):
        t0 = time.perf_counter_ns()
        run()
        dt = time.perf_counter_ns() - t0
        best = dt if i == 0 else min(best, dt)
    return best


def bench_normal(name: str, text: str) -> None:
    deltas = deltas_of(inflate(text))
    n = len(deltas)

    def baseline_list() -> None:
        out: list[str] = []
        append = out.append
        for d in deltas:
            append(d)

    def baseline_noop() -> None:
        feed = NoopFeed().feed
        for d in deltas:
            feed(d)

    def detector() -> None:
        feed = LoopDetector().feed
        for d in deltas:
            if feed(d) is not None:
                raise SystemExit(f"unexpected loop in {name}")

    t_list = best_ns(baseline_list) / n / 1000
    t_noop = best_ns(baseline_noop) / n / 1000
    t_det = best_ns(detector) / n / 1000
    slowest, peak = slowest_call_and_peak(deltas)
    print(
        f"  {name:<22} {t_list:7.3f} {t_noop:7.3f} {t_det:7.3f} {t_det - t_noop:8.3f}"
        f" {slowest:9.1f} {peak:8d}"
    )


def slowest_call_and_peak(deltas: list[str]) -> tuple[float, int]:
    """The 99.9th percentile of single ``feed`` calls (checks), in us; and the peak chars held.

    A percentile rather than the maximum: on a shared machine the maximum is a preemption.
    """
    det = LoopDetector()
    times: list[int] = []
    peak = 0
    clock = time.perf_counter_ns
    for d in deltas:
        t0 = clock()
        det.feed(d)
        times.append(clock() - t0)
        peak = max(peak, det.buffered_chars)
    times.sort()
    return times[min(len(times) - 1, len(times) * 999 // 1000)] / 1000, peak


def make_unit(length: int, rng: random.Random) -> str:
    if length <= 8:
        return "".join(rng.sample(string.ascii_lowercase, length))
    words: list[str] = []
    size = 0
    while size < length:
        w = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 9)))
        words.append(w)
        size += len(w) + 1
    return (" ".join(words))[: length - 2] + ".\n"


def bench_loops(prose: str, periods: list[int]) -> None:
    config = DetectorConfig()
    every = config.check_every_chars
    print(
        f"  {'period':>6} {'need':>6} {'lag(check)':>10} {'lag(fed)':>9} {'repeats':>7}"
        f" {'us/token':>8} {'p99.9 us':>10} {'peak chars':>10}"
    )
    for period in periods:
        rng = random.Random(period)
        unit = make_unit(period, rng)
        need = config.required_chars(period)
        assert need is not None
        prefix = prose[:1500]
        text = prefix + unit * ((need + every) // period + 2)
        deltas = deltas_of(text)
        onset = len(prefix)

        def run(deltas: list[str] = deltas) -> None:
            feed = LoopDetector().feed
            for d in deltas:
                if feed(d) is not None:
                    return
            raise SystemExit("loop not detected")

        det = LoopDetector()
        rep = None
        fed = 0
        for d in deltas:
            fed += 1
            rep = det.feed(d)
            if rep is not None:
                break
        assert rep is not None and rep.period == period
        t = best_ns(run) / fed / 1000
        slowest, peak = slowest_call_and_peak(deltas[:fed])
        found_at = rep.start_offset + rep.covered_chars
        print(
            f"  {period:>6} {need:>6} {found_at - onset:>10} {rep.detected_at - onset:>9}"
            f" {rep.repeats:>7} {t:8.3f} {slowest:10.1f} {peak:>10}"
        )


def load_detector(path: Path) -> type[LoopDetector]:
    """``LoopDetector`` of another detector.py, imported under a module name of its own."""
    spec = importlib.util.spec_from_file_location("baseline_detector", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    detector: type[LoopDetector] = module.LoopDetector
    return detector


def bench_whole(prose: str, baseline: type[LoopDetector] | None, rounds: int = 40) -> None:
    """A whole answer in one ``feed``: median and best over interleaved rounds, us per answer."""
    kinds: list[tuple[str, type[LoopDetector]]] = [("this", LoopDetector)]
    if baseline is not None:
        kinds.append(("baseline", baseline))
    for size in (512, 4096, 16384):
        answer = prose[:size]
        n = max(20, 200_000 // size)
        times: dict[str, list[float]] = {name: [] for name, _ in kinds}
        for _ in range(rounds):
            for name, detector in kinds:
                start = time.perf_counter()
                for _ in range(n):
                    detector().feed(answer)
                times[name].append((time.perf_counter() - start) / n * 1e6)
        cells = []
        for name, _ in kinds:
            got = sorted(times[name])
            cells.append(f"{name} {got[len(got) // 2]:8.2f} (best {got[0]:.2f})")
        ratio = ""
        if baseline is not None:
            mid = rounds // 2
            gain = sorted(times["baseline"])[mid] / sorted(times["this"])[mid]
            ratio = f"  baseline/this {gain:.2f}x"
        print(f"  {len(answer):>6} chars: " + "; ".join(cells) + ratio)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", type=Path, help="another detector.py to time against")
    args = ap.parse_args()
    baseline = load_detector(args.baseline) if args.baseline else None
    config = DetectorConfig()
    print(f"DetectorConfig defaults: {config}")
    print(f"python {sys.version.split()[0]}; deltas of {DELTA} chars; best of {REPEAT} runs")
    print()
    print("Normal text, ~1 MB each (us per 4-char delta; 'extra' = detector minus no-op feed)")
    print(
        f"  {'text':<22} {'list':>7} {'noop':>7} {'detect':>7} {'extra':>8}"
        f" {'p99.9 us':>9} {'peak':>8}"
    )
    files = sorted(p for p in CORPUS.iterdir() if p.is_file())
    for path in files:
        bench_normal(path.name, path.read_text(encoding="utf-8"))
    everything = "\n\n".join(p.read_text(encoding="utf-8") for p in files)
    bench_normal("all files, mixed", everything)
    print()
    print("Looping text: prose prefix, then a unit repeated; a fresh detector fed until it fires")
    print("  lag(check) = offset of the check that fired - onset; lag(fed) = chars fed - onset")
    prose = (CORPUS / "prose.txt").read_text(encoding="utf-8")
    bench_loops(prose, [4, 8, 14, 50, 180, 400, 1000, 2000, 4096])
    print()
    print(
        "A whole answer fed at once (a non-streamed answer), a fresh detector each: us per answer,"
    )
    print("median (best) of 40 interleaved rounds")
    bench_whole(everything, baseline)


if __name__ == "__main__":
    main()
