"""Several tokens per chunk (vLLM's --stream-interval) and speculative decoding."""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers.emulator import EmulatorClient, chat, completion
from tests.helpers.metrics import metric_samples
from tests.helpers.sse import chunks, stream_text

from .conftest import MakeClient


def choice_chunks(events: list[Any]) -> list[dict[str, Any]]:
    """The choice of every chunk after the role chunk (usage-only chunks left out)."""
    return [c["choices"][0] for c in chunks(events)[1:] if c["choices"]]


def n_tokens(choice: dict[str, Any]) -> int:
    return len(choice["logprobs"]["content"]) if choice["logprobs"] else 0


async def test_tokens_per_chunk(make_client: MakeClient) -> None:
    client, _ = await make_client(tokens_per_chunk=3)
    plain = (await client.chat(chat(logprobs=True, top_logprobs=2))).json()
    total = plain["usage"]["completion_tokens"]
    events = (await client.chat(chat(stream=True, logprobs=True, top_logprobs=2))).events()
    body = choice_chunks(events)
    sizes = [n_tokens(c) for c in body]
    assert sizes == [3] * (total // 3) + ([total % 3] if total % 3 else [])
    assert [c["finish_reason"] for c in body] == [None] * (len(body) - 1) + ["stop"]
    # Each chunk's text is exactly the tokens its logprobs list.
    for c in body:
        assert c["delta"]["content"] == "".join(e["token"] for e in c["logprobs"]["content"])
    streamed = [e for c in body for e in c["logprobs"]["content"]]
    assert streamed == plain["choices"][0]["logprobs"]["content"]
    assert stream_text(events) == plain["choices"][0]["message"]["content"]


async def test_tokens_per_chunk_usage_and_completions(make_client: MakeClient) -> None:
    client, _ = await make_client(tokens_per_chunk=4)
    opts = {"include_usage": True, "continuous_usage_stats": True}
    events = (await client.chat(chat(stream=True, max_tokens=10, stream_options=opts))).events()
    counts = [c["usage"]["completion_tokens"] for c in chunks(events)]
    assert counts == [0, 4, 8, 10, 10]  # role, three chunks (4+4+2), the usage chunk
    reply = await client.completion(completion(stream=True, max_tokens=7, logprobs=1))
    body = [c["choices"][0] for c in chunks(reply.events())]  # no role chunk in completions
    assert [len(c["logprobs"]["tokens"]) for c in body] == [4, 3]
    assert body[-1]["finish_reason"] == "length"
    offsets = body[0]["logprobs"]["text_offset"] + body[1]["logprobs"]["text_offset"]
    tokens = body[0]["logprobs"]["tokens"] + body[1]["logprobs"]["tokens"]
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    plain = (await client.completion(completion(max_tokens=7))).json()
    assert "".join(c["text"] for c in body) == plain["choices"][0]["text"]


async def test_chunk_spanning_reasoning_and_content(make_client: MakeClient) -> None:
    client, _ = await make_client(tokens_per_chunk=3, reasoning_tokens=4)
    plain = (await client.chat(chat())).json()["choices"][0]["message"]
    body = choice_chunks((await client.chat(chat(stream=True))).events())
    assert set(body[0]["delta"]) == {"reasoning"}
    assert set(body[1]["delta"]) == {"reasoning", "content"}  # 1 reasoning + 2 content tokens
    assert "".join(c["delta"].get("reasoning", "") for c in body) == plain["reasoning"]
    assert "".join(c["delta"].get("content", "") for c in body) == plain["content"]
    hidden = choice_chunks((await client.chat(chat(stream=True, include_reasoning=False))).events())
    assert all(set(c["delta"]) <= {"content"} for c in hidden)
    assert "".join(c["delta"].get("content", "") for c in hidden) == plain["content"]
    assert hidden[-1]["finish_reason"] == "stop"


async def metrics_of(client: EmulatorClient) -> dict[str, float]:
    return metric_samples((await client.get("/metrics")).raw.decode())


def spec(name: str, model: str = "emulator-model") -> str:
    return f'vllm:spec_decode_{name}_total{{engine="0",model_name="{model}"}}'


async def test_no_spec_decode_series_without_it(client: EmulatorClient) -> None:
    await client.chat(chat())
    text = (await client.get("/metrics")).raw.decode()
    assert "spec_decode" not in text


async def test_speculative_decoding(make_client: MakeClient) -> None:
    client, _ = await make_client(speculative=True, speculative_tokens=3)
    before = await metrics_of(client)
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert before[spec(name)] == 0.0  # present from the start, at 0
    reference, _ = await make_client()
    want = (await reference.chat(chat(logprobs=True))).json()
    events = (await client.chat(chat(stream=True, logprobs=True))).events()
    body = choice_chunks(events)
    sizes = [n_tokens(c) for c in body]
    assert all(1 <= n <= 4 for n in sizes)
    assert len(set(sizes)) > 1  # acceptance varies from step to step
    assert body[-1]["finish_reason"] == "stop" and sizes[-1] >= 1
    # Same tokens as without speculation (greedy), only chunked differently.
    assert stream_text(events) == want["choices"][0]["message"]["content"]
    after = await metrics_of(client)
    drafts = after[spec("num_drafts")]
    accepted = after[spec("num_accepted_tokens")]
    assert drafts == len(sizes)  # one engine step per chunk at tokens_per_chunk 1
    assert after[spec("num_draft_tokens")] == 3 * drafts
    assert accepted == sum(sizes) - drafts
    per_pos = [
        after[
            "vllm:spec_decode_num_accepted_tokens_per_pos_total"
            f'{{engine="0",model_name="emulator-model",position="{p}"}}'
        ]
        for p in range(3)
    ]
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
    gen = after['vllm:generation_tokens_total{engine="0",model_name="emulator-model"}']
    assert gen == drafts + accepted == want["usage"]["completion_tokens"]
    # Non-streamed requests draft too.
    await client.chat(chat(max_tokens=20))
    assert (await metrics_of(client))[spec("num_drafts")] > drafts


@pytest.mark.parametrize("acceptance", [0.0, 1.0])
async def test_speculative_acceptance_bounds(make_client: MakeClient, acceptance: float) -> None:
    client, _ = await make_client(
        speculative=True, speculative_tokens=2, speculative_acceptance=acceptance
    )
    body = choice_chunks((await client.chat(chat(stream=True, logprobs=True))).events())
    sizes = [n_tokens(c) for c in body]
    if acceptance == 0.0:
        assert set(sizes) == {1}
    else:
        assert set(sizes[:-1]) == {3}


async def test_prefix_cache_counters(make_client: MakeClient) -> None:
    client, _ = await make_client()
    q = 'vllm:prefix_cache_queries_total{engine="0",model_name="emulator-model"}'
    h = 'vllm:prefix_cache_hits_total{engine="0",model_name="emulator-model"}'
    assert (await metrics_of(client))[q] == 0.0
    long = [{"role": "user", "content": " ".join(f"w{i}" for i in range(40))}]
    first = (await client.chat(chat(messages=long, max_tokens=2))).json()
    n = first["usage"]["prompt_tokens"]
    m = await metrics_of(client)
    assert (m[q], m[h]) == (n, 0.0)
    await client.chat(chat(messages=long, max_tokens=2))
    m = await metrics_of(client)
    assert m[q] == 2 * n
    assert m[h] == (n - 1) // 16 * 16 > 0  # whole blocks; the last token is always computed
    await client.chat(chat(messages=long, max_tokens=2, cache_salt="tenant-b"))
    salted = await metrics_of(client)
    assert salted[q] == 3 * n and salted[h] == m[h]  # another salt shares no block
    longer = [{"role": "user", "content": long[0]["content"] + " more words here"}]
    await client.chat(chat(messages=longer, max_tokens=2))
    assert (await metrics_of(client))[h] > m[h]  # a shared prefix hits
    text = (await client.get("/metrics")).raw.decode()
    assert 'vllm:cache_config_info{block_size="16"' in text
