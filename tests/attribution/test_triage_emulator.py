"""Triage end to end in front of the emulator: the cause it attributes against the cause the
emulator injected, over many incidents of each, and no cause claimed on a stable emulator."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from prometheus_client import CollectorRegistry

from proxy.http.h1 import H1Upstream
from proxy.http.headers import HeaderFields
from proxy.http.upstream import Body, UpstreamResponse
from proxy.testing import MockUpstream, Received, Reply
from proxy.tools.emulator import EmulatorConfig, EmulatorServer
from tests.helpers.metrics import metric
from tests.helpers.triage import FAST, causes_of, fingerprint_of, idle
from tests.helpers.upstreams import MOCK_URL, recording
from tests.helpers.waiting import Unmet, eventually

MODEL = "emulator-model"
CHAT = "/v1/chat/completions"
LONG_ANSWER = 64  # max_tokens of the requests whose replays are cut short


def chat(prompt: str, long: bool = False) -> dict[str, Any]:
    """16 tokens, or 64 generated to the end (ignore_eos): replays cut at the first divergent
    token + replay_margin_tokens (16) + 1, at most 10 + 17 on the emulator, stop before it."""
    body: dict[str, Any] = {
        "model": MODEL,
        "temperature": 0,
        "max_tokens": LONG_ANSWER if long else 16,
        "messages": [{"role": "user", "content": prompt}],
    }
    if long:
        body["ignore_eos"] = True
    return body


async def serial_traffic(
    client: TestClient[Any, Any], n: int, tag: str, long: bool = False
) -> None:
    """One request at a time, each with its shadow and triage over before the next."""
    for i in range(n):
        resp = await client.post("/v1/chat/completions", json=chat(f"{tag} prompt {i}", long))
        assert resp.status == 200, await resp.text()
        await resp.read()
        await idle(client)


def table(incidents: list[dict[str, Any]]) -> Counter[str]:
    return Counter(str(i.get("cause")) for i in incidents)


def check_cut(incidents: list[dict[str, Any]], long: bool) -> None:
    """Long answers: every triage's replays were cut below the request's 64 tokens, and the
    runs compared over that window; 16-token answers: replays whole."""
    for i in incidents:
        evidence = i["cause_evidence"]
        window = (evidence["replay_max_tokens"], evidence["compared_tokens"])
        if long:
            assert window[0] == window[1] and window[0] < LONG_ANSWER, (window, evidence)
        else:
            assert window == (16, None), (window, evidence)


CUT = pytest.mark.parametrize("long", [False, True], ids=["whole", "cut"])


@CUT
async def test_intrinsic_flips_at_batch_1_are_attributed_to_intrinsic(
    make_proxy: Any, registry: CollectorRegistry, long: bool
) -> None:
    async with EmulatorServer(EmulatorConfig(flip_probability=0.5, seed=11)) as emu:
        client = await make_proxy(emu.url, env=FAST)
        await serial_traffic(client, 80, "intrinsic", long)
        incidents = await causes_of(client)
        got = table(incidents)
        print("intrinsic:", dict(got), "of", len(incidents))
        assert len(incidents) >= 25, f"too few divergences to measure: {len(incidents)}"
        assert got["intrinsic"] / len(incidents) >= 0.95, got
        check_cut(incidents, long)
        assert all(i["cause_evidence"]["runs"][0]["name"] == "primary" for i in incidents)
        counted = metric(
            registry, "detproxy_divergence_causes_total", model=MODEL, cause="intrinsic"
        )
        assert counted == got["intrinsic"]
        status = await (await client.get("/detproxy/status")).json()
        assert status["causes"][MODEL]["intrinsic"] == got["intrinsic"]


@CUT
async def test_batch_effects_are_attributed_to_batch(
    make_proxy: Any, registry: CollectorRegistry, long: bool
) -> None:
    latency = 0.002 if long else 0.004  # the long answers overlap as much in half the time
    config = EmulatorConfig(batch_divergence_slope=0.3, token_latency_s=latency, seed=5)
    async with EmulatorServer(config) as emu:
        env = FAST | {"DETPROXY_AUDIT__SCHEDULE": "quiet"}
        client = await make_proxy(emu.url, env=env)
        for wave in range(5 if long else 8):
            answers = await asyncio.gather(
                *(
                    client.post("/v1/chat/completions", json=chat(f"batch {wave}-{i}", long))
                    for i in range(8)
                )
            )
            for resp in answers:
                assert resp.status == 200
                await resp.read()
            await idle(client)
        incidents = await causes_of(client)
        got = table(incidents)
        print("batch:", dict(got), "of", len(incidents))
        assert len(incidents) >= 25, f"too few divergences to measure: {len(incidents)}"
        assert got["batch"] / len(incidents) >= 0.95, got
        check_cut(incidents, long)


async def test_a_stable_emulator_gets_no_cause(
    make_proxy: Any, registry: CollectorRegistry
) -> None:
    async with EmulatorServer(EmulatorConfig(token_latency_s=0.002)) as emu:
        client = await make_proxy(emu.url, env=FAST | {"DETPROXY_AUDIT__SCHEDULE": "quiet"})
        for wave in range(4):
            answers = await asyncio.gather(
                *(client.post("/v1/chat/completions", json=chat(f"s {wave}-{i}")) for i in range(6))
            )
            for resp in answers:
                await resp.read()
        status = await idle(client)
        assert status["audit"]["verdicts"] == {"identical": 24}, status["audit"]
        assert status["causes"] == {}
        assert await causes_of(client) == []
        assert status["triage"]["offered"] == 0


LONG = " ".join(f"word{i}" for i in range(48))  # three full KV blocks: a prefix-cache hit


@CUT
async def test_warm_cache_answers_are_attributed_to_prefix_cache(
    make_proxy: Any, registry: CollectorRegistry, long: bool
) -> None:
    async with EmulatorServer(EmulatorConfig(warm_cache_divergence=0.5, seed=3)) as emu:
        client = await make_proxy(emu.url, env=FAST)
        for i in range(80):
            # The first time cold (nothing cached yet), the second time warm: its cold shadow
            # (cache_salt) differs where the emulator makes warm answers differ.
            body = chat(f"{i} {LONG}", long)
            for _ in range(2):
                resp = await client.post("/v1/chat/completions", json=body)
                assert resp.status == 200
                await resp.read()
                await idle(client)
        incidents = await causes_of(client)
        got = table(incidents)
        print("prefix_cache:", dict(got), "of", len(incidents))
        assert len(incidents) >= 25, f"too few divergences to measure: {len(incidents)}"
        assert got["prefix_cache"] / len(incidents) >= 0.95, got
        check_cut(incidents, long)


async def test_salted_requests_all_at_once_on_a_caching_engine_are_attributed_to_batch(
    make_proxy: Any, registry: CollectorRegistry
) -> None:
    """The batch-invariant recipe's burst as real vLLM showed it (2026-12-07): each request
    with the client's own fresh cache_salt, all at once, on an engine whose warm answers also
    differ for half the prompts. The new salt says each primary ran cold, and the warm replays
    read what their own priming run cached: the company is the one switch left."""
    config = EmulatorConfig(
        batch_divergence_slope=0.3, warm_cache_divergence=0.5, token_latency_s=0.004, seed=5
    )
    async with EmulatorServer(config) as emu:
        client = await make_proxy(emu.url, env=FAST | {"DETPROXY_AUDIT__SCHEDULE": "quiet"})
        for wave in range(8):
            bodies = [chat(f"{wave}-{i} {LONG}") | {"cache_salt": f"c{wave}-{i}"} for i in range(8)]
            answers = await asyncio.gather(
                *(client.post("/v1/chat/completions", json=body) for body in bodies)
            )
            for resp in answers:
                assert resp.status == 200
                await resp.read()
            await idle(client)
        incidents = await causes_of(client)
        got = table(incidents)
        print("salted burst:", dict(got), "of", len(incidents))
        assert len(incidents) >= 25, f"too few divergences to measure: {len(incidents)}"
        assert got["batch"] / len(incidents) >= 0.9, got
        for i in incidents:
            assert i["cause_evidence"]["runs"][0]["cache"] == "cold", i["cause_evidence"]


@CUT
async def test_speculative_against_a_plain_reference_is_attributed_to_speculative(
    make_proxy: Any, registry: CollectorRegistry, long: bool
) -> None:
    recipe = EmulatorConfig(speculative=True, speculative_divergence=0.5, seed=4)
    async with EmulatorServer(recipe) as emu, EmulatorServer(EmulatorConfig(seed=4)) as plain:
        env = FAST | {"DETPROXY_AUDIT__REFERENCE_URL": plain.url}
        client = await make_proxy(emu.url, env=env)
        # Once detproxy has read what the upstream runs (speculative decoding among it).
        await eventually(lambda: fingerprint_of(client), what="the upstream's fingerprint read")
        await serial_traffic(client, 60, "speculative", long)
        incidents = await causes_of(client)
        got = table(incidents)
        print("speculative:", dict(got), "of", len(incidents))
        assert len(incidents) >= 20, f"too few divergences to measure: {len(incidents)}"
        assert got["speculative"] / len(incidents) >= 0.95, got
        check_cut(incidents, long)


class Switch:
    """An upstream (the seam) that is emulator A or B, as the test says: a redeploy between a
    primary and its shadow. ``hold`` answers once released (a client request kept in flight)."""

    def __init__(self, a: str, b: str) -> None:
        self.engines = {"a": H1Upstream(a), "b": H1Upstream(b)}
        self.now = "a"
        self.release = asyncio.Event()

    async def send(
        self, method: str, raw_path: str, headers: HeaderFields, body: Body
    ) -> UpstreamResponse:
        return await self.engines[self.now].send(method, raw_path, headers, body)

    async def close(self) -> None:
        for engine in self.engines.values():
            await engine.close()

    async def hold(self, request: Received) -> Reply:
        await self.release.wait()
        return Reply.text("released")


async def wait_fingerprint_not(client: TestClient[Any, Any], old: str | None) -> str:
    async def new() -> str | Unmet:
        now = await fingerprint_of(client)
        return now if now is not None and now != old else Unmet(now)

    return await eventually(new, interval_s=0.05, what=f"a fingerprint other than {old}")


async def test_a_redeploy_between_primary_and_shadow_is_a_recipe_change(make_proxy: Any) -> None:
    new = EmulatorConfig(version="0.24.0", flip_probability=1.0, flip_position=2)
    async with EmulatorServer(EmulatorConfig()) as a, EmulatorServer(new) as b:
        switch = Switch(a.url, b.url)
        try:
            upstream = MockUpstream(forward=switch, routes={"/hold": switch.hold})
            env = FAST | {
                "DETPROXY_AUDIT__SCHEDULE": "quiet",
                "DETPROXY_UPSTREAM__FINGERPRINT_INTERVAL_S": "0.2",
            }
            client = await make_proxy(MOCK_URL, upstream=upstream, env=env)
            seen = await wait_fingerprint_not(client, None)
            for i in range(12):
                switch.release.clear()
                hold = asyncio.ensure_future(client.get("/hold"))  # no shadow while it lasts
                resp = await client.post("/v1/chat/completions", json=chat(f"redeploy {i}"))
                assert resp.status == 200
                await resp.read()
                switch.now = "b" if switch.now == "a" else "a"  # the redeploy
                seen = await wait_fingerprint_not(client, seen)
                switch.release.set()
                await (await hold).read()
                await idle(client)
        finally:
            await switch.close()
        incidents = await causes_of(client)
        got = table(incidents)
        print("recipe_change:", dict(got), "of", len(incidents))
        assert len(incidents) == 12, incidents
        assert got == {"recipe_change": 12}, got


async def test_replays_sent_upstream_carry_the_cut_limit(make_proxy: Any) -> None:
    """Flips at token 3: the replays ask for 3 + 1 + 16 = 20 tokens where the client asked for
    64, every one of them, and the evidence says so."""
    config = EmulatorConfig(flip_probability=0.5, flip_position=3, seed=11)
    # what the emulator was sent, recorded
    async with EmulatorServer(config) as emu, recording(emu.url) as recorder:
        client = await make_proxy(MOCK_URL, upstream=recorder, env=FAST)
        await serial_traffic(client, 16, "limit", long=True)
        incidents = await causes_of(client)
    seen = [(r.headers.get("X-Request-Id", ""), r.json()) for r in recorder.received(CHAT)]
    assert len(incidents) >= 3, f"too few divergences: {len(incidents)}"
    replays = [(rid, body) for rid, body in seen if "-triage-" in rid]
    others = [(rid, body) for rid, body in seen if "-triage-" not in rid]
    assert len(replays) >= 2 * len(incidents), seen
    assert {body.get("max_tokens") for _, body in replays} == {20}, replays
    assert {body.get("max_tokens") for _, body in others} == {LONG_ANSWER}, others
    names = {rid.rsplit("-triage-", 1)[1] for rid, _ in replays}
    assert {"cold-1", "cold-2"} <= names, names
    for incident in incidents:
        evidence = incident["cause_evidence"]
        assert (evidence["replay_max_tokens"], evidence["compared_tokens"]) == (20, 20), evidence


async def test_a_burst_whose_shadows_outlast_the_quiet_deadline_still_gets_its_causes(
    make_proxy: Any, registry: CollectorRegistry
) -> None:
    """Real vLLM, 2026-12-07: two waves of 16 salted requests at once; the 32 shadows, sent one
    after another, kept the engine busy past the triage's quiet deadline, so experiments gave
    up ("no quiet moment") or ran beside a shadow ("serial replays alone: 1 answered"). An
    experiment now holds the shadows while it runs: every divergence gets its cause."""
    config = EmulatorConfig(
        batch_divergence_slope=0.3, warm_cache_divergence=0.5, token_latency_s=0.02, seed=5
    )
    async with EmulatorServer(config) as emu:
        env = FAST | {
            "DETPROXY_AUDIT__SCHEDULE": "quiet",
            # shadows alone take ~0.35 s each: the queue of 32 lasts ~10 times this
            "DETPROXY_ATTRIBUTION__QUIET_DEADLINE_S": "1",
        }
        client = await make_proxy(emu.url, env=env)
        for wave in range(2):
            bodies = [chat(f"{i % 4} {LONG}") | {"cache_salt": f"c{wave}-{i}"} for i in range(16)]
            answers = await asyncio.gather(
                *(client.post("/v1/chat/completions", json=body) for body in bodies)
            )
            for resp in answers:
                assert resp.status == 200
                await resp.read()
        await idle(client, timeout_s=120)
        incidents = await causes_of(client)
        got = table(incidents)
        print("burst past the quiet deadline:", dict(got), "of", len(incidents))
        assert len(incidents) >= 12, f"too few divergences to measure: {len(incidents)}"
        gave_up = metric(registry, "detproxy_triage_dropped_total", reason="quiet_deadline")
        assert gave_up == 0, f"{gave_up:g} incidents dropped for no quiet moment: {dict(got)}"
        assert got["batch"] / len(incidents) >= 0.9, got
