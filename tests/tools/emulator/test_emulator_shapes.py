"""Response, stream and endpoint shapes follow vLLM (shared/reference/vllm-api.md §1, §7, §8)."""

from __future__ import annotations

import asyncio
import math

from tests.helpers.emulator import EmulatorClient, chat, completion
from tests.helpers.sse import chunks, stream_text
from tests.helpers.waiting import eventually

from .conftest import MakeClient


async def test_chat_non_stream_shape(client: EmulatorClient) -> None:
    reply = await client.chat(chat(), headers={"X-Request-Id": "abc123"})
    assert reply.status == 200
    assert reply.headers["Content-Type"].startswith("application/json")
    assert "X-Request-Id" not in reply.headers  # vLLM: only with --enable-request-id-headers
    body = reply.json()
    assert body["id"] == "chatcmpl-abc123"
    assert body["object"] == "chat.completion"
    assert body["model"] == "emulator-model"
    assert isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert choice["index"] == 0
    assert choice["finish_reason"] == "stop"
    assert choice["stop_reason"] is None
    assert choice["logprobs"] is None
    msg = choice["message"]
    assert msg["role"] == "assistant"
    assert isinstance(msg["content"], str) and msg["content"]
    assert msg["reasoning"] is None
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert 12 <= usage["completion_tokens"] <= 60


async def test_request_id_from_body_and_random(client: EmulatorClient) -> None:
    body = (await client.chat(chat(request_id="from-body"))).json()
    assert body["id"] == "chatcmpl-from-body"
    reply = await client.chat(chat(request_id="from-body"), headers={"X-Request-Id": "hdr"})
    assert reply.json()["id"] == "chatcmpl-hdr"
    first = await client.chat(chat())
    second = await client.chat(chat())
    assert first.json()["id"] != second.json()["id"]
    assert "X-Request-Id" not in first.headers


