"""A corpus of bad input and dropped connections against a live detproxy process (started by
its console script): nothing gets a 5xx from detproxy's own fault, the process stays up and
its memory flat."""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from proxy.tools.emulator import EmulatorServer
from tests.helpers.processes import detproxy_serve

CHAT = "/v1/chat/completions"
GOOD = b'{"model":"emulator-model","temperature":0,"max_tokens":4,"messages":[{"role":"user","content":"hi"}]}'  # noqa: E501


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.fixture
async def live() -> AsyncIterator[tuple[str, int]]:
    async with (
        EmulatorServer() as emu,
        detproxy_serve(
            emu.url, "--sample-rate", "1", env={"DETPROXY_SERVER__MAX_BODY_BYTES": "1048576"}
        ) as (base, proc),
    ):
        yield base, proc.pid


BODIES: list[tuple[str, bytes, dict[str, str]]] = [
    ("not json", b"{nope", {}),
    ("not an object", b'"a string"', {}),
    ("invalid utf-8", b'{"model": "\xff\xfe"}', {}),
    ("wrong content type", GOOD, {"Content-Type": "text/plain"}),
    ("deeply nested", b"[" * 100_000 + b"]" * 100_000, {}),
    ("huge array", b'{"model":"emulator-model","messages":[' + b"1," * 200_000 + b"1]}", {}),
    ("over the limit", b'{"x":"' + b"a" * 2_000_000 + b'"}', {}),
    (
        "duplicate keys",
        b'{"temperature":0,"temperature":1,"model":"emulator-model",'
        b'"messages":[{"role":"user","content":"x"}],"max_tokens":3}',
        {},
    ),
    ("stream of the wrong type", GOOD[:-1] + b',"stream":"yes"}', {}),
    ("absurd max_tokens", GOOD[:-1] + b',"max_tokens":1000000000000}', {}),
    ("absurd n", GOOD[:-1] + b',"n":1000000}', {}),
    ("temperature as text", GOOD.replace(b'"temperature":0', b'"temperature":"0"'), {}),
    ("empty", b"", {}),
]


async def raw(port: int, data: bytes, *, drip: float = 0.0, read: bool = True) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        if drip:
            for i in range(len(data)):
                writer.write(data[i : i + 1])
                await writer.drain()
                await asyncio.sleep(drip)
        else:
            writer.write(data)
            await writer.drain()
        return await asyncio.wait_for(reader.read(65536), 10) if read else b""
    finally:
        writer.close()


def request(body: bytes, path: str = CHAT, extra: bytes = b"") -> bytes:
    return (
        (
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n"
        ).encode()
        + extra
        + b"\r\n"
        + body
    )


async def test_bad_input_corpus(live: tuple[str, int]) -> None:
    base, pid = live
    port = int(base.rsplit(":", 1)[1])
    async with aiohttp.ClientSession() as http:

        async def corpus() -> dict[str, int]:
            statuses = {}
            for name, body, headers in BODIES:
                hdrs = {"Content-Type": "application/json"} | headers
                # BytesIO: aiohttp warns about sending large raw bytes from the event loop.
                async with http.post(base + CHAT, data=io.BytesIO(body), headers=hdrs) as resp:
                    await resp.read()
                    statuses[name] = resp.status
            for method in ("PUT", "DELETE", "PATCH"):
                async with http.request(method, base + CHAT, data=GOOD) as resp:
                    statuses[method] = resp.status
            async with http.post(base + CHAT, data=GOOD, headers={"X-Big": "a" * 70_000}) as resp:
                statuses["oversized header"] = resp.status
            # A slow client: the body one byte at a time.
            reply = await raw(port, request(GOOD), drip=0.001)
            statuses["slow client"] = int(reply.split(b" ", 2)[1])
            # Connections dropped at every stage of a request.
            for cut in (b"POST /v1/chat", request(GOOD)[:80], request(GOOD)[:-20]):
                await raw(port, cut, read=False)
            await raw(port, request(GOOD + b" "), read=False)  # sent, then gone before the answer
            return statuses

        first = await corpus()
        rss_before = rss_kb(pid)
        for _ in range(4):
            assert await corpus() == first
        rss_after = rss_kb(pid)
        async with http.get(base + "/detproxy/health") as resp:
            assert resp.status == 200  # still up
        async with http.post(
            base + CHAT, data=GOOD, headers={"Content-Type": "application/json"}
        ) as resp:
            assert resp.status == 200  # and still serving
        metrics = await (await http.get(base + "/detproxy/metrics")).text()
    expected_4xx = {
        "not json",
        "not an object",
        "invalid utf-8",
        "wrong content type",
        "deeply nested",
        "empty",
        "oversized header",
    }
    for name in expected_4xx:
        assert 400 <= first[name] < 500, (name, first[name])
    assert first["over the limit"] == 413
    assert first["duplicate keys"] == 200 and first["slow client"] == 200
    assert all(status < 500 for status in first.values()), first
    assert 'outcome="proxy_error"' not in metrics
    assert rss_after - rss_before < 20_000, (rss_before, rss_after)  # KiB: flat
