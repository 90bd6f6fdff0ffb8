"""vLLM-shaped error answers for bad requests."""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers.emulator import EmulatorClient, chat, completion


def error_of(reply: Any, code: int) -> dict[str, Any]:
    assert reply.status == code, reply.raw
    body = reply.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == code
    return dict(body["error"])


async def test_unknown_model(client: EmulatorClient) -> None:
    err = error_of(await client.chat(chat(model="nope")), 404)
    assert err["message"] == "The model `nope` does not exist."
    assert err["type"] == "NotFoundError"
    error_of(await client.completion(completion(model="nope")), 404)


async def test_model_optional(client: EmulatorClient) -> None:
    body = chat()
    del body["model"]
    assert (await client.chat(body)).json()["model"] == "emulator-model"


async def test_logprobs_over_max(client: EmulatorClient) -> None:
    err = error_of(await client.chat(chat(logprobs=True, top_logprobs=21)), 400)
    assert (
        err["message"] == "Requested sample logprobs of 21, which is greater than max allowed: 20"
    )
    assert err["type"] == "BadRequestError"
    err = error_of(await client.completion(completion(logprobs=21)), 400)
    assert "greater than max allowed: 20" in err["message"]
    assert (await client.chat(chat(logprobs=True, top_logprobs=20))).status == 200


async def test_top_logprobs_requires_logprobs(client: EmulatorClient) -> None:
    err = error_of(await client.chat(chat(top_logprobs=2)), 400)
    assert "`logprobs` must be set to true" in err["message"]


async def test_stream_options_without_stream(client: EmulatorClient) -> None:
    err = error_of(await client.chat(chat(stream_options={"include_usage": True})), 400)
    assert err["message"] == "Stream options can only be defined when `stream=True`."


@pytest.mark.parametrize(
    "field",
    [
        {"temperature": "0"},
        {"max_tokens": "10"},
        {"n": 0},
        {"logprobs": "yes"},
        {"stream": "true"},
        {"messages": "hi"},
        {"messages": []},
        {"top_logprobs": -2, "logprobs": True},
        {"seed": 2**63},
    ],
)
async def test_wrong_field_types(client: EmulatorClient, field: dict[str, Any]) -> None:
    err = error_of(await client.chat(chat(**field)), 400)
    assert err["type"] == "BadRequestError"
    assert err["param"] == next(iter(field))


async def test_unknown_fields_ignored(client: EmulatorClient) -> None:
    assert (await client.chat(chat(frobnicate=True, user="u"))).status == 200


@pytest.mark.parametrize(
    ("raw", "ctype"),
    [
        (b"{not json", "application/json"),
        (b"[1, 2]", "application/json"),
        (b"\xff\xfe", "application/json"),
        (b'{"messages": []}', "text/plain"),
    ],
)
async def test_bad_bodies(client: EmulatorClient, raw: bytes, ctype: str) -> None:
    reply = await client.post("/v1/chat/completions", raw, headers={"Content-Type": ctype})
    error_of(reply, 400)


async def test_context_length(client: EmulatorClient) -> None:
    err = error_of(await client.chat(chat(max_tokens=5000)), 400)
    assert "maximum context length is 4096 tokens" in err["message"]
    long_prompt = " word" * 5000
    error_of(await client.completion(completion(prompt=long_prompt)), 400)
