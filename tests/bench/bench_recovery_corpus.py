"""Loop corpus and recovery ladder on the real engine: llama-server + SmolLM2-135M, directly.

Run: ``.venv/bin/python tests/bench/bench_recovery_corpus.py`` (~20-25 min on 2 idle cores).
Prints figures only (no assertions); detproxy is not involved. It starts llama-server the way
``tests/integration/conftest.py`` does (``-np 2 -c 4096``, two slots with per-slot KV, 127.0.0.1
only) unless ``--url`` names one already running, and stops it at the end.

1. Corpus: each prompt of ``OPEN_ENDED`` and ``FACTUAL`` at temperature 0, max_tokens 1024,
   ``cache_prompt: false``, streamed; the content deltas feed a ``LoopDetector`` with its
   default config, as detproxy feeds it. A generation is cut when the detector fires (what
   detproxy does), so a "loop" is "the detector fires within 1024 tokens".
2. Recovery, for every looping prompt and every option of ``OVERRIDES``:
   - ``restart``: the same request from scratch with the overrides;
   - ``continue``: the output cut at ``start_offset + period`` (the text before the loop plus
     one copy of its unit) sent as a final assistant message (``continue_final_message: true,
     add_generation_prompt: false``) with the overrides and ``max_tokens = 1024 - tokens of the
     prefix`` (POST /tokenize). The detector is fed the prefix, then the new deltas.
   An attempt *ends* a loop when it finishes ``stop`` with content, or ``length`` without the
   detector firing; a loop found in the new text cuts it (``looped``).
3. Second attempts: a restart does not depend on the attempt before it, so ``restart A`` then
   ``restart B`` (and ``continue A`` then ``restart B``) are read off step 2. ``continue A``
   then ``continue B`` is measured: the first continuation is cut at its own loop and continued.

Also measured: whether /tokenize of the prefix gives back the first tokens of the original
completion (token ids from ``logprobs``), and what llama-server returns for a continued final
assistant message (streamed and not). Raw results: ``--json`` (default
tests/bench/results/recovery-corpus-2026-12-01.json); the corpus with its looping flags:
``--corpus`` (default tests/integration/loop_corpus.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from policies.base import Trigger  # noqa: E402
from proxy.loops.continuation import prefix_of  # noqa: E402
from proxy.loops.detector import LoopDetector, LoopReport  # noqa: E402
from tests.helpers.processes import free_port  # noqa: E402

CACHE = Path.home() / ".cache" / "detproxy"
SERVER = CACHE / "llama-server-0.3.36-portable" / "build" / "bin" / "llama-server"
GGUF = CACHE / "smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
MAX_TOKENS = 1024
SHORT = 8  # a recovery that stops within this many tokens adds (almost) nothing
COLD = {"cache_prompt": False}
CONTINUE = {"continue_final_message": True, "add_generation_prompt": False}

OPEN_ENDED = [
    # stories
    "Write a short story about a dragon.",
    "Write a story about a robot who learns to paint.",
    "Write a story about a lost dog finding its way home.",
    "Tell me a bedtime story about a brave little mouse.",
    "Write a story about a time traveler who visits ancient Rome.",
    "Write a fairy tale about a princess and a frog.",
    "Write a story about two friends who go camping.",
    # poems
    "Write a poem about the ocean.",
    "Write a poem about love.",
    "Write a poem about autumn leaves.",
    "Write a poem about the moon.",
    "Write a poem about a city at night.",
    "Write a haiku sequence about winter.",
    # letters
    "Write a letter to a friend.",
    "Write a thank-you letter to a teacher.",
    "Write a cover letter for a job as a software engineer.",
    "Write a letter to your future self.",
    "Write an apology letter to a neighbor.",
    # essays
    "Write an essay about climate change.",
    "Write an essay on the importance of education.",
    "Write an essay about the benefits of reading books.",
    "Write an essay about social media and teenagers.",
    "Write an essay about the history of the internet.",
    # tips
    "Give me tips for staying productive while working from home.",
    "Give me tips for learning a new language.",
    "Give me tips for a healthy lifestyle.",
    "Give me advice on how to save money.",
    "How can I improve my public speaking skills?",
    # descriptions
    "Describe a beautiful sunset.",
    "Describe your ideal vacation.",
    "Describe a busy marketplace.",
    "Describe the life of a honeybee.",
    "Describe a forest after the rain.",
    # explanations
    "Explain how computers work.",
    "Explain how the human heart works.",
    "Explain photosynthesis to a child.",
    "Explain why the sky is blue.",
    "Explain how airplanes fly.",
    "Write a product description for a new smartphone.",
    "Write a speech for a high school graduation.",
]
FACTUAL = [
    "What is the capital of France?",
    "How many days are in a week?",
    "What is 12 times 12?",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water in Celsius?",
    "What is the largest planet in our solar system?",
    "What color do you get when you mix blue and yellow?",
    "How many legs does a spider have?",
    "What is the chemical symbol for gold?",
    "In which continent is Egypt?",
    "What is the square root of 81?",
    "Translate 'thank you' into Spanish.",
    "What is the opposite of 'hot'?",
    "Name the first month of the year.",
    "How many minutes are in an hour?",
]
# Sampling overrides of a recovery attempt (the rest of the request stays greedy).
OVERRIDES: dict[str, dict[str, Any]] = {
    "pp1.5": {"presence_penalty": 1.5},
    "t0.7+pp1.5": {"temperature": 0.7, "top_p": 0.95, "presence_penalty": 1.5, "seed": 1},
    "fp1.0": {"frequency_penalty": 1.0},
    "t0.7": {"temperature": 0.7, "top_p": 0.95, "seed": 1},
}


def start_server(
    args: argparse.Namespace, log: Path, extra: Sequence[str] = ()
) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [
        str(args.server),
        "-m",
        str(args.gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-t",
        str(args.threads),
        "-a",
        "smollm2",
        "--no-webui",
        "--metrics",
        "-np",
        "2",
        "-c",
        "4096",
        *extra,
    ]
    print("engine:", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode}, see {log}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return proc, url
        except OSError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError("llama-server not ready after 120 s")
        time.sleep(0.3)


def report_dict(report: LoopReport | None) -> dict[str, Any] | None:
    if report is None:
        return None
    return {
        "period": report.period,
        "repeats": report.repeats,
        "start_offset": report.start_offset,
        "covered_chars": report.covered_chars,
        "detected_at": report.detected_at,
        "trivial": report.trivial,
        "unit_preview": report.unit_preview[:60],
    }


def error_result(error: str) -> dict[str, Any]:
    return {
        "finish": "error",
        "error": error,
        "ended": False,
        "tokens": 0,
        "new_chars": 0,
        "prefix_tokens": 0,
        "loop": None,
        "_text": "",
        "_ids": [],
        "_pieces": [],
    }


class Engine:
    def __init__(self, session: aiohttp.ClientSession, url: str, slots: int) -> None:
        self.session = session
        self.url = url
        self.slots = asyncio.Semaphore(slots)
        self.tokens = 0  # completion tokens generated in all

    async def tokenize(self, text: str) -> list[int]:
        async with self.session.post(self.url + "/tokenize", json={"content": text}) as resp:
            return list((await resp.json())["tokens"])

    async def chat(
        self, prompt: str, overrides: dict[str, Any], prefix: str = "", ids: bool = False
    ) -> dict[str, Any]:
        """One streamed attempt, cut when the detector fires on prefix + new text."""
        for retry in range(3):
            try:
                return await self._chat(prompt, overrides, prefix, ids)
            except (TimeoutError, aiohttp.ClientError) as exc:
                print(f"retrying after {exc!r}: {prompt!r}", flush=True)
                if retry == 2:
                    return error_result(repr(exc))
                await asyncio.sleep(1)
        raise AssertionError

    async def _chat(
        self, prompt: str, overrides: dict[str, Any], prefix: str, ids: bool
    ) -> dict[str, Any]:
        messages: list[dict[str, str]] = [{"role": "user", "content": prompt}]
        body: dict[str, Any] = {"model": "smollm2", "temperature": 0, **COLD}
        max_tokens = MAX_TOKENS
        prefix_tokens = 0
        if prefix:
            messages.append({"role": "assistant", "content": prefix})
            body.update(CONTINUE)
            prefix_tokens = len(await self.tokenize(prefix))
            max_tokens = MAX_TOKENS - prefix_tokens
        body.update(overrides)
        body.update(
            messages=messages,
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
        )
        if ids:
            body.update(logprobs=True, top_logprobs=1)
        detector = LoopDetector()
        assert detector.feed(prefix) is None
        parts: list[str] = []
        token_ids: list[int] = []
        pieces: list[bytes] = []
        finish = None
        usage = None
        chunks = 0
        report = None
        t0 = time.monotonic()
        post = self.session.post
        async with self.slots, post(self.url + "/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                error = f"{resp.status} {await resp.text()}"[:300]
                return error_result(error)
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    text = delta.get("content")
                    if text:
                        chunks += 1
                        parts.append(text)
                        report = report or detector.feed(text)
                    for entry in (choice.get("logprobs") or {}).get("content") or []:
                        token_ids.append(entry["id"])
                        pieces.append(bytes(entry["bytes"]))
                    finish = choice.get("finish_reason") or finish
                if report is not None:
                    finish = "looped"
                    break  # closing the stream makes llama-server stop this slot
        tokens = usage["completion_tokens"] if usage and finish != "looped" else chunks
        self.tokens += tokens
        new = "".join(parts)
        out: dict[str, Any] = {
            "finish": finish,
            "tokens": tokens,
            "new_chars": len(new),
            "prefix_tokens": prefix_tokens,
            "max_tokens": max_tokens,
            "seconds": round(time.monotonic() - t0, 1),
            "loop": report_dict(report),
            "ended": (finish == "stop" and bool(prefix + new)) or finish == "length",
        }
        out["_text"] = new
        if ids:
            out["_ids"] = token_ids
            out["_pieces"] = pieces
        return out


def retokenisation(base: dict[str, Any], prefix: str, tok: list[int]) -> dict[str, Any]:
    """Does /tokenize(prefix) give the original completion's first tokens back?"""
    ids: list[int] = base["_ids"]
    want = prefix.encode()
    at, boundary_tokens = 0, None
    for i, piece in enumerate(base["_pieces"]):
        if at == len(want):
            boundary_tokens = i
            break
        if at > len(want):
            break
        at += len(piece)
    else:
        if at == len(want):
            boundary_tokens = len(ids)
    common = 0
    for a, b in zip(tok, ids, strict=False):
        if a != b:
            break
        common += 1
    return {
        "cut_on_token_boundary": boundary_tokens is not None,
        "original_tokens_of_prefix": boundary_tokens,
        "tokenize_len": len(tok),
        "common_prefix": common,
        "faithful": boundary_tokens is not None and tok == ids[:boundary_tokens],
    }


