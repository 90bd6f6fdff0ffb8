"""Reasoning loops on the real engine: ``close_reasoning`` against ``restart``.

Run: ``.venv/bin/python tests/bench/bench_close_reasoning.py`` (48 min on 2 cores here, shared
for part of it). Prints figures only (no assertions); detproxy is not involved. llama-server +
SmolLM2-135M serves a thinking chat template (``tests/integration/think.jinja``: the generation
prompt opens ``<think>``, as DeepSeek-R1's and Qwen3-thinking's do) with ``--reasoning-format
deepseek``, so what the model writes after ``<think>`` streams as ``reasoning_content``.
SmolLM2 is not a reasoning model: it never writes ``</think>`` by itself, so every answer is
all reasoning, and a loop in it is a reasoning loop. That is the case ``close_reasoning`` is
for (a reasoning that does not end); what a real reasoning model does after its reasoning is
closed is not measured here.

1. Corpus: the prompts of ``bench_recovery_corpus`` at temperature 0, max_tokens 1024,
   streamed; the reasoning deltas feed a ``LoopDetector`` (default config), as detproxy's
   watch does; a generation is cut when it fires.
2. For each looping prompt and each option of ``OVERRIDES``:
   - ``restart``: the same request from scratch with the overrides;
   - ``close_reasoning``: the reasoning cut where detproxy cuts it (``prefix_of``), between
     the markers, as a final assistant message (``continue_final_message: true,
     add_generation_prompt: false``), max_tokens 1024 less its tokens (POST /tokenize).
   An attempt *answers* when it finishes ``stop`` (or ``length``) with content in which the
   detector finds no loop; a loop in the new reasoning or content cuts it (``looped``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from policies.base import Trigger  # noqa: E402
from proxy.loops.continuation import closed_reasoning, prefix_of  # noqa: E402
from proxy.loops.detector import LoopDetector  # noqa: E402
from tests.bench.bench_recovery_corpus import (  # noqa: E402
    COLD,
    CONTINUE,
    FACTUAL,
    GGUF,
    MAX_TOKENS,
    OPEN_ENDED,
    OVERRIDES,
    SERVER,
    report_dict,
    start_server,
)

TEMPLATE = ROOT / "tests" / "integration" / "think.jinja"
THINKING = ["--jinja", "--chat-template-file", str(TEMPLATE), "--reasoning-format", "deepseek"]


async def tokens_of(session: aiohttp.ClientSession, url: str, text: str) -> int:
    async with session.post(url + "/tokenize", json={"content": text}) as resp:
        return len((await resp.json())["tokens"])


async def attempt(
    session: aiohttp.ClientSession,
    url: str,
    slots: asyncio.Semaphore,
    prompt: str,
    overrides: dict[str, Any],
    closed: str = "",
) -> dict[str, Any]:
    """One streamed attempt; each channel feeds its own detector, as in detproxy."""
    messages: list[dict[str, str]] = [{"role": "user", "content": prompt}]
    body: dict[str, Any] = {"model": "smollm2", "temperature": 0, **COLD, **overrides}
    max_tokens = MAX_TOKENS
    if closed:
        messages.append({"role": "assistant", "content": closed})
        body.update(CONTINUE)
        max_tokens -= await tokens_of(session, url, closed)
    body.update(messages=messages, max_tokens=max_tokens, stream=True)
    body["stream_options"] = {"include_usage": True}
    detectors = {"reasoning_content": LoopDetector(), "content": LoopDetector()}
    texts: dict[str, list[str]] = {"reasoning_content": [], "content": []}
    finish, usage, chunks, report, channel = None, None, 0, None, None
    async with slots, session.post(url + "/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            return {"finish": "error", "error": (await resp.text())[:300], "tokens": 0}
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                for key, parts in texts.items():
                    text = delta.get(key)
                    if text:
                        chunks += 1
                        parts.append(text)
                        found = detectors[key].feed(text)
                        if found is not None and report is None:
                            report, channel = found, key
                finish = choice.get("finish_reason") or finish
            if report is not None:
                finish = "looped"
                break  # closing the stream makes llama-server stop this slot
    tokens = usage["completion_tokens"] if usage and finish != "looped" else chunks
    reasoning, content = "".join(texts["reasoning_content"]), "".join(texts["content"])
    return {
        "finish": finish,
        "tokens": tokens,
        "reasoning_chars": len(reasoning),
        "content_chars": len(content),
        "loop": report_dict(report),
        "loop_channel": channel,
        "answered": finish in ("stop", "length") and bool(content.strip()),
        "content_head": content[:200],
        "_reasoning": reasoning,
    }


def trigger_of(loop: dict[str, Any]) -> Trigger:
    return Trigger("proxy", "reasoning", 0, loop["period"], loop["repeats"], loop["start_offset"])


async def run(args: argparse.Namespace, url: str) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=900)
    # A new connection per request: llama-server closes an idle keep-alive connection.
    connector = aiohttp.TCPConnector(force_close=True)
    slots = asyncio.Semaphore(2)
    t0 = time.monotonic()
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        prompts = [(p, "open") for p in OPEN_ENDED] + [(p, "factual") for p in FACTUAL]
        if args.limit:
            prompts = prompts[: args.limit]
        bases = await asyncio.gather(*(attempt(session, url, slots, p, {}) for p, _ in prompts))
        corpus = []
        for (prompt, kind), base in zip(prompts, bases, strict=True):
            base["prompt"], base["kind"] = prompt, kind
            corpus.append(base)
            loop = base["loop"]
            print(f"{'LOOP' if loop else '    '} {kind:7} {base['finish']:6} {prompt!r}")
        print(f"corpus: {time.monotonic() - t0:.0f} s", flush=True)
        looping = [b for b in corpus if b["loop"] and b["loop_channel"] == "reasoning_content"]
        jobs = []
        for base in looping:
            kept = prefix_of(base["_reasoning"], trigger_of(base["loop"])) or ""
            base["kept_chars"] = len(kept)
            base["kept_tokens"] = await tokens_of(session, url, kept) if kept else 0
            closed = closed_reasoning(kept, "<think>", "</think>")
            for name, over in OVERRIDES.items():
                restart = attempt(session, url, slots, base["prompt"], over)
                close = attempt(session, url, slots, base["prompt"], over, closed)
                jobs.append((base, f"restart:{name}", restart))
                jobs.append((base, f"close_reasoning:{name}", close))
        results = await asyncio.gather(*(j[2] for j in jobs))
        for (base, key, _), res in zip(jobs, results, strict=True):
            res.pop("_reasoning", None)
            base.setdefault("attempts", {})[key] = res
    for base in corpus:
        base.pop("_reasoning", None)
    print(f"attempts: {time.monotonic() - t0:.0f} s", flush=True)
    return {"corpus": corpus, "seconds": round(time.monotonic() - t0)}


def summarise(data: dict[str, Any]) -> dict[str, Any]:
    corpus = data["corpus"]
    looping = [b for b in corpus if "attempts" in b]
    calm = [b for b in corpus if not b["loop"]]
    factual = [b for b in corpus if b["kind"] == "factual"]
    print()
    print(f"reasoning loops: {len(looping)} of {len(corpus)} prompts "
          f"({sum(1 for b in factual if b['loop'])} of {len(factual)} factual)")  # fmt: skip
    print(f"calm answers by finish_reason: "
          f"{ {f: sum(1 for b in calm if b['finish'] == f) for f in {b['finish'] for b in calm}} }"
          f", with content: {sum(1 for b in calm if b['content_chars'])}")  # fmt: skip
    if looping:
        kept = [b["kept_tokens"] for b in looping]
        print(f"kept reasoning: median {statistics.median(kept):.0f} tokens")
    summary: dict[str, Any] = {}
    print(f"{'attempt':24} {'answered':>9} {'looped':>7} {'stop, no content':>17} "
          f"{'tokens (all)':>13} {'tokens/answered':>16}")  # fmt: skip
    keys = sorted({k for b in looping for k in b["attempts"]})
    for key in keys:
        runs = [b["attempts"][key] for b in looping]
        answered = [r for r in runs if r["answered"]]
        row = {
            "answered": len(answered),
            "of": len(runs),
            "looped": sum(r["finish"] == "looped" for r in runs),
            "stop_without_content": sum(
                r["finish"] in ("stop", "length") and not r["answered"] for r in runs
            ),
            "errors": sum(r["finish"] == "error" for r in runs),
            "all_tokens": sum(r["tokens"] for r in runs),
        }
        row["tokens_per_answered"] = round(row["all_tokens"] / len(answered)) if answered else None
        summary[key] = row
        print(f"{key:24} {row['answered']:>5}/{row['of']:<3} {row['looped']:>7} "
              f"{row['stop_without_content']:>17} {row['all_tokens']:>13} "
              f"{row['tokens_per_answered'] or '-':>16}")  # fmt: skip
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a llama-server already serving the thinking template")
    parser.add_argument("--server", type=Path, default=SERVER)
    parser.add_argument("--gguf", type=Path, default=GGUF)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--limit", type=int, default=0, help="only the first N prompts")
    parser.add_argument(
        "--json",
        type=Path,
        default=ROOT / "tests" / "bench" / "results" / "close-reasoning-2026-12-01.json",
    )
    args = parser.parse_args()
    proc = None
    url = args.url
    if url is None:
        log = Path("/tmp") / "bench-close-reasoning-llama-server.log"
        proc, url = start_server(args, log, THINKING)
    try:
        data = asyncio.run(run(args, url))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=10)
    data["summary"] = summarise(data)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(data, indent=1))
    print("raw results:", args.json)


if __name__ == "__main__":
    main()
