"""One path: a greedy loop recovers to the same text streamed or not, and the same way twice.

Streamed or not, a retry goes on from the loop's onset and one unit under the same overrides and
the same seed (the client's, else one derived from the request); a stream's client keeps the
repeats it was shown before the loop was caught, then gets the same continuation.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from proxy.testing import MockUpstream, Received, Reply
from proxy.tools.emulator import EmulatorServer
from tests.helpers.emulator import CHAT, knobs
from tests.helpers.sse import sse_chunks
from tests.helpers.upstreams import MOCK_URL

MODEL = "emulator-model"
# These tests are about continuations (stream_mode continue, the default, set here too).
RETRY = {
    "DETPROXY_LOOPS__POLICY": "retry",
    "DETPROXY_AUDIT__PASSIVE_CHECKS": "false",
    "DETPROXY_LOOPS__STREAM_MODE": "continue",
}
UNIT = " and then the model repeats itself."  # the emulator's loop unit
LOOP = knobs(loop_channel="content", loop_after_tokens=5, loop_escape_probability=1.0)
DELIVERY = ("stream", "stream_options")  # how it is delivered


def ask(stream: bool, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "temperature": 0,
        "max_tokens": 300,
        "messages": [{"role": "user", "content": "tell me a story"}],
        "stream": stream,
        **extra,
    }


async def answer_text(client: Any, stream: bool, **extra: Any) -> tuple[str, dict[str, Any]]:
    """The content the client assembles, and its recovery info."""
    resp = await client.post("/v1/chat/completions", json=ask(stream, **extra), headers=LOOP)
    assert resp.status == 200
    if not stream:
        body = await resp.json()
        info = {
            "recovered": resp.headers["X-Detproxy-Recovered"] == "true",
            "attempts": int(resp.headers["X-Detproxy-Attempts"]),
            "strategy": resp.headers["X-Detproxy-Strategy"],
        }
        return body["choices"][0]["message"]["content"], info
    chunks = sse_chunks(await resp.read())
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    return text, chunks[-1]["detproxy"]


async def test_a_greedy_loop_recovers_to_the_same_continuation_streamed_or_not(
    make_proxy: Any, emulator: EmulatorServer
) -> None:
    client = await make_proxy(emulator.url, env=RETRY)
    whole, whole_info = await answer_text(client, stream=False)
    streamed, streamed_info = await answer_text(client, stream=True)
    info = {"recovered": True, "attempts": 2, "strategy": "continue"}
    assert whole_info == info and streamed_info == info, (whole_info, streamed_info)
    # The non-streamed answer kept one unit; the stream showed more before the loop was caught.
    assert whole.count(UNIT) == 1 and streamed.count(UNIT) > 1, (whole, streamed)
    tail = whole[whole.index(UNIT) + len(UNIT) :]
    assert tail.strip(), f"no continuation after the kept unit: {whole!r}"
    # The same continuation after the repeats the stream showed.
    assert streamed.endswith(tail), f"streamed {streamed!r}\nnot streamed {whole!r}"
    # Before it, what the stream showed: the kept prefix, then whole repeats of the unit (one
    # caught mid-unit is completed before the continuation).
    prefix, shown = whole[: -len(tail)], streamed[: -len(tail)]
    assert shown.startswith(prefix), f"streamed {streamed!r}\nnot streamed {whole!r}"
    extra = shown[len(prefix) :]
    assert extra and extra == UNIT * (len(extra) // len(UNIT)), extra
    # And the same way twice, each way.
    assert (await answer_text(client, stream=False))[0] == whole
    assert (await answer_text(client, stream=True))[0] == streamed


async def test_a_clients_own_seed_is_the_retrys(make_proxy: Any, emulator: EmulatorServer) -> None:
    client = await make_proxy(emulator.url, env=RETRY)
    seeded = {}
    for seed in (7, 8):
        text, info = await answer_text(client, stream=False, seed=seed)
        assert info["recovered"] is True, info
        seeded[seed] = text
        assert (await answer_text(client, stream=False, seed=seed))[0] == text
    # The emulator's retry draws from the seed: another seed, another continuation.
    assert seeded[7] != seeded[8], seeded


def looping(request: Received) -> Reply:
    """Loops greedy; a retry (a presence penalty) answers."""
    body = request.json()
    if body.get("presence_penalty"):
        pieces, finish = [" The end."], "stop"
    else:
        pieces, finish = ["Once upon a time", *[UNIT] * 40], "length"
    if not body.get("stream"):
        message = {"role": "assistant", "content": "".join(pieces)}
        choice = {"index": 0, "message": message, "finish_reason": finish}
        return Reply.json({"id": "chatcmpl-w", "choices": [choice]})
    chunks = [
        {
            "id": "chatcmpl-s",
            "choices": [{"index": 0, "delta": {"content": p}, "finish_reason": None}],
        }
        for p in pieces
    ]
    end = {"index": 0, "delta": {}, "finish_reason": finish}
    return Reply.sse([*chunks, {"id": "chatcmpl-s", "choices": [end]}])


async def test_streamed_and_whole_retries_ask_the_same(
    mock_upstream: MockUpstream, make_proxy: Any
) -> None:
    engine = mock_upstream
    engine.on(CHAT, looping)
    env = RETRY | {"DETPROXY_UPSTREAM__FINGERPRINT_INTERVAL_S": "0"}
    client = await make_proxy(MOCK_URL, upstream=engine, env=env)
    for stream in (False, True, False):
        await answer_text(client, stream=stream)
    bodies = engine.bodies(CHAT)
    assert len(bodies) == 6, [b.get("stream") for b in bodies]
    whole, streamed, again = (
        {k: v for k, v in bodies[i].items() if k not in DELIVERY} for i in (1, 3, 5)
    )
    # The same point (the loop's onset and one unit), the same overrides, seed and limit.
    assert whole == streamed == again, (whole, streamed)
    assert whole["messages"][-1]["content"].count(UNIT) == 1
    assert isinstance(whole["seed"], int) and "seed" not in bodies[0]


def counted(usage: bool) -> Any:
    """``looping``, its whole answers counting their tokens (``usage``) or not."""

    def reply(request: Received) -> Reply:
        out = looping(request)
        if usage and not request.json().get("stream"):
            answer = orjson.loads(out.body)
            tokens = 4 + 8 * 40  # the opening, then 40 repeats of the unit
            answer["usage"] = {"prompt_tokens": 9, "completion_tokens": tokens}
            return Reply.json(answer)
        return out

    return reply


@pytest.mark.parametrize("usage", [False, True], ids=["no usage", "usage"])
async def test_streamed_and_whole_retries_ask_the_same_max_tokens(
    mock_upstream: MockUpstream, make_proxy: Any, usage: bool
) -> None:
    """The retry's limit is the client's max_tokens less the kept prefix's tokens, one estimate
    from the kept text: the same streamed or not, however the looping answer counted its own."""
    engine = mock_upstream
    engine.on(CHAT, counted(usage))
    env = RETRY | {"DETPROXY_UPSTREAM__FINGERPRINT_INTERVAL_S": "0"}
    client = await make_proxy(MOCK_URL, upstream=engine, env=env)
    for stream in (False, True):
        await answer_text(client, stream=stream)
    bodies = engine.bodies(CHAT)
    assert len(bodies) == 4, [b.get("stream") for b in bodies]
    whole, streamed = bodies[1]["max_tokens"], bodies[3]["max_tokens"]
    assert whole == streamed, f"whole retry asked {whole}, streamed {streamed}"
    assert 0 < whole < 300, whole  # the kept tokens were taken off
