"""What detproxy's default audit costs, with only greedy client traffic.

    .venv/bin/python tests/bench/bench_defaults.py --engine emulator [--requests 240]
    .venv/bin/python tests/bench/bench_defaults.py --engine llama-server   # /tmp/engine.env

Two ``detproxy serve --upstream URL`` processes in front of one engine, started as a user
starts them: one with the defaults only (audit on: ``audit.sample_rate`` 0.05, one audit a
minute per model at least, the token budgets), one with the audit off (``--sample-rate 0``,
``DETPROXY_AUDIT__AT_LEAST_EVERY_S=0``). The same greedy requests (the openai SDK, a pool of
prompts of which some repeat, as real traffic does) go through each in interleaved rounds.
Printed: the engine's tokens (from its own /metrics) per phase and their ratio (generated
tokens are the exact measure; llama-server's evaluated prompt tokens leave out what its prompt
cache held), the client latency p50/p99 through each, and the time from the first request
until the first audit shows in /detproxy/metrics. At low traffic the floor (one audit a minute)
dominates the cost: a run's share of audits depends on its length as well as on its requests.
Bounded by --requests and --deadline-s; figures only, no assertions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from openai import AsyncOpenAI  # noqa: E402

from tests.helpers.llama_server import run_engine  # noqa: E402
from tests.helpers.metrics import metric_samples  # noqa: E402
from tests.helpers.processes import EXE, free_port, stop, wait_http  # noqa: E402

# The engine's own token counters: (prompt, generated).
COUNTERS = {
    "emulator": ("vllm:prompt_tokens_total", "vllm:generation_tokens_total"),
    "llama-server": ("llamacpp:prompt_tokens_total", "llamacpp:tokens_predicted_total"),
}
TOPICS = [
    "the tides",
    "a compiler",
    "photosynthesis",
    "the stock market",
    "volcanoes",
    "a bicycle",
    "the moon",
    "coffee",
    "rainbows",
    "bread",
    "jazz",
    "glaciers",
]


def prompts(distinct: int) -> list[str]:
    return [f"In two sentences, explain {TOPICS[i % len(TOPICS)]} (#{i})." for i in range(distinct)]


def engine_tokens(url: str, kind: str) -> tuple[float, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        samples = metric_samples(resp.read().decode())
    prompt, generated = COUNTERS[kind]
    return (
        sum(v for k, v in samples.items() if k.split("{")[0] == prompt),
        sum(v for k, v in samples.items() if k.split("{")[0] == generated),
    )


def detproxy_audits(url: str) -> float:
    """Shadow audits completed (full or prefill), from /detproxy/metrics."""
    with urllib.request.urlopen(url + "/detproxy/metrics", timeout=10) as resp:
        samples = metric_samples(resp.read().decode(), "detproxy_audits_total")
    return sum(v for k, v in samples.items() if 'mode="full"' in k or 'mode="prefill"' in k)


def shadows_idle(url: str) -> bool:
    with urllib.request.urlopen(url + "/detproxy/status", timeout=10) as resp:
        shadow = json.loads(resp.read())["shadow"]
    return shadow is None or shadow["queued"] == shadow["running"] == 0


def start_detproxy(stack: ExitStack, upstream: str, state: Path, off: bool, logdir: Path) -> str:
    port = free_port()
    argv = [EXE, "serve", "--upstream", upstream, "--port", str(port)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DETPROXY_")}
    env["DETPROXY_STATE_DIR"] = str(state)
    if off:
        argv += ["--sample-rate", "0"]
        env["DETPROXY_AUDIT__AT_LEAST_EVERY_S"] = "0"
    log = stack.enter_context(open(logdir / f"detproxy-{'off' if off else 'on'}.log", "wb"))  # noqa: SIM115
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    stack.callback(stop, proc)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/detproxy/health", proc, timeout=30)
    return url


def start_emulator(stack: ExitStack, token_latency_s: float, logdir: Path) -> str:
    port = free_port()
    log = stack.enter_context(open(logdir / "emulator.log", "wb"))  # noqa: SIM115
    argv = [EXE, "emulator", "--port", str(port), "--token-latency", str(token_latency_s)]
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    stack.callback(stop, proc)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", proc, timeout=30)
    return url


class Phase:
    def __init__(self, name: str) -> None:
        self.name = name
        self.latencies: list[float] = []
        self.client_prompt = 0
        self.client_completion = 0
        self.engine_prompt = 0.0
        self.engine_generated = 0.0


async def one_round(
    url: str, model: str, batch: list[str], concurrency: int, max_tokens: int, phase: Phase
) -> None:
    client = AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    gate = asyncio.Semaphore(concurrency)

    async def ask(prompt: str) -> None:
        async with gate:
            t0 = time.perf_counter()
            answer = await client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": prompt}],
                temperature=0,
                max_tokens=max_tokens,
            )
            phase.latencies.append(time.perf_counter() - t0)
            if answer.usage is not None:
                phase.client_prompt += answer.usage.prompt_tokens
                phase.client_completion += answer.usage.completion_tokens

    try:
        await asyncio.gather(*(ask(p) for p in batch))
    finally:
        await client.close()


def wait_idle(url: str, limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while not shadows_idle(url) and time.monotonic() < deadline:
        time.sleep(0.05)


async def first_audit(url: str, t0: float) -> float:
    """Seconds from ``t0`` until /detproxy/metrics shows a completed audit (polled every 0.1 s)."""
    while True:  # another process's page: polled
        if await asyncio.to_thread(detproxy_audits, url) > 0:
            return time.monotonic() - t0
        await asyncio.sleep(0.1)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


async def run(args: argparse.Namespace, engine: str, model: str, logdir: Path) -> None:
    pool = prompts(args.distinct)
    rng_order = [pool[(i * 7) % len(pool)] for i in range(args.requests)]  # repeats, mixed
    rounds = [rng_order[i : i + args.round] for i in range(0, len(rng_order), args.round)]
    phases = {"off": Phase("audit off"), "on": Phase("defaults")}
    first_audit_s: float | None = None
    deadline = time.monotonic() + args.deadline_s
    with ExitStack() as stack:
        urls = {
            "off": start_detproxy(stack, engine, logdir / "state-off", True, logdir),
            "on": start_detproxy(stack, engine, logdir / "state-on", False, logdir),
        }
        watch: asyncio.Task[float] | None = None
        for n, batch in enumerate(rounds):
            if time.monotonic() > deadline:
                print(f"deadline reached after {sum(len(p.latencies) for p in phases.values())}")
                break
            # Each goes first every other round: the first of a pair meets the engine's prompt
            # cache cold for this batch's prompts, the second warm.
            for key in ("off", "on") if n % 2 == 0 else ("on", "off"):
                if key == "on" and watch is None:  # from the first request through "on"
                    watch = asyncio.create_task(first_audit(urls["on"], time.monotonic()))
                before = engine_tokens(engine, args.engine)
                await one_round(
                    urls[key], model, batch, args.concurrency, args.max_tokens, phases[key]
                )
                await asyncio.to_thread(wait_idle, urls[key], 120.0)  # its shadows: its phase
                after = engine_tokens(engine, args.engine)
                phases[key].engine_prompt += after[0] - before[0]
                phases[key].engine_generated += after[1] - before[1]
        if watch is not None:
            if watch.done():
                first_audit_s = watch.result()
            watch.cancel()
        audits = detproxy_audits(urls["on"])
        state_file = logdir / "state-on" / "incidents.jsonl"
        on_disk = state_file.exists()
    print(f"engine {args.engine} at {engine}, model {model}")
    print(
        f"{args.requests} greedy chat requests per phase ({args.distinct} distinct prompts, "
        f"repeated), concurrency {args.concurrency}, max_tokens {args.max_tokens}, "
        f"rounds of {args.round}, interleaved"
    )
    print(
        f"{'phase':<12}{'p50 ms':>9}{'p99 ms':>9}{'client prompt':>15}{'client gen':>12}"
        f"{'engine prompt':>15}{'engine gen':>12}"
    )
    for phase in phases.values():
        print(
            f"{phase.name:<12}{pct(phase.latencies, 0.5):>9.1f}{pct(phase.latencies, 0.99):>9.1f}"
            f"{phase.client_prompt:>15}{phase.client_completion:>12}"
            f"{phase.engine_prompt:>15.0f}{phase.engine_generated:>12.0f}"
        )
    off, on = phases["off"], phases["on"]
    # Prompt tokens the engine evaluated exclude what its prompt cache held (llama-server):
    # generated tokens are the exact measure of the extra decoding.
    generated = on.engine_generated / off.engine_generated
    evaluated = on.engine_prompt / off.engine_prompt
    print(f"engine generated tokens, defaults / audit off: {generated:.3f}")
    print(f"engine prompt tokens evaluated, defaults / audit off: {evaluated:.3f}")
    both_on, both_off = (
        on.engine_prompt + on.engine_generated,
        off.engine_prompt + off.engine_generated,
    )
    print(f"engine tokens (both), defaults / audit off: {both_on / both_off:.3f}")
    p50_ratio = statistics.median(on.latencies) / statistics.median(off.latencies)
    print(f"client p50 defaults / off: {p50_ratio:.3f}")
    print(f"audits (full) in /detproxy/metrics: {audits:.0f}")
    shown = "never" if first_audit_s is None else f"{first_audit_s:.1f} s"
    print(f"first audit in /detproxy/metrics after the first request: {shown}")
    print(f"incident file under DETPROXY_STATE_DIR: {'yes' if on_disk else 'no'} ({state_file})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=sorted(COUNTERS), default="emulator")
    parser.add_argument("--requests", type=int, default=240, help="per phase")
    parser.add_argument("--distinct", type=int, default=40, help="distinct prompts in the pool")
    parser.add_argument("--round", type=int, default=20, help="requests per interleaved round")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--token-latency-s", type=float, default=0.005, help="emulator only")
    parser.add_argument("--deadline-s", type=float, default=600.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-defaults-") as tmp, ExitStack() as stack:
        logdir = Path(tmp)
        if args.engine == "emulator":
            engine, model = start_emulator(stack, args.token_latency_s, logdir), "emulator-model"
        else:
            eng = stack.enter_context(run_engine(logdir, "-np", "4", "-c", "8192"))
            engine, model = eng.url, eng.model
        asyncio.run(run(args, engine, model, logdir))


if __name__ == "__main__":
    main()