async def probe_continue(engine: Engine) -> dict[str, Any]:
    """What llama-server returns for a final assistant message, streamed and not."""
    prompt, prefix = "Write a poem about the ocean.", "In the depths of the ocean, where"
    messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": prefix}]
    out: dict[str, Any] = {"prefix": prefix}
    for name, extra in (("flags", CONTINUE), ("no_flags", {})):
        body = {"model": "smollm2", "messages": messages, "temperature": 0, "max_tokens": 8}
        body.update(COLD, **extra)
        async with engine.session.post(engine.url + "/v1/chat/completions", json=body) as resp:
            answer = await resp.json()
        content = answer["choices"][0]["message"]["content"]
        out[f"nonstream_{name}"] = {
            "content": content,
            "starts_with_prefix": content.startswith(prefix),
        }
    body.update(CONTINUE, stream=True)
    streamed = []
    async with engine.session.post(engine.url + "/v1/chat/completions", json=body) as resp:
        async for raw in resp.content:
            line = raw.strip()
            if line.startswith(b"data: {"):
                for choice in json.loads(line[6:]).get("choices") or []:
                    streamed.append((choice.get("delta") or {}).get("content") or "")
    text = "".join(streamed)
    out["stream_flags"] = {"content": text, "starts_with_prefix": text.startswith(prefix)}
    return out


