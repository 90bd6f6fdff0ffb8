"""NaN-logprob mode: what real vLLM does with a model whose logprobs are NaN (vllm-on-h200.md)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from proxy.tools.emulator.cli import build_parser, config_from_args
from tests.helpers.emulator import EmulatorClient, chat, completion
from tests.helpers.sse import chunks, parse_sse

from .conftest import MakeClient

NAN_ERROR = {
    "error": {
        "message": "Out of range float values are not JSON compliant: nan",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
}
KNOBS = {"X-Emulator-Knobs": orjson.dumps({"nan_logprobs": True}).decode()}


@pytest.mark.parametrize(
    ("endpoint", "body"),
    [
        ("chat", chat(logprobs=True)),
        ("chat", chat(logprobs=True, top_logprobs=5)),
        ("completion", completion(logprobs=0)),
        ("completion", completion(logprobs=3)),
    ],
)
async def test_non_streamed_logprobs_get_400(
    make_client: MakeClient, endpoint: str, body: dict[str, Any]
) -> None:
    client, server = await make_client(nan_logprobs=True)
    send = client.chat if endpoint == "chat" else client.completion
    reply = await send(body)
    assert reply.status == 400
    assert reply.headers["Content-Type"].startswith("application/json")
    assert reply.json() == NAN_ERROR
    (rec,) = server.injections()
    assert rec["kind"] == "nan_logprobs" and rec["detail"] == {"status": 400}
    # The same request on a healthy model answers 200.
    healthy, _ = await make_client()
    assert (await (healthy.chat if endpoint == "chat" else healthy.completion)(body)).status == 200


async def test_requests_without_logprobs_answer_normally(make_client: MakeClient) -> None:
    client, server = await make_client(nan_logprobs=True)
    healthy, _ = await make_client()
    for body in (chat(), chat(logprobs=False), chat(stream=True)):
        reply = await client.chat(body)
        assert reply.status == 200
        want = await healthy.chat(body)
        assert _scrub(reply.raw) == _scrub(want.raw)
    reply = await client.completion(completion())
    assert reply.status == 200 and reply.json()["choices"][0]["logprobs"] is None
    assert server.injections() == []


def _scrub(raw: bytes) -> list[Any]:
    """Bodies or stream chunks without id/created."""
    if raw.startswith(b"data: "):
        return [
            {k: v for k, v in chunk.items() if k not in {"id", "created"}}
            for chunk in parse_sse(raw)
            if chunk != "[DONE]"
        ]
    return [{k: v for k, v in orjson.loads(raw).items() if k not in {"id", "created"}}]


async def test_streamed_chat_logprobs_are_null(make_client: MakeClient) -> None:
    client, server = await make_client(nan_logprobs=True)
    healthy, _ = await make_client()
    body = chat(stream=True, logprobs=True, top_logprobs=3, max_tokens=8)
    reply = await client.chat(body)
    assert reply.status == 200
    assert b'"logprob":null' in reply.raw and b"NaN" not in reply.raw
    got = chunks(reply.events())
    want = chunks((await healthy.chat(body)).events())
    entries = [
        e for c in got for ch in c["choices"] for e in (ch["logprobs"] or {}).get("content", [])
    ]
    assert len(entries) == 8
    for entry in entries:
        assert entry["logprob"] is None
        assert len(entry["top_logprobs"]) == 3
        assert all(t["logprob"] is None for t in entry["top_logprobs"])
    # Same tokens as a healthy model; only the values are unknown.
    healthy_entries = [
        e for c in want for ch in c["choices"] for e in (ch["logprobs"] or {}).get("content", [])
    ]
    assert [e["token"] for e in entries] == [e["token"] for e in healthy_entries]
    assert all(isinstance(e["logprob"], float) for e in healthy_entries)
    (rec,) = server.injections()
    assert rec["kind"] == "nan_logprobs" and rec["detail"] == {"status": 200}


async def test_streamed_completion_logprobs_are_null(make_client: MakeClient) -> None:
    client, _ = await make_client(nan_logprobs=True)
    reply = await client.completion(completion(stream=True, logprobs=2, max_tokens=4))
    assert reply.status == 200
    lps = [c["choices"][0]["logprobs"] for c in chunks(reply.events()) if c["choices"]]
    lps = [lp for lp in lps if lp is not None]
    assert len(lps) >= 1
    assert sum(len(lp["tokens"]) for lp in lps) == 4
    for lp in lps:
        assert all(v is None for v in lp["token_logprobs"])
        assert all(v is None for top in lp["top_logprobs"] for v in top.values())


async def test_nan_mode_per_request_header(client: EmulatorClient) -> None:
    reply = await client.chat(chat(logprobs=True), headers=KNOBS)
    assert reply.status == 400 and reply.json() == NAN_ERROR
    assert (await client.chat(chat(logprobs=True))).status == 200
    streamed = await client.chat(chat(logprobs=True, stream=True), headers=KNOBS)
    assert streamed.status == 200 and b'"logprob":null' in streamed.raw


def test_nan_logprobs_cli_flag() -> None:
    assert config_from_args(build_parser().parse_args(["--nan-logprobs"])).nan_logprobs is True
    assert config_from_args(build_parser().parse_args([])).nan_logprobs is False
