"""Scripted and recording upstreams: a raw HTTP/1.1 server for the upstream client's tests (on
a socket: they are about the bytes on the wire), the routes of a minimal OpenAI-compatible
upstream (an SSE stream, a /version that can change), and what the tests read of a
``proxy.testing.MockUpstream``'s records (the scripted and recording upstream tests and users
share)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from proxy.http.h1 import H1Upstream
from proxy.loops.rendered import SENTINEL
from proxy.testing import Handler, MockUpstream, Received, Reply
from tests.helpers.sse import chat_chunk

# The upstream URL of a detproxy given a ``MockUpstream`` (the ``mock_upstream`` fixture): it
# names the engine (in the status, the logs); nothing listens there, every request goes to the
# mock.
MOCK_URL = "http://engine.test:8000"


@contextlib.asynccontextmanager
async def recording(url: str) -> AsyncIterator[MockUpstream]:
    """A real server (an engine, the emulator) at ``url`` behind a ``MockUpstream`` that
    records what it is sent (and answers first what a test scripts)."""
    engine = H1Upstream(url)
    try:
        async with MockUpstream(forward=engine) as upstream:
            yield upstream
    finally:
        await engine.close()


# A scripted HTTP/1.1 server for the upstream client's tests: it records each request and the
# connection it came on, and answers with whatever bytes a test's ``ScriptedReply`` writes.

JSON_REPLY = (
    b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 7\r\n\r\n{"a":1}'
)


@dataclass
class ScriptedRequest:
    conn: int  # which server-side connection it came on (0, 1, ...)
    head: bytes
    body: bytes

    @property
    def lines(self) -> list[bytes]:
        return self.head.split(b"\r\n")

    def header(self, name: bytes) -> bytes | None:
        for line in self.lines[1:]:
            key, _, value = line.partition(b":")
            if key.strip().lower() == name.lower():
                return value.strip()
        return None


# Gets the request and the writer; returns True to keep reading requests on the connection.
ScriptedReply = Callable[[ScriptedRequest, asyncio.StreamWriter], Awaitable[bool]]


@dataclass
class ScriptedServer:
    reply: ScriptedReply
    requests: list[ScriptedRequest] = field(default_factory=list)
    connections: int = 0
    eofs: int = 0  # connections the client closed
    server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = self.connections
        self.connections += 1
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    self.eofs += 1
                    return
                req = ScriptedRequest(conn, head, b"")
                length = req.header(b"content-length")
                if length is not None:
                    req.body = await reader.readexactly(int(length))
                elif req.header(b"transfer-encoding") == b"chunked":
                    req.body = await _read_chunked(reader)
                self.requests.append(req)
                if not await self.reply(req, writer):
                    writer.close()
                    return
                await writer.drain()
        finally:
            writer.close()


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    out = b""
    while True:
        size = int((await reader.readuntil(b"\r\n")).strip(), 16)
        data = await reader.readexactly(size + 2)
        if size == 0:
            return out
        out += data[:-2]


def replies_with(raw: bytes) -> ScriptedReply:
    """A ``ScriptedReply`` that writes ``raw`` to every request and keeps the connection."""

    async def reply(req: ScriptedRequest, writer: asyncio.StreamWriter) -> bool:
        writer.write(raw)
        return True

    return reply


# A scripted OpenAI-compatible upstream (routes for a MockUpstream or a FakeUpstream): a minimal
# SSE stream and a /version that can change


@dataclass
class UpstreamScript:
    tokens: int = 20
    delay_s: float = 0.002
    change_version: bool = False  # /version says 0.1.0 once, then 0.2.0
    fail_every: int = 0  # every n-th chat request (not the first) answers HTTP 500
    # /metrics of a vLLM with speculative decoding: its spec-decode counters start at 0 and
    # rise with the chat requests after the first (drafts of 3 tokens, 2 accepted); the first
    # drafts nothing, as vLLM's n-gram proposer when the prompt has no match.
    speculative: bool = False
    version_calls: int = 0
    chat_calls: int = 0
    bodies: list[dict[str, Any]] = field(default_factory=list)


def scripted_routes(script: UpstreamScript) -> dict[str, Handler]:
    """The paths ``script`` answers, for ``MockUpstream(routes=...)`` (404 elsewhere)."""

    def version(request: Received) -> Reply:
        script.version_calls += 1
        changed = script.change_version and script.version_calls > 1
        return Reply.json({"version": "0.2.0" if changed else "0.1.0"})

    def models(request: Received) -> Reply:
        return Reply.json({"object": "list", "data": [{"id": "m", "object": "model"}]})

    def chat(request: Received) -> Reply:
        script.chat_calls += 1
        script.bodies.append(request.json())
        if (
            script.fail_every
            and script.chat_calls > 1
            and script.chat_calls % script.fail_every == 0
        ):
            return Reply.json({"error": {"message": "scripted failure"}}, 500)
        events = [chat_chunk({"role": "assistant", "content": ""})]
        events += [chat_chunk({"content": "x"}) for _ in range(script.tokens)]
        events.append(chat_chunk({}, "length"))
        usage = {"prompt_tokens": 5, "completion_tokens": script.tokens, "total_tokens": 25}
        events.append({"choices": [], "usage": usage})
        return Reply.sse(events, interval_s=script.delay_s)

    def metrics(request: Received) -> Reply:
        n = max(0, script.chat_calls - 1)
        lines = [
            'vllm:num_requests_running{engine="0",model_name="m"} 0.0',
            f'vllm:spec_decode_num_drafts_total{{engine="0",model_name="m"}} {n}.0',
            f'vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="m"}} {3 * n}.0',
            f'vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="m"}} {2 * n}.0',
        ]
        return Reply.text("\n".join(lines) + "\n")

    routes: dict[str, Handler] = {"/version": version, "/v1/models": models}
    routes["/v1/chat/completions"] = chat
    if script.speculative:
        routes["/metrics"] = metrics
    return routes


def probes(upstream: MockUpstream) -> int:
    """Probes of a template an upstream got (the /tokenize renders whose reasoning is
    SENTINEL): the loop tests' record of a ``MockUpstream`` forwarding to the emulator."""
    return sum(
        1
        for body in upstream.bodies("/tokenize")
        if SENTINEL in orjson.dumps(body.get("messages") or []).decode()
    )
