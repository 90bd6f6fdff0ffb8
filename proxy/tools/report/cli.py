"""``detproxy report FILE...``: summarise incident logs for a write-up (text, markdown, JSON)."""

from __future__ import annotations

import argparse
import sys

import orjson

from proxy.observe.ui.report import html_report
from proxy.tools.report.load import LogReadError, read_logs
from proxy.tools.report.render import blocks, to_markdown, to_text
from proxy.tools.report.summary import build_report


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="detproxy report",
        description="Summarise detproxy incident logs: audit rates with 95%% Wilson intervals,"
        " TARr/TARa, divergence positions, loops, policy actions and the worst items.",
    )
    p.add_argument(
        "files", nargs="+", metavar="FILE", help="incident log (JSON lines; rotated or .gz too)"
    )
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="one JSON object (machine readable)")
    fmt.add_argument("--markdown", action="store_true", help="GitHub markdown tables")
    p.add_argument(
        "--top", type=_non_negative, default=10, metavar="N", help="worst items (default 10)"
    )
    p.add_argument("--model", metavar="GLOB", help="only models matching this glob")
    p.add_argument(
        "--html",
        metavar="OUT",
        help="also write the incident explorer's views to OUT: one self-contained HTML file",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2): argparse has printed why
        return exc.code if isinstance(exc.code, int) else 2
    try:
        data = read_logs(args.files)
    except LogReadError as exc:
        print(f"detproxy report: {exc}", file=sys.stderr)
        return 2
    report = build_report(data, args.files, args.model, args.top)
    if args.html is not None:
        try:
            page = html_report(args.files, args.model)
        except LogReadError as exc:
            print(f"detproxy report: {exc}", file=sys.stderr)
            return 2
        try:
            with open(args.html, "w", encoding="utf-8") as sink:
                sink.write(page)
        except OSError as exc:
            print(f"detproxy report: cannot write {args.html}: {exc.strerror}", file=sys.stderr)
            return 2
    if args.json:
        out = orjson.dumps(report, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS).decode()
        sys.stdout.write(out + "\n")
    elif args.markdown:
        sys.stdout.write(to_markdown(blocks(report)))
    else:
        sys.stdout.write(to_text(blocks(report)))
    return 0
