"""The ``detproxy`` command: ``serve`` runs the proxy; ``probe``, ``report``, ``demo`` and
``emulator`` are the instruments around it."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import socket
import sys
from collections.abc import Sequence

from aiohttp import web

from proxy import __version__
from proxy.config import ConfigError, Settings, load_settings
from proxy.http.eventloop import loop_name, new_event_loop
from proxy.workers import (
    WORKER,
    Supervisor,
    WorkerIdentity,
    reuseport_socket,
    watch_supervisor,
    worker_budgets,
)

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
    p.add_argument(
        "--event-loop",
        choices=["auto", "uvloop", "asyncio"],
        help="auto (default): uvloop where it can be imported, else asyncio",
    )
    p.add_argument(
        "--workers",
        type=int,
        help="serving processes on the port (SO_REUSEPORT), supervised; default 1: this one",
    )
    p.add_argument("--worker-index", type=int, help=argparse.SUPPRESS)  # set by the supervisor
    p.add_argument("--log-level", default=os.environ.get("DETPROXY_LOG_LEVEL", "INFO"))


def _bind(host: str, port: int, shared: bool = False) -> socket.socket:
    if shared:  # a worker: the port is the supervisor's, shared with the other workers
        return reuseport_socket(host, port)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def serve_app(settings: Settings) -> web.Application:
    """The app ``serve`` runs: ``build_app`` and, once it serves, the collector settled."""
    from proxy.app import build_app
    from proxy.collector import on_serving

    app = build_app(settings)
    app.on_startup.append(on_serving(settings.server))
    return app


def _supervise(settings: Settings, serve_argv: list[str]) -> int:
    """``--workers N``: the port bound here first (in use: exit 2; 0: one port for all), then
    N workers started on it and kept running (proxy/workers.py)."""
    server = settings.server
    try:
        held = [reuseport_socket(server.host, server.port)]
        if server.admin_port is not None:
            held.append(reuseport_socket(server.host, server.admin_port))
    except OSError as exc:
        print(f"detproxy: cannot listen on {server.host}:{server.port}: {exc}", file=sys.stderr)
        return 2
    port = held[0].getsockname()[1]
    env = dict(os.environ) | worker_budgets(settings, server.workers)
    if server.admin_port is not None:
        env["DETPROXY_SERVER__ADMIN_PORT"] = str(held[1].getsockname()[1])
    argv = [sys.executable, "-m", "proxy", *serve_argv, "--port", str(port)]
    log.info(
        "detproxy %s supervising %d workers on %s:%d, upstream %s",
        __version__,
        server.workers,
        server.host,
        port,
        settings.upstream.url,
    )
    try:
        return Supervisor(argv, server.workers, server.shutdown_grace_s, env).run()
    finally:
        for sock in held:
            sock.close()


def _serve(args: argparse.Namespace, serve_argv: list[str]) -> int:
    worker = args.worker_index
    tag = "" if worker is None else f" [worker {worker}]"
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s %(levelname)s %(name)s{tag}: %(message)s",
    )
    flags = {
        "upstream": args.upstream,
        "host": args.host,
        "port": args.port,
        "sample_rate": args.sample_rate,
        "shadow_mode": args.shadow_mode,
        "loop_policy": args.loop_policy,
        "event_loop": args.event_loop,
        "workers": args.workers,
    }
    try:
        settings = load_settings(
            args.config or os.environ.get("DETPROXY_CONFIG"), os.environ, flags
        )
        loop = new_event_loop(settings.server.event_loop)
    except ConfigError as exc:
        print(f"detproxy: {exc}", file=sys.stderr)
        return 2
    server = settings.server
    if worker is None and server.workers > 1:
        return _supervise(settings, serve_argv)
    app = serve_app(settings)
    if worker is not None:
        app[WORKER] = WorkerIdentity(worker, server.workers)
        app.cleanup_ctx.append(watch_supervisor(os.getppid()))
    log.info(
        "detproxy %s listening on %s:%d, upstream %s, event loop %s",
        __version__,
        server.host,
        server.port,
        settings.upstream.url,
        loop_name(loop),
    )
    from proxy.serving import run

    shared = worker is not None
    main_sock = _bind(server.host, server.port, shared=shared)
    admin_sock = (
        _bind(server.host, server.admin_port, shared=shared)
        if server.admin_port is not None
        else None
    )
    run(app, server, main_sock, admin_sock, loop)
    return 0


TOOLS = {
    "probe": "the two-minute instrument: is greedy output bitwise stable on this upstream?",
    "report": "read incident logs and print rates, agreement and the worst items",
    "demo": "run the emulator, detproxy and a little traffic, and show what was found",
    "sweep": "throughput, TTFT and ITL per concurrency level, with the spread across repeats",
    "emulator": "run the vLLM emulator (for demos and tests)",
}


TOOL_MODULES = {
    "probe": "proxy.tools.probe",
    "report": "proxy.tools.report.cli",
    "demo": "proxy.tools.demo",
    "sweep": "proxy.tools.sweep.cli",
    "emulator": "proxy.tools.emulator.cli",
}


def _tool(name: str, argv: list[str]) -> int:
    # Each tool parses its own arguments; imported on use, so `serve` loads none of them.
    module = importlib.import_module(TOOL_MODULES[name])
    return int(module.main(argv))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="detproxy", description=__doc__)
    parser.add_argument("--version", action="version", version=f"detproxy {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    for name, text in TOOLS.items():
        sub.add_parser(name, help=text, add_help=False)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] and argv[0] in TOOLS:
        return _tool(argv[0], argv[1:])
    args = parser.parse_args(argv)
    return _serve(args, argv)
