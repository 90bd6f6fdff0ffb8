"""The ``detproxy`` command: ``serve`` runs the proxy; ``config`` prints or checks its
configuration; ``probe``, ``report``, ``demo``, ``sweep`` and ``emulator`` are the instruments
around it."""

from __future__ import annotations

import argparse
import errno
import importlib
import logging
import os
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from aiohttp import web

from proxy import __version__
from proxy.config import SERVER_ID_ENV, ConfigError, Settings, load_settings
from proxy.http.eventloop import loop_name, new_event_loop
from proxy.workers import (
    MULTIPROC_ENV,
    WORKER,
    Supervisor,
    WorkerIdentity,
    resolve_workers,
    reuseport_socket,
    watch_supervisor,
    worker_budgets,
)

log = logging.getLogger("detproxy")

DESCRIPTION = """\
detproxy sits in front of an OpenAI-compatible engine (vLLM, SGLang, llama.cpp's server),
relays every request unchanged, and audits determinism: it replays a budgeted share of
greedy requests and compares the answers, and it catches repetition loops and recovers them.
"""

SERVE_DESCRIPTION = """\
Run detproxy in front of an OpenAI-compatible upstream: clients send their requests to it
as they would to the upstream, and get exactly the upstream's answers.

Settings come from, lowest first: the defaults, the TOML file (--config or DETPROXY_CONFIG),
environment variables (DETPROXY_<SECTION>__<FIELD>, e.g. DETPROXY_AUDIT__SAMPLE_RATE=0.1, and
the flat names of the flags below: DETPROXY_UPSTREAM, DETPROXY_PORT, DETPROXY_LOG_LEVEL, ...),
then these flags. "detproxy config" prints the result without starting a server.
"""

SERVE_EPILOG = """\
detproxy's own endpoints: /detproxy/health, /detproxy/metrics (Prometheus),
/detproxy/status, /detproxy/incidents, /detproxy/ui. On an address other than loopback
(--host 0.0.0.0), only health and metrics are served without server.admin_token. SIGTERM
stops accepting connections and lets requests in flight finish for server.shutdown_grace_s
seconds.

exit status: 0 after a signal, 2 when it cannot start (one line on stderr says why).
"""

CONFIG_DESCRIPTION = """\
Print the configuration "detproxy serve" would run with, as TOML: the defaults, the file
(--config or DETPROXY_CONFIG), DETPROXY_* environment variables and the flags, merged.
Secrets (tokens, API keys, passwords in URLs) are masked. The output is a valid config file.
With --check, only validate: exit 0 when valid, 2 (and one line on stderr) when not.
"""

LOG_LEVELS = ("debug", "info", "warning", "error")


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line that says where to look, exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _settings_flags(p: argparse.ArgumentParser) -> None:
    """The flags that override the configuration (``proxy.config.FLAT``)."""
    p.add_argument("--config", metavar="FILE", help="TOML config file (also DETPROXY_CONFIG)")
    p.add_argument(
        "--upstream",
        metavar="URL",
        help="the engine's base URL, without /v1 (default http://127.0.0.1:8000)",
    )
    p.add_argument("--host", help="address to listen on (default 127.0.0.1; 0.0.0.0: all)")
    p.add_argument("--port", type=int, help="port to listen on (default 8080; 0: any free one)")
    p.add_argument(
        "--sample-rate",
        type=float,
        metavar="F",
        help="share of deterministic (greedy) requests replayed to audit them, 0 to 1",
    )
    p.add_argument(
        "--shadow-mode",
        choices=["full", "prefill"],
        help="full: replay the whole answer; prefill: replay only its first token (cheap)",
    )
    p.add_argument(
        "--loop-policy",
        choices=["retry", "abort", "observe"],
        help="what a repetition loop leads to: retry with other sampling, abort the answer,"
        " or observe (count it, change nothing; the default)",
    )
    p.add_argument(
        "--event-loop",
        choices=["auto", "uvloop", "asyncio"],
        help="auto (default): uvloop where it can be imported, else asyncio",
    )
    p.add_argument(
        "--workers",
        metavar="N|auto",
        help="serving processes on the port (SO_REUSEPORT), supervised; default auto: one per"
        " core this process may use (its cgroup's CPU quota, rounded up); 1: this one alone",
    )
    p.add_argument(
        "--log-level",
        type=str.lower,
        choices=LOG_LEVELS,
        help="info (default): start-up, notable events; debug: every request and audit",
    )
    p.add_argument(
        "--log-format",
        type=str.lower,
        choices=["text", "json"],
        help="text (default), or json: one object per line, for log pipelines",
    )
    p.add_argument(
        "--access-log",
        action="store_true",
        default=None,
        help="one line per finished request: endpoint, model, status, duration, request id",
    )


