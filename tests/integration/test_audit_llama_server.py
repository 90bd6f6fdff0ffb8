"""The audit against a real engine that no one here wrote: llama.cpp's llama-server.

Stock configuration (4 slots, unified KV cache): greedy answers change when requests run
together. detproxy audits every request; its quiet, serial, cold-prefill shadows must
reproduce the ground truth measured here by replaying every prompt alone. Per-slot KV with
serial traffic is batch-invariant: detproxy must report nothing there.
"""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path
from typing import Any

import orjson
import pytest

from proxy.audit.outcome import ChoiceOutcome
from proxy.audit.verdict import output_hash
from tests.helpers.llama_server import Engine, run_engine, wait_engine_idle
from tests.helpers.processes import run_detproxy
from tests.helpers.sse import sse_chunks
from tests.helpers.waiting import settle_sync

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


async def one_request(
    http: Any, base: str, rid: str, prompt: str, stream: bool
) -> tuple[Any, str | None]:
    """The answer's signature and its finish_reason."""
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
        sig = signature(choice["message"]["content"], choice["logprobs"]["content"])
        return sig, choice["finish_reason"]
    content, entries, finish = "", [], None
    for chunk in sse_chunks(resp.content):
        for choice in chunk.get("choices", []):
            content += choice.get("delta", {}).get("content") or ""
            entries += (choice.get("logprobs") or {}).get("content") or []
            finish = choice.get("finish_reason") or finish
    return signature(content, entries), finish


Received = dict[str, tuple[str, Any, str | None]]  # request id: (prompt, signature, finish)


async def drive(base: str, phases: list[tuple[int, int]]) -> Received:
    """Bounded traffic, phase after phase: (concurrency, rounds of every prompt)."""
    import httpx2

    received: Received = {}
    async with httpx2.AsyncClient(timeout=300) as http:
        for phase, (concurrency, rounds) in enumerate(phases):
            sem = asyncio.Semaphore(concurrency)

            async def task(rid: str, prompt: str, stream: bool, sem: Any = sem) -> None:
                async with sem:
                    received[rid] = (prompt, *await one_request(http, base, rid, prompt, stream))

            jobs = [
                (f"audit-{phase}-{r}-{p}", PROMPTS[p], (r + p) % 2 == 0)
                for r in range(rounds)
                for p in range(len(PROMPTS))
            ]
            await asyncio.gather(*(task(*job) for job in jobs))
    return received


Reference = dict[str, tuple[Any, str | None]]  # prompt: (signature, finish), alone and cold


def reference_answers(engine: Engine) -> Reference:
    """Every prompt replayed alone, cold: what a quiet, serial, cold shadow must reproduce."""
    reference: Reference = {}
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
        sig = signature(choice["message"]["content"], choice["logprobs"]["content"])
        reference[prompt] = (sig, choice["finish_reason"])
    return reference


def ground_truth(reference: Reference, received: Received) -> set[str]:
    """Request ids whose answer differs from the same prompt replayed alone, cold."""
    return {rid for rid, (prompt, got, _) in received.items() if got != reference[prompt][0]}


def _margin(top: list[tuple[str, float]]) -> float | None:
    values = sorted((v for _, v in top), reverse=True)
    return values[0] - values[1] if len(values) >= 2 else None


def _position_delta(a: Any, b: Any) -> float:
    """|delta| of the chosen token's logprob and of every top-k token both sides list (the
    first entry of a token string listed twice)."""
    worst = abs(a[1] - b[1])
    mine: dict[str, float] = {}
    theirs: dict[str, float] = {}
    for token, value in a[2]:
        mine.setdefault(token, value)
    for token, value in b[2]:
        theirs.setdefault(token, value)
    for token in mine.keys() & theirs.keys():
        worst = max(worst, abs(mine[token] - theirs[token]))
    return worst


Expected = tuple[str, int, str | None, str | None, float, float | None]


def expected_verdict(
    primary: Any, p_finish: str | None, shadow: Any, s_finish: str | None
) -> Expected:
    """What SPEC section 1 item 6 says of a primary and its shadow (signatures), written from
    the spec, not from the comparator: the verdict, the first divergent index, both tokens
    there, the max |delta| over the common prefix, the primary's top-1/top-2 margin there."""
    a, b = primary[1], shadow[1]
    common = min(len(a), len(b))
    index = next((i for i in range(common) if a[i][0] != b[i][0]), None)
    if index is None and len(a) == len(b):  # same tokens: the first position that differs
        at = next(i for i in range(common) if a[i] != b[i])
        delta = max(_position_delta(a[i], b[i]) for i in range(common))
        return "logprob_drift", at, a[at][0], b[at][0], delta, _margin(a[at][2])
    if index is None:  # one is a prefix of the other: a divergence only where it ended
        index = common
        short, long = (p_finish, s_finish) if len(a) < len(b) else (s_finish, p_finish)
        ended = ("stop", "length")
        assert short in ended and long in ended and (short != long or short == "stop")
    delta = max((_position_delta(a[i], b[i]) for i in range(index)), default=0.0)
    token_a = a[index][0] if index < len(a) else None
    token_b = b[index][0] if index < len(b) else None
    margin = _margin(a[index][2]) if index < len(a) else None
    return "text_divergence", index, token_a, token_b, delta, margin


