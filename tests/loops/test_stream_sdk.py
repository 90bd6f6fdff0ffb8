"""A streamed recovery as the official openai SDK reads it, against the emulator: one answer
(SPEC 1.17), and the recovery readable from the last chunk's ``detproxy`` object (SPEC 5)."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from proxy.tools.emulator import EmulatorServer
from tests.helpers.emulator import knobs

MODEL = "emulator-model"
UNIT = " and then the model repeats itself."  # the emulator's looping unit
# Both kinds of recovery go on from the loop's onset (and one unit): the non-streamed one by
# its ladder's strategy, the streamed one by stream_mode continue.
CONTINUE_LADDER = (
    '[{"models": "*", "attempts": [{"strategy": "continue", "temperature": 0.7,'
    ' "presence_penalty": 1.5, "seed": 1}]}]'
)
ENV = {
    "DETPROXY_LOOPS__POLICY": "retry",
    "DETPROXY_LOOPS__STREAM_MODE": "continue",
    "DETPROXY_LOOPS__LADDERS": CONTINUE_LADDER,
    "DETPROXY_AUDIT__PASSIVE_CHECKS": "false",
}
LOOP = knobs(loop_channel="content", loop_after_tokens=5, loop_escape_probability=1.0)


def request(prompt: str) -> dict[str, Any]:
    return {
        "model": MODEL,
        "temperature": 0,
        "max_tokens": 300,
        "messages": [{"role": "user", "content": prompt}],
    }


async def both(client: Any, prompt: str) -> tuple[str, str, list[Any]]:
    """The non-streamed recovery's content, and the content the SDK assembles from the same
    request streamed, with the stream's chunks."""
    sdk = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="x", max_retries=0)
    try:
        whole = await sdk.chat.completions.with_raw_response.create(
            **request(prompt), extra_headers=LOOP
        )
        assert whole.headers["X-Detproxy-Recovered"] == "true", "the non-streamed loop stayed"
        answer = whole.parse().choices[0].message.content or ""
        stream = await sdk.chat.completions.create(
            **request(prompt), stream=True, extra_headers=LOOP
        )
        chunks = [c async for c in stream]
    finally:
        await sdk.close()
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return answer, text, chunks


@pytest.mark.parametrize("prompt", ["tell me a story", "write about the sea", "a poem"])
async def test_with_the_tail_held_back_the_sdk_assembles_the_non_streamed_recovery(
    make_proxy: Any, emulator: EmulatorServer, prompt: str
) -> None:
    # Held back further than the detector needs to see a loop of this unit: no repeat is ever
    # shown, and the stream's continuation is the non-streamed one's, character for character.
    client = await make_proxy(emulator.url, env=ENV | {"DETPROXY_LOOPS__HOLD_BACK_CHARS": "512"})
    answer, text, chunks = await both(client, prompt)
    assert text == answer, f"streamed {text!r} != non-streamed {answer!r}"
    assert text.count(UNIT) == 1, "a repeat of the loop reached the client"
    info = (chunks[-1].model_extra or {}).get("detproxy")
    assert info == {"recovered": True, "attempts": 2, "strategy": "continue"}, chunks[-1]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "stop" and finishes.count("stop") == 1


async def test_without_hold_back_the_answer_differs_only_by_the_repeats_shown(
    make_proxy: Any, emulator: EmulatorServer
) -> None:
    # Nothing held back: the client was shown some repeats before the loop was seen; they stay,
    # and the engine goes on from exactly them. Before the loop, the two answers are the same.
    client = await make_proxy(emulator.url, env=ENV | {"DETPROXY_LOOPS__HOLD_BACK_CHARS": "0"})
    answer, text, chunks = await both(client, "tell me a story")
    onset = answer.index(UNIT)
    assert text[:onset] == answer[:onset], "the streamed answer differs before the loop"
    shown_repeats = text.count(UNIT)
    assert 1 < shown_repeats < 300 // 4, f"{shown_repeats} repeats shown"
    assert answer.count(UNIT) == 1
    info = (chunks[-1].model_extra or {}).get("detproxy")
    assert info == {"recovered": True, "attempts": 2, "strategy": "continue"}, chunks[-1]


async def test_a_stream_without_a_loop_has_no_detproxy_object(
    make_proxy: Any, emulator: EmulatorServer
) -> None:
    client = await make_proxy(emulator.url, env=ENV)
    sdk = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="x", max_retries=0)
    try:
        stream = await sdk.chat.completions.create(**request("hello"), stream=True)
        chunks = [c async for c in stream]
    finally:
        await sdk.close()
    assert chunks and all("detproxy" not in (c.model_extra or {}) for c in chunks)
