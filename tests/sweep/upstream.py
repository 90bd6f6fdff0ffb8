"""A scripted OpenAI-compatible upstream: a minimal SSE stream and a /version that can change."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web


@dataclass
class Script:
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


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def _chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
    return _event({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


def scripted_app(script: Script) -> web.Application:
    async def version(request: web.Request) -> web.Response:
        script.version_calls += 1
        changed = script.change_version and script.version_calls > 1
        return web.json_response({"version": "0.2.0" if changed else "0.1.0"})

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

    async def chat(request: web.Request) -> web.StreamResponse:
        script.chat_calls += 1
        script.bodies.append(await request.json())
        if (
            script.fail_every
            and script.chat_calls > 1
            and script.chat_calls % script.fail_every == 0
        ):
            return web.json_response({"error": {"message": "scripted failure"}}, status=500)
        delay = script.delay_s
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(_chunk({"role": "assistant", "content": ""}))
        for _ in range(script.tokens):
            await asyncio.sleep(delay)
            await resp.write(_chunk({"content": "x"}))
        await resp.write(_chunk({}, "length"))
        usage = {"prompt_tokens": 5, "completion_tokens": script.tokens, "total_tokens": 25}
        await resp.write(_event({"choices": [], "usage": usage}))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def metrics(request: web.Request) -> web.Response:
        n = max(0, script.chat_calls - 1)
        lines = [
            'vllm:num_requests_running{engine="0",model_name="m"} 0.0',
            f'vllm:spec_decode_num_drafts_total{{engine="0",model_name="m"}} {n}.0',
            f'vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="m"}} {3 * n}.0',
            f'vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="m"}} {2 * n}.0',
        ]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    app = web.Application()
    if script.speculative:
        app.router.add_get("/metrics", metrics)
    app.router.add_get("/version", version)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat)
    return app