def _serve_parser(sub: argparse._SubParsersAction[_Parser]) -> None:
    p = sub.add_parser(
        "serve",
        help="run the proxy in front of an OpenAI-compatible upstream",
        description=SERVE_DESCRIPTION,
        epilog=SERVE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _settings_flags(p)
    p.add_argument("--worker-index", type=int, help=argparse.SUPPRESS)  # set by the supervisor


def _config_parser(sub: argparse._SubParsersAction[_Parser]) -> None:
    p = sub.add_parser(
        "config",
        help="print the effective configuration as TOML, or check it",
        description=CONFIG_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--check", action="store_true", help="only validate; print nothing if valid")
    _settings_flags(p)


def _flags(args: argparse.Namespace) -> dict[str, object]:
    return {
        "upstream": args.upstream,
        "host": args.host,
        "port": args.port,
        "sample_rate": args.sample_rate,
        "shadow_mode": args.shadow_mode,
        "loop_policy": args.loop_policy,
        "event_loop": args.event_loop,
        "workers": args.workers,
        "log_level": args.log_level,
        "log_format": args.log_format,
        "access_log": args.access_log,
    }


def _load(args: argparse.Namespace) -> Settings:
    return load_settings(args.config or os.environ.get("DETPROXY_CONFIG"), os.environ, _flags(args))


def _fail(message: str) -> int:
    print(f"detproxy: {message}", file=sys.stderr)
    return 2


def one_line(exc: ConfigError) -> str:
    """A ConfigError's message (one line per invalid field) on one line."""
    return " ".join(str(exc).split())


# ---------------------------------------------------------------------------------------------
# Listening


def bind_error(host: str, port: int, exc: OSError, flag: str = "--port") -> str:
    """Why ``host:port`` cannot be listened on, and what to do about it, in one line."""
    where = f"cannot listen on {host}:{port}"
    if isinstance(exc, socket.gaierror):
        return f"{where}: {host!r} is not a known host name or address; check --host"
    if exc.errno == errno.EADDRINUSE:
        return (
            f"{where}: the address is already in use by another process; stop it, or choose"
            f" another {flag}"
        )
    if exc.errno == errno.EADDRNOTAVAIL:
        return (
            f"{where}: {host} is not an address of this machine; use one of its addresses,"
            " 127.0.0.1, or 0.0.0.0 for all"
        )
    if exc.errno == errno.EACCES:
        return (
            f"{where}: permission denied (ports below 1024 need privileges); choose another {flag}"
        )
    return f"{where}: {exc.strerror or exc}"


def _bind(host: str, port: int, shared: bool = False) -> socket.socket:
    if shared:  # a worker: the port is the supervisor's, shared with the other workers
        return reuseport_socket(host, port)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        # Listen now: two sockets with SO_REUSEADDR that do not listen yet (another process
        # starting at the same moment) can both bind a port; only listen() says it is taken.
        # The server listens again later, with its own backlog.
        sock.listen()
    except BaseException:
        sock.close()
        raise
    return sock


def _listeners(settings: Settings, shared: bool) -> tuple[socket.socket, socket.socket | None]:
    """The main socket and the admin one, bound; raises ``ConfigError`` saying why not."""
    server = settings.server
    if server.admin_port is not None and server.admin_port == server.port != 0:
        raise ConfigError(
            f"server.admin_port is server.port ({server.port}): give the admin listener"
            " another port, or leave admin_port unset to serve /detproxy/ on the main port"
        )
    try:
        main = _bind(server.host, server.port, shared=shared)
    except OSError as exc:
        raise ConfigError(bind_error(server.host, server.port, exc)) from None
    admin = None
    if server.admin_port is not None:
        try:
            admin = _bind(server.admin_address(), server.admin_port, shared=shared)
        except OSError as exc:
            main.close()
            raise ConfigError(
                bind_error(server.admin_address(), server.admin_port, exc, "server.admin_port")
            ) from None
    _refuse_own_address(settings, [s for s in (main, admin) if s is not None])
    return main, admin


def _refuse_own_address(settings: Settings, held: list[socket.socket]) -> None:
    """An upstream on one of the addresses just bound (port 0 resolved, names too) would be
    sent every request back: ``ConfigError``, the sockets closed (proxy/selfloop.py)."""
    from proxy.selfloop import points_back

    why = points_back(settings, [s.getsockname()[:2] for s in held])
    if why is not None:
        for sock in held:
            sock.close()
        raise ConfigError(why)


# ---------------------------------------------------------------------------------------------
# serve


def serve_app(
    settings: Settings, server_id: str | None = None, fleet_dir: Path | None = None
) -> web.Application:
    """The app ``serve`` runs: ``build_app``, its events logged, and, once it serves, the
    collector settled. ``server_id``: what its upstream requests carry (proxy/selfloop.py);
    ``fleet_dir``: a worker's, where the workers publish their figures to each other."""
    from proxy.app import BUS, build_app
    from proxy.collector import on_serving
    from proxy.observe.log import EventLog

    app = build_app(settings, server_id=server_id, fleet_dir=fleet_dir)
    EventLog(settings.log, settings.upstream.url).subscribe(app[BUS])
    app.on_startup.append(on_serving(settings.server))
    return app


def _log_summary(settings: Settings, app: web.Application, admin: socket.socket) -> None:
    """What runs, in a few lines; ``admin``: the listener the admin endpoints are on (its
    bound address says how much of them it serves)."""
    from proxy.app import INCIDENTS
    from proxy.observe.log import startup_lines

    at = admin.getsockname()[:2]
    for msg, fields in startup_lines(settings, on_disk=app[INCIDENTS].on_disk, admin_at=at):
        log.info("%s", msg, extra={"fields": {"event": "config", **fields}})


def _supervise(settings: Settings, serve_argv: list[str]) -> int:
    """``--workers N``: the port bound here first (in use: exit 2; 0: one port for all), then
    N workers started on it and kept running (proxy/workers.py)."""
    from proxy.redact import mask_url
    from proxy.selfloop import new_server_id
    from proxy.serving import describe_start_error

    server = settings.server
    own = new_server_id()  # the workers' one id: what one sends, another knows as its own
    try:  # what would stop every worker at its start stops here, once (the incident path)
        app = serve_app(settings, own)
    except (ConfigError, OSError) as exc:
        return _fail(describe_start_error(exc))
    try:
        held = [reuseport_socket(server.host, server.port)]
    except OSError as exc:
        return _fail(bind_error(server.host, server.port, exc))
    if server.admin_port is not None:
        try:
            held.append(reuseport_socket(server.admin_address(), server.admin_port))
        except OSError as exc:
            held[0].close()
            return _fail(
                bind_error(server.admin_address(), server.admin_port, exc, "server.admin_port")
            )
    try:
        _refuse_own_address(settings, held)
    except ConfigError as exc:
        return _fail(str(exc))
    port = held[0].getsockname()[1]
    env = dict(os.environ) | worker_budgets(settings, server.processes) | {SERVER_ID_ENV: own}
    if server.admin_port is not None:
        env["DETPROXY_SERVER__ADMIN_PORT"] = str(held[1].getsockname()[1])
    # The count resolved here ("auto") is every worker's: the last --workers is the one read.
    argv = [sys.executable, "-m", "proxy", *serve_argv, "--port", str(port)]
    argv += ["--workers", str(server.processes)]
    log.info(
        "detproxy %s supervising %d workers on %s:%d, upstream %s",
        __version__,
        server.processes,
        server.host,
        port,
        mask_url(settings.upstream.url),
        extra={"fields": {"event": "supervising", "workers": server.processes, "port": port}},
    )
    _log_summary(settings, app, held[-1])  # the admin listener, else the main one
    try:
        return Supervisor(argv, server.processes, server.shutdown_grace_s, env).run()
    finally:
        for sock in held:
            sock.close()


def _serve(args: argparse.Namespace, serve_argv: list[str]) -> int:
    from proxy.observe.log import configure
    from proxy.redact import mask_url
    from proxy.selfloop import server_id

    worker = args.worker_index
    try:
        settings = _load(args)
    except ConfigError as exc:
        return _fail(one_line(exc))
    configure(settings.log, worker)
    settings = resolve_workers(settings)  # "auto": one per core it may use (proxy/cores.py)
    server = settings.server
    if worker is None and server.processes > 1:
        if settings.upstream.engine_log == "-":  # one stdin cannot feed N processes
            return _fail(
                f"upstream.engine_log: '-' (stdin) cannot be read by {server.processes} workers;"
                " name the engine's log file instead (e.g. vllm serve ... 2>&1 | tee FILE)"
            )
        return _supervise(settings, serve_argv)
    try:
        loop = new_event_loop(server.event_loop)
    except ConfigError as exc:
        return _fail(one_line(exc))
    try:
        main_sock, admin_sock = _listeners(settings, shared=worker is not None)
    except ConfigError as exc:
        loop.close()
        return _fail(str(exc))
    try:
        shared = os.environ.get(MULTIPROC_ENV) if worker is not None else None
        app = serve_app(settings, server_id(worker, os.environ), Path(shared) if shared else None)
    except (ConfigError, OSError) as exc:
        from proxy.serving import describe_start_error

        for sock in (main_sock, admin_sock):
            if sock is not None:
                sock.close()
        loop.close()
        return _fail(describe_start_error(exc))
    if worker is not None:
        app[WORKER] = WorkerIdentity(worker, server.processes)
        app.cleanup_ctx.append(watch_supervisor(os.getppid()))
    port = main_sock.getsockname()[1]

    def listening() -> None:
        admin = ""
        if admin_sock is not None:
            admin = f", admin on {server.admin_address()}:{admin_sock.getsockname()[1]}"
        log.info(
            "detproxy %s listening on %s:%d%s, upstream %s, event loop %s%s",
            __version__,
            server.host,
            port,
            admin,
            mask_url(settings.upstream.url),
            loop_name(loop),
            "" if worker is None else f", worker {worker} of {server.processes}",
            extra={
                "fields": {
                    "event": "listening",
                    "version": __version__,
                    "host": server.host,
                    "port": port,
                    "upstream": mask_url(settings.upstream.url),
                    "event_loop": loop_name(loop),
                    "workers": server.processes,
                }
            },
        )
        if worker is None:  # with --workers, the supervisor said it once
            _log_summary(settings, app, admin_sock or main_sock)

    from proxy.serving import StartError, run

    try:
        run(app, server, main_sock, admin_sock, loop, on_listening=listening)
    except StartError as exc:
        return _fail(str(exc))
    return 0


# ---------------------------------------------------------------------------------------------
# config


def _config(args: argparse.Namespace) -> int:
    from proxy.config_toml import effective_toml

    try:
        settings = _load(args)
    except ConfigError as exc:
        return _fail(one_line(exc))
    if not args.check:
        sys.stdout.write(effective_toml(settings))
    return 0


# ---------------------------------------------------------------------------------------------
# The tools


TOOLS = {
    "probe": "the two-minute instrument: is greedy output bitwise stable on this upstream?",
    "report": "read incident logs and print rates, agreement and the worst items",
    "demo": "run the emulator, detproxy and a little traffic, and show what was found",
    "sweep": "throughput, TTFT and inter-token latency per concurrency level",
    "diagnose": "why greedy output varies: each cause tested alone (a CI gate)",
    "emulator": "run the vLLM emulator (for demos and tests)",
}


TOOL_MODULES = {
    "probe": "proxy.tools.probe",
    "report": "proxy.tools.report.cli",
    "demo": "proxy.tools.demo",
    "sweep": "proxy.tools.sweep.cli",
    "diagnose": "proxy.tools.diagnose.cli",
    "emulator": "proxy.tools.emulator.cli",
}


def _tool(name: str, argv: list[str]) -> int:
    # Each tool parses its own arguments; imported on use, so `serve` loads none of them.
    module = importlib.import_module(TOOL_MODULES[name])
    return int(module.main(argv))


def main(argv: Sequence[str] | None = None) -> int:
    parser = _Parser(
        prog="detproxy",
        description=DESCRIPTION,
        epilog='Run "detproxy COMMAND --help" for the options of a command.',
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"detproxy {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _serve_parser(sub)
    _config_parser(sub)
    for name, text in TOOLS.items():
        sub.add_parser(name, help=text, add_help=False)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] and argv[0] in TOOLS:
        return _tool(argv[0], argv[1:])
    args = parser.parse_args(argv)
    if args.command == "config":
        return _config(args)
    return _serve(args, argv)