def cut(full: str, loop: dict[str, Any]) -> str:
    return full[: loop["start_offset"] + loop["period"]]


async def retok_only(args: argparse.Namespace, url: str) -> None:
    """The corpus, then /tokenize of each loop's prefix cut raw (onset + one unit) and cut where
    detproxy cuts it (``prefix_of``: moved back to a word end), against the generated ids."""
    connector = aiohttp.TCPConnector(force_close=True)
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        engine = Engine(session, url, slots=2)
        prompts = OPEN_ENDED[: args.limit] if args.limit else OPEN_ENDED
        bases = await asyncio.gather(*(engine.chat(p, {}, ids=True) for p in prompts))
        counts = {"raw": [0, 0], "word_end": [0, 0]}  # [on a token boundary, faithful]
        n = 0
        for base in bases:
            loop = base["loop"]
            if not loop:
                continue
            n += 1
            full = base["_text"]
            trigger = Trigger("proxy", "content", 0, loop["period"], loop["repeats"],
                              loop["start_offset"])  # fmt: skip
            for name, prefix in (("raw", cut(full, loop)), ("word_end", prefix_of(full, trigger))):
                r = retokenisation(base, prefix or "", await engine.tokenize(prefix or ""))
                counts[name][0] += r["cut_on_token_boundary"]
                counts[name][1] += r["faithful"]
    for name, (boundary, faithful) in counts.items():
        print(f"{name:9} cut on a token boundary {boundary}/{n}, faithful {faithful}/{n}")


