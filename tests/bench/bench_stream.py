"""Micro-benchmark of detproxy's own work per streamed request, no network.

Run: ``.venv/bin/python tests/bench/bench_stream.py [--n 2000] [--rounds 15] [--profile]``.
Prints figures only (no assertions).

Streamed chat requests, as the openai SDK sends them (each with its own prompt, so that none
is a passive duplicate), go through ``Forwarder.handle`` of
the app ``build_app`` wires (its metrics, its passive duplicate checks, its loop recovery),
against an in-memory upstream whose ``pump`` hands each event over on its own, as a paced engine
does (one read per token), to a client that takes every write. Streams of 1 and of 64 tokens
are timed in interleaved rounds; what a stream costs whatever its length and what each more
event costs follow from the two (a straight line through them). Configurations: the defaults
(loop inspection on, passive checks on, audit off), loops off, and loops and passive checks
off.

What the servers do around it (parsing the request, the upstream client's parser, the system
calls, the event loop) is not in these figures: ``bench_paced.py`` measures them all together.
``--profile CONFIGURATION`` adds cProfile's top functions for one configuration, 64 tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import itertools
import pstats
import sys
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from statistics import median_high

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE))

from aiohttp import web  # noqa: E402
from bench_proxy import make_sse_stream, request_body  # noqa: E402
from bench_request import CLIENT_HEADERS  # noqa: E402
from multidict import CIMultiDict, CIMultiDictProxy  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402

from proxy.app import RUNTIME, build_app  # noqa: E402
from proxy.config import Settings, load_settings  # noqa: E402
from proxy.forward import Forwarder  # noqa: E402
from proxy.http.upstream import Body, Sink, UpstreamResponse  # noqa: E402

PATH = "/v1/chat/completions"
_SERIAL = itertools.count()
# What vLLM (uvicorn) answers a streamed chat completion with.
STREAM_HEADERS = {
    "date": "Tue, 01 Dec 2026 12:00:00 GMT",
    "server": "uvicorn",
    "content-type": "text/event-stream; charset=utf-8",
    "transfer-encoding": "chunked",
}
CONFIGS: dict[str, dict[str, str]] = {
    "defaults": {},
    "loops off": {"DETPROXY_LOOPS__ENABLED": "false"},
    "loops, passive off": {
        "DETPROXY_LOOPS__ENABLED": "false",
        "DETPROXY_AUDIT__PASSIVE_CHECKS": "false",
    },
}


class PacedResponse:
    """A streamed answer whose events are handed over one at a time."""

    __slots__ = ("_at", "_events", "headers", "raw_fields", "status")

    def __init__(self, events: list[bytes], headers: Mapping[str, str]) -> None:
        self._events = events
        self._at = 0
        self.status = 200
        self.headers = headers
        self.raw_fields: list[tuple[bytes, bytes]] | None = None

    async def pump(self, sink: Sink) -> bool:
        events = self._events
        while self._at < len(events):
            event = events[self._at]
            self._at += 1
            if not sink(event):
                return False
        return True

    async def chunks(self) -> AsyncIterator[bytes]:
        for event in self._events:
            yield event

    async def read(self) -> bytes:
        return b"".join(self._events)

    def close(self) -> None:
        pass


class PacedUpstream:
    """Answers every request with the same stream of ``tokens`` one-token events."""

    def __init__(self, tokens: int) -> None:
        raw, _ = make_sse_stream(tokens)
        self.events = [part + b"\n\n" for part in raw.split(b"\n\n") if part]
        self._headers = CIMultiDictProxy(CIMultiDict(STREAM_HEADERS))

    async def send(
        self, method: str, raw_path: str, headers: Mapping[str, str], body: Body
    ) -> UpstreamResponse:
        return PacedResponse(self.events, self._headers)

    async def close(self) -> None:
        pass


class SinkClient:
    """One client request (the SDK's headers and a streamed body) that takes every write."""

    __slots__ = ("_body", "headers", "wrote")

    method = "POST"
    path = PATH
    raw_path = PATH
    has_body = True
    passed_fields = None  # the headers are filtered, as behind aiohttp's server

    def __init__(self, body: bytes, headers: Mapping[str, str]) -> None:
        self._body = body
        self.headers = headers
        self.wrote = 0

    def header(self, name: bytes) -> str | None:
        return self.headers.get(name.decode("latin-1"))

    async def read_body(self, limit: int) -> bytes:
        return self._body

    async def body_chunks(self) -> AsyncIterator[bytes]:
        yield self._body

    async def respond(self, status: int, headers: Mapping[str, str], body: bytes) -> None:
        self.wrote += len(body)

    async def start(self, status: int, headers: Mapping[str, str]) -> None:
        pass

    async def write(self, data: bytes) -> None:
        self.wrote += len(data)

    def write_nowait(self, data: bytes) -> bool:
        self.wrote += len(data)
        return True

    async def drain(self) -> None:
        pass

    async def end(self) -> None:
        pass


def settings_for(env: dict[str, str]) -> Settings:
    return load_settings(env=env, flags={"upstream": "http://127.0.0.1:8000"})


async def forwarder_for(
    env: dict[str, str], upstream: PacedUpstream
) -> tuple[Forwarder, web.AppRunner]:
    """The forwarder of a started app (its cleanup contexts run: the passive store, the
    auditor), serving no socket."""
    app = build_app(settings_for(env), registry=CollectorRegistry(), upstream=upstream)
    runner = web.AppRunner(app)
    await runner.setup()
    return app[RUNTIME].forwarder, runner


def distinct_bodies(n: int) -> list[bytes]:
    """``n`` streamed requests that differ in their prompt: none is a passive duplicate."""
    body = request_body(True)
    prompt = b"a token stream."
    assert prompt in body
    return [body.replace(prompt, b"a token stream, %d." % next(_SERIAL)) for _ in range(n)]


async def per_stream_us(forwarder: Forwarder, n: int) -> float:
    headers = CIMultiDictProxy(CIMultiDict(CLIENT_HEADERS))
    clients = [SinkClient(body, headers) for body in distinct_bodies(n)]
    gc.collect()
    start = time.perf_counter()
    for client in clients:
        await forwarder.handle(client)
    took = time.perf_counter() - start
    assert clients[-1].wrote > 0
    return took / n * 1e6


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=2000, help="streams per timing")
    ap.add_argument("--rounds", type=int, default=15, help="interleaved rounds (median kept)")
    ap.add_argument(
        "--profile",
        metavar="CONFIGURATION",
        choices=list(CONFIGS),
        help="cProfile this configuration on 64-token streams",
    )
    args = ap.parse_args()
    lengths = (1, 64)
    forwarders: dict[tuple[str, int], Forwarder] = {}
    runners: list[web.AppRunner] = []
    events: dict[int, int] = {}
    for name, overrides in CONFIGS.items():
        for tokens in lengths:
            upstream = PacedUpstream(tokens)
            events[tokens] = len(upstream.events)
            forwarders[name, tokens], runner = await forwarder_for(overrides, upstream)
            runners.append(runner)
    times: dict[tuple[str, int], list[float]] = {key: [] for key in forwarders}
    for forwarder in forwarders.values():
        await per_stream_us(forwarder, 200)  # warm up: templates, caches, first allocations
    for _ in range(args.rounds):
        for key, forwarder in forwarders.items():
            times[key].append(await per_stream_us(forwarder, args.n))
    short, long = lengths
    extra_events = events[long] - events[short]
    print(f"Python {sys.version.split()[0]}; {args.n} streams a timing, median of {args.rounds}")
    print(f"events a stream: {events[short]} ({short} token), {events[long]} ({long} tokens)")
    print(
        f"{'configuration':<20}{'1 token':>10}{'64 tokens':>11}{'per event':>11}{'per stream':>12}"
    )
    for name in CONFIGS:
        a, b = median_high(times[name, short]), median_high(times[name, long])
        per_event = (b - a) / extra_events
        per_stream = a - per_event * events[short]
        print(f"{name:<20}{a:>10.1f}{b:>11.1f}{per_event:>11.2f}{per_stream:>12.1f}")
    print("(us a stream; 'per stream': what a stream costs whatever its length, the intercept)")
    if args.profile:
        forwarder = forwarders[args.profile, long]
        profiler = cProfile.Profile()
        profiler.enable()
        await per_stream_us(forwarder, args.n)
        profiler.disable()
        stats = pstats.Stats(profiler)
        stats.sort_stats("tottime").print_stats(30)
        stats.sort_stats("cumulative").print_stats(45)
    for runner in runners:
        await runner.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
