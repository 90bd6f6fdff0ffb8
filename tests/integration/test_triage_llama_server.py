"""Triage against llama.cpp's llama-server: what detproxy attributes each divergence to, on the
stock server (4 slots, unified KV) and on a per-slot one, checked by a hand-made ablation of
the same prompts (alone cold three times, alone warm, written here from the issue, not from
``proxy.attribution``)."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.llama_server import Engine, run_engine, wait_engine_idle
from tests.helpers.processes import run_detproxy
from tests.helpers.waiting import Unmet, eventually_sync
from tests.integration.test_audit_llama_server import (
    AUDIT_CONFIG,
    MAX_TOKENS,
    drive,
    get_json,
    post_json,
    signature,
)

pytestmark = pytest.mark.integration

CONFIG = (
    AUDIT_CONFIG
    + """
[attribution]
cold_replays = 3
max_per_minute = 1000
token_allowance = 100000000
queue_size = 100
quiet_deadline_s = 300
"""
)


def alone(engine: Engine, prompt: str, cache_prompt: bool) -> Any:
    answer = post_json(
        engine.url + "/v1/chat/completions",
        {
            "model": "smollm2",
            "temperature": 0,
            "max_tokens": MAX_TOKENS,
            "logprobs": True,
            "top_logprobs": 5,
            "cache_prompt": cache_prompt,
            "messages": [{"role": "user", "content": prompt}],
        },
    )
    choice = answer["choices"][0]
    return signature(choice["message"]["content"], choice["logprobs"]["content"])


def by_hand(engine: Engine, prompt: str, inflight: int) -> str:
    """The cause of a divergence of ``prompt`` (its primary ran with ``inflight`` requests in
    flight), one switch at a time, text level."""
    cold = [alone(engine, prompt, False)[0] for _ in range(3)]
    if len(set(cold)) > 1:
        return "intrinsic"
    alone(engine, prompt, True)  # prime the slot's cache
    warm = [alone(engine, prompt, True)[0] for _ in range(2)]
    if len(set(warm)) > 1:
        return "intrinsic"
    if warm[0] != cold[0]:
        return "prefix_cache"
    return "batch" if inflight > 1 else "unknown"


def triaged(proxy: str, timeout: float = 1800) -> list[dict[str, Any]]:
    """The audit incidents once no shadow or triage is queued or running and each has a cause."""

    def done() -> tuple[list[dict[str, Any]]] | Unmet:
        status = get_json(proxy + "/detproxy/status")
        shadow, triage = status["shadow"], status["triage"]
        if (
            not shadow["queued"]
            and not shadow["running"]
            and not triage["queued"]
            and not triage["running"]
        ):
            incidents = get_json(proxy + "/detproxy/incidents?limit=1000&kind=audit")
            if all("cause" in i for i in incidents):
                # In a tuple: no divergence at all (an empty list) is an end too, not "not yet".
                return (list(incidents),)
        return Unmet({"shadow": shadow, "triage": triage})

    found: list[dict[str, Any]] = eventually_sync(
        done, timeout_s=timeout, interval_s=0.5, what="triage finished"
    )[0]
    return found


@pytest.mark.parametrize("recipe", [(), ("-np", "2", "-c", "4096")], ids=["stock", "per_slot"])
def test_llama_server_divergences_get_the_cause_a_hand_ablation_finds(
    tmp_path: Path, recipe: tuple[str, ...]
) -> None:
    with run_engine(tmp_path, *recipe) as engine, run_detproxy(tmp_path, engine.url, CONFIG) as url:
        received = asyncio.run(drive(url, [(1, 1), (4, 2)]))
        incidents = triaged(url)
        wait_engine_idle(engine)
        hand = {}
        for incident in incidents:
            prompt = received[incident["request_id"]][0]
            inflight = max(r["inflight"] or 0 for r in incident["cause_evidence"]["runs"][:1])
            hand[incident["request_id"]] = by_hand(engine, prompt, inflight)
    table = Counter((hand[i["request_id"]], i["cause"]) for i in incidents)
    print(
        f"\n{'-'.join(recipe) or 'stock'}: {len(incidents)}/{len(received)} diverged; "
        f"(by hand, attributed): {dict(table)}"
    )
    for incident in incidents:
        assert incident["cause"] == hand[incident["request_id"]], incident["cause_evidence"]
