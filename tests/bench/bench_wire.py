"""Micro-benchmark of detproxy's whole Python path per request and per event, in memory.

Run: ``.venv/bin/python tests/bench/bench_wire.py [--streams 100] [--rounds 9] [--baseline DIR]``.
Prints figures only (no assertions).

Where ``bench_stream.py`` starts at ``Forwarder.handle``, this one runs everything detproxy
runs in a process, but the system calls: the request's bytes go into a ``FrontConnection``
(httptools parses them, the handler task is made as a socket would make it), the upstream is
the real ``H1Upstream`` pool whose connections' transports are in memory, the engine behind
them answers each request with response bytes fed to the connection's ``data_received`` (a
streamed answer one chunk-framed event per event-loop iteration, as a paced engine is read
one token a read), and the client's transport takes what the front's coalescer writes. So the
figures hold detproxy's own parsing, pool, dispatch, relay, coalescer and metrics, and leave
out only the kernel and uvloop's socket code (``bench_paced.py`` has those).

``--streams`` requests run at once, each on its own client connection, as that many
concurrent clients would; each request has its own prompt (none is a passive duplicate).
Streams of 1 and 64 tokens are timed in interleaved rounds, and non-streamed requests with
them: what a stream costs whatever its length, what each more event costs, and what a
non-streamed request costs. Configurations: the defaults (loop inspection and passive checks
on, audit off), loops off, and neither (the raw relay).

``--baseline DIR`` (a checkout of another commit: ``git worktree add DIR COMMIT``) times that
version too, in the same rounds, and prints the ratios; ``--gc`` the cyclic collector's passes
during the timings and what they freed; ``--profile CONFIGURATION`` cProfile's top functions
(``--profile-kind``: non-streamed requests or 64-token streams); ``--only KIND`` times one kind
of request alone, for a sampling profiler (py-spy).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import importlib
import itertools
import pstats
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from statistics import median_high
from types import SimpleNamespace
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE))

from aiohttp import web  # noqa: E402
from bench_proxy import make_json_answer, make_sse_stream, request_body  # noqa: E402
from bench_request import CLIENT_HEADERS  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402

# What this benchmark uses of detproxy, by module (``Tree`` imports them from one checkout).
USES = {
    "proxy.app": ("RUNTIME", "build_app"),
    "proxy.collector": ("settle",),
    "proxy.config": ("load_settings",),
    "proxy.http.front": ("FrontConnection", "FrontServer"),
    "proxy.http.h1": ("H1Upstream",),
    "proxy.http.h1conn": ("Conn",),
}
_PACKAGE_IMPORT = re.compile(r"\b(from|import) (proxy|policies)\b")

PATH = "/v1/chat/completions"
_SERIAL = itertools.count()
CONFIGS: dict[str, dict[str, str]] = {
    "defaults": {},
    "loops off": {"DETPROXY_LOOPS__ENABLED": "false"},
    "raw relay": {
        "DETPROXY_LOOPS__ENABLED": "false",
        "DETPROXY_AUDIT__PASSIVE_CHECKS": "false",
    },
}
# What uvicorn (vLLM) answers with, less the date.
STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\nserver: uvicorn\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)
JSON_HEAD = b"HTTP/1.1 200 OK\r\nserver: uvicorn\r\ncontent-type: application/json\r\n"


def load_tree(baseline: Path | None) -> SimpleNamespace:
    """The modules of ``USES``: this checkout's, or a copy of another checkout's packages
    (``--baseline DIR``) renamed ``proxy_base`` and ``policies_base``, so that both versions
    run in one process, in interleaved rounds: on a machine whose speed drifts within minutes,
    two processes run one after the other do not compare."""
    suffix = ""
    if baseline is not None:
        suffix = "_base"
        dest = Path(tempfile.mkdtemp(prefix="bench-wire-"))
        for package in ("proxy", "policies"):
            copy = dest / (package + suffix)
            shutil.copytree(baseline / package, copy, ignore=shutil.ignore_patterns("__pycache__"))
            for source in copy.rglob("*.py"):
                text = _PACKAGE_IMPORT.sub(r"\1 \2" + suffix, source.read_text())
                source.write_text(text)
        sys.path.insert(0, str(dest))
    tree = SimpleNamespace()
    for name, attributes in USES.items():
        module = importlib.import_module(name.replace("proxy", "proxy" + suffix, 1))
        for attribute in attributes:
            setattr(tree, attribute, getattr(module, attribute))
    return tree


class MemoryTransport:
    """What the protocols need of a transport; written bytes go to ``on_write``."""

    def __init__(self, on_write: Callable[[bytes], None]) -> None:
        self._on_write = on_write
        self._closing = False

    def write(self, data: bytes) -> None:
        self._on_write(data)

    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        self._closing = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


class Engine:
    """Answers each request written to one of its connections: a stream of ``tokens`` events
    (one event a loop iteration), or, for a non-streamed request, one JSON answer."""

    def __init__(self, tokens: int) -> None:
        raw, _ = make_sse_stream(tokens)
        events = [part + b"\n\n" for part in raw.split(b"\n\n") if part]
        self.frames = [b"%x\r\n%b\r\n" % (len(e), e) for e in events] + [b"0\r\n\r\n"]
        self.events = len(events)
        answer = make_json_answer()
        self.answer = JSON_HEAD + b"content-length: %d\r\n\r\n" % len(answer) + answer

    def connect(self, loop: asyncio.AbstractEventLoop, conn_class: Any) -> Any:
        conn = conn_class(loop)

        def on_write(request: bytes) -> None:
            if b'"stream":true' in request:
                loop.call_soon(conn.data_received, STREAM_HEAD)
                self._paced(loop, conn, 0)
            else:
                loop.call_soon(conn.data_received, self.answer)

        conn.connection_made(MemoryTransport(on_write))  # type: ignore[arg-type]
        return conn

    def _paced(self, loop: asyncio.AbstractEventLoop, conn: Any, at: int) -> None:
        def step() -> None:
            conn.data_received(self.frames[at])
            if at + 1 < len(self.frames):
                self._paced(loop, conn, at + 1)

        loop.call_soon(step)


def memory_upstream(tree: SimpleNamespace, engine: Engine) -> Any:
    """The tree's real ``H1Upstream`` pool, its connections made in memory to ``engine``."""

    async def connect() -> Any:
        return engine.connect(asyncio.get_running_loop(), tree.Conn)

    options: dict[str, Any] = {
        "connect_timeout_s": 5,
        "read_timeout_s": 60,
        "keepalive_timeout_s": 4,
        "max_connections": 10_000,
    }
    try:
        return tree.H1Upstream("http://127.0.0.1:8000", connector=connect, **options)
    except TypeError:  # a baseline from before the pool took a connector
        upstream = tree.H1Upstream("http://127.0.0.1:8000", **options)
        upstream._connect = connect
        return upstream


