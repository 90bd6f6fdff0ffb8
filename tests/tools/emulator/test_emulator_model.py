"""Determinism of the pseudo-model, sampling, penalties and the reasoning channel."""

from __future__ import annotations

import pytest

from tests.helpers.emulator import EmulatorClient, chat, completion
from tests.helpers.sse import chunks, stream_text, without_ids

from .conftest import MakeClient


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("endpoint", ["chat", "completion"])
async def test_same_request_same_bytes(client: EmulatorClient, endpoint: str, stream: bool) -> None:
    if endpoint == "chat":
        body = chat(stream=stream, logprobs=True, top_logprobs=4)
        first, second = await client.chat(body), await client.chat(body)
    else:
        body = completion(stream=stream, logprobs=4, max_tokens=40)
        first, second = await client.completion(body), await client.completion(body)
    assert first.raw != second.raw  # ids differ
    assert without_ids(first.raw) == without_ids(second.raw)


async def test_different_prompts_differ(client: EmulatorClient) -> None:
    a = (await client.completion(completion(prompt="alpha"))).json()["choices"][0]["text"]
    b = (await client.completion(completion(prompt="beta"))).json()["choices"][0]["text"]
    assert a != b


async def test_default_temperature_is_not_greedy(client: EmulatorClient) -> None:
    body = chat(max_tokens=40)
    del body["temperature"]
    texts = {(await client.chat(body)).json()["choices"][0]["message"]["content"] for _ in range(3)}
    assert len(texts) > 1


async def test_seeded_sampling_is_reproducible(client: EmulatorClient) -> None:
    body = chat(temperature=0.8, seed=1234, max_tokens=40)
    a = (await client.chat(body)).json()["choices"][0]["message"]["content"]
    b = (await client.chat(body)).json()["choices"][0]["message"]["content"]
    greedy = (await client.chat(chat(max_tokens=40))).json()["choices"][0]["message"]["content"]
    other = (await client.chat(chat(temperature=0.8, seed=99, max_tokens=40))).json()
    assert a == b
    assert a != greedy
    assert other["choices"][0]["message"]["content"] != a


async def test_top_k_one_is_greedy(client: EmulatorClient) -> None:
    greedy = (await client.chat(chat(max_tokens=30))).json()["choices"][0]["message"]
    topk = (await client.chat(chat(max_tokens=30, temperature=1.0, top_k=1))).json()
    assert topk["choices"][0]["message"] == greedy


@pytest.mark.parametrize(
    "penalty",
    [{"presence_penalty": 1.5}, {"frequency_penalty": 1.5}, {"repetition_penalty": 1.8}],
)
async def test_penalties_change_output(client: EmulatorClient, penalty: dict[str, float]) -> None:
    base = (await client.chat(chat(max_tokens=60))).json()["choices"][0]["message"]["content"]
    pen = (await client.chat(chat(max_tokens=60, **penalty))).json()
    assert pen["choices"][0]["message"]["content"] != base


async def test_max_tokens_and_natural_length(client: EmulatorClient) -> None:
    natural = (await client.chat(chat())).json()
    n = natural["usage"]["completion_tokens"]
    assert natural["choices"][0]["finish_reason"] == "stop"
    capped = (await client.chat(chat(max_completion_tokens=n - 1))).json()
    assert capped["choices"][0]["finish_reason"] == "length"
    assert capped["usage"]["completion_tokens"] == n - 1
    assert natural["choices"][0]["message"]["content"].startswith(
        capped["choices"][0]["message"]["content"]
    )
    exact = (await client.chat(chat(max_tokens=n + 5))).json()
    assert exact["choices"][0]["finish_reason"] == "stop"
    eos = (await client.chat(chat(max_tokens=n + 5, ignore_eos=True))).json()
    assert eos["usage"]["completion_tokens"] == n + 5


@pytest.mark.parametrize("style", ["reasoning", "reasoning_content", "both"])
async def test_reasoning_styles(make_client: MakeClient, style: str) -> None:
    client, _ = await make_client(reasoning_tokens=4, reasoning_style=style)
    body = (await client.chat(chat())).json()
    msg = body["choices"][0]["message"]
    fields = {"reasoning", "reasoning_content"} & set(msg)
    expected = {"reasoning", "reasoning_content"} if style == "both" else {style}
    assert fields == expected
    reasoning = msg[style if style != "both" else "reasoning"]
    assert reasoning and len(reasoning.split()) == 4
    if style == "both":
        assert msg["reasoning_content"] == msg["reasoning"]
    assert msg["content"]
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 4}

    events = (await client.chat(chat(stream=True))).events()
    deltas = [c["choices"][0]["delta"] for c in chunks(events)[1:-1]]
    assert all(set(d) <= {"reasoning", "reasoning_content", "content"} for d in deltas)
    reasoning_deltas = [d for d in deltas if "content" not in d]
    content_deltas = [d for d in deltas if "content" in d]
    assert len(reasoning_deltas) == 4
    assert deltas[:4] == reasoning_deltas  # reasoning precedes content
    for d in reasoning_deltas:
        assert set(d) == expected
    for d in content_deltas:
        if style == "both":
            assert d["reasoning_content"] is None and set(d) == {"content", "reasoning_content"}
        else:
            assert set(d) == {"content"}
    field = "reasoning_content" if style == "reasoning_content" else "reasoning"
    assert stream_text(events, field) == reasoning
    assert stream_text(events) == msg["content"]


async def test_thinking_disabled_per_request(make_client: MakeClient) -> None:
    client, _ = await make_client(reasoning_tokens=4)
    body = chat(chat_template_kwargs={"enable_thinking": False})
    msg = (await client.chat(body)).json()["choices"][0]["message"]
    assert msg["reasoning"] is None and msg["content"]
    hidden = (await client.chat(chat(include_reasoning=False))).json()
    assert hidden["choices"][0]["message"]["reasoning"] is None
    assert hidden["usage"]["completion_tokens_details"] == {"reasoning_tokens": 4}


async def test_reasoning_not_on_completions(make_client: MakeClient) -> None:
    client, _ = await make_client(reasoning_tokens=4)
    body = (await client.completion(completion())).json()
    assert "reasoning" not in body["choices"][0]
