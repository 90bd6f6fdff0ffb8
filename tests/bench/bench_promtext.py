"""Benchmark: reading the upstream's /metrics (proxy/engine/promtext.py) against prometheus_client's
parser (``prometheus_client.parser.text_string_to_metric_families``).

Run: ``.venv/bin/python tests/bench/bench_promtext.py``. Prints figures only (no assertions):
per text, the p50 and p99 time of one read of the running gauge (``UpstreamLoad``'s, every
``quiet_poll_s`` while a shadow waits for a quiet upstream) and of the fingerprint's counters,
by ``proxy.engine.promtext`` and by prometheus_client (the same sums, checked equal), and the ratio.

The texts: the emulator's ``/metrics`` (a few vLLM series), and the same with the histograms
a vLLM server exports (names and bucket bounds as vLLM 0.1x has them, two models) and the
process and Python collector series: about the size of a real vLLM /metrics.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from proxy.engine.fingerprint import _WANTED, parse_metrics  # noqa: E402
from proxy.engine.load import RUNNING, parse_running  # noqa: E402
from proxy.tools.emulator.config import EmulatorConfig  # noqa: E402
from proxy.tools.emulator.injections import EmulatorState  # noqa: E402
from proxy.tools.emulator.metrics import render_metrics  # noqa: E402

ROUNDS = 300

_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
            7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
_TOKENS = tuple(float(2**k) for k in range(16))
_HISTOGRAMS = {
    "vllm:time_to_first_token_seconds": _LATENCY,
    "vllm:inter_token_latency_seconds": _LATENCY,
    "vllm:e2e_request_latency_seconds": _LATENCY,
    "vllm:request_queue_time_seconds": _LATENCY,
    "vllm:request_inference_time_seconds": _LATENCY,
    "vllm:request_prefill_time_seconds": _LATENCY,
    "vllm:request_decode_time_seconds": _LATENCY,
    "vllm:request_prompt_tokens": _TOKENS,
    "vllm:request_generation_tokens": _TOKENS,
    "vllm:iteration_tokens_total": _TOKENS,
    "vllm:request_max_num_generation_tokens": _TOKENS,
    "vllm:request_params_max_tokens": _TOKENS,
    "vllm:request_params_n": (1.0, 2.0, 5.0, 10.0, 20.0),
}


def vllm_like(models: tuple[str, ...]) -> str:
    cfg = EmulatorConfig(models=models, speculative=True)
    state = EmulatorState(seed=0)
    lines = [render_metrics(cfg, state).rstrip("\n")]
    for name, bounds in _HISTOGRAMS.items():
        lines += [f"# HELP {name} Histogram of {name}.", f"# TYPE {name} histogram"]
        for model in models:
            labels = f'engine="0",model_name="{model}"'
            count = 0
            for le in (*bounds, "+Inf"):
                count += 3
                lines.append(f'{name}_bucket{{{labels},le="{le}"}} {float(count)}')
            lines.append(f"{name}_count{{{labels}}} {float(count)}")
            lines.append(f"{name}_sum{{{labels}}} {count * 0.37}")
            lines.append(f"{name}_created{{{labels}}} 1.7e+09")
    for gen in range(3):
        lines += [
            f'python_gc_objects_collected_total{{generation="{gen}"}} {1000.0 * gen}',
            f'python_gc_collections_total{{generation="{gen}"}} {10.0 * gen}',
        ]
    for name in ("process_virtual_memory_bytes", "process_resident_memory_bytes",
                 "process_start_time_seconds", "process_cpu_seconds_total",
                 "process_open_fds", "process_max_fds"):  # fmt: skip
        lines += [f"# TYPE {name} gauge", f"{name} 1.0e+09"]
    return "\n".join(lines) + "\n"


def client_sums(text: str, names: frozenset[str]) -> dict[str, float]:
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in names:
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    times = []
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return statistics.median(times), times[int(len(times) * 0.99)]


def main() -> None:
    texts = {
        "emulator": render_metrics(EmulatorConfig(), EmulatorState(seed=0)),
        "vllm-like, 2 models": vllm_like(("qwen3-8b", "qwen3-8b-lora")),
    }
    running, counters = frozenset(RUNNING), frozenset(_WANTED)
    for label, text in texts.items():
        print(f"{label}: {len(text.splitlines())} lines, {len(text)} chars")
        ours = parse_metrics(text)
        theirs = client_sums(text, counters)
        assert {_WANTED[n]: v for n, v in theirs.items()} == {
            k: v for k, v in ours.items() if k in _WANTED.values()
        }, (ours, theirs)
        assert parse_running(text) == sum(client_sums(text, running).values())
        for what, mine, other in (
            ("running gauge", lambda t=text: parse_running(t),
             lambda t=text: client_sums(t, running)),
            ("fingerprint counters", lambda t=text: parse_metrics(t),
             lambda t=text: client_sums(t, counters)),
        ):  # fmt: skip
            p50, p99 = timed(mine)
            c50, c99 = timed(other)
            print(
                f"  {what:22s} promtext p50 {p50 * 1e6:8.1f} us  p99 {p99 * 1e6:8.1f} us | "
                f"prometheus_client p50 {c50 * 1e6:8.1f} us  p99 {c99 * 1e6:8.1f} us | "
                f"ratio p50 {c50 / p50:5.1f}x"
            )


if __name__ == "__main__":
    main()