class Client:
    """One client connection: writes a request, waits for its whole response."""

    def __init__(self, tree: SimpleNamespace, server: Any) -> None:
        self.conn = tree.FrontConnection(server)
        self.conn.connection_made(MemoryTransport(self._on_write))  # type: ignore[arg-type]
        self._done: asyncio.Future[None] | None = None
        self._chunked = False
        self.received = 0

    def _on_write(self, data: bytes) -> None:
        self.received += len(data)
        if data.startswith(b"HTTP/1.1 "):
            self._chunked = b"Transfer-Encoding: chunked\r\n" in data[: data.find(b"\r\n\r\n") + 2]
        if not self._chunked or data.endswith(b"0\r\n\r\n"):
            assert self._done is not None
            self._done.set_result(None)

    async def ask(self, request: bytes) -> None:
        self._done = asyncio.get_running_loop().create_future()
        self.conn.data_received(request)
        await self._done


def requests(n: int, stream: bool) -> list[bytes]:
    """``n`` requests as the openai SDK sends them, each with its own prompt."""
    body = request_body(stream)
    prompt = b"a token stream."
    assert prompt in body
    head = b"POST %b HTTP/1.1\r\nHost: 127.0.0.1\r\n" % PATH.encode()
    head += b"".join(b"%b: %b\r\n" % (k.encode(), v.encode()) for k, v in CLIENT_HEADERS.items())
    out = []
    for _ in range(n):
        unique = body.replace(prompt, b"a token stream, %d." % next(_SERIAL))
        out.append(head + b"Content-Length: %d\r\n\r\n" % len(unique) + unique)
    return out


