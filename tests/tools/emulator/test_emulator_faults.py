"""Transport/protocol faults and client aborts."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import aiohttp
import orjson
import pytest

from proxy.tools.emulator import EmulatorServer
from tests.helpers.emulator import CHAT, chat, completion
from tests.helpers.sse import chunks, parse_sse
from tests.helpers.waiting import Unmet, eventually

from .conftest import MakeClient


def stat(server: EmulatorServer, key: str, value: int) -> Callable[[], bool | Unmet]:
    """A check for eventually(): the emulator's ``key`` counter reads ``value``."""

    def check() -> bool | Unmet:
        stats = server.stats()
        return stats[key] == value or Unmet(stats)

    return check


async def test_reset_mid_stream(make_client: MakeClient) -> None:
    client, server = await make_client(fault="reset_mid_stream", fault_after_tokens=3)
    received = b""
    with pytest.raises(aiohttp.ClientPayloadError):
        async with client.session.post(client.base + CHAT, json=chat(stream=True)) as resp:
            assert resp.status == 200
            async for data in resp.content.iter_any():
                received += data
    events = parse_sse(received)
    assert "[DONE]" not in events
    assert len(events) == 4  # role chunk + 3 tokens
    (rec,) = server.injections()
    assert rec["kind"] == "fault" and rec["position"] == 3
    assert rec["detail"] == {"fault": "reset_mid_stream"}
    stats = server.stats()
    assert stats["faulted"] == 1 and stats["running"] == 0 and stats["aborted"] == 0


@pytest.mark.parametrize("endpoint", [CHAT, "/v1/completions"])
async def test_stream_fails_before_its_first_event(make_client: MakeClient, endpoint: str) -> None:
    client, server = await make_client(fault="reset_mid_stream", fault_after_tokens=0)
    received = b""
    body = chat(stream=True) if endpoint == CHAT else completion(stream=True)
    with pytest.raises(aiohttp.ClientPayloadError):
        async with client.session.post(client.base + endpoint, json=body) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            async for data in resp.content.iter_any():
                received += data
    assert received == b""
    (rec,) = server.injections()
    assert rec["position"] == 0 and rec["detail"] == {"fault": "reset_mid_stream"}
    inband, _ = await make_client(fault="inband_error", fault_after_tokens=0)
    events = parse_sse((await inband.chat(chat(stream=True))).raw)
    assert events[0]["error"]["code"] == 500 and events[1:] == ["[DONE]"]


async def test_reset_non_stream(make_client: MakeClient) -> None:
    client, server = await make_client(fault="reset_mid_stream")
    with pytest.raises(aiohttp.ServerDisconnectedError):
        await client.chat(chat())
    assert server.injections()[0]["detail"]["fault"] == "reset_mid_stream"
    assert server.stats()["running"] == 0


@pytest.mark.parametrize(("fault", "code"), [("http_500", 500), ("http_503", 503)])
async def test_http_errors(make_client: MakeClient, fault: str, code: int) -> None:
    client, server = await make_client(fault=fault)
    for body in (chat(), chat(stream=True)):
        reply = await client.chat(body)
        assert reply.status == code
        err = reply.json()["error"]
        assert err["code"] == code and isinstance(err["message"], str)
        assert set(err) == {"message", "type", "param", "code"}
    assert [r["detail"]["code"] for r in server.injections()] == [code, code]


async def test_slow_headers(make_client: MakeClient) -> None:
    client, server = await make_client(fault="slow_headers", headers_delay_s=0.3)
    start = time.monotonic()
    reply = await client.chat(chat(max_tokens=2))
    assert reply.status == 200
    assert time.monotonic() - start >= 0.3
    assert server.injections()[0]["detail"] == {"fault": "slow_headers", "delay_s": 0.3}
    timeout = aiohttp.ClientTimeout(sock_read=0.1)
    with pytest.raises(asyncio.TimeoutError):
        async with client.session.post(client.base + CHAT, json=chat(), timeout=timeout):
            pass
    await eventually(stat(server, "aborted", 1), what="aborted == 1")


async def test_malformed_sse(make_client: MakeClient) -> None:
    client, server = await make_client(fault="malformed_sse", fault_after_tokens=2)
    reply = await client.chat(chat(stream=True, max_tokens=5))
    assert reply.status == 200
    marker = b"garbage without data prefix\n\n"
    assert reply.raw.count(marker) == 1
    with pytest.raises(AssertionError):
        parse_sse(reply.raw)
    before, after = reply.raw.split(marker)
    assert len(parse_sse(before)) == 3
    assert chunks(parse_sse(after))[-1]["choices"][0]["finish_reason"] == "length"
    assert server.injections()[0]["position"] == 2


async def test_malformed_json(make_client: MakeClient) -> None:
    client, server = await make_client(fault="malformed_json", fault_after_tokens=1)
    reply = await client.chat(chat(stream=True, max_tokens=3))
    blocks = reply.raw.split(b"\n\n")
    assert blocks[2] == b"data: {not json"
    assert blocks[-2] == b"data: [DONE]"
    non_stream = await client.completion(completion())
    assert non_stream.status == 200
    with pytest.raises(orjson.JSONDecodeError):
        non_stream.json()
    assert [r["kind"] for r in server.injections()] == ["fault", "fault"]


async def test_inband_error(make_client: MakeClient) -> None:
    client, server = await make_client(fault="inband_error", fault_after_tokens=3)
    reply = await client.chat(chat(stream=True))
    assert reply.status == 200
    events = parse_sse(reply.raw)
    assert events[-1] == "[DONE]"
    err = events[-2]["error"]
    assert err["code"] == 500 and err["type"] == "InternalServerError"
    assert len(events) == 6  # role + 3 tokens + error + DONE
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:4])
    non_stream = await client.chat(chat())
    assert non_stream.status == 500
    assert non_stream.json()["error"]["code"] == 500
    assert server.stats()["faulted"] == 2


async def test_fault_probability_zero(make_client: MakeClient) -> None:
    client, server = await make_client(fault="http_500", fault_probability=0.0)
    assert (await client.chat(chat())).status == 200
    assert server.injections() == []


async def test_client_abort_mid_stream(make_client: MakeClient) -> None:
    client, server = await make_client(token_latency_s=0.02)
    async with client.session.post(client.base + CHAT, json=chat(stream=True)) as resp:
        await resp.content.readuntil(b"\n\n")
        await resp.content.readuntil(b"\n\n")
        assert server.stats()["running"] == 1
        resp.close()
    await eventually(stat(server, "aborted", 1), what="aborted == 1")
    await eventually(stat(server, "running", 0), what="running == 0")
    assert server.stats()["completed"] == 0


async def test_client_abort_non_stream(make_client: MakeClient) -> None:
    client, server = await make_client(token_latency_s=0.02)
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(client.chat(chat()), timeout=0.1)
    await eventually(stat(server, "aborted", 1), what="aborted == 1")
    await eventually(stat(server, "running", 0), what="running == 0")


async def test_end_delay_holds_the_framing_after_done(make_client: MakeClient) -> None:
    client, server = await make_client(end_delay_s=0.3)
    async with client.session.post(
        client.base + CHAT, json=chat(stream=True, max_tokens=3)
    ) as resp:
        head = await resp.content.readuntil(b"data: [DONE]\n\n")
        assert head.endswith(b"data: [DONE]\n\n")
        await asyncio.sleep(0.1)
        assert not resp.content.at_eof()  # the last chunk frame is still to come
        assert await resp.content.read() == b""
        assert resp.content.at_eof()
    await eventually(stat(server, "completed", 1), what="completed == 1")