async def test_chat_stream_shape(client: EmulatorClient) -> None:
    plain = (await client.chat(chat())).json()
    reply = await client.chat(chat(stream=True), headers={"X-Request-Id": "s1"})
    assert reply.status == 200
    assert reply.headers["Content-Type"].startswith("text/event-stream")
    events = reply.events()
    body = chunks(events)
    assert all(c["id"] == "chatcmpl-s1" for c in body)
    assert all(c["object"] == "chat.completion.chunk" for c in body)
    first = body[0]["choices"][0]
    assert first == {
        "index": 0,
        "delta": {"role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": None,
    }
    tokens = body[1:]
    assert all(set(c["choices"][0]["delta"]) == {"content"} for c in tokens)
    # One token per chunk; the last token shares its chunk with finish_reason (vLLM: no
    # separate empty finish chunk).
    assert len(tokens) == plain["usage"]["completion_tokens"]
    assert [c["choices"][0]["finish_reason"] for c in tokens[:-1]] == [None] * (len(tokens) - 1)
    assert all("stop_reason" not in c["choices"][0] for c in tokens[:-1])
    last = body[-1]["choices"][0]
    assert last["delta"]["content"]
    assert (
        last["delta"]["content"]
        == plain["choices"][0]["message"]["content"][-len(last["delta"]["content"]) :]
    )
    assert last["finish_reason"] == "stop"
    assert "stop_reason" in last and last["stop_reason"] is None
    assert "usage" not in body[-1]
    assert stream_text(events) == plain["choices"][0]["message"]["content"]


async def test_usage_chunk(client: EmulatorClient) -> None:
    reply = await client.chat(chat(stream=True, stream_options={"include_usage": True}))
    body = chunks(reply.events())
    assert body[-1]["choices"] == []
    usage = body[-1]["usage"]
    assert usage["completion_tokens"] == len(body) - 2  # less the role and usage chunks
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert body[-2]["choices"][0]["finish_reason"] == "stop"
    cont = chunks(
        (
            await client.chat(
                chat(
                    stream=True,
                    max_tokens=4,
                    stream_options={"include_usage": True, "continuous_usage_stats": True},
                )
            )
        ).events()
    )
    assert [c["usage"]["completion_tokens"] for c in cont[1:5]] == [1, 2, 3, 4]


async def test_n_choices_stream_interleaved(client: EmulatorClient) -> None:
    body = (await client.chat(chat(n=3, max_tokens=5))).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    texts = {c["message"]["content"] for c in body["choices"]}
    assert len(texts) == 1  # greedy: identical choices
    assert body["usage"]["completion_tokens"] == 15
    events = chunks((await client.chat(chat(n=2, max_tokens=3, stream=True))).events())
    order = [c["choices"][0]["index"] for c in events]
    assert order == [0, 1, 0, 1, 0, 1, 0, 1]  # roles, then one token of each per step
    assert all(len(c["choices"]) == 1 for c in events)
    assert [c["choices"][0]["finish_reason"] for c in events[-2:]] == ["length", "length"]
    sampled = (await client.chat(chat(n=2, temperature=1.0, seed=3, max_tokens=30))).json()
    assert sampled["choices"][0]["message"] != sampled["choices"][1]["message"]


async def test_chat_logprobs_shape(client: EmulatorClient) -> None:
    body = (await client.chat(chat(logprobs=True, top_logprobs=5, max_tokens=8))).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 8
    text = ""
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["bytes"] == list(entry["token"].encode())
        tops = entry["top_logprobs"]
        assert len(tops) == 5
        assert tops[0]["token"] == entry["token"] and tops[0]["logprob"] == entry["logprob"]
        lps = [t["logprob"] for t in tops]
        assert lps == sorted(lps, reverse=True)
        assert all(-30 < lp < 0 for lp in lps)
        assert sum(math.exp(lp) for lp in lps) <= 1.0 + 1e-9
        text += entry["token"]
    assert text == body["choices"][0]["message"]["content"]
    zero = (await client.chat(chat(logprobs=True, max_tokens=2))).json()
    assert zero["choices"][0]["logprobs"]["content"][0]["top_logprobs"] == []


async def test_chat_stream_logprobs_per_chunk(client: EmulatorClient) -> None:
    full = (await client.chat(chat(logprobs=True, top_logprobs=3, max_tokens=6))).json()
    events = chunks(
        (await client.chat(chat(logprobs=True, top_logprobs=3, max_tokens=6, stream=True))).events()
    )
    per_chunk = [c["choices"][0]["logprobs"] for c in events[1:]]
    assert all(len(lp["content"]) == 1 for lp in per_chunk)
    assert [lp["content"][0] for lp in per_chunk] == full["choices"][0]["logprobs"]["content"]
    assert events[0]["choices"][0]["logprobs"] is None
    assert events[-1]["choices"][0]["finish_reason"] == "length"


async def test_completions_shapes(client: EmulatorClient) -> None:
    body = (await client.completion(completion(logprobs=2), {"X-Request-Id": "c1"})).json()
    assert body["id"] == "cmpl-c1"
    assert body["object"] == "text_completion"
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "length"  # default max_tokens 16
    assert body["usage"]["completion_tokens"] == 16
    lp = choice["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["text_offset"][0] == 0
    for tok, off, nxt in zip(lp["tokens"], lp["text_offset"], lp["text_offset"][1:], strict=False):
        assert nxt == off + len(tok)
    for tok, tlp, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert top[tok] == tlp
        assert 2 <= len(top) <= 3
    events = (await client.completion(completion(stream=True, max_tokens=4, logprobs=1))).events()
    body_chunks = chunks(events)
    assert all(c["object"] == "text_completion" for c in body_chunks)
    texts = [c["choices"][0]["text"] for c in body_chunks]
    plain = (await client.completion(completion(max_tokens=4))).json()
    assert "".join(texts) == plain["choices"][0]["text"]
    assert len(body_chunks) == 4  # one token each, the last with finish_reason
    offsets = [c["choices"][0]["logprobs"]["text_offset"][0] for c in body_chunks]
    assert offsets[0] == 0 and offsets == sorted(offsets)
    assert body_chunks[-1]["choices"][0]["finish_reason"] == "length"
    multi = (await client.completion(completion(prompt=["a b", "c d e"], n=2, max_tokens=2))).json()
    assert [c["index"] for c in multi["choices"]] == [0, 1, 2, 3]


async def test_misc_endpoints(make_client: MakeClient) -> None:
    client, _ = await make_client(models=("m1", "m2"), max_model_len=2048, version="0.15.1")
    models = (await client.get("/v1/models")).json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == ["m1", "m2"]
    m = models["data"][0]
    assert m["object"] == "model" and m["owned_by"] == "vllm" and m["root"] == "m1"
    assert m["parent"] is None and m["max_model_len"] == 2048
    health = await client.get("/health")
    assert health.status == 200 and health.raw == b""
    assert (await client.get("/version")).json() == {"version": "0.15.1"}
    tok = (await client.post("/tokenize", {"model": "m2", "prompt": "hello big world"})).json()
    assert tok["count"] == 3 and len(tok["tokens"]) == 3 and tok["max_model_len"] == 2048
    body = await client.chat({"model": "m2", "messages": [{"role": "user", "content": "x"}]})
    assert body.json()["model"] == "m2"
    text = (await client.get("/metrics")).raw.decode()
    assert 'vllm:num_requests_running{engine="0",model_name="m1"} 0.0' in text
    assert 'vllm:num_requests_waiting{engine="0",model_name="m1"} 0.0' in text
    usage = body.json()["usage"]
    assert (
        f'vllm:prompt_tokens_total{{engine="0",model_name="m1"}} {usage["prompt_tokens"]}.0' in text
    )
    gen = usage["completion_tokens"]
    assert f'vllm:generation_tokens_total{{engine="0",model_name="m1"}} {gen}.0' in text
    reason = body.json()["choices"][0]["finish_reason"]
    assert f'finished_reason="{reason}",model_name="m1"}} 1.0' in text


RUNNING_ONE = 'vllm:num_requests_running{engine="0",model_name="emulator-model"} 1.0'
RUNNING_ZERO = 'vllm:num_requests_running{engine="0",model_name="emulator-model"} 0.0'


async def test_running_gauge_while_generating(make_client: MakeClient) -> None:
    client, server = await make_client(token_latency_s=0.02)
    task = asyncio.create_task(client.chat(chat(max_tokens=20)))

    async def gauge() -> str:
        return (await client.get("/metrics")).raw.decode()

    seen = ""
    deadline = asyncio.get_running_loop().time() + 10
    while RUNNING_ONE not in seen and not task.done():
        assert asyncio.get_running_loop().time() < deadline, "the gauge never said 1 running"
        seen = await gauge()
    assert RUNNING_ONE in seen, "the request ended before the gauge counted it"
    await task
    assert RUNNING_ZERO in await gauge(), "a finished request still counted running"
    assert server.stats()["running"] == 0
    assert server.stats()["completed"] == 1


async def test_running_gauge_counts_a_request_from_its_first_engine_step(
    make_client: MakeClient,
) -> None:
    """Like vLLM's gauges (set once per engine step): a request accepted but not yet through
    its first step is not counted yet (on an H100, every read 20 ms after sending said 0)."""
    client, server = await make_client(headers_delay_s=0.5)
    task = asyncio.create_task(client.chat(chat(max_tokens=2)))
    await eventually(lambda: server.stats()["running"], what="the request accepted")
    assert not task.done(), "the request ended before the gauge could be read"
    assert RUNNING_ZERO in (await client.get("/metrics")).raw.decode(), (
        "a request not yet through a step counted running"
    )
    await task
