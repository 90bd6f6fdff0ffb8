"""The ``detproxy`` command: ``serve`` runs the proxy, ``emulator`` runs the vLLM emulator."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from aiohttp import web

from proxy import __version__
from proxy.config import ConfigError, load_settings

log = logging.getLogger("detproxy")


def _serve_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="run the proxy in front of an OpenAI-compatible upstream")
    p.add_argument("--config", help="TOML config file (also DETPROXY_CONFIG)")
    p.add_argument("--upstream", help="upstream base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to listen on (default 8080)")
    p.add_argument("--sample-rate", type=float, help="share of deterministic requests audited")
    p.add_argument("--shadow-mode", choices=["full", "prefill"])
    p.add_argument("--loop-policy", choices=["retry", "abort", "observe"])
    p.add_argument("--log-level", default=os.environ.get("DETPROXY_LOG_LEVEL", "INFO"))


def _serve(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    flags = {
        "upstream": args.upstream,
        "host": args.host,
        "port": args.port,
        "sample_rate": args.sample_rate,
        "shadow_mode": args.shadow_mode,
        "loop_policy": args.loop_policy,
    }
    try:
        settings = load_settings(
            args.config or os.environ.get("DETPROXY_CONFIG"), os.environ, flags
        )
    except ConfigError as exc:
        print(f"detproxy: {exc}", file=sys.stderr)
        return 2
    from proxy.app import build_app

    app = build_app(settings)
    server = settings.server
    log.info(
        "detproxy %s listening on %s:%d, upstream %s",
        __version__,
        server.host,
        server.port,
        settings.upstream.url,
    )
    web.run_app(
        app,
        host=server.host,
        port=server.port,
        shutdown_timeout=server.shutdown_grace_s,
        handler_cancellation=True,  # a client that leaves cancels its handler: upstream closes
        access_log=None,
        print=None,
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="detproxy", description=__doc__)
    parser.add_argument("--version", action="version", version=f"detproxy {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    sub.add_parser("emulator", help="run the vLLM emulator (for demos and tests)", add_help=False)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["emulator"]:
        from proxy.emulator.cli import main as emulator_main

        return int(emulator_main(argv[1:]))
    args = parser.parse_args(argv)
    return _serve(args)