def reported_unstable(proxy: str) -> tuple[set[str], list[dict[str, Any]]]:
    incidents = get_json(proxy + "/detproxy/incidents?limit=1000")
    return {i["request_id"] for i in incidents}, incidents


# Triage off here: its replays go to the engine while the cold reference is read straight from
# it, beside them (a CI run's reference differed on one prompt that way). Triage has its own test.
NO_TRIAGE = AUDIT_CONFIG + "\n[attribution]\ntriage_rate = 0.0\n"


def test_stock_llama_server_instability_matches_ground_truth(tmp_path: Path) -> None:
    with run_engine(tmp_path) as engine, run_detproxy(tmp_path, engine.url, NO_TRIAGE) as proxy:
        # Alone first, then four at a time. Even alone, an answer can differ from the cold
        # reference: llama-server reuses the KV of a shared prefix (its prompt cache).
        received = asyncio.run(drive(proxy, [(1, 1), (4, 2)]))
        status = settle_sync(proxy, len(received), timeout_s=300)
        reference = reference_answers(engine)
        truth = ground_truth(reference, received)
        reported, incidents = reported_unstable(proxy)
    audit = status["audit"]
    assert audit["audits"] == len(received) and audit["shadows_dropped"] == {}
    assert truth, "the stock engine was expected to diverge under 4 concurrent requests"
    assert reported == truth
    assert len(incidents) == len(truth)  # one choice per request: one incident each
    assert not any(i["shadow_overlapped"] for i in incidents)
    assert audit["verdicts"].get("identical", 0) == len(received) - len(truth)
    counts: dict[str, int] = {}
    for incident in incidents:
        prompt, got, finish = received[incident["request_id"]]
        ref, ref_finish = reference[prompt]
        where = f"{incident['request_id']}: {incident['verdict']} {incident['divergence']}"
        # the shadow reproduced the serial reference, the primary is what the client got
        assert incident["shadow_hash"] == output_hash(ChoiceOutcome(0, ref[0], "", None, None))
        assert incident["primary_hash"] == output_hash(ChoiceOutcome(0, got[0], "", None, None))
        verdict, index, token, shadow_token, delta, margin = expected_verdict(
            got, finish, ref, ref_finish
        )
        counts[verdict] = counts.get(verdict, 0) + 1
        div = incident["divergence"]
        assert incident["verdict"] == verdict, where
        assert div["index"] == index, where
        assert (div["primary_token"], div["shadow_token"]) == (token, shadow_token), where
        assert div["margin"] == margin, where
        assert incident["max_abs_logprob_delta"] == delta, where
        assert (incident["primary_tokens"], incident["shadow_tokens"]) == (len(got[1]), len(ref[1]))
    assert {v: n for v, n in audit["verdicts"].items() if v != "identical"} == counts
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
        status = settle_sync(proxy, len(received), timeout_s=300)
        reported, _ = reported_unstable(proxy)
    assert status["audit"]["verdicts"] == {"identical": len(received)}
    assert reported == set()


def test_probe_separates_batch_effects_on_the_stock_engine(tmp_path: Path) -> None:
    from proxy.tools.probe import main as probe

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
    # Stock engine: its instability under load shows only when the probe's prefill shares a
    # batch with a background prefill, which is likely but not certain on 2 shared cores (a CI
    # run found none in 3 probes of 8 runs). So here the probe's verdict must be consistent
    # with its own data; that it detects batch effects when they are there is required on the
    # emulator, where they are certain (tests/tools/test_probe.py, --batch-divergence-slope).
    tries = []
    with run_engine(tmp_path) as stock:
        for _ in range(3):
            # The last try's background requests may still be generating (the engine finishes
            # a request its client left): "alone" must be alone.
            wait_engine_idle(stock)
            code, report = run(stock, "1,4")
            tries.append(report)
            if code == 1:
                break
    alone, loaded = report["results"]
    for each in tries:  # every try: stable alone and cold, a verdict consistent with its data
        first, under_load = each["results"]
        assert (first["concurrency"], under_load["concurrency"]) == (1, 4)
        assert first["distinct_vectors"] == 1 and first["max_abs_delta"] == 0
        assert (under_load["distinct_vectors"] >= 2) == (not each["stable"])
    assert code == (0 if report["stable"] else 1)
    if not report["stable"]:
        assert loaded["max_abs_delta"] > 1e-3  # batch effects, not last-bit noise
    print(
        f"\nprobe, stock llama-server ({len(tries)} tries): alone {alone['distinct_vectors']} "
        f"vector, 4 in flight {loaded['distinct_vectors']} vectors, max |delta| "
        f"{loaded['max_abs_delta']:.3f} nats, first token flips: {loaded['first_token_flips']}"
    )