def fmt_mean(values: list[int]) -> str:
    return f"{statistics.mean(values):7.0f}" if values else "      -"


async def run(args: argparse.Namespace, url: str) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=900)
    # A new connection per request: llama-server (cpp-httplib) closes a keep-alive connection
    # after 100 requests or 5 s idle, and a request sent as it does so fails.
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        engine = Engine(session, url, slots=2)
        t0 = time.monotonic()
        probe = await probe_continue(engine)
        print("continue probe:", json.dumps(probe), flush=True)

        prompts = [(p, "open") for p in OPEN_ENDED] + [(p, "factual") for p in FACTUAL]
        if args.limit:
            prompts = prompts[: args.limit] + [(p, "factual") for p in FACTUAL[:2]]
        bases = await asyncio.gather(*(engine.chat(p, {}, ids=True) for p, _ in prompts))
        corpus = []
        for (prompt, kind), base in zip(prompts, bases, strict=True):
            base["prompt"], base["kind"] = prompt, kind
            base["text_head"] = base["_text"][:300]
            loop = base["loop"]
            flag = "LOOP" if loop else "    "
            detail = f"p={loop['period']} start={loop['start_offset']}" if loop else ""
            print(f"{flag} {kind:7} {base['finish']:6} {base['tokens']:5} {prompt!r} {detail}")
            corpus.append(base)
        print(f"corpus: {time.monotonic() - t0:.0f} s, {engine.tokens} tokens", flush=True)
        looping = [b for b in corpus if b["loop"]]

        # The continue prefixes and the re-tokenisation check.
        for base in looping:
            full = base["_text"]
            base["_prefix"] = cut(full, base["loop"])
            tok = await engine.tokenize(base["_prefix"])
            base["retok"] = retokenisation(base, base["_prefix"], tok)

        # First attempts: every option, both strategies.
        jobs = []
        for base in looping:
            for name, over in OVERRIDES.items():
                jobs.append((base, "restart", name, engine.chat(base["prompt"], over)))
                jobs.append(
                    (base, "continue", name, engine.chat(base["prompt"], over, base["_prefix"]))
                )
        results = await asyncio.gather(*(j[3] for j in jobs))
        for (base, strategy, name, _), res in zip(jobs, results, strict=True):
            base.setdefault("attempts", {})[f"{strategy}:{name}"] = res
        print(f"first attempts: {time.monotonic() - t0:.0f} s, {engine.tokens} tokens", flush=True)

        # Second attempts of continue ladders: continue A looped -> continue B from its cut.
        # Only after the continue option that ended the most loops (the ladder's first rung).
        def ended(first: str) -> int:
            return sum(b["attempts"][f"continue:{first}"]["ended"] for b in looping)

        firsts = sorted(OVERRIDES, key=ended, reverse=True)[: args.second_after]
        jobs2 = []
        for base in looping:
            for first in firsts:
                res = base["attempts"][f"continue:{first}"]
                if res["finish"] != "looped":
                    continue
                full = base["_prefix"] + res["_text"]
                prefix2 = cut(full, res["loop"])
                for second, over in OVERRIDES.items():
                    key = f"continue:{first}>continue:{second}"
                    jobs2.append((base, key, engine.chat(base["prompt"], over, prefix2)))
        results2 = await asyncio.gather(*(j[2] for j in jobs2))
        for (base, key, _), res in zip(jobs2, results2, strict=True):
            base.setdefault("second", {})[key] = res
        print(f"second attempts: {time.monotonic() - t0:.0f} s, {engine.tokens} tokens")
        return {"probe": probe, "corpus": corpus, "seconds": round(time.monotonic() - t0)}


