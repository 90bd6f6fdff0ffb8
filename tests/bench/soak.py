"""Soak: several minutes of mixed traffic through a real detproxy process, with its RSS, open
file descriptors and asyncio task count at the start and at the end.

    .venv/bin/python tests/bench/soak.py [--minutes 3] [--concurrency 16]

The upstream is the emulator (its own process) with injected nondeterminism, loops on some
requests, and faults on a few; detproxy audits every greedy request and retries loops. A
flat RSS, a stable fd count and a stable task count at the end mean nothing leaks.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.helpers.processes import EXE, free_port


def proc_figures(pid: int) -> dict[str, int]:
    status = Path(f"/proc/{pid}/status").read_text()
    rss = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS"))
    return {"rss_kib": rss, "fds": len(list(Path(f"/proc/{pid}/fd").iterdir()))}


async def wait_up(http: aiohttp.ClientSession, url: str) -> None:
    for _ in range(200):
        try:
            async with http.get(url) as resp:
                if resp.status == 200:
                    return
        except aiohttp.ClientError:
            await asyncio.sleep(0.05)
    raise RuntimeError(f"{url} did not come up")


async def snapshot(http: aiohttp.ClientSession, base: str, pid: int) -> dict[str, Any]:
    status = await (await http.get(base + "/detproxy/status")).json()
    return proc_figures(pid) | {
        "tasks": status["tasks"],
        "inflight": status["inflight"],
        "audits": status["audit"]["audits"],
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    emu_port, port = free_port(), free_port()
    emulator = await asyncio.create_subprocess_exec(
        EXE,
        "emulator",
        "--port",
        str(emu_port),
        "--token-latency",
        "0.002",
        "--flip-probability",
        "0.05",
        "--logprob-jitter",
        "0.05",
        stderr=asyncio.subprocess.DEVNULL,
    )
    proxy = await asyncio.create_subprocess_exec(
        EXE,
        "serve",
        "--upstream",
        f"http://127.0.0.1:{emu_port}",
        "--port",
        str(port),
        "--sample-rate",
        "1",
        "--loop-policy",
        "retry",
        "--workers",
        "1",  # RSS, fds and tasks are read from this one process
        stderr=asyncio.subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    outcomes: Counter[str] = Counter()
    rng = random.Random(1)
    try:
        async with aiohttp.ClientSession() as http:
            await wait_up(http, f"http://127.0.0.1:{emu_port}/health")
            await wait_up(http, base + "/detproxy/health")
            start = await snapshot(http, base, proxy.pid)
            deadline = time.monotonic() + args.minutes * 60

            async def worker(n: int) -> None:
                i = 0
                while time.monotonic() < deadline:
                    i += 1
                    roll = rng.random()
                    knobs: dict[str, Any] = {}
                    if roll < 0.1:
                        knobs = {"loop_channel": "content", "loop_after_tokens": 4}
                    elif roll < 0.13:
                        knobs = {
                            "fault": rng.choice(["reset_mid_stream", "http_500", "malformed_json"])
                        }
                    body = {
                        "model": "emulator-model",
                        "max_tokens": rng.randint(4, 96),
                        "temperature": 0 if roll < 0.8 else 0.7,
                        "stream": roll < 0.6,
                        "messages": [{"role": "user", "content": f"soak {n}-{i % 50}"}],
                    }
                    headers = {"X-Emulator-Knobs": orjson.dumps(knobs).decode()} if knobs else {}
                    try:
                        async with http.post(
                            base + "/v1/chat/completions", json=body, headers=headers
                        ) as resp:
                            await resp.read()
                            outcomes[str(resp.status)] += 1
                    except aiohttp.ClientError as exc:
                        outcomes[type(exc).__name__] += 1
                    if rng.random() < 0.02:  # a client that gives up mid-stream
                        try:
                            async with http.post(
                                base + "/v1/chat/completions", json=body | {"stream": True}
                            ) as resp:
                                await resp.content.readline()
                        except aiohttp.ClientError:
                            pass
                        outcomes["abandoned"] += 1

            await asyncio.gather(*(worker(n) for n in range(args.concurrency)))
            await asyncio.sleep(2)  # shadows drain
            end = await snapshot(http, base, proxy.pid)
    finally:
        for proc in (proxy, emulator):
            proc.terminate()
            await proc.wait()
    total = sum(v for k, v in outcomes.items() if k != "abandoned")
    print(
        f"soak: {args.minutes:g} min, {args.concurrency} clients, {total} requests "
        f"({total / (args.minutes * 60):.0f}/s), outcomes {dict(outcomes)}"
    )
    print(f"{'':10} {'RSS MiB':>8} {'fds':>5} {'tasks':>6} {'audits':>7}")
    for name, snap in (("start", start), ("end", end)):
        print(
            f"{name:10} {snap['rss_kib'] / 1024:8.1f} {snap['fds']:5} {snap['tasks']:6} "
            f"{snap['audits']:7}"
        )


if __name__ == "__main__":
    asyncio.run(main())
