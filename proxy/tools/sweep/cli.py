"""``detproxy sweep``: measure an upstream under bounded load at several concurrency levels."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any, TextIO

import orjson

from proxy.tools.sweep.chart import write_chart
from proxy.tools.sweep.load import DEFAULT_PROMPTS, Clock, Target, Window
from proxy.tools.sweep.render import to_markdown, to_text
from proxy.tools.sweep.run import SweepConfig, SweepError, normalise_base, run_sweep

EPILOG = """\
Each repeat runs every level in turn (repeat 1: 1,2,4..., repeat 2: 1,2,4...), each for
--duration seconds with that many streaming requests always in flight. At the deadline the
requests still running are cut (cancelled, counted as "cut"); tokens before it count.
tok/s = output tokens within the window / window. TTFT and ITL (the gap between streamed
chunks) are pooled over the repeats. spread = (max - min) / mean of tok/s across repeats.

The upstream fingerprint (/version, /v1/models, /props, /metrics) is read before the sweep
and after every level; a change (a redeploy, a silent fallback) is reported. So is the
recipe, what the engine says it loaded (vLLM's /server_info in dev mode and
vllm:cache_config_info, SGLang's /server_info, llama.cpp's /props, and with --engine-log its
start-up log): its digest beside each run, its facts before and after.

exit status:
  0  measured, nothing to warn about
  1  the upstream fingerprint changed during the sweep, a level's spread exceeded
     --spread-warn, requests failed, or a level got no tokens at all
  2  usage error, or the upstream could not be reached or refused the test request
"""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _levels(text: str) -> list[int]:
    levels = [_positive_int(part.strip()) for part in text.split(",") if part.strip()]
    if not levels:
        raise argparse.ArgumentTypeError("expected levels like 1,2,4,8")
    return sorted(set(levels))


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="detproxy sweep",
        description="Sustained output tokens/s, TTFT and inter-token latency per concurrency"
        " level,\nrepeated to show the spread, with the upstream fingerprint read before and"
        " after.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--upstream", required=True, metavar="URL", help="e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=True, metavar="M", help="model name sent in each request")
    p.add_argument(
        "--concurrency",
        type=_levels,
        default=[1, 2, 4, 8, 16],
        metavar="LIST",
        help="levels, comma separated (default 1,2,4,8,16)",
    )
    p.add_argument(
        "--duration",
        type=_positive_float,
        default=10.0,
        metavar="S",
        help="seconds per level and repeat (default 10)",
    )
    p.add_argument(
        "--repeats",
        type=_positive_int,
        default=3,
        metavar="R",
        help="times the whole list of levels is run (default 3)",
    )
    p.add_argument(
        "--max-tokens",
        type=_positive_int,
        default=128,
        metavar="N",
        help="max_tokens of each request (default 128)",
    )
    p.add_argument(
        "--timeout",
        type=_positive_float,
        default=120.0,
        metavar="S",
        help="limit for one request (default 120)",
    )
    p.add_argument(
        "--spread-warn",
        type=float,
        default=0.10,
        metavar="F",
        help="warn when (max - min) / mean of tok/s across repeats exceeds this (default 0.10)",
    )
    p.add_argument(
        "--extra-body",
        type=_json_object,
        default={},
        metavar="JSON",
        help="merged into every request body, e.g. '{\"top_k\": 1}'",
    )
    p.add_argument("--prompts", metavar="FILE", help="prompts, one a line (default: built in)")
    p.add_argument(
        "--endpoint",
        choices=["chat", "completions"],
        default="chat",
        help="/v1/chat/completions (default) or /v1/completions",
    )
    p.add_argument("--api-key", metavar="KEY", help="sent as a bearer token")
    p.add_argument(
        "--engine-log",
        metavar="FILE",
        help="the engine's log (vLLM, SGLang, llama.cpp's server): read for what loaded",
    )
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="one JSON object (stable keys)")
    fmt.add_argument("--markdown", action="store_true", help="a GitHub markdown table")
    p.add_argument(
        "--chart", metavar="PATH", help="write a chart: SVG, or an HTML page if PATH ends .html"
    )
    return p


class Progress:
    """One line on a terminal, rewritten in place; silent when ``stream`` is None."""

    def __init__(
        self, stream: TextIO | None, total_runs: int, clock: Clock = time.monotonic
    ) -> None:
        self._stream = stream
        self._total = total_runs
        self._clock = clock
        self._width = 0

    def tick(self, window: Window, index: int) -> None:
        if self._stream is None:
            return
        elapsed = min(window.duration_s, max(0.0, self._clock() - window.start))
        tokens = window.tokens()
        rate = tokens / elapsed if elapsed > 0 else 0.0
        errors = sum(1 for r in window.records if r.error is not None)
        line = (
            f"sweep run {index + 1}/{self._total}: repeat {window.repeat}, concurrency"
            f" {window.concurrency}, {elapsed:4.1f}/{window.duration_s:g} s, {tokens} tokens,"
            f" {rate:7.1f} tok/s, {errors} errors"
        )
        self._stream.write("\r" + line.ljust(self._width))
        self._stream.flush()
        self._width = len(line)

    def clear(self) -> None:
        if self._stream is not None and self._width:
            self._stream.write("\r" + " " * self._width + "\r")
            self._stream.flush()
            self._width = 0


def _prompts(path: str | None) -> tuple[str, ...]:
    if path is None:
        return DEFAULT_PROMPTS
    with open(path, encoding="utf-8") as fh:
        prompts = tuple(line.strip() for line in fh if line.strip())
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


async def amain(argv: list[str] | None = None) -> int:
    """``main`` without ``asyncio.run``, for callers that already have a loop."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2): argparse has printed why
        return exc.code if isinstance(exc.code, int) else 2
    try:
        prompts = _prompts(args.prompts)
    except (OSError, ValueError) as exc:
        print(f"detproxy sweep: {exc}", file=sys.stderr)
        return 2
    target = Target(
        base_url=normalise_base(args.upstream),
        model=args.model,
        max_tokens=args.max_tokens,
        endpoint=args.endpoint,
        extra_body=args.extra_body,
        prompts=prompts,
        api_key=args.api_key,
        timeout_s=args.timeout,
    )
    config = SweepConfig(
        target=target,
        concurrency=args.concurrency,
        duration_s=args.duration,
        repeats=args.repeats,
        spread_warn=args.spread_warn,
        extra={"prompts_file": args.prompts, "engine_log": args.engine_log},
        engine_log=args.engine_log,
    )
    show = not args.json and sys.stderr.isatty()
    progress = Progress(sys.stderr if show else None, args.repeats * len(args.concurrency))
    try:
        report = await run_sweep(config, progress.tick)
    except SweepError as exc:
        progress.clear()
        print(f"detproxy sweep: {exc}", file=sys.stderr)
        return 2
    finally:
        progress.clear()
    code = 0 if report["ok"] else 1
    report["exit_code"] = code
    if args.json:
        opts = orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS
        sys.stdout.write(orjson.dumps(report, option=opts).decode() + "\n")
    elif args.markdown:
        sys.stdout.write(to_markdown(report))
    else:
        sys.stdout.write(to_text(report))
    if args.chart:
        try:
            write_chart(args.chart, report)
        except OSError as exc:
            print(f"detproxy sweep: cannot write the chart: {exc}", file=sys.stderr)
            return 2
    return code


def main(argv: list[str] | None = None) -> int:
    try:
        return asyncio.run(amain(argv))
    except KeyboardInterrupt:
        print("\ndetproxy sweep: interrupted", file=sys.stderr)
        return 130