class Collections:
    """The cyclic collector's passes while a timing runs: how many, what they freed (objects
    left in reference cycles), how long they took."""

    def __init__(self) -> None:
        self.active = False
        self.passes = self.freed = 0
        self.seconds = 0.0
        self._began = 0.0
        gc.callbacks.append(self._on_pass)

    def _on_pass(self, phase: str, info: dict[str, int]) -> None:
        if not self.active:
            return
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.passes += 1
            self.freed += info["collected"]
            self.seconds += time.perf_counter() - self._began

    def taken(self) -> tuple[int, int, float]:
        """What was counted since the last call."""
        out = (self.passes, self.freed, self.seconds)
        self.passes = self.freed = 0
        self.seconds = 0.0
        return out


class Setup:
    """One configuration's app and front, serving clients of one engine."""

    collections: Collections | None = None  # set by main: shared by every setup

    def __init__(
        self, tree: SimpleNamespace, env: dict[str, str], tokens: int, streams: int
    ) -> None:
        self.tree, self.env, self.streams = tree, env, streams
        self.engine = Engine(tokens)

    async def start(self) -> None:
        tree = self.tree
        settings = tree.load_settings(env=self.env, flags={"upstream": "http://127.0.0.1:8000"})
        upstream = memory_upstream(tree, self.engine)
        self.app = tree.build_app(settings, registry=CollectorRegistry(), upstream=upstream)
        self.runner = web.AppRunner(self.app)
        await self.runner.setup()
        forwarder = self.app[tree.RUNTIME].forwarder
        # No /detproxy/ request is made here: the admin handler is never called.
        self.server = tree.FrontServer(forwarder.handle, forwarder.handle, keepalive_s=75.0)
        self.clients = [Client(tree, self.server) for _ in range(self.streams)]

    async def run(self, n: int, stream: bool) -> float:
        """Microseconds of wall time per request, ``n`` requests, ``streams`` at a time."""
        batch = requests(n, stream)
        gc.collect()
        gc.freeze()  # the prebuilt requests are not the collector's to walk
        per = len(self.clients)
        if self.collections is not None:
            self.collections.active = True
        start = time.perf_counter()
        for at in range(0, n, per):
            await asyncio.gather(
                *(c.ask(r) for c, r in zip(self.clients, batch[at : at + per], strict=False))
            )
        took = time.perf_counter() - start
        if self.collections is not None:
            self.collections.active = False
        gc.unfreeze()
        return took / n * 1e6

    async def stop(self) -> None:
        await self.runner.cleanup()


