"""What auditing costs: client latency and extra upstream load, audit off vs 100%.

    .venv/bin/python tests/bench/bench_audit.py [--requests 60] [--concurrency 4]

One emulator (vLLM's API, a fixed time per token) and four detproxy configurations in
front of it, driven in interleaved rounds by the same client. Prints p50/p99 latency as the
client sees it, the ratio to "off", and the upstream requests and generated tokens per
client request (read from the emulator's /metrics). Figures only, no assertions.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import time
from contextlib import AsyncExitStack
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry

from proxy.app import build_app
from proxy.config import ServerConfig, load_settings
from proxy.serving import serving
from proxy.tools.emulator import EmulatorConfig, EmulatorServer

CONFIGS: dict[str, dict[str, str]] = {
    "off": {"DETPROXY_AUDIT__SAMPLE_RATE": "0", "DETPROXY_AUDIT__PASSIVE_CHECKS": "false"},
    "full": {"DETPROXY_AUDIT__SAMPLE_RATE": "1"},
    "prefill": {"DETPROXY_AUDIT__SAMPLE_RATE": "1", "DETPROXY_AUDIT__SHADOW_MODE": "prefill"},
    "full-quiet": {
        "DETPROXY_AUDIT__SAMPLE_RATE": "1",
        "DETPROXY_AUDIT__SCHEDULE": "quiet",
        "DETPROXY_AUDIT__QUIET_DEADLINE_S": "600",
    },
}
COMMON = {"DETPROXY_AUDIT__MAX_SHADOWS_PER_S": "100000", "DETPROXY_AUDIT__QUEUE_SIZE": "100000"}


async def start(stack: AsyncExitStack, app: web.Application, server: ServerConfig) -> str:
    """The app served as ``detproxy serve`` serves it (the lean front), until ``stack`` closes."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    stack.callback(listener.close)
    await stack.enter_async_context(serving(app, server, listener))
    return f"http://127.0.0.1:{listener.getsockname()[1]}"


async def upstream_counts(http: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    text = await (await http.get(url + "/metrics")).text()
    requests = tokens = 0.0
    for line in text.splitlines():
        if line.startswith("vllm:request_success_total"):
            requests += float(line.split()[-1])
        elif line.startswith("vllm:generation_tokens_total"):
            tokens += float(line.split()[-1])
    return requests, tokens


async def settle(http: aiohttp.ClientSession, url: str) -> None:
    while True:
        shadow = (await (await http.get(url + "/detproxy/status")).json())["shadow"]
        if shadow is None or (shadow["queued"] == 0 and shadow["running"] == 0):
            return
        await asyncio.sleep(0.01)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=60, help="per configuration")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--token-latency", type=float, default=0.002, help="seconds per token")
    args = parser.parse_args()

    emulator = EmulatorServer(EmulatorConfig(token_latency_s=args.token_latency))
    upstream = await emulator.start()
    proxies: dict[str, str] = {}
    served = AsyncExitStack()
    for name, env in CONFIGS.items():
        settings = load_settings(env=COMMON | env, flags={"upstream": upstream})
        app = build_app(settings, registry=CollectorRegistry())
        proxies[name] = await start(served, app, settings.server)
    latencies: dict[str, list[float]] = {n: [] for n in CONFIGS}
    load: dict[str, list[float]] = {n: [0.0, 0.0] for n in CONFIGS}
    async with aiohttp.ClientSession() as http:
        sem = asyncio.Semaphore(args.concurrency)

        async def one(name: str, i: int) -> None:
            body: dict[str, Any] = {
                "model": "emulator-model",
                "temperature": 0,
                "max_tokens": args.max_tokens,
                "stream": i % 2 == 0,
                "messages": [{"role": "user", "content": f"benchmark prompt {i}"}],
            }
            async with sem:
                t0 = time.perf_counter()
                resp = await http.post(proxies[name] + "/v1/chat/completions", json=body)
                await resp.read()
                latencies[name].append(time.perf_counter() - t0)

        rounds = 6
        per_round = max(1, args.requests // rounds)
        for r in range(rounds):  # interleaved: every configuration in every round
            for name in CONFIGS:
                before = await upstream_counts(http, upstream)
                await asyncio.gather(*(one(name, r * per_round + i) for i in range(per_round)))
                await settle(http, proxies[name])
                after = await upstream_counts(http, upstream)
                load[name][0] += after[0] - before[0]
                load[name][1] += after[1] - before[1]
    await served.aclose()
    await emulator.stop()

    base = statistics.median(latencies["off"])
    print(
        f"{len(latencies['off'])} requests per configuration, concurrency "
        f"{args.concurrency}, {args.max_tokens} tokens at {args.token_latency * 1000:.1f} "
        "ms/token, half streamed"
    )
    print(
        f"{'config':<11} {'p50 ms':>8} {'p99 ms':>8} {'p50/off':>8} "
        f"{'upstream req/client req':>24} {'gen tokens/client req':>22}"
    )
    for name, values in latencies.items():
        values.sort()
        p50 = statistics.median(values)
        p99 = values[min(len(values) - 1, int(0.99 * len(values)))]
        n = len(values)
        print(
            f"{name:<11} {p50 * 1000:8.2f} {p99 * 1000:8.2f} {p50 / base:8.3f} "
            f"{load[name][0] / n:24.2f} {load[name][1] / n:22.2f}"
        )


if __name__ == "__main__":
    asyncio.run(main())
