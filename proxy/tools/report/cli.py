"""``detproxy report [FILE...]``: summarise incident logs for a write-up (text, markdown, JSON).

With no FILE it reads the incident log the configuration names (``incidents.path`` of
``--config FILE``, else of ``$DETPROXY_CONFIG``, else the default: ``incidents.jsonl`` in the
state directory) and its rotated backups (``PATH.N`` ... ``PATH.1``), oldest first.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TextIO

import orjson

from proxy.config import ConfigError, load_settings
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
        description="Summarise detproxy incident logs: audit rates with 95% Wilson intervals,"
        " TARr/TARa, divergence positions, loops, policy actions and the worst items. With no"
        " FILE: the incident log that detproxy serve writes (incidents.path of --config FILE or"
        " $DETPROXY_CONFIG, else <state dir>/incidents.jsonl) and its rotated backups.",
    )
    p.add_argument(
        "files",
        nargs="*",
        metavar="FILE",
        help="incident log (JSON lines; rotated or .gz too). Default: the incident log the"
        " configuration names, with its rotated backups",
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        help="read the incident log this TOML config names (the one detproxy serve uses;"
        " also DETPROXY_CONFIG); only without FILE",
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
        help="write the incident explorer's views to OUT (one self-contained HTML file) and say"
        " where, instead of the text report (--json or --markdown still print theirs)",
    )
    return p


class NoLogError(Exception):
    """No incident log where the configuration says: the message says where and what to do."""


def rotated(path: str) -> list[str]:
    """``path`` and its rotated backups (``path.1`` newest ... ``path.N``, also ``.gz``) that
    exist, oldest first, as the incident log's rotation names them."""
    base = Path(path)
    backup = re.compile(re.escape(base.name) + r"\.(\d+)(\.gz)?")
    found: list[tuple[int, str]] = []
    try:
        for entry in base.parent.iterdir():
            match = backup.fullmatch(entry.name)
            if match and entry.is_file():
                found.append((int(match[1]), str(base.parent / entry.name)))
    except OSError:
        pass
    files = [name for _, name in sorted(found, reverse=True)]
    if base.is_file():
        files.append(path)
    return files


def default_logs(config: str | None, env: Mapping[str, str]) -> list[str]:
    """The files ``detproxy report`` reads with no FILE; NoLogError when there are none."""
    config = config or env.get("DETPROXY_CONFIG") or None
    settings = load_settings(config, env)
    named = f"incidents.path of {config}" if config else "the default incidents.path"
    path = settings.incidents.path
    if not path:
        raise NoLogError(
            f"no incident log: {named} is empty (incidents are kept in memory only);"
            " name the log: detproxy report FILE..."
        )
    files = rotated(path)
    if not files:
        hint = "" if config else ", or --config FILE for the log a served config names"
        raise NoLogError(
            f"no incident log at {path} ({named}); detproxy serve writes it there once it"
            f" audits; name another: detproxy report FILE...{hint}"
        )
    return files


def write_html(out: str, files: list[str], model_glob: str | None, say: TextIO) -> int:
    """Write the explorer's views to ``out`` and say where in one line to ``say``; the exit
    status."""
    try:
        page = html_report(files, model_glob)
    except LogReadError as exc:
        print(f"detproxy report: {exc}", file=sys.stderr)
        return 2
    try:
        with open(out, "w", encoding="utf-8") as sink:
            sink.write(page)
    except OSError as exc:
        print(f"detproxy report: cannot write {out}: {exc.strerror}", file=sys.stderr)
        return 2
    print(f"detproxy report: wrote {os.path.abspath(out)} (opens offline in a browser)", file=say)
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2): argparse has printed why
        return exc.code if isinstance(exc.code, int) else 2
    if not args.files:
        try:
            args.files = default_logs(args.config, os.environ)
        except (ConfigError, NoLogError) as exc:
            print(f"detproxy report: {exc}", file=sys.stderr)
            return 2
    try:
        data = read_logs(args.files)
    except LogReadError as exc:
        print(f"detproxy report: {exc}", file=sys.stderr)
        return 2
    report = build_report(data, args.files, args.model, args.top)
    if args.html is not None:
        # With --json or --markdown, stdout is theirs: the line saying where goes to stderr.
        printing = args.json or args.markdown
        status = write_html(
            args.html, args.files, args.model, sys.stderr if printing else sys.stdout
        )
        if status or not printing:
            return status
    if args.json:
        out = orjson.dumps(report, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS).decode()
        sys.stdout.write(out + "\n")
    elif args.markdown:
        sys.stdout.write(to_markdown(blocks(report)))
    else:
        sys.stdout.write(to_text(blocks(report)))
    return 0
