"""What one triage costs, with replays cut short after the point that matters and without.

    .venv/bin/python tests/bench/bench_triage.py [--cause batch|intrinsic] [--incidents 12]
        [--max-tokens 512] [--token-latency 0.002] [--settle 0.25]

One emulator (vLLM's API, a fixed time per token, answers generated to max_tokens:
``ignore_eos``) with one injected cause. N divergent audits are made first, as the auditor
would make them (batch: the primary beside 7 other requests, the shadow alone and cold;
intrinsic: both alone, flips at batch 1), each kept only when its verdict is one triage looks
into. Each is then triaged by ``Triage`` (proxy/attribution) once per arm, the arms in turn:

- before: ``replay_margin_tokens`` 100000 (nothing cut: every replay generates the client's
  max_tokens) and the quiet settle waited before every replay (the code before issue 38);
- cut: the default margin, the settle before every replay;
- cut+carried: the default margin, the settle carried over from a replay that ran alone (now).

Printed per arm: seconds per triage (p50, p99: from the offer until the cause is published),
replays and generated replay tokens per triage (the emulator's own counts), quiet waits per
triage and seconds per wait (the wait_quiet calls timed; ``--settle`` is
audit.quiet_settle_s, 0.25 by default), the causes found, and the ratios to "before". Figures
only, no assertions.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

import proxy.attribution.triage as triage_module
from proxy.attribution.case import TRIAGED, Diverged, TriageCase
from proxy.attribution.triage import Triage
from proxy.audit.compare import compare_choices
from proxy.audit.outcome import Outcome, outcome_from_response
from proxy.audit.shadow import wait_quiet
from proxy.config import AttributionConfig, AuditConfig
from proxy.events import CauseAttributed, EventBus
from proxy.http.h1 import H1Upstream
from proxy.tools.emulator import EmulatorConfig, EmulatorServer

MODEL = "emulator-model"
FILLERS = 7
PATH = "/v1/chat/completions"


class Load:
    """detproxy's client traffic as triage sees it: none (the quiet waits settle at once)."""

    inflight = 0
    started = 0


def body(prompt: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "temperature": 0,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 5,
        "messages": [{"role": "user", "content": prompt}],
    }


async def ask(http: aiohttp.ClientSession, url: str, payload: dict[str, Any]) -> Outcome:
    async with http.post(url + PATH, json=payload) as resp:
        resp.raise_for_status()
        return outcome_from_response("chat", await resp.json())


async def until(check: Callable[[], bool], what: str, deadline_s: float = 30.0) -> None:
    deadline = time.monotonic() + deadline_s
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"never happened: {what}")
        await asyncio.sleep(0.001)


async def make_case(
    http: aiohttp.ClientSession, emu: EmulatorServer, cause: str, i: int, max_tokens: int
) -> TriageCase | None:
    """One audit as the auditor makes it; None when primary and shadow agreed."""
    request = body(f"bench triage {cause} {i}", max_tokens)
    fillers: list[asyncio.Task[Outcome]] = []
    if cause == "batch":
        fillers = [
            asyncio.ensure_future(ask(http, emu.url, body(f"filler {i}-{j}", max_tokens)))
            for j in range(FILLERS)
        ]
        await until(lambda: emu.state.running >= FILLERS, "the fillers running")
    started = time.time()
    primary = await ask(http, emu.url, request)
    await asyncio.gather(*fillers)
    shadow_body = request | {"cache_salt": uuid.uuid4().hex}
    shadow = await ask(http, emu.url, shadow_body)
    verdict = compare_choices(primary.choices[0], shadow.choices[0])
    if verdict.verdict not in TRIAGED:
        return None
    now = time.time()
    crowd = FILLERS + 1 if cause == "batch" else 1
    return TriageCase(
        request_id=f"bench-{i}",
        model=MODEL,
        endpoint="chat",
        raw_path=PATH,
        body=request,
        headers={"Content-Type": "application/json"},
        mode="full",
        target="same",
        primary=primary,
        shadow=shadow,
        primary_inflight=crowd,
        primary_inflight_end=crowd,
        shadow_inflight=0,
        shadow_cold=True,
        shadow_alone=True,
        primary_at=started,
        shadow_at=now,
        estimated_tokens=(primary.prompt_tokens or 0) + (primary.completion_tokens or 0),
        diverged=(Diverged(0, verdict.verdict, now),),
    )


@dataclass
class Arm:
    name: str
    margin: int
    carry: bool  # False: every replay waits for the settle, as before (Triage._still_quiet)
    seconds: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    replays: list[int] = field(default_factory=list)
    quiet: list[float] = field(default_factory=list)  # one per wait_quiet call
    waits: list[int] = field(default_factory=list)  # wait_quiet calls per triage
    causes: Counter[str] = field(default_factory=Counter)
    limits: Counter[str] = field(default_factory=Counter)


def timed_quiet(
    original: Callable[..., Awaitable[bool]], into: list[list[float]]
) -> Callable[..., Awaitable[bool]]:
    async def wait(*args: Any, **kwargs: Any) -> bool:
        t0 = time.perf_counter()
        try:
            return await original(*args, **kwargs)
        finally:
            into[0].append(time.perf_counter() - t0)

    return wait


