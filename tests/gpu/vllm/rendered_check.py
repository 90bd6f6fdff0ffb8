"""close_reasoning on real vLLM with a template that drops assistant reasoning (issue 40.3):
the stand-in reasoning model (think_tokenizer.py, deepseek_r1 parser) served twice, with
think.jinja (keeps a final assistant message's reasoning) and think_drop.jinja (DeepSeek-R1's
distills' way: only what follows ``</think>``). Through a recording pass-through, so that the
requests detproxy sent (and vLLM's answers to them) are counted:

1. vLLM directly: the chat continuation of a closed reasoning on each template.
2. The looping prompts through detproxy, close_reasoning ladder, streamed and not, 4 in
   flight: rendered_continuation auto on both templates, never on the dropping one.

    PYTHONPATH=. python3 tests/gpu/vllm/rendered_check.py --keep URL --drop URL --out DIR

(on the H200: rendered_on_device.sh; here, two emulators, the second with
--template-drops-reasoning, both --model smollm2 --loop-channel reasoning --reasoning-tokens 200
--loop-after-tokens 30).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from tests.gpu.vllm.validate import LOOPING, MODEL, Detproxy, chat, free_port, looped

REASON_TOKENS = 512
ATTEMPTS = [{"strategy": "close_reasoning", "frequency_penalty": 1.0}]


class Recorder:
    """A pass-through in front of one vLLM that counts what it was sent and answered."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.seen: Counter[str] = Counter()
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        kind = request.path
        if body:
            with_fields = orjson.loads(body)
            if with_fields.get("continue_final_message"):
                kind += "+continue"
            if "messages" in with_fields and request.path == "/tokenize":
                kind += "+messages"
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host",)}
        async with self.http.request(
            request.method, self.upstream + request.path_qs, data=body, headers=headers
        ) as resp:
            self.seen[f"{kind} {resp.status}"] += 1
            if resp.content_type == "text/event-stream":
                out = web.StreamResponse(status=resp.status)
                out.content_type = resp.content_type
                await out.prepare(request)
                # detproxy closes a looping attempt's stream: the rest is not wanted.
                with contextlib.suppress(ConnectionError):
                    async for data in resp.content.iter_any():
                        await out.write(data)
                    await out.write_eof()
                return out
            return web.Response(
                status=resp.status, body=await resp.read(), content_type=resp.content_type
            )

    async def start(self) -> None:
        self.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600))
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        await self.runner.cleanup()
        await self.http.close()


async def wait_up(http: aiohttp.ClientSession, base: str, limit_s: float = 240) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        try:
            async with http.get(base + "/health") as resp:
                if resp.status == 200:
                    return time.monotonic() - t0
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(1)
    raise RuntimeError(f"{base} not up")


async def direct(http: aiohttp.ClientSession, base: str) -> dict[str, Any]:
    """vLLM itself: the chat continuation of a closed reasoning, and the render of a turn."""
    closed = "<think>\nThe ocean is wide and deep.\n</think>\n\n"
    messages = [
        {"role": "user", "content": "Write a poem about the ocean."},
        {"role": "assistant", "content": closed},
    ]
    body = {
        "model": MODEL,
        "messages": messages,
        "continue_final_message": True,
        "add_generation_prompt": False,
        "max_tokens": 32,
        "temperature": 0,
    }
    async with http.post(base + "/v1/chat/completions", json=body) as resp:
        continued = {"status": resp.status, "body": (await resp.text())[:400]}
    render = {"model": MODEL, "messages": messages, "add_generation_prompt": False}
    async with http.post(base + "/tokenize", json=render | {"return_token_strs": True}) as resp:
        rendered = await resp.json()
    return {
        "chat_continuation": continued,
        "rendered_turn": "".join(rendered.get("token_strs") or []),
    }


async def through(
    http: aiohttp.ClientSession, upstream: str, mode: str, work: Path, name: str
) -> dict[str, Any]:
    recorder = Recorder(upstream)
    await recorder.start()
    cfg = {
        "audit": {"sample_rate": 0.0, "passive_checks": False},
        "loops": {
            "policy": "retry",
            "ladders": [{"models": "*", "attempts": ATTEMPTS}],
            "reasoning_markers": [{"models": "*", "rendered_continuation": mode}],
        },
    }
    proxy = Detproxy(recorder.base, cfg, work, name)
    rows: list[dict[str, Any]] = []
    try:
        await proxy.ready(http)
        sem = asyncio.Semaphore(4)

        async def one(prompt: str, stream: bool) -> None:
            async with sem:
                r = await chat(http, proxy.base, prompt, stream=stream, max_tokens=REASON_TOKENS)
            content, reasoning = r.get("text") or "", r.get("reasoning") or ""
            rows.append(
                {
                    "prompt": prompt,
                    "stream": stream,
                    "status": r["status"],
                    "error": r.get("error"),
                    "finish": r.get("finish"),
                    "attempts": r.get("attempts"),
                    "recovered": r.get("recovered"),
                    "strategy": r.get("strategy"),
                    "ids": r.get("ids"),
                    "restart_marks": r.get("restart_marks"),
                    "reasoning_chars": len(reasoning),
                    "content_chars": len(content),
                    "answered": r["status"] == 200
                    and bool(content.strip())
                    and not looped(content),
                    "content_head": content[:160],
                }
            )

        await asyncio.gather(*(one(p, s) for p in LOOPING for s in (False, True)))
    finally:
        proxy.proc.terminate()
        proxy.proc.wait(timeout=30)
        await recorder.stop()
    retried = [r for r in rows if r["attempts"] not in (None, "1", 1)]
    return {
        "mode": mode,
        "upstream_requests": dict(recorder.seen),
        "requests": len(rows),
        "client_errors": sum(1 for r in rows if r["status"] != 200),
        "retried": len(retried),
        "recovered": sum(1 for r in retried if str(r["recovered"]).lower() == "true"),
        "answered_after_retry": sum(1 for r in retried if r["answered"]),
        "streams_with_one_id": sum(1 for r in rows if r["stream"] and r["ids"] == 1),
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--keep", required=True)
    parser.add_argument("--drop", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--work", default="/root/work/rendered")
    args = parser.parse_args()
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    asyncio.run(run(args, out, work))


async def run(args: argparse.Namespace, out: Path, work: Path) -> None:
    results: dict[str, Any] = {}

    def save() -> None:
        (out / "rendered.json").write_text(json.dumps(results, indent=1))

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as http:
        for name, base in (("keep", args.keep), ("drop", args.drop)):
            results[f"{name}_up_s"] = round(await wait_up(http, base), 1)
            results[f"{name}_direct"] = await direct(http, base)
            save()
        for name, base, mode in (
            ("drop_auto", args.drop, "auto"),
            ("drop_never", args.drop, "never"),
            ("keep_auto", args.keep, "auto"),
        ):
            t0 = time.monotonic()
            results[name] = await through(http, base, mode, work, name)
            results[name]["seconds"] = round(time.monotonic() - t0, 1)
            summary = {k: v for k, v in results[name].items() if k != "rows"}
            print(name, json.dumps(summary), flush=True)
            save()


if __name__ == "__main__":
    main()