def ratio(times: dict[tuple[str, str, str], list[float]], name: str, kind: str) -> float:
    """Baseline over this checkout, the median of the rounds' ratios (each round's pair was
    timed back to back)."""
    pairs = zip(times["baseline", name, kind], times["this", name, kind], strict=True)
    return median_high([base / this for base, this in pairs])


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=1000, help="requests per timing")
    ap.add_argument("--streams", type=int, default=100, help="requests at once")
    ap.add_argument("--rounds", type=int, default=9, help="interleaved rounds (median kept)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset")
    ap.add_argument(
        "--only",
        choices=("json", "1 token", "64 tokens"),
        help="time these requests only, and print their figure (under a sampling profiler)",
    )
    ap.add_argument(
        "--profile",
        metavar="CONFIGURATION",
        choices=list(CONFIGS),
        help="cProfile this configuration (with --profile-kind)",
    )
    ap.add_argument(
        "--profile-kind",
        choices=("json", "64 tokens"),
        default="64 tokens",
        help="what --profile profiles: non-streamed requests or 64-token streams",
    )
    ap.add_argument(
        "--baseline",
        metavar="DIR",
        type=Path,
        help="another checkout (git worktree add DIR COMMIT): its figures beside these, "
        "timed in the same rounds, and their ratio",
    )
    ap.add_argument(
        "--gc",
        action="store_true",
        help="also print the cyclic collector's passes during the timings, and what they freed",
    )
    args = ap.parse_args()
    collections = Collections() if args.gc else None
    Setup.collections = collections
    names = [name for name in args.configs.split(",") if name]
    trees = {"this": load_tree(None)}
    if args.baseline is not None:
        trees["baseline"] = load_tree(args.baseline.resolve())
    short, long = 1, 64
    setups: dict[tuple[str, str, int], Setup] = {}
    for label, tree in trees.items():
        for name in names:
            for tokens in (short, long):
                setup = Setup(tree, CONFIGS[name], tokens, args.streams)
                setups[label, name, tokens] = setup
                await setup.start()
    server = trees["this"].load_settings(env={}, flags={"upstream": "http://x:1"}).server
    trees["this"].settle(server.gc_freeze, server.gc_threshold)  # as ``serve`` does
    times: dict[tuple[str, str, str], list[float]] = {}
    passes: dict[tuple[str, str, str], list[tuple[int, int, float]]] = {}
    kinds = (("json", short, False), ("1 token", short, True), ("64 tokens", long, True))
    if args.only:
        kinds = tuple(k for k in kinds if k[0] == args.only)
    for setup in setups.values():  # warm up: templates, pools, first allocations
        await setup.run(args.streams * 2, stream=True)
        await setup.run(args.streams * 2, stream=False)
    labels = list(trees)
    for at in range(args.rounds):
        for name in names:
            for kind, tokens, stream in kinds:
                for label in labels if at % 2 == 0 else labels[::-1]:
                    if collections is not None:
                        collections.taken()
                    us = await setups[label, name, tokens].run(args.n, stream)
                    times.setdefault((label, name, kind), []).append(us)
                    if collections is not None:
                        passes.setdefault((label, name, kind), []).append(collections.taken())
    events = {t: setups["this", names[0], t].engine.events for t in (short, long)}
    extra = events[long] - events[short]
    print(
        f"Python {sys.version.split()[0]}; {args.n} requests a timing, {args.streams} at once, "
        f"median of {args.rounds} rounds; events a stream: {events[short]} and {events[long]}"
    )
    if args.only:
        for label in labels:
            for name in names:
                us = median_high(times[label, name, args.only])
                print(f"{label:<9}{name:<14}{args.only}: {us:.1f} us a request")
    else:
        print(
            f"{'':<9}{'configuration':<14}{'json':>9}{'1 token':>10}{'64 tokens':>11}"
            f"{'per event':>11}{'per stream':>12}"
        )
        for name in names:
            rows = {}
            for label in labels:
                j, a, b = (median_high(times[label, name, kind]) for kind, _, _ in kinds)
                per_event = (b - a) / extra
                rows[label] = (j, a, b, per_event, a - per_event * events[short])
                cells = "".join(
                    f"{v:>{w}.{2 if w == 11 and i == 3 else 1}f}"
                    for i, (v, w) in enumerate(zip(rows[label], (9, 10, 11, 11, 12), strict=True))
                )
                print(f"{label:<9}{name:<14}{cells}")
            if "baseline" in rows:
                ratios = [ratio(times, name, kind) for kind, _, _ in kinds]
                cells = f"{ratios[0]:>9.2f}{ratios[1]:>10.2f}{ratios[2]:>11.2f}"
                print(f"{'ratio':<9}{name:<14}{cells}   (baseline / this, median of rounds)")
    print("(us a request; 'per stream': what a stream costs whatever its length, the intercept)")
    if collections is not None:
        print("\nthe cyclic collector during the timings, all rounds: passes, objects freed a")
        print("request (what requests left in reference cycles), collector time a request (us)")
        for key, taken in passes.items():
            count = args.n * len(taken)
            runs, freed, seconds = (sum(t[i] for t in taken) for i in range(3))
            label = " ".join(key)
            print(f"  {label:<32}{runs:>6}{freed / count:>10.2f}{seconds / count * 1e6:>10.2f}")
    if args.profile:
        stream = args.profile_kind != "json"
        setup = setups["this", args.profile, long if stream else short]
        profiler = cProfile.Profile()
        profiler.enable()
        await setup.run(args.n, stream=stream)
        profiler.disable()
        stats = pstats.Stats(profiler)
        stats.sort_stats("tottime").print_stats(35)
        stats.sort_stats("cumulative").print_stats(50)
    for setup in setups.values():
        await setup.stop()
    return 0


if __name__ == "__main__":
    import uvloop

    sys.exit(uvloop.run(main()))