async def triage_once(
    arm: Arm,
    case: TriageCase,
    http: aiohttp.ClientSession,
    emu: EmulatorServer,
    audit: AuditConfig,
    sink: list[list[float]],
) -> None:
    bus = EventBus()
    found: list[CauseAttributed] = []
    bus.subscribe(CauseAttributed, found.append)
    config = AttributionConfig(
        cold_method="cache_salt",
        max_per_minute=1e6,
        token_allowance=10**12,
        replay_margin_tokens=arm.margin,
        quiet_deadline_s=600,
    )
    upstream = H1Upstream(
        emu.url,
        connect_timeout_s=10.0,
        read_timeout_s=3600.0,
        keepalive_timeout_s=4.0,
        max_connections=64,
    )
    triage = Triage(config, audit, bus, upstream, Load())
    if not arm.carry:
        setattr(triage, "_still_quiet", lambda: False)  # noqa: B010 (the previous behaviour)
    triage.start()
    sink[0] = arm.quiet
    waits_before = len(arm.quiet)
    tokens_before = emu.state.generation_tokens
    requests_before = emu.state.requests
    t0 = time.perf_counter()
    triage.offer(case)
    await until(lambda: bool(found), f"{arm.name}: the cause of {case.request_id}", 600)
    arm.seconds.append(time.perf_counter() - t0)
    await triage.close()
    await upstream.close()
    arm.tokens.append(emu.state.generation_tokens - tokens_before)
    arm.replays.append(emu.state.requests - requests_before)
    arm.waits.append(len(arm.quiet) - waits_before)
    arm.causes[found[0].cause] += 1
    arm.limits[str(found[0].evidence.get("replay_max_tokens"))] += 1


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


def report(arms: list[Arm]) -> None:
    print(
        f"{'arm':<13} {'triages':>7} {'p50 s':>7} {'p99 s':>7} {'replays':>8} {'tokens':>8} "
        f"{'waits':>6} {'s/wait':>7} {'quiet s':>8}  replay max_tokens / causes"
    )
    for arm in arms:
        per_triage = sum(arm.quiet) / len(arm.seconds)
        print(
            f"{arm.name:<13} {len(arm.seconds):>7} {statistics.median(arm.seconds):>7.3f} "
            f"{p99(arm.seconds):>7.3f} {statistics.mean(arm.replays):>8.2f} "
            f"{statistics.mean(arm.tokens):>8.1f} {statistics.mean(arm.waits):>6.2f} "
            f"{statistics.mean(arm.quiet):>7.3f} {per_triage:>8.3f}  "
            f"{dict(arm.limits)} {dict(arm.causes)}"
        )
    before = arms[0]
    for arm in arms[1:]:
        p50_ratio = statistics.median(arm.seconds) / statistics.median(before.seconds)
        p99_ratio = p99(arm.seconds) / p99(before.seconds)
        tokens_ratio = statistics.mean(arm.tokens) / statistics.mean(before.tokens)
        print(
            f"{arm.name} / {before.name}: p50 {p50_ratio:.3f}, p99 {p99_ratio:.3f}, "
            f"replay tokens per triage {tokens_ratio:.4f}"
        )
    for arm in arms:
        share = sum(arm.quiet) / sum(arm.seconds)
        print(f"{arm.name}: quiet waits are {share:.0%} of the triage time")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cause", choices=("batch", "intrinsic"), default="batch")
    parser.add_argument("--incidents", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--token-latency", type=float, default=0.002, help="seconds per token")
    parser.add_argument("--settle", type=float, default=0.25, help="audit.quiet_settle_s")
    args = parser.parse_args()

    injected: dict[str, Any] = (
        {"batch_divergence_slope": 0.3}
        if args.cause == "batch"
        else {"flip_probability": 0.5, "flip_position": 0}
    )
    config = EmulatorConfig(token_latency_s=args.token_latency, seed=7, **injected)
    audit = AuditConfig(quiet_settle_s=args.settle)
    sink: list[list[float]] = [[]]
    setattr(triage_module, "wait_quiet", timed_quiet(wait_quiet, sink))  # noqa: B010 (timed)
    margin = AttributionConfig().replay_margin_tokens
    arms = [
        Arm("before", 100_000, carry=False),
        Arm("cut", margin, carry=False),
        Arm("cut+carried", margin, carry=True),
    ]
    async with EmulatorServer(config) as emu, aiohttp.ClientSession() as http:
        cases: list[TriageCase] = []
        tries = 0
        while len(cases) < args.incidents and tries < args.incidents * 10:
            found = await make_case(http, emu, args.cause, tries, args.max_tokens)
            tries += 1
            if found is not None:
                cases.append(found)
        print(
            f"{len(cases)} {args.cause} audits diverged of {tries}; max_tokens {args.max_tokens}, "
            f"{args.token_latency * 1000:g} ms a token, quiet_settle_s {args.settle}"
        )
        for i, case in enumerate(cases):
            order = arms[i % len(arms) :] + arms[: i % len(arms)]  # each arm first in turn
            for arm in order:
                await triage_once(arm, case, http, emu, audit, sink)
    report(arms)


if __name__ == "__main__":
    asyncio.run(main())
