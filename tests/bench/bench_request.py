"""Micro-benchmark of detproxy's own per-request work on the non-streamed path, no network.

Run: ``.venv/bin/python tests/bench/bench_request.py [--n 10000] [--repeat 5]``. Prints figures
only (no assertions): microseconds per request, best of ``--repeat`` runs of ``--n`` requests.

The request is what the openai SDK sends (its headers, a small greedy chat body); the answer is
bench_proxy.py's vLLM-shaped ~1 KB chat completion, with uvicorn's response headers. Steps, each
timed alone on its own inputs:

- ``request_id_of``: the client sent no ``X-Request-Id`` (one is minted), then one it sent;
- ``ensure_json_content_type``;
- ``parse_object``, ``classify``, ``upstream_request_headers``, ``client_response_headers``;
- ``publish RequestStarted + RequestFinished``: the app's bus, with its real subscribers
  (Metrics, IncidentLog, AuditTally as ``build_app`` wires them);
- ``parse_answer``; the passive checks' steps (``canonical_request_key`` of the request,
  ``outcome_from_response`` and ``digest_outcome`` of the answer); ``Attempts.decided`` on a
  clean answer (the real ladder policy);
- loops on only: ``LoopSettings.watch`` + ``LoopWatch.on_answer`` on the ~1 KB answer.

Then the whole path, twice (``[loops] enabled = false``, then the default ``true``; audit off):
``Forwarder.handle`` on an in-memory client (its body buffered, its answer kept) against an
in-memory upstream that answers at once. What the front does around it (parsing, writing) is
not in these figures (``bench_wire.py`` has it).

The inputs are built before the timing starts and frozen out of the garbage collector's reach
(``gc.freeze``).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_proxy import MODEL, PATH, make_json_answer, request_body  # noqa: E402
from multidict import CIMultiDict, CIMultiDictProxy  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402

import proxy  # noqa: E402
from policies.base import PolicyChain  # noqa: E402
from policies.budget import RecoveryBudget  # noqa: E402
from policies.ladder import Ladder, LoopLadderPolicy  # noqa: E402
from proxy.app import BUS, RUNTIME, Runtime, build_app  # noqa: E402
from proxy.attempts import Attempts  # noqa: E402
from proxy.audit.outcome import outcome_from_response  # noqa: E402
from proxy.audit.store import digest_outcome  # noqa: E402
from proxy.classify import classify  # noqa: E402
from proxy.config import Settings, load_settings  # noqa: E402
from proxy.events import RequestFinished, RequestStarted  # noqa: E402
from proxy.forward import Forwarder  # noqa: E402
from proxy.hashing import canonical_request_key  # noqa: E402
from proxy.http.body import ensure_json_content_type, parse_answer, parse_object  # noqa: E402
from proxy.http.headers import (  # noqa: E402
    HeaderFields,
    client_response_headers,
    request_id_of,
    upstream_request_headers,
)
from proxy.http.upstream import Body, UpstreamResponse  # noqa: E402
from proxy.loops.recovery import Recovery  # noqa: E402

# What openai-python 1.x sends with a chat completion (httpx adds the first four).
CLIENT_HEADERS = {
    "Host": "127.0.0.1:8080",
    "Accept-Encoding": "gzip, deflate",
    "Connection": "keep-alive",
    "Accept": "application/json",
    "Content-Type": "application/json",
    "User-Agent": "OpenAI/Python 1.54.0",
    "X-Stainless-Lang": "python",
    "X-Stainless-Package-Version": "1.54.0",
    "X-Stainless-OS": "Linux",
    "X-Stainless-Arch": "x64",
    "X-Stainless-Runtime": "CPython",
    "X-Stainless-Runtime-Version": "3.11.7",
    "Authorization": "Bearer sk-not-a-real-key-0123456789",
    "X-Stainless-Async": "false",
    "X-Stainless-Retry-Count": "0",
}
# What vLLM (uvicorn) answers a non-streamed chat completion with.
UPSTREAM_HEADERS = {
    "date": "Tue, 01 Dec 2026 12:00:00 GMT",
    "server": "uvicorn",
    "content-length": "1024",
    "content-type": "application/json",
}


class _Response:
    __slots__ = ("_payload", "headers", "raw_fields", "status")

    def __init__(self, payload: bytes, headers: Mapping[str, str]) -> None:
        self._payload = payload
        self.status = 200
        self.headers = headers
        self.raw_fields: list[tuple[bytes, bytes]] | None = None

    async def chunks(self) -> AsyncIterator[bytes]:
        yield self._payload

    async def read(self) -> bytes:
        return self._payload

    def close(self) -> None:
        pass


class InstantUpstream:
    """Answers every request at once with the same non-streamed answer."""

    def __init__(self, payload: bytes) -> None:
        self._payload = payload
        self._headers = CIMultiDictProxy(CIMultiDict(UPSTREAM_HEADERS))

    async def send(
        self, method: str, raw_path: str, headers: Mapping[str, str], body: Body
    ) -> UpstreamResponse:
        return _Response(self._payload, self._headers)


def best_us(run: Callable[[], None], n: int, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        gc.collect()
        t0 = time.perf_counter_ns()
        run()
        best = min(best, (time.perf_counter_ns() - t0) / n / 1000)
    return best


async def best_us_async(
    make: Callable[[int], list[Any]],
    step: Callable[[Any], Awaitable[Any]],
    n: int,
    repeat: int,
) -> float:
    """Inputs are built (outside the timing) afresh for each run: steps that consume them."""
    best = float("inf")
    for _ in range(repeat):
        inputs = make(n)
        gc.collect()
        gc.freeze()  # the prebuilt inputs are not this step's garbage to walk
        t0 = time.perf_counter_ns()
        for item in inputs:
            await step(item)
        best = min(best, (time.perf_counter_ns() - t0) / n / 1000)
        gc.unfreeze()
    return best


class MemoryClient:
    """A ``ClientSide`` in memory: the request's body buffered, the answer kept."""

    __slots__ = ("_body", "answer", "headers", "status")

    method = "POST"
    path = raw_path = PATH
    passed_fields = None  # the headers are filtered, as for a Connection naming a field
    has_body = True

    def __init__(self, headers: CIMultiDictProxy[str], body: bytes) -> None:
        self.headers = headers
        self._body = body
        self.status = 0
        self.answer = b""

    def header(self, name: bytes) -> str | None:
        return self.headers.get(name.decode("latin-1"))

    async def read_body(self, limit: int) -> bytes:
        return self._body

    async def body_chunks(self) -> AsyncIterator[bytes]:
        yield self._body

    async def respond(self, status: int, headers: HeaderFields, body: bytes) -> None:
        self.status, self.answer = status, body

    async def start(self, status: int, headers: HeaderFields) -> None:
        self.status = status

    async def write(self, data: bytes) -> None:
        self.answer += data

    def write_nowait(self, data: bytes) -> bool:
        self.answer += data
        return True

    async def drain(self) -> None:
        pass

    async def end(self) -> None:
        pass