def summarise(data: dict[str, Any]) -> dict[str, Any]:
    corpus = data["corpus"]
    looping = [b for b in corpus if b["loop"]]
    opened = [b for b in corpus if b["kind"] == "open"]
    factual = [b for b in corpus if b["kind"] == "factual"]
    n = len(looping)
    print()
    print(f"loops: {sum(1 for b in opened if b['loop'])}/{len(opened)} open-ended prompts,")
    print(f"       {sum(1 for b in factual if b['loop'])}/{len(factual)} factual")
    for b in factual:
        if b["loop"]:
            head = b.get("text_head")
            print(f"  factual hit, judge it (a real loop or a false positive): {head!r}")
    print("looping prompts: period, repeats at detection, start offset, tokens until detection")
    for b in looping:
        lp = b["loop"]
        print(
            f"  {lp['period']:4} x{lp['repeats']:<3} @{lp['start_offset']:5} "
            f"{b['tokens']:5} tok  {b['prompt']!r}  unit={lp['unit_preview'][:40]!r}"
        )
    finishes = {}
    for b in corpus:
        if not b["loop"]:
            finishes[b["finish"]] = finishes.get(b["finish"], 0) + 1
    print(f"non-looping outputs by finish_reason: {finishes}")
    retok = [b["retok"] for b in looping]
    print(
        "re-tokenisation of the continue prefix: "
        f"cut on a token boundary {sum(r['cut_on_token_boundary'] for r in retok)}/{n}, "
        f"tokenize(prefix) == original first tokens {sum(r['faithful'] for r in retok)}/{n}; "
        "mismatches (common prefix / tokenize len / original tokens): "
        + ", ".join(
            f"{r['common_prefix']}/{r['tokenize_len']}/{r['original_tokens_of_prefix']}"
            for r in retok
            if not r["faithful"]
        )
    )

    table = {}
    print()
    print("first attempt          ended   looped  mean extra tok/ended  median  kept prefix tok")
    for strategy in ("restart", "continue"):
        for name in OVERRIDES:
            key = f"{strategy}:{name}"
            rows = [b["attempts"][key] for b in looping]
            ended = [r for r in rows if r["ended"]]
            toks = [r["tokens"] for r in ended]
            kept = [r["prefix_tokens"] for r in rows]
            stops = sum(1 for r in ended if r["finish"] == "stop")
            short = sum(1 for r in ended if r["finish"] == "stop" and r["tokens"] <= SHORT)
            table[key] = {
                "ended": len(ended),
                "of": n,
                "stop": stops,
                "length": len(ended) - stops,
                "looped": sum(1 for r in rows if r["finish"] == "looped"),
                "stop_within_short": short,
                "errors": sum(1 for r in rows if r["finish"] not in ("stop", "length", "looped")),
                "mean_tokens_ended": round(statistics.mean(toks), 1) if toks else None,
                "mean_prefix_tokens": round(statistics.mean(kept), 1) if kept else None,
                "all_tokens": sum(r["tokens"] for r in rows),
            }
            t = table[key]
            print(
                f"{key:22} {len(ended):2}/{n:<3} {t['looped']:5}   {fmt_mean(toks)}"
                f"               {statistics.median(toks) if toks else 0:6.0f}"
                f"  {fmt_mean(kept) if strategy == 'continue' else '      -'}"
                f"   (stop {stops}, of them <= {SHORT} tok {short}; length {len(ended) - stops})"
            )

    print()
    print("two-attempt ladders: ended/total, mean tokens of the attempts per ended loop")
    ladders = {}
    keys = [f"{s}:{o}" for s in ("restart", "continue") for o in OVERRIDES]
    for a in keys:
        for b_key in keys:
            measured = a.startswith("continue:") and b_key.startswith("continue:")
            if a == b_key and not measured:
                continue  # a restart repeats its first attempt exactly
            ended, toks = 0, []
            for b in looping:
                first = b["attempts"][a]
                if first["ended"]:
                    ended += 1
                    toks.append(first["tokens"])
                    continue
                if measured:
                    second = b.get("second", {}).get(f"{a}>{b_key}")
                    if second is None:  # an error, not a loop: no second attempt measured
                        continue
                else:
                    second = b["attempts"][b_key]
                if second["ended"]:
                    ended += 1
                    toks.append(first["tokens"] + second["tokens"])
            if measured and not any(f"{a}>{b_key}" in b.get("second", {}) for b in looping):
                continue  # not measured (see --second-after)
            ladders[f"{a} > {b_key}"] = {"ended": ended, "of": n, "mean_tokens": toks}
    print(f"rows: first attempt, columns: second attempt (ended of {n})")
    print(" " * 22 + "".join(f"{k[0].upper() + ':' + k.split(':')[1]:>14}" for k in keys))
    for a in keys:
        cells = []
        for b_key in keys:
            v = ladders.get(f"{a} > {b_key}")
            cells.append(f"{v['ended']:>14}" if v else f"{'-':>14}")
        print(f"{a:22}" + "".join(cells))
    print("mean tokens of the attempts per ended loop")
    for a in keys:
        cells = []
        for b_key in keys:
            v = ladders.get(f"{a} > {b_key}")
            cells.append(f"{fmt_mean(v['mean_tokens']):>14}" if v else f"{'-':>14}")
        print(f"{a:22}" + "".join(cells))
    for v in ladders.values():
        v["mean_tokens"] = round(statistics.mean(v["mean_tokens"]), 1) if v["mean_tokens"] else None
    return {"first": table, "ladders": ladders}


