"""Live speed as detproxy sees it: TTFT, inter-token latency and decode rate per stream,
bucketed by how many requests were in flight."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from prometheus_client import CollectorRegistry

from proxy.events import StreamTimed
from proxy.http.sse import encode_event
from proxy.observe.metrics import inflight_bucket
from proxy.relay.result import StreamResult
from proxy.streaming import speed_event
from proxy.testing import MockResponse, MockUpstream, Received
from tests.helpers.answers import grouped_chat_chunks, tokens
from tests.helpers.metrics import metric
from tests.helpers.relay_run import relay
from tests.helpers.upstreams import MOCK_URL


def test_inflight_buckets() -> None:
    assert [inflight_bucket(n) for n in (1, 2, 3, 4, 5, 16, 17, 64, 65, 1000)] == [
        "1",
        "2",
        "3-4",
        "3-4",
        "5-8",
        "9-16",
        "17-32",
        "33-64",
        "65+",
        "65+",
    ]


class Clock:
    """The proxy's clock, advanced by the scripted upstream: 10 ms before each token."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def paced_stream(clock: Clock, tokens: int) -> MockResponse:
    """A stream of ``tokens`` tokens, each one piece, ``clock`` 10 ms on before each."""

    async def events() -> AsyncIterator[bytes]:
        role = {"index": 0, "delta": {"role": "assistant", "content": ""}}
        yield encode_event(orjson.dumps({"id": "c", "choices": [role]}))
        for i in range(tokens):
            clock.now += 0.01
            finish = "length" if i == tokens - 1 else None
            choice = {"index": 0, "delta": {"content": f" t{i}"}, "finish_reason": finish}
            yield encode_event(orjson.dumps({"id": "c", "choices": [choice]}))
            # Real time between pieces, so that streams sent at once overlap; the figures
            # come from the virtual clock only.
            await asyncio.sleep(0.02 if i == 0 else 0.002)
        yield b"data: [DONE]\n\n"

    return MockResponse(headers={"Content-Type": "text/event-stream"}, body=events())


async def test_speed_by_concurrency(
    mock_upstream: MockUpstream, make_proxy: Any, registry: CollectorRegistry
) -> None:
    clock = Clock()

    def stream(request: Received) -> MockResponse:
        return paced_stream(clock, 20)

    mock_upstream.on("/v1/chat/completions", stream)
    client = await make_proxy(MOCK_URL, upstream=mock_upstream, clock=clock)
    body = {
        "model": "emulator-model",
        "temperature": 0.5,
        "max_tokens": 20,
        "stream": True,
        "messages": [{"role": "user", "content": "speed"}],
    }
    resp = await client.post("/v1/chat/completions", json=body)
    await resp.read()

    def count(name: str, bucket: str) -> float:
        return metric(registry, f"detproxy_{name}_count", model="emulator-model", inflight=bucket)

    def total(name: str) -> float:
        return metric(registry, f"detproxy_{name}_sum", model="emulator-model", inflight="1")

    # Alone: 10 ms a token on the clock, the first one step after the request.
    assert count("inter_token_latency_seconds", "1") == 1
    assert total("inter_token_latency_seconds") == pytest.approx(0.01)
    assert total("output_tokens_per_second") == pytest.approx(100.0)
    assert total("time_to_first_token_seconds") == pytest.approx(0.01)

    async def one() -> None:
        r = await client.post("/v1/chat/completions", json=body)
        await r.read()

    await asyncio.gather(*(one() for _ in range(4)))
    buckets = ("1", "2", "3-4", "5-8")
    assert sum(count("time_to_first_token_seconds", b) for b in buckets) == 5
    assert sum(count("time_to_first_token_seconds", b) for b in buckets[1:]) >= 2  # under load


def published_speed(result: StreamResult, first_s: float, last_s: float) -> StreamTimed:
    """The speed a finished stream publishes, its first and last token at the given times."""
    result.first_token_s, result.last_token_s = first_s, last_s
    ev = speed_event("chat", "m", 1, result)
    assert ev is not None
    return ev


PATHS: dict[str, dict[str, Any]] = {
    "raw": {},
    "simple": {"loops": True},
    "general": {"general": True},
    "stripped": {"strip_logprobs": True},  # logprobs detproxy injected for an audit
}
# Twelve tokens, four a chunk: what --stream-interval 4 or speculative decoding sends.
GROUPED = {
    "logprobs": dict(logprobs=True, final_usage=False),
    "continuous_usage": dict(logprobs=False, continuous_usage=True),
    "both": dict(logprobs=True, continuous_usage=True),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shape", GROUPED)
def test_several_tokens_a_chunk_count_as_tokens(path: str, shape: str) -> None:
    """Chunks of four tokens over 2 s: the eight tokens after the first chunk took 0.25 s
    each (not the 1 s a chunk takes), 4 tokens/s."""
    events = [
        encode_event(orjson.dumps(c)) for c in grouped_chat_chunks(tokens(12), 4, **GROUPED[shape])
    ]
    run = relay([*events, b"data: [DONE]\n\n"], **PATHS[path])
    assert run.result.token_events == 3
    ev = published_speed(run.result, 1.0, 3.0)
    assert ev.tokens == 12
    assert ev.inter_token_s == pytest.approx(0.25)
    assert ev.tokens_per_s == pytest.approx(4.0)


@pytest.mark.parametrize("path", PATHS)
def test_without_logprobs_or_running_usage_the_final_usage_counts(path: str) -> None:
    """Only the last usage chunk says how many tokens came; the first chunk counts as one."""
    chunks = grouped_chat_chunks(tokens(12), 4, logprobs=False)
    events = [encode_event(orjson.dumps(c)) for c in chunks]
    run = relay([*events, b"data: [DONE]\n\n"], **PATHS[path])
    ev = published_speed(run.result, 1.0, 3.0)
    assert ev.tokens == 12
    assert ev.inter_token_s == pytest.approx(2.0 / 11)
    assert ev.tokens_per_s == pytest.approx(11 / 2.0)
    # Nothing says: the chunks are all there is to count.
    bare = grouped_chat_chunks(tokens(12), 4, logprobs=False, final_usage=False)
    run = relay(
        [*(encode_event(orjson.dumps(c)) for c in bare), b"data: [DONE]\n\n"], **PATHS[path]
    )
    ev = published_speed(run.result, 1.0, 3.0)
    assert (ev.tokens, ev.inter_token_s, ev.tokens_per_s) == (3, 1.0, 1.0)
