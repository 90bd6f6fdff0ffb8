"""The audit against a real engine that no one here wrote: llama.cpp's llama-server.

Stock configuration (4 slots, unified KV cache): greedy answers change when requests run
together. detproxy audits every request; its quiet, serial, cold-prefill shadows must
reproduce the ground truth measured here by replaying every prompt alone. Per-slot KV with
serial traffic is batch-invariant: detproxy must report nothing there.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.integration.conftest import Engine, run_detproxy, run_engine

pytestmark = pytest.mark.integration

PROMPTS = [
    "Write a short story about a robot who learns to paint. Use vivid details.",
    "Explain why the sky is blue to a ten year old.",
    "List five tips for staying focused while studying.",
    "Describe the water cycle in three sentences.",
]
MAX_TOKENS = 48
AUDIT_CONFIG = """
[audit]
sample_rate = 1.0
passive_checks = false
schedule = "quiet"          # shadows wait until detproxy has nothing in flight,
quiet_max_inflight = 0
quiet_deadline_s = 300
quiet_settle_s = 1.0        # quiet for a whole second, not between two requests
max_concurrent_shadows = 1  # and run one at a time: the serial reference
max_shadows_per_s = 100
shadow_extra_body = { cache_prompt = false }  # cold prefill on llama-server
"""


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return orjson.loads(resp.read())


def post_json(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(
        url, data=orjson.dumps(body), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        return orjson.loads(resp.read())


def signature(content: str, entries: list[dict[str, Any]]) -> Any:
    """Tokens and logprobs, bit for bit; the trailing end-of-sequence entry that only the
    non-streamed answer carries is left out."""
    if entries and entries[-1]["token"] == "" and entries[-1].get("bytes") == []:
        entries = entries[:-1]
    return (
        content,
        [
            (e["token"], e["logprob"], [(t["token"], t["logprob"]) for t in e["top_logprobs"]])
            for e in entries
        ],
    )


async def one_request(http: Any, base: str, rid: str, prompt: str, stream: bool) -> Any:
    body = {
        "model": "smollm2",
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
        "logprobs": True,
        "top_logprobs": 5,
        "stream": stream,
        "messages": [{"role": "user", "content": prompt}],
    }
    resp = await http.post(base + "/v1/chat/completions", json=body, headers={"X-Request-Id": rid})
    resp.raise_for_status()
    if not stream:
        choice = resp.json()["choices"][0]
        return signature(choice["message"]["content"], choice["logprobs"]["content"])
    content, entries = "", []
    for block in resp.text.split("\n\n"):
        if not block.startswith("data: ") or block == "data: [DONE]":
            continue
        for choice in orjson.loads(block[6:]).get("choices", []):
            content += choice.get("delta", {}).get("content") or ""
            entries += (choice.get("logprobs") or {}).get("content") or []
    return signature(content, entries)


async def drive(base: str, phases: list[tuple[int, int]]) -> dict[str, tuple[str, Any]]:
    """Bounded traffic, phase after phase: (concurrency, rounds of every prompt)."""
    import httpx2

    received: dict[str, tuple[str, Any]] = {}
    async with httpx2.AsyncClient(timeout=300) as http:
        for phase, (concurrency, rounds) in enumerate(phases):
            sem = asyncio.Semaphore(concurrency)

            async def task(rid: str, prompt: str, stream: bool, sem: Any = sem) -> None:
                async with sem:
                    received[rid] = (prompt, await one_request(http, base, rid, prompt, stream))

            jobs = [
                (f"audit-{phase}-{r}-{p}", PROMPTS[p], (r + p) % 2 == 0)
                for r in range(rounds)
                for p in range(len(PROMPTS))
            ]
            await asyncio.gather(*(task(*job) for job in jobs))
    return received


def ground_truth(engine: Engine, received: dict[str, tuple[str, Any]]) -> set[str]:
    """Request ids whose answer differs from the same prompt replayed alone, cold."""
    reference = {}
    for prompt in PROMPTS:
        answer = post_json(
            engine.url + "/v1/chat/completions",
            {
                "model": "smollm2",
                "temperature": 0,
                "max_tokens": MAX_TOKENS,
                "logprobs": True,
                "top_logprobs": 5,
                "cache_prompt": False,
                "messages": [{"role": "user", "content": prompt}],
            },
        )
        choice = answer["choices"][0]
        reference[prompt] = signature(choice["message"]["content"], choice["logprobs"]["content"])
    return {rid for rid, (prompt, got) in received.items() if got != reference[prompt]}


def settle(proxy: str, audits: int, timeout: float = 300) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = get_json(proxy + "/detproxy/status")
        if status["audit"]["audits"] + sum(status["audit"]["shadows_dropped"].values()) >= audits:
            return status  # type: ignore[no-any-return]
        time.sleep(0.5)
    raise AssertionError(f"audits did not finish: {status}")


def reported_unstable(proxy: str) -> tuple[set[str], list[dict[str, Any]]]:
    incidents = get_json(proxy + "/detproxy/incidents?limit=1000")
    return {i["request_id"] for i in incidents}, incidents


def test_stock_llama_server_instability_matches_ground_truth(tmp_path: Path) -> None:
    with run_engine(tmp_path) as engine, run_detproxy(tmp_path, engine.url, AUDIT_CONFIG) as proxy:
        # Alone first, then four at a time. Even alone, an answer can differ from the cold
        # reference: llama-server reuses the KV of a shared prefix (its prompt cache).
        received = asyncio.run(drive(proxy, [(1, 1), (4, 2)]))
        status = settle(proxy, len(received))
        truth = ground_truth(engine, received)
        reported, incidents = reported_unstable(proxy)
    audit = status["audit"]
    assert audit["audits"] == len(received) and audit["shadows_dropped"] == {}
    assert truth, "the stock engine was expected to diverge under 4 concurrent requests"
    assert reported == truth
    assert not any(i["shadow_overlapped"] for i in incidents)
    assert audit["verdicts"].get("identical", 0) == len(received) - len(truth)
    for incident in incidents:
        assert incident["verdict"] in ("logprob_drift", "text_divergence")
        assert incident["divergence"]["index"] >= 0
        if incident["verdict"] == "text_divergence":
            assert (
                incident["max_abs_logprob_delta"] is None or incident["max_abs_logprob_delta"] >= 0
            )
    print(
        f"\nstock llama-server, 4 in flight: {len(truth)}/{len(received)} answers differ from "
        f"the serial reference; detproxy reported {len(reported)} "
        f"({audit['verdicts']})"
    )


def test_per_slot_kv_serial_traffic_reports_nothing(tmp_path: Path) -> None:
    with (
        run_engine(tmp_path, "-np", "4", "-c", "8192") as engine,
        run_detproxy(tmp_path, engine.url, AUDIT_CONFIG) as proxy,
    ):
        received = asyncio.run(drive(proxy, [(1, 2)]))
        status = settle(proxy, len(received))
        reported, _ = reported_unstable(proxy)
    assert status["audit"]["verdicts"] == {"identical": len(received)}
    assert reported == set()


def test_probe_separates_batch_effects_on_the_stock_engine(tmp_path: Path) -> None:
    from proxy.probe import main as probe

    def run(engine: Engine, levels: str) -> tuple[int, Any]:
        out = tmp_path / f"probe-{levels}.json"
        import contextlib
        import io

        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            code = probe(
                [
                    "--upstream",
                    engine.url,
                    "--model",
                    engine.model,
                    "--runs",
                    "8",
                    "--prompt",
                    PROMPTS[0],
                    "--concurrency",
                    levels,
                    "--json",
                    "--extra-body",
                    '{"cache_prompt": false}',
                ]
            )
        out.write_text(buffer.getvalue())
        return code, orjson.loads(buffer.getvalue())

    with run_engine(tmp_path, "-np", "4", "-c", "8192") as per_slot:
        code, report = run(per_slot, "1,4")
    assert code == 0 and report["stable"]  # per-slot KV: batch-invariant
    with run_engine(tmp_path) as stock:
        code, report = run(stock, "1,4")
    alone, loaded = report["results"]
    assert alone["distinct_vectors"] == 1  # alone and cold, the engine is stable
    # Under load the first token changes only when the probe's prefill shares a batch with
    # another prefill: usual (2 vectors, 0.18 nats in 3 of 3 runs alone) but not certain on 2
    # cores, so the verdict is checked for consistency; the audit tests prove the instability.
    unstable = loaded["distinct_vectors"] >= 2
    assert code == (1 if unstable else 0)
    assert (loaded["max_abs_delta"] > 1e-3) == unstable
    print(
        f"\nprobe, stock llama-server: alone {alone['distinct_vectors']} vector, "
        f"4 in flight {loaded['distinct_vectors']} vectors, max |delta| "
        f"{loaded['max_abs_delta']:.3f} nats, first token flips: {loaded['first_token_flips']}"
    )
