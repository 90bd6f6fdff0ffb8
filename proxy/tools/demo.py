"""``detproxy demo``: the first thing to run. It starts the vLLM emulator with injected
nondeterminism and repetition loops, detproxy in front of it (every greedy request audited,
loops retried), sends a short burst of traffic, prints what was detected and recovered and
where to look, and stops everything it started."""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from prometheus_client import CollectorRegistry

from proxy.app import build_app
from proxy.config import load_settings
from proxy.tools.emulator import EmulatorConfig, EmulatorServer

MODEL = "emulator-model"
PROMPTS = [
    "Extract the invoice date and total from: 'Invoice 2291, 3 March 2024, total 1,240.50 EUR'",
    "Summarise the plot of Hamlet in two sentences.",
    "What is 17 times 23? Answer with the number only.",
    "List three uses of a paperclip.",
    "Translate 'good morning' into French, German and Spanish.",
    "Write a haiku about autumn rain.",
]
LOOP_KNOBS = [
    {"loop_channel": "content", "loop_after_tokens": 6},
    {"loop_channel": "reasoning", "loop_after_tokens": 4, "reasoning_tokens": 8},
]


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def _traffic(http: aiohttp.ClientSession, proxy: str, requests: int) -> Counter[str]:
    outcomes: Counter[str] = Counter()
    sem = asyncio.Semaphore(4)

    async def one(i: int) -> None:
        body: dict[str, Any] = {
            "model": MODEL,
            "temperature": 0,
            "max_tokens": 160,
            "stream": i % 2 == 1,
            "messages": [{"role": "user", "content": PROMPTS[i % 6]}],
        }
        headers = {"X-Request-Id": f"demo-{i:03d}"}
        if i % 5 == 4:  # a prompt that makes this model loop
            knobs = LOOP_KNOBS[(i // 5) % 2]
            headers["X-Emulator-Knobs"] = orjson.dumps(knobs).decode()
            body["stream_options"] = {"include_usage": True} if body["stream"] else None
            body = {k: v for k, v in body.items() if v is not None}
        async with (
            sem,
            http.post(proxy + "/v1/chat/completions", json=body, headers=headers) as resp,
        ):
            await resp.read()
            outcomes["ok" if resp.status == 200 else f"http {resp.status}"] += 1
            if resp.headers.get("X-Detproxy-Recovered") == "true":
                outcomes["recovered (non-streamed)"] += 1

    await asyncio.gather(*(one(i) for i in range(requests)))
    return outcomes


async def _settle(http: aiohttp.ClientSession, proxy: str, deadline_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + deadline_s
    while True:
        status: dict[str, Any] = await (await http.get(proxy + "/detproxy/status")).json()
        shadow = status["shadow"]
        idle = shadow is None or (shadow["queued"] == 0 and shadow["running"] == 0)
        if idle or time.monotonic() > deadline:
            return status
        await asyncio.sleep(0.05)


def _metric_lines(text: str, *names: str) -> list[str]:
    return [
        line for line in text.splitlines() if line.startswith(names) and not line.endswith(" 0.0")
    ]


async def run(requests: int, workdir: Path, out: Any) -> int:
    incidents = workdir / "incidents.jsonl"
    emulator = EmulatorServer(
        EmulatorConfig(
            flip_probability=0.1,
            flip_position=3,
            logprob_jitter_probability=0.1,
            seed=7,
            token_latency_s=0.002,
        )
    )
    upstream = await emulator.start()
    settings = load_settings(
        env={
            "DETPROXY_AUDIT__SAMPLE_RATE": "1",
            "DETPROXY_AUDIT__MAX_SHADOWS_PER_S": "1000",
            "DETPROXY_LOOPS__POLICY": "retry",
            "DETPROXY_LOOPS__STREAM_MODE": "hold_reasoning",
            "DETPROXY_INCIDENTS__PATH": str(incidents),
        },
        flags={"upstream": upstream},
    )
    runner, proxy = await _serve(build_app(settings, registry=CollectorRegistry()))
    t0 = time.monotonic()
    try:
        async with aiohttp.ClientSession() as http:
            out.write(
                f"emulator (vLLM API) on {upstream}, detproxy on {proxy}\n"
                f"sending {requests} greedy chat requests, 4 at a time...\n"
            )
            outcomes = await _traffic(http, proxy, requests)
            status = await _settle(http, proxy, 30)
            metrics = await (await http.get(proxy + "/detproxy/metrics")).text()
            recent = await (await http.get(proxy + "/detproxy/incidents?limit=1000")).json()
    finally:
        await runner.cleanup()
        await emulator.stop()
    injected = Counter(r["kind"] for r in emulator.injections())
    # What the model did on the client requests and their retries (not the shadows): each
    # looping attempt, and each retry whose penalty or temperature ended the loop.
    primary = Counter(
        r["kind"] for r in emulator.injections() if not r["request_id"].endswith("-shadow")
    )
    audit = status["audit"]
    rate = audit["nondeterminism_rate"]
    out.write(f"\ndone in {time.monotonic() - t0:.1f} s; client outcomes: {dict(outcomes)}\n\n")
    out.write(
        f"The emulator injected (primaries and shadows together): {dict(injected) or 'nothing'}\n"
    )
    out.write(
        f"Audits: {audit['audits']} {audit['modes']}, by verdict {audit['verdicts']}"
        + (f"; nondeterminism rate {rate:.0%}\n" if rate is not None else "\n")
    )
    divergences = [i for i in recent if i["kind"] == "audit" and i["divergence"]]
    for item in sorted(divergences, key=lambda i: i["request_id"])[:3]:
        d = item["divergence"]
        out.write(
            f"  {item['request_id']}: {item['verdict']} at token {d['index']} "
            f"({d['primary_token']!r} vs {d['shadow_token']!r}), "
            f"max |delta| {item['max_abs_logprob_delta']}\n"
        )
    out.write(
        f"The model looped on {primary['loop']} attempts of client requests and retries; "
        f"{primary['loop_escape']} retries escaped the loop\n"
    )
    loops = [i for i in recent if i["kind"] == "loop"]
    out.write(
        f"Loops detected: {len(loops)} "
        f"({dict(Counter((i['channel'], i['source']) for i in loops))})\n"
    )
    for line in _metric_lines(metrics, "detproxy_policy_actions_total"):
        out.write(f"  {line}\n")
    out.write(
        f"\nIncident log: {incidents}\n"
        f"  detproxy report {incidents}\n"
        "In production, look at /detproxy/metrics (Prometheus), /detproxy/incidents and "
        "/detproxy/status.\nEverything the demo started has stopped.\n"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="detproxy demo", description=__doc__)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument(
        "--dir",
        type=Path,
        help="where to keep the incident log (default: a new temporary directory)",
    )
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    workdir = args.dir or Path(tempfile.mkdtemp(prefix="detproxy-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    return asyncio.run(run(max(1, args.requests), workdir, sys.stdout))