def requests(body: bytes, n: int) -> list[MemoryClient]:
    """``n`` requests with the body buffered."""
    headers = CIMultiDictProxy(CIMultiDict({**CLIENT_HEADERS, "Content-Length": str(len(body))}))
    return [MemoryClient(headers, body) for _ in range(n)]


def settings_for(loops: bool) -> Settings:
    return load_settings(
        env={
            "DETPROXY_AUDIT__SAMPLE_RATE": "0",
            "DETPROXY_AUDIT__PASSIVE_CHECKS": "false",
            "DETPROXY_LOOPS__ENABLED": "true" if loops else "false",
        },
        flags={"upstream": "http://127.0.0.1:8000"},
    )


def proxy_app(loops: bool, answer: bytes) -> Any:
    """build_app's app, with its runtime made by hand as its cleanup context would (no
    session: the upstream is in memory), and the same policy chain."""
    settings = settings_for(loops)
    app = build_app(settings, registry=CollectorRegistry())
    config = settings.loops
    budget = RecoveryBudget(
        config.recovery_token_share, config.recovery_token_floor, config.recovery_window_s
    )
    ladders = [
        Ladder(lad.models, lad.action, tuple(lad.attempts), lad.on_exhausted)
        for lad in config.ladder_list()
    ]
    chain = PolicyChain([LoopLadderPolicy(ladders, budget)])
    recovery = Recovery(config, chain, app[BUS], budget=budget)
    upstream = InstantUpstream(answer)
    forwarder = Forwarder(settings, upstream, app[BUS], recovery)
    app[RUNTIME] = Runtime(forwarder, None, None, None, budget)
    return app


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=10_000, help="requests per run")
    parser.add_argument("--repeat", type=int, default=5, help="runs per figure (best is kept)")
    args = parser.parse_args()
    n, repeat = args.n, args.repeat

    body = request_body(False)
    answer = make_json_answer()
    parsed_answer = parse_answer(answer)
    assert parsed_answer is not None
    app_off = proxy_app(False, answer)
    app_on = proxy_app(True, answer)
    bus = app_on[BUS]
    forwarder_on = app_on[RUNTIME].forwarder
    recovery: Recovery = forwarder_on._recovery  # type: ignore[assignment]
    client = requests(body, 1)[0]
    given = CIMultiDictProxy(CIMultiDict({**CLIENT_HEADERS, "X-Request-Id": "my-request-0001"}))
    upstream_headers = CIMultiDictProxy(CIMultiDict(UPSTREAM_HEADERS))
    rid = request_id_of(client.headers.get("X-Request-Id"))
    parsed = parse_object(body)
    view = classify("chat", parsed)

    rows: list[tuple[str, float]] = []

    def run_sync(label: str, fn: Callable[[], object]) -> None:
        def run() -> None:
            for _ in range(n):
                fn()

        rows.append((label, best_us(run, n, repeat)))

    run_sync("request_id_of (minted)", lambda: request_id_of(client.headers.get("X-Request-Id")))
    run_sync("request_id_of (given)", lambda: request_id_of(given.get("X-Request-Id")))

    run_sync(
        "ensure_json_content_type", lambda: ensure_json_content_type(client.header(b"content-type"))
    )
    run_sync("parse_object (request body)", lambda: parse_object(body))
    run_sync("classify", lambda: classify("chat", parsed))
    run_sync(
        "upstream_request_headers",
        lambda: upstream_request_headers(client.headers, rid, proxy_reads_body=True),
    )
    run_sync("client_response_headers", lambda: client_response_headers(upstream_headers, rid))

    def publish() -> None:
        bus.publish(RequestStarted("chat"))
        bus.publish(RequestFinished("chat", MODEL, False, True, 200, "ok", 0.0021, 0.002))

    run_sync("publish RequestStarted + RequestFinished", publish)
    run_sync("parse_answer (~1 KB)", lambda: parse_answer(answer))
    # The passive checks' own steps on a non-streamed answer (the store's swap aside).
    run_sync("passive: canonical_request_key", lambda: canonical_request_key(parsed))
    run_sync("passive: outcome_from_response", lambda: outcome_from_response("chat", parsed_answer))
    outcome = outcome_from_response("chat", parsed_answer)
    run_sync("passive: digest_outcome", lambda: digest_outcome(outcome))

    def decide() -> None:
        attempts = Attempts(recovery.context, rid, view.model, "chat", False, None, parsed)
        attempts.decided(None, 200, parsed_answer)

    run_sync("Attempts + Attempts.decided (clean answer)", decide)

    def watch() -> None:
        w = recovery.context.settings.watch("chat")
        assert w is not None
        w.on_answer(parsed_answer)

    run_sync("loops on: LoopSettings.watch + LoopWatch.on_answer", watch)

    # The whole path below runs with passive checks off: their steps are not in the sums.
    left_out = ("loops on", "request_id_of (given)", "passive: ")
    total_off = sum(v for k, v in rows if not k.startswith(left_out))
    total_on = total_off + dict(rows)["loops on: LoopSettings.watch + LoopWatch.on_answer"]

    whole: list[tuple[str, float]] = []
    for label, app in (("loops off", app_off), ("loops on", app_on)):
        handle = app[RUNTIME].forwarder.handle
        probe = requests(body, 1)[0]
        await handle(probe)  # the path measured answers as a proxied request is answered
        assert probe.status == 200 and probe.answer == answer, f"answered {probe.status}"
        whole.append(
            (
                f"Forwarder.handle, {label}",
                await best_us_async(lambda k: requests(body, k), handle, n, repeat),
            )
        )

    width = max(len(k) for k, _ in rows + whole) + 2
    loop = type(asyncio.get_running_loop())
    where = Path(proxy.__file__).parent.parent
    print(f"detproxy per-request work in {where}, event loop {loop.__module__}")
    print(f"us per request, best of {repeat} runs of {n} requests")
    print(f"{'step':<{width}}{'us':>8}")
    for label, us in rows:
        print(f"{label:<{width}}{us:>8.2f}")
    print(f"{'sum of steps, loops off':<{width}}{total_off:>8.2f}")
    print(f"{'sum of steps, loops on':<{width}}{total_on:>8.2f}")
    print()
    for label, us in whole:
        print(f"{label:<{width}}{us:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
