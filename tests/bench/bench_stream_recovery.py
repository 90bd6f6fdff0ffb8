"""Streamed loop recovery, the candidates against each other, as a delta-reading client sees them.

Run (emulator, ~1 min): ``.venv/bin/python tests/bench/bench_stream_recovery.py``
Run (llama-server + SmolLM2-135M, looping prompts of tests/integration/loop_corpus.json):
``set -a; . /tmp/engine.env; set +a; .venv/bin/python tests/bench/bench_stream_recovery.py
--engine llama --prompts 3 --calm 2``

For each candidate (``restart``; ``continue`` with ``hold_back_chars`` 0, 256, 512) detproxy is
started as a user starts it (``policy = "retry"``, the default ladder) and each prompt is
streamed once, greedy, read as the openai SDK reads a stream (comments dropped, deltas joined).
Per candidate it prints:

- ended: streams whose last chunk's ``detproxy`` object says ``recovered: true``;
- spliced: streams in which a restart followed text the client had been shown;
- repeats shown: chars of the loop past its onset and one unit that the client was shown, the
  greedy looping answer (read directly from the engine, the detector run on it) against the
  client's text (their common prefix past ``start_offset + period``);
- first token (s) on looping and on calm prompts, and the time per content chunk after it;
- extra tokens: what recoveries made the engine generate (detproxy_recovery_tokens_total).

Prints figures only; no assertions.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from proxy.loops.detector import DetectorConfig, LoopDetector  # noqa: E402
from tests.helpers.llama_server import run_engine  # noqa: E402
from tests.helpers.metrics import scrape  # noqa: E402
from tests.helpers.processes import EXE, free_port, run_detproxy, stop, wait_http  # noqa: E402

CANDIDATES: dict[str, str] = {
    "restart": 'stream_mode = "restart"\n',
    "continue": 'stream_mode = "continue"\nhold_back_chars = 0\n',
    "continue+hold256": 'stream_mode = "continue"\nhold_back_chars = 256\n',
    "continue+hold512": 'stream_mode = "continue"\nhold_back_chars = 512\n',
}
LOOP_KNOBS = {"loop_channel": "content", "loop_after_tokens": 40, "loop_escape_probability": 0.7}


@contextlib.contextmanager
def run_emulator(logdir: Path, latency: float) -> Iterator[tuple[str, str]]:
    port = free_port()
    log = open(logdir / "emulator.log", "wb")  # noqa: SIM115
    args = [EXE, "emulator", "--port", str(port), "--token-latency", str(latency)]
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc, timeout=30)
        yield f"http://127.0.0.1:{port}", "emulator-model"
    finally:
        stop(proc)
        log.close()


async def stream(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str]
) -> dict[str, Any]:
    """One streamed request read as the SDK reads it."""
    t0 = time.monotonic()
    first: float | None = None
    last = t0
    text: list[str] = []
    chunks = 0
    info: dict[str, Any] | None = None
    comments = 0
    async with session.post(url, json=body | {"stream": True}, headers=headers) as resp:
        buf = b""
        async for piece in resp.content.iter_any():
            buf += piece
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                if event.startswith(b":"):
                    comments += 1
                    continue
                if not event.startswith(b"data: ") or event == b"data: [DONE]":
                    continue
                chunk = orjson.loads(event[6:])
                info = chunk.get("detproxy", info)
                for choice in chunk.get("choices") or []:
                    delta = (choice.get("delta") or {}).get("content")
                    if delta:
                        now = time.monotonic()
                        first = first if first is not None else now - t0
                        last = now
                        chunks += 1
                        text.append(delta)
    return {
        "text": "".join(text),
        "ttft": first,
        "per_chunk": (last - t0 - first) / (chunks - 1)
        if first is not None and chunks > 1
        else None,
        "detproxy": info,
        "comments": comments,
    }


async def direct(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str]
) -> tuple[str, int | None]:
    """The greedy answer straight from the engine, and where the detector sees its loop end
    its first unit (start_offset + period; None: no loop)."""
    async with session.post(url, json=body | {"stream": False}, headers=headers) as resp:
        answer = await resp.json()
    text = answer["choices"][0]["message"]["content"] or ""
    detector = LoopDetector(DetectorConfig())
    for at in range(0, len(text), 16):
        report = detector.feed(text[at : at + 16])
        if report is not None:
            return text, report.start_offset + report.period
    return text, None


def common(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def recovery_tokens(url: str) -> float:
    counts = scrape(url + "/detproxy/metrics", "detproxy_recovery_tokens_total")
    return sum(v for k, v in counts.items() if 'kind="generated"' in k)


def mean(values: list[float]) -> str:
    return f"{statistics.mean(values):.3f}" if values else "-"


async def measure(
    engine_url: str,
    proxy: str,
    model: str,
    prompts: list[str],
    calm: list[str],
    llama: bool,
    greedy_answers: dict[str, tuple[str, int | None]],
) -> dict[str, Any]:
    """One candidate's figures (``greedy_answers``: the engine's own answers, read once)."""
    extra: dict[str, Any] = {"cache_prompt": False} if llama else {}
    loop_headers = {} if llama else {"X-Emulator-Knobs": json.dumps(LOOP_KNOBS)}
    rows = []
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for i, prompt in enumerate(prompts):
            body = {
                "model": model,
                "temperature": 0,
                "max_tokens": 1024 if llama else 400,
                "messages": [{"role": "user", "content": prompt}],
                **extra,
            }
            if prompt not in greedy_answers:
                greedy_answers[prompt] = await direct(
                    session, engine_url + "/v1/chat/completions", body, loop_headers
                )
            greedy, onset = greedy_answers[prompt]
            got = await stream(session, proxy + "/v1/chat/completions", body, loop_headers)
            shown = common(greedy, got["text"])
            rows.append(
                {
                    "prompt": i,
                    "looped": onset is not None,
                    "ended": bool(got["detproxy"] and got["detproxy"]["recovered"]),
                    "spliced": got["comments"] > 0,
                    "repeats_shown": max(0, shown - onset) if onset is not None else 0,
                    "ttft": got["ttft"],
                    "per_chunk": got["per_chunk"],
                    "detproxy": got["detproxy"],
                }
            )
        calm_rows = []
        for prompt in calm:
            body = {
                "model": model,
                "temperature": 0,
                "max_tokens": 256,
                "messages": [{"role": "user", "content": prompt}],
                **extra,
            }
            got = await stream(session, proxy + "/v1/chat/completions", body, {})
            calm_rows.append({"ttft": got["ttft"], "per_chunk": got["per_chunk"]})
    looped = [r for r in rows if r["looped"]]
    return {
        "looping": len(looped),
        "ended": sum(r["ended"] for r in looped),
        "spliced": sum(r["spliced"] for r in looped),
        "repeats_shown_chars_mean": mean([r["repeats_shown"] for r in looped]),
        "repeats_shown_chars_max": max((r["repeats_shown"] for r in looped), default=0),
        "ttft_loop_s": mean([r["ttft"] for r in looped if r["ttft"] is not None]),
        "ttft_calm_s": mean([r["ttft"] for r in calm_rows if r["ttft"] is not None]),
        "per_chunk_s": mean([r["per_chunk"] for r in rows + calm_rows if r["per_chunk"]]),
        "extra_tokens": recovery_tokens(proxy),
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engine", choices=["emulator", "llama"], default="emulator")
    parser.add_argument("--prompts", type=int, default=12, help="looping prompts")
    parser.add_argument("--calm", type=int, default=4, help="prompts that do not loop")
    parser.add_argument("--latency", type=float, default=0.005, help="emulator s per token")
    parser.add_argument("--only", action="append", help="candidates (default: all)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    llama = args.engine == "llama"
    corpus = json.loads((ROOT / "tests/integration/loop_corpus.json").read_text())["prompts"]
    if llama:
        prompts = [p["prompt"] for p in corpus if p["looping"]][: args.prompts]
        calm = [p["prompt"] for p in corpus if not p["looping"]][: args.calm]
    else:
        prompts = [f"tell me story number {i}" for i in range(args.prompts)]
        calm = [f"a calm question {i}" for i in range(args.calm)]
    out: dict[str, Any] = {}
    greedy_answers: dict[str, tuple[str, int | None]] = {}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        logdir = Path(tmp)
        if llama:
            # As the corpus was measured: two slots, 4096 tokens of context.
            engine = stack.enter_context(run_engine(logdir, "-np", "2", "-c", "4096"))
            url, model = engine.url, engine.model
        else:
            url, model = stack.enter_context(run_emulator(logdir, args.latency))
        for name, config in CANDIDATES.items():
            if args.only and name not in args.only:
                continue
            toml = f'[loops]\npolicy = "retry"\n{config}\n[audit]\nsample_rate = 0.0\n'
            with run_detproxy(logdir, url, toml) as proxy:
                figures = asyncio.run(
                    measure(url, proxy, model, prompts, calm, llama, greedy_answers)
                )
            out[name] = figures
            shown = {k: v for k, v in figures.items() if k != "rows"}
            print(name, json.dumps(shown), flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
