"""A burst of divergences on a handful of prompts, against live triage's defaults.

    .venv/bin/python tests/bench/bench_burst.py [--divergences 100] [--prompts 10]
        [--concurrency 8] [--max-tokens 48] [--deadline-s 600]

What issue 48 asks of the defaults: a burst of 100 divergences on 10 prompts given a cause
within 10 minutes, for at most 5% more engine tokens. One emulator (vLLM's API) with a batch
effect only (``--batch-divergence-slope``: a greedy answer beside others in flight diverges
with a probability that grows with their number; alone it never does), and one ``detproxy
serve --upstream URL`` with nothing else, both started as a user starts them. Greedy chat
requests on ``--prompts`` prompts go through detproxy ``--concurrency`` at a time (the openai
SDK), until detproxy's audit incidents (the passive duplicate checks' and the 5% of shadows')
count ``--divergences`` or ``--max-requests`` were sent. Then nothing is sent, and the
incidents are read until every one carries a cause that is not a budget's ``unknown``, or
``--deadline-s`` from the first request passed.

Printed: requests sent and the time the burst took; incidents and their causes (``unknown`` by
what it names); when the last cause came, from the first request; triage's experiments and
tokens; the engine's tokens (its own /metrics) against what the clients were answered (their
``usage``), with triage's share of them. The truth is ``batch`` for every divergence here (no
other effect is injected). Figures only, no assertions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from openai import AsyncOpenAI  # noqa: E402

from tests.bench.bench_defaults import engine_tokens, prompts  # noqa: E402
from tests.helpers.processes import EXE, free_port, stop, wait_http  # noqa: E402

MODEL = "emulator-model"
BUDGET = "triage budget"  # what an incident left unknown for a budget names


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def incidents(proxy: str) -> list[dict[str, Any]]:
    """detproxy's audit incidents (every one a divergence: identical audits make none)."""
    return list(get_json(proxy + "/detproxy/incidents?limit=1000&kind=audit"))


def reason(incident: dict[str, Any]) -> str:
    """The cause, or for ``unknown`` the cause and the first thing it names as missing."""
    cause = str(incident.get("cause") or "none yet")
    if cause != "unknown":
        return cause
    missing = (incident.get("cause_evidence") or {}).get("missing") or ["?"]
    return f"unknown: {str(missing[0])[:60]}"


def settled(incident: dict[str, Any]) -> bool:
    """A cause that will not change: given, and not a budget's unknown (triaged again)."""
    cause = incident.get("cause")
    return cause is not None and not (cause == "unknown" and BUDGET in reason(incident))


def start(stack: ExitStack, argv: list[str], health: str, log: Path, env: dict[str, str]) -> str:
    port = free_port()
    out = stack.enter_context(open(log, "wb"))  # noqa: SIM115
    proc = subprocess.Popen(
        [*argv, "--port", str(port)], stdout=out, stderr=subprocess.STDOUT, env=env
    )
    stack.callback(stop, proc)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + health, proc, timeout=30)
    return url


async def burst(args: argparse.Namespace, proxy: str, t0: float) -> tuple[int, int, float]:
    """Requests until the incidents count ``--divergences``; (requests, client tokens, s)."""
    client = AsyncOpenAI(base_url=proxy + "/v1", api_key="none", max_retries=0, timeout=120)
    pool = prompts(args.prompts)
    sent = tokens = 0

    async def ask(prompt: str) -> None:
        nonlocal tokens
        answer = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": prompt}],
            temperature=0,
            max_tokens=args.max_tokens,
        )
        if answer.usage is not None:
            tokens += answer.usage.prompt_tokens + answer.usage.completion_tokens

    try:
        while sent < args.max_requests and time.monotonic() - t0 < args.deadline_s:
            wave = [pool[(sent + i) % len(pool)] for i in range(args.concurrency)]
            await asyncio.gather(*(ask(p) for p in wave))
            sent += len(wave)
            found = await asyncio.to_thread(incidents, proxy)
            if len(found) >= args.divergences:
                break
    finally:
        await client.close()
    return sent, tokens, time.monotonic() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--divergences", type=int, default=100)
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--max-requests", type=int, default=4000)
    parser.add_argument("--deadline-s", type=float, default=600.0)
    parser.add_argument("--slope", type=float, default=0.1, help="--batch-divergence-slope")
    parser.add_argument("--token-latency-s", type=float, default=0.004)
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DETPROXY_")}
    with tempfile.TemporaryDirectory(prefix="bench-burst-") as tmp, ExitStack() as stack:
        logs = Path(tmp)
        emulator = [EXE, "emulator", "--token-latency", str(args.token_latency_s)]
        emulator += ["--batch-divergence-slope", str(args.slope), "--seed", "3"]
        engine = start(stack, emulator, "/health", logs / "emulator.log", env)
        proxy = start(
            stack,
            [EXE, "serve", "--upstream", engine],
            "/detproxy/health",
            logs / "detproxy.log",
            env | {"DETPROXY_STATE_DIR": str(logs / "state")},
        )
        before = engine_tokens(engine, "emulator")
        t0 = time.monotonic()
        sent, client_tokens, took = asyncio.run(burst(args, proxy, t0))
        last_change, seen = took, Counter[str]()
        while time.monotonic() - t0 < args.deadline_s:
            found = incidents(proxy)
            now = Counter(reason(i) for i in found)
            if now != seen:
                seen, last_change = now, time.monotonic() - t0
            if found and all(settled(i) for i in found):
                break
            time.sleep(1.0)  # another process's state, polled
        status = get_json(proxy + "/detproxy/status")
        after = engine_tokens(engine, "emulator")
    engine_total = sum(after) - sum(before)
    triage = status["triage"]
    print(
        f"emulator: batch effect only (slope {args.slope}), {args.token_latency_s * 1000:g} ms"
        f" a token; detproxy serve --upstream URL, nothing else"
    )
    print(
        f"burst: {sent} greedy requests on {args.prompts} prompts, {args.concurrency} at a time,"
        f" max_tokens {args.max_tokens}: {took:.1f} s"
    )
    total = sum(seen.values())
    print(f"audit incidents: {total}; the causes, {last_change:.1f} s after the first request:")
    for name, n in seen.most_common():
        print(f"  {n:5d}  {name}")
    right = seen.get("batch", 0)
    print(f"batch (the truth): {right} of {total} ({right / max(total, 1):.0%})")
    print(
        f"triage: {triage['triaged']} experiments, {triage['explained']} incidents explained,"
        f" {triage['tokens']} tokens (budget {triage['token_budget']:.0f}),"
        f" queued {triage['queued']}, again {triage['again_incidents']}"
    )
    print(
        f"engine tokens {engine_total:.0f} for {client_tokens} answered to clients:"
        f" {engine_total / max(client_tokens, 1):.3f}x; triage's {triage['tokens']}"
        f" = {triage['tokens'] / max(client_tokens, 1):.1%} of the clients'"
    )


if __name__ == "__main__":
    main()
