"""An honest signal: ``recovered`` only for an answer that ended ``stop`` (or a tool call) with
content and no loop at its end (proxy/loops/verdict.py), in the header, the last chunk and the
metric outcome alike."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from proxy.loops.detector import DetectorConfig
from proxy.loops.verdict import ending, loop_at_end
from proxy.testing import MockUpstream, Received, Reply
from proxy.tools.emulator import EmulatorServer
from tests.helpers.emulator import CHAT, knobs
from tests.helpers.metrics import metric
from tests.helpers.sse import sse_chunks
from tests.helpers.upstreams import MOCK_URL

MODEL = "emulator-model"
# These tests are about continuations (stream_mode continue, the default, set here too).
RETRY = {
    "DETPROXY_LOOPS__POLICY": "retry",
    "DETPROXY_AUDIT__PASSIVE_CHECKS": "false",
    "DETPROXY_LOOPS__STREAM_MODE": "continue",
}
UNIT = " and then the model repeats itself."
CONFIG = DetectorConfig()


def test_only_an_answer_that_stopped_with_content_and_no_loop_at_its_end_is_recovered() -> None:
    calm = "Once upon a time" + UNIT + " The sea was calm and the story ended well."
    assert ending("stop", True, calm, CONFIG) == "recovered"
    assert ending("tool_calls", True, "", CONFIG) == "recovered"
    assert ending("length", True, calm, CONFIG) == "length"
    assert ending(None, True, calm, CONFIG) == "unfinished"
    assert ending("stop", False, "  ", CONFIG) == "empty"
    assert ending("stop", True, "Once" + UNIT * 12, CONFIG) == "looped_again"
    assert ending("stop", True, None, CONFIG) == "recovered"  # not kept: the finish alone


def test_a_loop_left_behind_is_not_a_loop_at_the_end() -> None:
    assert loop_at_end("Once" + UNIT * 12 + "\n", CONFIG)
    assert loop_at_end("Once" + UNIT * 12 + " and then the mo", CONFIG)  # cut mid-unit
    assert not loop_at_end("Once" + UNIT * 12 + " Then the storm came and the night ended.", CONFIG)
    assert loop_at_end("Once" + UNIT * 12 + " A new part." + UNIT * 12, CONFIG)
    assert not loop_at_end("", CONFIG)


def actions(registry: CollectorRegistry, outcome: str) -> float:
    labels = {"model": MODEL, "action": "retry", "outcome": outcome}
    return metric(registry, "detproxy_policy_actions_total", **labels)


def ask(stream: bool, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "temperature": 0,
        "max_tokens": 300,
        "messages": [{"role": "user", "content": "tell me a story"}],
        "stream": stream,
        **extra,
    }


async def said(resp: Any, stream: bool) -> tuple[bool, str]:
    """What the client was told (recovered?) and the last choice's finish reason."""
    if not stream:
        body = await resp.json()
        return resp.headers["X-Detproxy-Recovered"] == "true", body["choices"][0]["finish_reason"]
    chunks = sse_chunks(await resp.read())
    last = [c for c in chunks if c.get("choices")][-1]["choices"][0]
    return chunks[-1]["detproxy"]["recovered"], last["finish_reason"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_continuation_that_ends_at_its_token_limit_is_not_recovered(
    make_proxy: Any, emulator: EmulatorServer, registry: CollectorRegistry, stream: bool
) -> None:
    # ignore_eos: the continuation escapes the loop but runs until max_tokens.
    client = await make_proxy(emulator.url, env=RETRY)
    loop = knobs(loop_channel="content", loop_after_tokens=5, loop_escape_probability=1.0)
    resp = await client.post(
        "/v1/chat/completions", json=ask(stream, ignore_eos=True), headers=loop
    )
    recovered, finish = await said(resp, stream)
    assert finish == "length"
    assert recovered is False, "an answer that ended at its token limit said recovered"
    assert actions(registry, "length") == 1
    assert actions(registry, "recovered") == 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_continuation_that_stops_is_recovered(
    make_proxy: Any, emulator: EmulatorServer, registry: CollectorRegistry, stream: bool
) -> None:
    client = await make_proxy(emulator.url, env=RETRY)
    loop = knobs(loop_channel="content", loop_after_tokens=5, loop_escape_probability=1.0)
    resp = await client.post("/v1/chat/completions", json=ask(stream), headers=loop)
    recovered, finish = await said(resp, stream)
    assert (recovered, finish) == (True, "stop")
    assert actions(registry, "recovered") == 1


def repeats_at_its_end(request: Received) -> Reply:
    """Loops greedy; the retry (a presence penalty) writes three more units and stops: too few
    for its own watch, but the answer the client holds ends in the loop."""
    body = request.json()
    if body.get("presence_penalty"):
        pieces, finish = [UNIT] * 3, "stop"
    else:
        pieces, finish = ["Once upon a time", *[UNIT] * 40], "length"
    chunks = [
        {
            "id": "chatcmpl-s",
            "choices": [{"index": 0, "delta": {"content": p}, "finish_reason": None}],
        }
        for p in pieces
    ]
    end = {"index": 0, "delta": {}, "finish_reason": finish}
    return Reply.sse([*chunks, {"id": "chatcmpl-s", "choices": [end]}])


async def test_a_stream_that_ends_in_the_loop_it_showed_is_not_recovered(
    mock_upstream: MockUpstream, make_proxy: Any, registry: CollectorRegistry
) -> None:
    engine = mock_upstream
    engine.on(CHAT, repeats_at_its_end)
    env = RETRY | {"DETPROXY_UPSTREAM__FINGERPRINT_INTERVAL_S": "0"}
    client = await make_proxy(MOCK_URL, upstream=engine, env=env)
    resp = await client.post("/v1/chat/completions", json=ask(True))
    recovered, finish = await said(resp, True)
    assert finish == "stop"
    assert recovered is False, "an answer that ends in a loop said recovered"
    assert actions(registry, "looped_again") == 1
    assert actions(registry, "recovered") == 0