def strip(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: strip(v) for k, v in obj.items() if not k.startswith("_")}
    if isinstance(obj, list):
        return [strip(v) for v in obj]
    return obj


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", help="a running llama-server (default: start one)")
    parser.add_argument("--server", type=Path, default=Path(os.environ.get("LLAMA_SERVER", SERVER)))
    parser.add_argument("--gguf", type=Path, default=Path(os.environ.get("SMOLLM2_GGUF", GGUF)))
    parser.add_argument("--threads", type=int, default=2, help="llama-server -t (tests: 2)")
    parser.add_argument("--limit", type=int, default=0, help="only the first N open prompts")
    parser.add_argument(
        "--json", type=Path, default=ROOT / "tests/bench/results/recovery-corpus-2026-12-01.json"
    )
    parser.add_argument("--corpus", type=Path, default=ROOT / "tests/integration/loop_corpus.json")
    parser.add_argument(
        "--second-after", type=int, default=1, help="continue>continue after the N best firsts"
    )
    parser.add_argument("--summary", type=Path, help="only print the summary of a --json file")
    parser.add_argument(
        "--retok-only", action="store_true", help="only the corpus and the prefixes' /tokenize"
    )
    parser.add_argument("--log", type=Path, default=Path("/tmp/bench-recovery-llama-server.log"))
    args = parser.parse_args()
    if args.summary:
        summarise(json.loads(args.summary.read_text()))
        return
    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(args, args.log)
    try:
        if args.retok_only:
            asyncio.run(retok_only(args, url))
            return
        data = asyncio.run(run(args, url))
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    summary = summarise(data)
    engine = {
        "server": "llama-server 0.5.0-dev (commit 0c1e570)",
        "model": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "args": f"-t {args.threads} -a smollm2 --no-webui --metrics -np 2 -c 4096",
        "request": {"temperature": 0, "max_tokens": MAX_TOKENS, **COLD, "stream": True},
    }
    out = {"engine": engine, "overrides": OVERRIDES, "summary": summary, **strip(data)}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1) + "\n")
    corpus = {
        "note": (
            "Written by tests/bench/bench_recovery_corpus.py: greedy chat completions on "
            "llama-server + SmolLM2-135M-Instruct Q4_1 (-np 2 -c 4096, cache_prompt false, "
            "max_tokens 1024); looping = proxy.loops.detector.LoopDetector (default config) "
            "fired on the streamed content. offsets are chars, tokens count until detection."
        ),
        "engine": engine,
        "prompts": [
            {
                "prompt": b["prompt"],
                "kind": b["kind"],
                "looping": b["loop"] is not None,
                "finish": b["finish"],
                "tokens": b["tokens"],
                **(
                    {
                        "period": b["loop"]["period"],
                        "start_offset": b["loop"]["start_offset"],
                        "detected_at": b["loop"]["detected_at"],
                    }
                    if b["loop"]
                    else {}
                ),
            }
            for b in data["corpus"]
        ],
    }
    args.corpus.write_text(json.dumps(corpus, indent=1) + "\n")
    print(f"\nwrote {args.json} and {args.corpus} ({data['seconds']} s)")


if __name__ == "__main__":
    main()
