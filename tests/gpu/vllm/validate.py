"""Real-vLLM validation: detproxy in front of vLLM 0.23.0 on the lent H200, measured against truth.

Five vLLM instances serve SmolLM2-135M (on_device.sh starts them): the bf16 checkpoint eager
(stock), with ``VLLM_BATCH_INVARIANT=1`` (the control), with n-gram speculative decoding, and
with CUDA graphs and torch.compile (graphs, optional); and the GGUF itself (whose logprobs are
NaN). Each step below starts its own detproxy (``python3 -m proxy
serve``, from the carried source) and writes what it measured into results.json and
results.md, after every step, in --work and --out. Steps run in order of priority and are
skipped when the time left (--deadline-s) is short of their estimate; ``--resume`` runs the
steps a previous call did not finish (the serial references are kept in --work).

Ground truth: each prompt alone and cold (a fresh ``cache_salt``), non-streamed with top-5
logprobs, repeated; a client's answer is unstable when its text (or, for a client that asked
for logprobs, any logprob) differs from that reference, bit for bit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fnmatch
import gzip
import math
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import time
import traceback
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson

PARAGRAPH = (
    "The committee reviewed the quarterly figures for the northern region, noting that "
    "shipping delays in March pushed several large orders into April, while returns "
    "stayed flat and the new warehouse cut handling costs by a fifth. "
)
# Twelve chat prompts, about 20 to 1,600 tokens; the long ones quote a paragraph, which
# n-gram speculation can draft from.
PROMPTS = [
    "Write a short story about a robot who learns to paint. Use vivid details.",
    "Explain why the sky is blue to a ten year old.",
    PARAGRAPH * 2 + "What is the main cause of the change in orders?",
    PARAGRAPH * 10 + "Summarise the figures in two sentences.",
    PARAGRAPH * 25 + "List three risks for next quarter.",
    PARAGRAPH * 45 + "Extract every month mentioned, as a JSON list.",
    "List ten countries in Europe and their capitals.",
    "Describe how a bill becomes a law in the United States.",
    "Write a recipe for a chocolate cake.",
    PARAGRAPH * 4 + "Repeat the text above word for word.",
    "Explain the difference between TCP and UDP.",
    "What are the health benefits of drinking water? Answer in detail.",
]
# Open-ended prompts on which SmolLM2-135M loops at temperature 0 (llama.cpp; tests/
# integration/test_loops_llama_server.py) and a few like them.
LOOPING = [
    "Write a poem about the ocean.",
    "Write a poem about love.",
    "Write a letter to a friend.",
    "Write a poem about the moon.",
    "Write a song about summer.",
    "Write a letter to your future self.",
    "List as many animals as you can.",
    "Write a poem about the stars.",
]
LONG = "Write a very long story about a dragon, a knight and a village, chapter by chapter."
MODEL = "smollm2"
MAX_TOKENS = 128
TOP = 5
REPS = 3
LOADS = (8, 16, 32)
N_LOAD = 64
SWEEP_LEVELS = "1,2,4,8,16,32,64"
SWEEP_DURATION = 4.0
PROBE_LEVELS = "1,4,16"
PROBE_RUNS = 10


def salt() -> str:
    return uuid.uuid4().hex


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wilson(k: int, n: int, z: float = 1.96) -> list[float]:
    if n == 0:
        return [0.0, 1.0]
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return [round(max(0.0, c - h), 4), round(min(1.0, c + h), 4)]


def rate(k: int, n: int) -> dict[str, Any]:
    return {"k": k, "n": n, "rate": round(k / n, 4) if n else None, "ci95": wilson(k, n)}


def spread(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0}
    return {
        "n": len(values),
        "min": round(min(values), 4),
        "median": round(statistics.median(values), 4),
        "max": round(max(values), 4),
    }


# ---------------------------------------------------------------------------------- clients


def lp_entries(entries: list[dict[str, Any]] | None) -> list[Any] | None:
    if entries is None:
        return None
    return [
        [
            e.get("token"),
            e.get("logprob"),
            [[t.get("token"), t.get("logprob")] for t in e.get("top_logprobs") or []],
        ]
        for e in entries
    ]


async def post(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str]
) -> tuple[int, bytes, dict[str, str]]:
    async with http.post(url, json=body, headers=headers) as resp:
        return resp.status, await resp.read(), dict(resp.headers)


def parse_sse(raw: bytes) -> tuple[list[dict[str, Any]], list[Any]]:
    events, errors = [], []
    for block in raw.split(b"\n\n"):
        for line in block.split(b"\n"):
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            try:
                event = orjson.loads(line[6:])
            except orjson.JSONDecodeError:
                errors.append(line[:200].decode(errors="replace"))
                continue
            if "error" in event:
                errors.append(event["error"])
            events.append(event)
    return events, errors


async def chat(
    http: aiohttp.ClientSession,
    base: str,
    prompt: str,
    *,
    stream: bool = False,
    logprobs: bool = False,
    cache_salt: str | None = None,
    rid: str | None = None,
    max_tokens: int | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One greedy chat request; what the client got: status, text, logprobs, finish."""
    body: dict[str, Any] = {
        "model": MODEL,
        "temperature": 0,
        "max_tokens": max_tokens or MAX_TOKENS,
        "stream": stream,
        "messages": [{"role": "user", "content": prompt}],
    }
    if logprobs:
        body |= {"logprobs": True, "top_logprobs": TOP}
    if cache_salt:
        body["cache_salt"] = cache_salt
    body |= extra or {}
    headers = {"X-Request-Id": rid} if rid else {}
    t0 = time.monotonic()
    try:
        status, raw, hdrs = await post(http, base + "/v1/chat/completions", body, headers)
    except (TimeoutError, aiohttp.ClientError) as exc:
        return {"status": 0, "error": repr(exc)[:300]}
    out: dict[str, Any] = {"status": status, "latency_s": round(time.monotonic() - t0, 4)}
    out["attempts"] = hdrs.get("X-Detproxy-Attempts")
    out["recovered"] = hdrs.get("X-Detproxy-Recovered")
    out["strategy"] = hdrs.get("X-Detproxy-Strategy")
    if status != 200:
        out["error"] = raw[:300].decode(errors="replace")
        return out
    if not stream:
        try:
            choice = orjson.loads(raw)["choices"][0]
        except (orjson.JSONDecodeError, KeyError, IndexError) as exc:
            return out | {"status": -1, "error": f"unparsable: {exc!r}"}
        lp = (choice.get("logprobs") or {}).get("content") if choice.get("logprobs") else None
        return out | {
            "text": choice["message"].get("content") or "",
            "reasoning": reasoning_in(choice["message"]),
            "lp": lp_entries(lp),
            "finish": choice.get("finish_reason"),
        }
    events, errors = parse_sse(raw)
    text, reasoning, finish, seen_lp = "", "", None, False
    entries: list[Any] = []
    for event in events:
        for choice in event.get("choices") or []:
            text += (choice.get("delta") or {}).get("content") or ""
            reasoning += reasoning_in(choice.get("delta") or {})
            if choice.get("logprobs"):
                seen_lp = True
                entries += choice["logprobs"].get("content") or []
            finish = choice.get("finish_reason") or finish
    out |= {"text": text, "lp": lp_entries(entries) if seen_lp else None, "finish": finish}
    out["reasoning"] = reasoning
    marks = [e["detproxy"] for e in events if isinstance(e.get("detproxy"), dict)]
    if marks:  # a recovered stream says so on its last chunk (SPEC section 5)
        out["detproxy"] = marks[-1]
        out["attempts"] = marks[-1].get("attempts")
        out["recovered"] = marks[-1].get("recovered")
        out["strategy"] = marks[-1].get("strategy")
    out["restart_marks"] = raw.count(b"\n: detproxy retry") + raw.startswith(b": detproxy retry")
    out["ids"] = len({e.get("id") for e in events if isinstance(e, dict)})
    if errors:
        out |= {"status": -2, "error": str(errors[0])[:300]}
    return out


async def complete(
    http: aiohttp.ClientSession,
    base: str,
    prompt: str,
    *,
    stream: bool = False,
    logprobs: int | None = None,
    max_tokens: int = 32,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "temperature": 0,
        "max_tokens": max_tokens,
        "stream": stream,
        "prompt": prompt,
    }
    if logprobs is not None:
        body["logprobs"] = logprobs
    try:
        status, raw, _ = await post(http, base + "/v1/completions", body, {})
    except (TimeoutError, aiohttp.ClientError) as exc:
        return {"status": 0, "error": repr(exc)[:300]}
    if status != 200:
        return {"status": status, "error": raw[:300].decode(errors="replace")}
    if not stream:
        choice = orjson.loads(raw)["choices"][0]
        lps = (choice.get("logprobs") or {}).get("token_logprobs")
        return {"status": 200, "text": choice.get("text") or "", "lp": lps}
    events, errors = parse_sse(raw)
    text, lps = "", []
    for event in events:
        for choice in event.get("choices") or []:
            text += choice.get("text") or ""
            lps += (choice.get("logprobs") or {}).get("token_logprobs") or []
    out = {"status": 200 if not errors else -2, "text": text, "lp": lps or None}
    if errors:
        out["error"] = str(errors[0])[:300]
    return out


def reasoning_in(message: dict[str, Any]) -> str:
    """A message's or delta's reasoning: ``reasoning`` (vLLM >= 0.16) or ``reasoning_content``
    (older; both, the same text, in between)."""
    value = message.get("reasoning") or message.get("reasoning_content")
    return value if isinstance(value, str) else ""


def looped(text: str, min_covered: int = 200) -> bool:
    """The tail is one unit repeated back to back, at least 4 times over min_covered chars."""
    for unit in range(1, 120):
        reps = max(4, -(-min_covered // unit))
        if len(text) < unit * reps:
            break
        tail = text[-unit * reps :]
        if tail == tail[:unit] * reps:
            return True
    return False


# ---------------------------------------------------------------------------------- servers


def toml(cfg: dict[str, dict[str, Any]]) -> str:
    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):
            return orjson.dumps(v).decode()
        if isinstance(v, dict):
            return "{ " + ", ".join(f"{k} = {value(x)}" for k, x in v.items()) + " }"
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        raise TypeError(v)

    return "".join(
        f"[{section}]\n" + "".join(f"{k} = {value(v)}\n" for k, v in fields.items())
        for section, fields in cfg.items()
    )


def prom(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            with contextlib.suppress(ValueError):
                name, val = line.rsplit(" ", 1)
                out[name] = float(val)
    return out


def msum(metrics: dict[str, float], name: str, **labels: str) -> float:
    total = 0.0
    for key, val in metrics.items():
        base = key.split("{", 1)[0]
        if base != name:
            continue
        if all(f'{k}="{v}"' in key for k, v in labels.items()):
            total += val
    return total


class Detproxy:
    """``python3 -m proxy serve`` from the carried source, with a config file of its own."""

    def __init__(self, upstream: str, cfg: dict[str, Any], work: Path, name: str) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.name = name
        path = work / f"detproxy-{name}.toml"
        path.write_text(toml(cfg))
        self.log = open(work / f"detproxy-{name}.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "proxy",
                "serve",
                "--upstream",
                upstream,
                "--port",
                str(self.port),
                "--config",
                str(path),
            ],
            stdout=self.log,
            stderr=self.log,
            env=os.environ.copy(),
        )

    async def ready(self, http: aiohttp.ClientSession) -> None:
        for _ in range(400):
            if self.proc.poll() is not None:
                raise RuntimeError(f"detproxy {self.name} exited {self.proc.returncode}")
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get(self.base + "/detproxy/health") as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.05)
        raise RuntimeError("detproxy did not start")

    async def status(self, http: aiohttp.ClientSession) -> dict[str, Any]:
        async with http.get(self.base + "/detproxy/status") as resp:
            result: dict[str, Any] = await resp.json()
            return result

    async def incidents(self, http: aiohttp.ClientSession) -> list[dict[str, Any]]:
        async with http.get(self.base + "/detproxy/incidents?limit=100000") as resp:
            result: list[dict[str, Any]] = await resp.json()
            return result

    async def metrics(self, http: aiohttp.ClientSession) -> dict[str, float]:
        async with http.get(self.base + "/detproxy/metrics") as resp:
            return prom(await resp.text())

    async def settle(self, http: aiohttp.ClientSession, expected: int | None) -> dict[str, Any]:
        """Until ``expected`` shadows are audited or dropped (or, with None, the queue is empty)."""
        deadline = time.monotonic() + 900
        calm = 0
        await asyncio.sleep(0.5)
        while True:
            status = await self.status(http)
            audit, shadow = status["audit"], status["shadow"]
            done = audit["modes"].get("full", 0) + sum(audit["shadows_dropped"].values())
            if expected is not None and done >= expected:
                return status
            if expected is None:
                calm = calm + 1 if shadow["queued"] == 0 and shadow["running"] == 0 else 0
                if calm >= 10:
                    return status
            if time.monotonic() > deadline:
                status["settle_timeout"] = True
                return status
            await asyncio.sleep(0.2)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def audit_config(
    rate_: float = 1.0, by: str = "hash", reference: str | None = None, fp_s: float = 30
) -> dict[str, Any]:
    audit: dict[str, Any] = {
        "sample_rate": rate_,
        "sample_by": by,
        "schedule": "quiet",
        "quiet_max_inflight": 0,
        "quiet_settle_s": 1.0,
        "quiet_deadline_s": 900,
        "max_concurrent_shadows": 1,
        "max_shadows_per_s": 1000,
        "max_token_share": 100,
        "queue_size": 5000,
        "cache_salt": True,
        "passive_checks": False,
        "inject_top_logprobs": TOP,
    }
    if reference:
        audit["reference_url"] = reference
    return {
        "upstream": {"fingerprint_interval_s": fp_s},
        "audit": audit,
        "incidents": {"ring_size": 20000},
        "loops": {"enabled": False},
    }


PIDS: dict[str, Path] = {}  # base URL -> its vLLM's pid file (on_device.sh writes them)


def alive(url: str) -> bool:
    pidfile = PIDS.get(url)
    if pidfile is None or not pidfile.exists():
        return True
    try:
        os.kill(int(pidfile.read_text()), 0)
    except (OSError, ValueError):
        return False
    return True


async def engine_up(http: aiohttp.ClientSession, url: str, wait_s: float) -> bool:
    """Healthy within wait_s; False at once when its process has died."""
    deadline = time.monotonic() + wait_s
    while True:
        if not alive(url):
            return False
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
            async with http.get(url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                if r.status == 200:
                    return True
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(1)


async def engine_metrics(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with http.get(url + "/metrics") as resp:
        return prom(await resp.text())


# ---------------------------------------------------------------------------------- context


class Ctx:
    def __init__(self, args: argparse.Namespace, http: aiohttp.ClientSession) -> None:
        self.args = args
        self.http = http
        self.url = {"stock": args.stock, "bi": args.bi, "spec": args.spec, "gguf": args.gguf}
        if args.graphs:
            self.url["graphs"] = args.graphs
        if args.think:
            self.url["think"] = args.think
        for name in ("stock_ptd", "bi_ptd"):  # --enable-prompt-tokens-details (issue 48)
            if getattr(args, name, None):
                self.url[name] = getattr(args, name)
        self.work: Path = args.work
        self.deadline: float = time.monotonic() + args.deadline_s
        state = args.work / "results.json"
        self.results: dict[str, Any] = (
            orjson.loads(state.read_bytes()) if args.resume and state.exists() else {}
        )
        self.results.setdefault("steps", {})
        self.results.setdefault("refs", {})
        self.results.setdefault("calls", []).append(
            {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "deadline_s": args.deadline_s}
        )

    @property
    def refs(self) -> dict[str, list[dict[str, Any]]]:
        refs: dict[str, list[dict[str, Any]]] = self.results["refs"]
        return refs

    @property
    def t1(self) -> float:
        return float(self.results.get("t1_s") or 1.0)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def save(self) -> None:
        blob = orjson.dumps(self.results, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS)
        md = markdown(self.results)
        for folder in {self.work, self.args.out}:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "results.json").write_bytes(blob)
            (folder / "results.md").write_text(md)


# ---------------------------------------------------------------------------------- truth


async def reference(ctx: Ctx, name: str, reps: int = REPS) -> dict[str, Any]:
    """Each prompt alone and cold, ``reps`` times: the serial reference, and is it stable?"""
    base = ctx.url[name]
    answers, unstable, times = [], [], []
    for p, prompt in enumerate(PROMPTS):
        runs = []
        for _ in range(reps):
            t0 = time.monotonic()
            runs.append(await chat(ctx.http, base, prompt, logprobs=True, cache_salt=salt()))
            times.append(time.monotonic() - t0)
        bad = [r for r in runs if r["status"] != 200]
        if bad:
            raise RuntimeError(f"reference {name} p{p}: {bad[0]}")
        if any((r["text"], r["lp"]) != (runs[0]["text"], runs[0]["lp"]) for r in runs):
            unstable.append(p)
        answers.append({k: runs[0][k] for k in ("text", "lp", "finish")})
    ctx.refs[name] = answers
    return {
        "instance": name,
        "reps": reps,
        "unstable_prompts": unstable,
        "mean_request_s": round(statistics.mean(times), 4),
        "tokens": [len(a["lp"] or []) for a in answers],
        "finish": [a["finish"] for a in answers],
    }


def first_diff(a: list[Any] | None, b: list[Any] | None) -> int | None:
    if a is None or b is None:
        return None
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x[0] != y[0]:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def truth_of(got: dict[str, Any], ref: dict[str, Any], asked: bool) -> str:
    if got["status"] != 200:
        return "error"
    if got["text"] != ref["text"]:
        return "text"
    if asked and got["lp"] != ref["lp"]:
        return "drift"
    return "same"


UNSTABLE = ("logprob_drift", "text_divergence", "answer_divergence")
TEXTUAL = ("text_divergence", "answer_divergence")


async def audit_load(
    ctx: Ctx,
    label: str,
    engine: str,
    truth: str,
    conc: int,
    n: int,
    *,
    rate_: float = 1.0,
    by: str = "hash",
    reference_url: str | None = None,
    proxy: Detproxy | None = None,
    expected_before: int = 0,
) -> dict[str, Any]:
    """Greedy load through detproxy; its verdicts against the truth, request by request."""
    http = ctx.http
    own = proxy is None
    if proxy is None:
        proxy = Detproxy(ctx.url[engine], audit_config(rate_, by, reference_url), ctx.work, label)
    rng = random.Random(label)
    jobs = [(f"{label}-{i}", i % len(PROMPTS)) for i in range(n)]
    rng.shuffle(jobs)
    plan = {rid: (p, rng.random() < 0.5, rng.random() < 0.5) for rid, p in jobs}
    received: dict[str, dict[str, Any]] = {}
    try:
        if own:
            await proxy.ready(http)
        before = (await proxy.status(http))["audit"]["verdicts"]
        sem = asyncio.Semaphore(conc)

        async def one(rid: str) -> None:
            p, stream, asked = plan[rid]
            async with sem:
                received[rid] = await chat(
                    http,
                    proxy.base,
                    PROMPTS[p],
                    stream=stream,
                    logprobs=asked,
                    cache_salt=salt(),
                    rid=rid,
                )

        t0 = time.monotonic()
        await asyncio.gather(*(one(rid) for rid, _ in jobs))
        traffic_s = time.monotonic() - t0
        status = await proxy.settle(http, expected_before + n if rate_ >= 1.0 else None)
        incidents = await proxy.incidents(http)
        dmetrics = await proxy.metrics(http)
    finally:
        if own:
            proxy.stop()
    audits = {
        i["request_id"]: i
        for i in incidents
        if i.get("kind") == "audit" and i.get("mode") == "full" and i.get("choice", 0) == 0
    }
    audits = {rid: i for rid, i in audits.items() if rid in plan}
    refs = ctx.refs[truth]
    rows: list[dict[str, Any]] = []
    for rid, (p, stream, asked) in plan.items():
        got = received[rid]
        t = truth_of(got, refs[p], asked)
        inc = audits.get(rid)
        rows.append(
            {
                "rid": rid,
                "p": p,
                "stream": stream,
                "asked": asked,
                "truth": t,
                "verdict": inc["verdict"] if inc else None,
                "leaked_logprobs": (not asked) and got.get("lp") is not None,
                "truth_index": first_diff(got.get("lp"), refs[p]["lp"]) if asked else None,
            }
        )
    ok = [r for r in rows if r["truth"] != "error"]
    audited_all = rate_ >= 1.0 and not sum(status["audit"]["shadows_dropped"].values())

    def det_textual(r: dict[str, Any]) -> bool:
        return r["verdict"] in TEXTUAL

    t_text = {r["rid"] for r in ok if r["truth"] == "text"}
    d_text = {r["rid"] for r in ok if det_textual(r)}
    asked_rows = [r for r in ok if r["asked"]]
    t_full = {r["rid"] for r in asked_rows if r["truth"] in ("text", "drift")}
    d_full = {r["rid"] for r in asked_rows if r["verdict"] in UNSTABLE}
    verdicts = {
        k: v - before.get(k, 0)
        for k, v in status["audit"]["verdicts"].items()
        if v > before.get(k, 0)
    }
    unstable = sum(v for k, v in verdicts.items() if k in UNSTABLE)
    comparable = sum(v for k, v in verdicts.items() if k != "incomparable")
    texts: dict[int, set[str]] = {}
    for r in ok:
        texts.setdefault(r["p"], set()).add(received[r["rid"]]["text"])
    divs = [i for i in audits.values() if i["verdict"] in TEXTUAL and i.get("divergence")]
    return {
        "label": label,
        "engine": engine,
        "truth_against": truth,
        "reference_url": reference_url,
        "concurrency": conc,
        "requests": n,
        "sample_rate": rate_,
        "sample_by": by,
        "traffic_s": round(traffic_s, 2),
        "client_errors": sum(1 for r in rows if r["truth"] == "error"),
        "client_error_examples": [received[r["rid"]].get("error") for r in rows][:0]
        + [received[r["rid"]].get("error") for r in rows if r["truth"] == "error"][:3],
        "leaked_logprobs": sum(1 for r in rows if r["leaked_logprobs"]),
        "audited": sum(verdicts.values()),
        "all_audited": audited_all,
        "dropped": status["audit"]["shadows_dropped"],
        "settle_timeout": status.get("settle_timeout", False),
        "verdicts": verdicts,
        "detproxy_rate": rate(unstable, comparable),
        "detproxy_text_rate": rate(sum(verdicts.get(k, 0) for k in TEXTUAL), comparable),
        "truth_text_rate": rate(len(t_text), len(ok)),
        "truth_full_rate_asked": rate(len(t_full), len(asked_rows)),
        "agreement_text": {
            "both": len(t_text & d_text),
            "only_truth": len(t_text - d_text),
            "only_detproxy": len(d_text - t_text),
            "neither": len(ok) - len(t_text | d_text),
        },
        "agreement_full_asked": {
            "n": len(asked_rows),
            "both": len(t_full & d_full),
            "only_truth": len(t_full - d_full),
            "only_detproxy": len(d_full - t_full),
        },
        "drift_text_same_not_asked": sum(
            1 for r in ok if not r["asked"] and r["verdict"] == "logprob_drift"
        ),
        "disagreements": [
            r for r in ok if (r["rid"] in t_text) != (r["rid"] in d_text) and audited_all
        ][:12],
        "divergence_positions": spread([i["divergence"]["index"] for i in divs]),
        "divergence_positions_all": sorted(i["divergence"]["index"] for i in divs)[:80],
        "truth_positions_asked": sorted(
            r["truth_index"] for r in asked_rows if r["truth_index"] is not None
        )[:80],
        "margins_nats": spread(
            [i["divergence"]["margin"] for i in divs if i["divergence"].get("margin") is not None]
        ),
        "max_abs_logprob_delta": spread(
            [
                i["max_abs_logprob_delta"]
                for i in audits.values()
                if i.get("max_abs_logprob_delta") is not None
            ]
        ),
        "overlapped_shadows": sum(1 for i in audits.values() if i.get("shadow_overlapped")),
        "distinct_texts_per_prompt": {p: len(s) for p, s in sorted(texts.items())},
        "fallbacks": msum(dmetrics, "detproxy_fallbacks_total"),
        "injection_failures": msum(dmetrics, "detproxy_injection_failures_total"),
    }


# ---------------------------------------------------------------------------------- steps


def norm(raw: bytes) -> bytes:
    raw = re.sub(rb'"id":\s*"[^"]*"', b'"id":"X"', raw)
    raw = re.sub(rb'"created":\s*\d+', b'"created":0', raw)
    return re.sub(rb'"(chatcmpl|cmpl)-[0-9a-f-]+', b'"X', raw)


async def step_passthrough(ctx: Ctx) -> dict[str, Any]:
    """Chat and completions, streamed and not, through detproxy (defaults) and direct."""
    from openai import AsyncOpenAI

    base = ctx.url["stock"]
    proxy = Detproxy(base, {"server": {}}, ctx.work, "passthrough")
    out: dict[str, Any] = {"sdk": [], "raw": [], "errors": [], "paths": []}
    try:
        await proxy.ready(ctx.http)
        clients = {
            "detproxy": AsyncOpenAI(base_url=proxy.base + "/v1", api_key="none", max_retries=0),
            "direct": AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0),
        }
        q = "What is the capital of France?"
        for endpoint in ("chat", "completions"):
            for stream in (False, True):
                got = {}
                for who, client in clients.items():
                    extra = {"cache_salt": salt()}
                    if endpoint == "chat":
                        kw: dict[str, Any] = {
                            "model": MODEL,
                            "temperature": 0,
                            "max_tokens": 48,
                            "messages": [{"role": "user", "content": q}],
                            "extra_body": extra,
                        }
                        if stream:
                            text, finish = "", None
                            async for ch in await client.chat.completions.create(stream=True, **kw):
                                for c in ch.choices:
                                    text += c.delta.content or ""
                                    finish = c.finish_reason or finish
                        else:
                            r = await client.chat.completions.create(**kw)
                            text = r.choices[0].message.content or ""
                            finish = r.choices[0].finish_reason
                    else:
                        kw = {
                            "model": MODEL,
                            "temperature": 0,
                            "max_tokens": 48,
                            "prompt": "The capital of France is",
                            "extra_body": extra,
                        }
                        if stream:
                            text, finish = "", None
                            async for ch in await client.completions.create(stream=True, **kw):
                                for c in ch.choices:
                                    text += c.text or ""
                                    finish = c.finish_reason or finish
                        else:
                            r2 = await client.completions.create(**kw)
                            text = r2.choices[0].text
                            finish = r2.choices[0].finish_reason
                    got[who] = (text, finish)
                out["sdk"].append(
                    {
                        "endpoint": endpoint,
                        "stream": stream,
                        "equal": got["detproxy"] == got["direct"],
                        "text": got["direct"][0][:80],
                        "finish": got["direct"][1],
                    }
                )
        # raw bytes: the same cold request direct and through detproxy (ids, times normalised)
        for endpoint, body in (
            ("chat/completions", {"messages": [{"role": "user", "content": q}]}),
            ("completions", {"prompt": "The capital of France is"}),
        ):
            for stream in (False, True):
                raws = []
                # direct, detproxy, direct again: is a difference detproxy's or the engine's?
                for url in (base, proxy.base, base):
                    b = {"model": MODEL, "temperature": 0, "max_tokens": 24, "stream": stream}
                    b |= body | {"cache_salt": salt()}
                    async with ctx.http.post(f"{url}/v1/{endpoint}", json=b) as resp:
                        raws.append((resp.status, norm(await resp.read())))
                row: dict[str, Any] = {
                    "endpoint": endpoint,
                    "stream": stream,
                    "bytes_equal": raws[0] == raws[1],
                    "direct_repeat_equal": raws[0] == raws[2],
                    "size": len(raws[0][1]),
                }
                if raws[0] != raws[1]:  # where they part, normalised, to see what differs
                    a, d = raws[0][1], raws[1][1]
                    at = common_prefix(a.decode(errors="replace"), d.decode(errors="replace"))
                    row["first_difference_at"] = at
                    row["direct"] = a.decode(errors="replace")[max(0, at - 300) : at + 600]
                    row["detproxy"] = d.decode(errors="replace")[max(0, at - 300) : at + 600]
                    row["direct_again"] = raws[2][1].decode(errors="replace")[
                        max(0, at - 300) : at + 600
                    ]
                out["raw"].append(row)
        bad: list[tuple[str, dict[str, Any]]] = [
            ("unknown model", {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}),
            (
                "top_logprobs over --max-logprobs",
                {
                    "model": MODEL,
                    "logprobs": True,
                    "top_logprobs": 30,
                    "messages": [{"role": "user", "content": "hi"}],
                },
            ),
            (
                "max_tokens over the context",
                {
                    "model": MODEL,
                    "max_tokens": 100000,
                    "messages": [{"role": "user", "content": "hi"}],
                },
            ),
            ("messages not a list", {"model": MODEL, "messages": "hi"}),
        ]
        for what, b in bad:
            seen = []
            for url in (base, proxy.base):
                async with ctx.http.post(f"{url}/v1/chat/completions", json=b) as resp:
                    seen.append((resp.status, await resp.read()))
            out["errors"].append(
                {
                    "case": what,
                    "status": [seen[0][0], seen[1][0]],
                    "body_equal": seen[0][1] == seen[1][1],
                }
            )
        for path in ("/v1/models", "/version", "/health", "/metrics"):
            seen = []
            for url in (base, proxy.base):
                async with ctx.http.get(url + path) as resp:
                    seen.append((resp.status, await resp.read()))
            out["paths"].append(
                {
                    "path": path,
                    "status": [seen[0][0], seen[1][0]],
                    "equal": path == "/metrics" or norm(seen[0][1]) == norm(seen[1][1]),
                }
            )
        st = await proxy.status(ctx.http)
        out["fingerprint"] = st.get("upstream_fingerprint", {}).get("identity")
    finally:
        proxy.stop()
    return out


async def step_reference(ctx: Ctx) -> dict[str, Any]:
    names = ["stock", "bi"]
    got = await asyncio.gather(*(reference(ctx, n) for n in names))
    ctx.results["t1_s"] = max(g["mean_request_s"] for g in got)
    out: dict[str, Any] = {n: g for n, g in zip(names, got, strict=True)}
    out["stock_equals_bi"] = [
        (a["text"] == b["text"], a["lp"] == b["lp"])
        for a, b in zip(ctx.refs["stock"], ctx.refs["bi"], strict=True)
    ]
    return out


def audit_pair(conc: int) -> Callable[[Ctx], Awaitable[dict[str, Any]]]:
    async def run(ctx: Ctx) -> dict[str, Any]:
        labels = [f"stock-c{conc}", f"bi-c{conc}"]
        got = await asyncio.gather(
            audit_load(ctx, labels[0], "stock", "stock", conc, N_LOAD),
            audit_load(ctx, labels[1], "bi", "bi", conc, N_LOAD),
        )
        return {"stock": got[0], "bi": got[1]}

    return run


async def step_random10(ctx: Ctx) -> dict[str, Any]:
    conc = LOADS[-1]
    got = await asyncio.gather(
        audit_load(ctx, f"stock-c{conc}-random10", "stock", "stock", conc, N_LOAD, rate_=0.1,
                   by="random"),
        audit_load(ctx, f"bi-c{conc}-random10", "bi", "bi", conc, N_LOAD, rate_=0.1,
                   by="random"),
    )  # fmt: skip
    return {"stock": got[0], "bi": got[1]}


async def step_spec(ctx: Ctx) -> dict[str, Any]:
    """n-gram speculative decoding against plain greedy; and the fingerprint of a fresh server."""
    http = ctx.http
    if not await engine_up(http, ctx.url["spec"], min(120, ctx.left() - 60)):
        return {"status": "skipped", "reason": "spec instance not up"}
    before = await engine_metrics(http, ctx.url["spec"])
    proxy = Detproxy(
        ctx.url["spec"], audit_config(reference=ctx.url["stock"], fp_s=1), ctx.work, "spec"
    )
    out: dict[str, Any] = {
        "fresh_server_requests_before": msum(before, "vllm:request_success_total"),
        "fresh_server_draft_tokens_before": msum(before, "vllm:spec_decode_num_draft_tokens_total"),
        "spec_metrics_present_before": any(k.startswith("vllm:spec_decode") for k in before),
    }
    try:
        await proxy.ready(http)
        await asyncio.sleep(1.5)
        st = await proxy.status(http)
        out["speculative_flag_at_start"] = st["upstream_fingerprint"]["identity"]["speculative"]
        out["fingerprint_at_start"] = st["upstream_fingerprint"]["fingerprint"]
        ref = await reference(ctx, "spec", reps=2)
        out["spec_reference"] = ref
        plain = ctx.refs["stock"]
        spec = ctx.refs["spec"]
        out["spec_vs_plain_serial"] = {
            "text_differs": [p for p in range(len(PROMPTS)) if spec[p]["text"] != plain[p]["text"]],
            "logprobs_differ": [p for p in range(len(PROMPTS)) if spec[p]["lp"] != plain[p]["lp"]],
            "first_token_diff": [
                first_diff(spec[p]["lp"], plain[p]["lp"]) for p in range(len(PROMPTS))
            ],
        }
        n1 = 2 * len(PROMPTS)
        out["serial"] = await audit_load(
            ctx, "spec-c1", "spec", "stock", 1, n1, reference_url=ctx.url["stock"], proxy=proxy
        )
        out["load16"] = await audit_load(
            ctx,
            "spec-c16",
            "spec",
            "stock",
            16,
            N_LOAD // 2,
            reference_url=ctx.url["stock"],
            proxy=proxy,
            expected_before=n1,
        )
        await asyncio.sleep(2.5)
        st = await proxy.status(http)
        out["speculative_flag_at_end"] = st["upstream_fingerprint"]["identity"]["speculative"]
        out["fingerprint_at_end"] = st["upstream_fingerprint"]["fingerprint"]
        out["load_gauges"] = st["upstream_fingerprint"].get("load")
        m = await proxy.metrics(http)
        out["upstream_changes_total"] = msum(m, "detproxy_upstream_changes_total")
        incidents = await proxy.incidents(http)
        out["upstream_change_incidents"] = [
            {k: i.get(k) for k in ("ts", "before", "after")}
            for i in incidents
            if i.get("kind") == "upstream_change"
        ][:3]
        after = await engine_metrics(http, ctx.url["spec"])
        drafts = msum(after, "vllm:spec_decode_num_draft_tokens_total") - msum(
            before, "vllm:spec_decode_num_draft_tokens_total"
        )
        acc = msum(after, "vllm:spec_decode_num_accepted_tokens_total") - msum(
            before, "vllm:spec_decode_num_accepted_tokens_total"
        )
        out["acceptance_rate_engine"] = round(acc / drafts, 4) if drafts else None
    finally:
        proxy.stop()
    return out


async def step_spec_fresh(ctx: Ctx) -> dict[str, Any]:
    """The fingerprint's speculative flag on a speculative server that has served nothing yet
    (run it first after ``setup``): set from the start, and no upstream change once drafts
    are counted."""
    http, url = ctx.http, ctx.url["spec"]
    if not await engine_up(http, url, min(120, ctx.left() - 30)):
        return {"status": "skipped", "reason": "spec instance not up"}
    before = await engine_metrics(http, url)
    async with http.get(url + "/server_info") as resp:
        server_info_status = resp.status
    out: dict[str, Any] = {
        "requests_before": msum(before, "vllm:request_success_total"),
        "draft_tokens_before": msum(before, "vllm:spec_decode_num_draft_tokens_total"),
        "spec_series_at_start": sorted(
            {k.split("{", 1)[0] for k in before if k.startswith("vllm:spec_decode")}
        ),
        "server_info_status": server_info_status,
    }
    cfg = {"upstream": {"fingerprint_interval_s": 1}, "audit": {"sample_rate": 0.0}}
    proxy = Detproxy(url, cfg, ctx.work, "spec-fresh")
    try:
        await proxy.ready(http)
        await asyncio.sleep(1.5)
        st = await proxy.status(http)
        out["flag_at_start"] = st["upstream_fingerprint"]["identity"]["speculative"]
        out["fingerprint_at_start"] = st["upstream_fingerprint"]["fingerprint"]
        for p in (2, 3, 9, 0):  # quoting prompts: n-gram drafts
            r = await chat(http, proxy.base, PROMPTS[p % len(PROMPTS)], cache_salt=salt())
            out.setdefault("statuses", []).append(r["status"])
        await asyncio.sleep(2.5)
        st = await proxy.status(http)
        out["flag_at_end"] = st["upstream_fingerprint"]["identity"]["speculative"]
        out["fingerprint_at_end"] = st["upstream_fingerprint"]["fingerprint"]
        m = await proxy.metrics(http)
        out["upstream_changes_total"] = msum(m, "detproxy_upstream_changes_total")
    finally:
        proxy.stop()
    after = await engine_metrics(http, url)
    out["draft_tokens_after"] = msum(after, "vllm:spec_decode_num_draft_tokens_total")
    return out


# What the operator declares for each instance ([upstream.expect]); what each should give:
# stock runs --enforce-eager (cudagraphs declared on: a mismatch); gguf was started with
# VLLM_ATTENTION_BACKEND=FLASHINFER, which vLLM 0.23 calls unknown and ignores (two mismatches).
ENGINE_EXPECT: dict[str, dict[str, Any]] = {
    "stock": {"attention_backend": "FLASH_ATTN", "cudagraphs": True, "prefix_caching": True,
              "speculative": False, "unknown_env": False},
    "bi": {"batch_invariant": True, "enforce_eager": True, "unknown_env": False},
    "spec": {"speculative": "ngram", "enforce_eager": True},
    "gguf": {"attention_backend": "FLASHINFER", "quantization": "gguf", "unknown_env": False},
    "graphs": {"cudagraphs": True, "enforce_eager": False, "dtype": "bfloat16"},
    "think": {"dtype": "bfloat16", "speculative": False},
}  # fmt: skip


async def engine_truth_one(ctx: Ctx, name: str, url: str) -> dict[str, Any]:
    log = ctx.args.logs / f"vllm-{name}.log" if ctx.args.logs else None
    if log is None or not log.exists():
        return {"status": "skipped", "reason": f"no log for {name}"}
    expect = ENGINE_EXPECT.get(name, {})
    cfg: dict[str, Any] = {
        "upstream": {"fingerprint_interval_s": 2, "engine_log": str(log)},
        "upstream.expect": expect,
        "audit": {"sample_rate": 0.0},
    }
    proxy = Detproxy(url, cfg, ctx.work, f"engine-{name}")
    lines = len(log.read_text(errors="replace").splitlines())
    out: dict[str, Any] = {"expect": expect, "log_lines": lines}
    try:
        await proxy.ready(http := ctx.http)
        t0 = time.monotonic()
        engine: dict[str, Any] = {}
        while time.monotonic() - t0 < 25:
            st = await proxy.status(http)
            engine = st.get("engine") or {}
            loaded = (engine.get("loaded") or {}).get("facts") or {}
            if loaded.get("attention_backend") or loaded.get("start_failed"):
                break
            await asyncio.sleep(0.5)
        out["read_after_s"] = round(time.monotonic() - t0, 2)
        out["engine"] = engine
        out["identity"] = (st.get("upstream_fingerprint") or {}).get("identity")
        m = await proxy.metrics(http)
        out["mismatch_gauges"] = {
            k: v for k, v in m.items() if k.startswith("detproxy_engine_expectation_mismatch")
        }
        out["incidents"] = [
            i for i in await proxy.incidents(http) if i.get("kind") == "engine_mismatch"
        ][:5]
    finally:
        proxy.stop()
    return out


async def step_engine_truth(ctx: Ctx) -> dict[str, Any]:
    """Each instance's own start-up log followed by a detproxy ([upstream] engine_log), with an
    [upstream.expect] per instance: what /detproxy/status says loaded, and the mismatches."""
    names = [n for n in ("stock", "bi", "spec", "gguf", "graphs", "think") if n in ctx.url]
    got = await asyncio.gather(
        *(engine_truth_one(ctx, n, ctx.url[n]) for n in names), return_exceptions=True
    )
    return {
        n: (g if not isinstance(g, BaseException) else {"status": "error", "error": repr(g)})
        for n, g in zip(names, got, strict=True)
    }


TRIAGE_N = 24  # requests per instance (all in flight), each audited with a quiet cold shadow
TRIAGE_LONG = 8  # of them the longest prompt (PROMPTS[5]: where the 16 drifts of 2026-12-01 were)


async def triage_load(ctx: Ctx, name: str, conc: int, n: int) -> dict[str, Any]:
    """Every greedy request audited (quiet cold shadows, as the 2026-12-01 run that found 16
    logprob_drift on the batch-invariant instance), live triage on: what cause detproxy
    attributes to each non-identical audit, and on what evidence."""
    http = ctx.http
    cfg = audit_config(1.0)
    cfg["attribution"] = {
        "triage_rate": 1.0,
        "cold_replays": 3,
        "max_per_minute": 1000.0,
        "max_token_share": 100.0,
        "queue_size": 200,
        "quiet_deadline_s": 600.0,
    }
    proxy = Detproxy(ctx.url[name], cfg, ctx.work, f"triage-{name}")
    rng = random.Random(name)
    long = min(5, len(PROMPTS) - 1)  # --quick keeps 4 prompts
    others = [p for p in range(len(PROMPTS)) if p != long]
    picks = [long] * TRIAGE_LONG + [others[i % len(others)] for i in range(n - TRIAGE_LONG)]
    jobs = [(f"triage-{name}-{i}", p) for i, p in enumerate(picks)]
    rng.shuffle(jobs)
    received: dict[str, dict[str, Any]] = {}
    try:
        await proxy.ready(http)
        sem = asyncio.Semaphore(conc)

        async def one(rid: str, p: int) -> None:
            async with sem:
                received[rid] = await chat(
                    http, proxy.base, PROMPTS[p], stream=bool(p % 2), cache_salt=salt(), rid=rid
                )

        t0 = time.monotonic()
        await asyncio.gather(*(one(rid, p) for rid, p in jobs))
        traffic_s = time.monotonic() - t0
        status = await proxy.settle(http, n)
        t1 = time.monotonic()
        until = t1 + max(10.0, ctx.left() - 15)  # fixed once: the time left shrinks as it waits
        incidents: list[dict[str, Any]] = []
        while time.monotonic() < until:
            incidents = [i for i in await proxy.incidents(http) if i.get("kind") == "audit"]
            if all("cause" in i for i in incidents):
                break
            await asyncio.sleep(1.0)
        triage_s = time.monotonic() - t1
        status = await proxy.status(http)
        m = await proxy.metrics(http)
    finally:
        proxy.stop()
    prompt_of = dict(jobs)
    table: dict[str, dict[str, int]] = {}
    by_prompt: dict[str, dict[str, int]] = {}
    for i in incidents:
        cause = str(i.get("cause", "undecided"))
        row = table.setdefault(str(i.get("verdict")), {})
        row[cause] = row.get(cause, 0) + 1
        p = str(prompt_of.get(i.get("request_id", ""), "?"))
        by_prompt.setdefault(p, {})[cause] = by_prompt.setdefault(p, {}).get(cause, 0) + 1
    return {
        "requests": n,
        "concurrency": conc,
        "client_errors": sum(1 for r in received.values() if r["status"] != 200),
        "traffic_s": round(traffic_s, 1),
        "triage_s": round(triage_s, 1),
        "verdicts": status["audit"]["verdicts"],
        "verdict_x_cause": table,
        "causes_by_prompt": by_prompt,
        "status_causes": status.get("causes"),
        "causes_metric": series(m, "detproxy_divergence_causes_total"),
        "triage_dropped": series(m, "detproxy_triage_dropped_total"),
        "evidence_examples": [
            {k: i.get(k) for k in ("request_id", "verdict", "cause", "cause_evidence")}
            for i in incidents[:60]  # all of them: decide() can be re-read offline
        ],
    }


CAUSES_BURST = 16  # salted requests at once, per wave (issue 48's burst)
CAUSES_WAVES = int(os.environ.get("CAUSES_WAVES", "3"))  # fewer where device time is short
CAUSES_WARM = 8  # one long prompt, one request at a time, no salt: warm from the second
CAUSES_CONTROL = 8  # distinct prompts, one at a time, each with a fresh salt


async def causes_idle(proxy: Detproxy, http: aiohttp.ClientSession, until: float) -> float:
    """Until no shadow or triage is queued or running and every non-identical audit has a
    cause (or ``until``): the seconds it took."""
    t0 = time.monotonic()
    calm = 0
    while time.monotonic() < until:
        status = await proxy.status(http)
        shadow, triage = status["shadow"], status["triage"]
        busy = shadow["queued"] or shadow["running"] or triage["queued"] or triage["running"]
        incidents = [i for i in await proxy.incidents(http) if i.get("kind") == "audit"]
        open_ = [i for i in incidents if i.get("verdict") in UNSTABLE and "cause" not in i]
        calm = calm + 1 if not busy and not open_ else 0
        if calm >= 3:
            break
        await asyncio.sleep(0.5)
    return time.monotonic() - t0


async def causes_one(ctx: Ctx, name: str) -> dict[str, Any]:
    """Issue 48's measure on one instance, with [attribution] at its defaults (every request
    audited by a quiet cold shadow, so there are divergences to attribute): workloads whose
    cause is known by construction, one after another, on one detproxy."""
    http = ctx.http
    cfg = audit_config(1.0)
    proxy = Detproxy(ctx.url[name], cfg, ctx.work, f"causes-{name}")
    phases: dict[str, dict[str, Any]] = {}
    long = PROMPTS[min(5, len(PROMPTS) - 1)]
    try:
        await proxy.ready(http)

        async def phase(label: str, send: Callable[[], Awaitable[list[str]]]) -> None:
            before = (await proxy.status(http))["triage"]
            t0 = time.monotonic()
            rids = await send()
            traffic_s = time.monotonic() - t0
            wait_s = await causes_idle(proxy, http, time.monotonic() + max(20.0, ctx.left() - 20))
            after = (await proxy.status(http))["triage"]
            mine = set(rids)
            incidents = [
                i for i in await proxy.incidents(http)
                if i.get("kind") == "audit" and i.get("request_id") in mine
            ]  # fmt: skip
            divergent = [i for i in incidents if i.get("verdict") in UNSTABLE]
            causes: dict[str, int] = {}
            for i in divergent:
                key = str(i.get("cause", "none"))
                causes[key] = causes.get(key, 0) + 1
            primary_cache: dict[str, int] = {}
            for i in divergent:
                runs = (i.get("cause_evidence") or {}).get("runs") or [{}]
                key = str(runs[0].get("cache"))
                primary_cache[key] = primary_cache.get(key, 0) + 1
            experiments = after["triaged"] - before["triaged"]
            phases[label] = {
                "requests": len(rids),
                "traffic_s": round(traffic_s, 1),
                "settle_s": round(wait_s, 1),
                "divergent": len(divergent),
                "causes": causes,
                "with_cause": sum(1 for i in divergent if "cause" in i),
                "primary_cache": primary_cache,
                "experiments": experiments,
                "explained": after["explained"] - before["explained"],
                "triage_tokens": after["tokens"] - before["tokens"],
                "s_per_experiment": round(wait_s / experiments, 2) if experiments else None,
                # what an incident left without a cause says of itself (why it has none)
                "uncaused": [
                    {k: i.get(k) for k in ("request_id", "mode", "choice", "verdict", "process",
                                           "ts", "upstream")}
                    for i in divergent if "cause" not in i
                ][:6],
                # the evidence of the incidents left unknown, to re-read decide() offline
                "unknown_evidence": [
                    {k: i.get(k) for k in ("request_id", "verdict", "cause_evidence")}
                    for i in divergent if i.get("cause") == "unknown"
                ][:12],
                "unknown_missing": sorted(
                    {m for i in divergent if i.get("cause") == "unknown"
                     for m in (i.get("cause_evidence") or {}).get("missing", [])}
                )[:8],
            }  # fmt: skip

        async def control() -> list[str]:
            rids = []
            for k in range(CAUSES_CONTROL):
                rid = f"causes-{name}-control-{k}"
                await chat(http, proxy.base, PROMPTS[k % len(PROMPTS)], cache_salt=salt(), rid=rid)
                rids.append(rid)
                await causes_idle(proxy, http, time.monotonic() + 120)
            return rids

        async def warm() -> list[str]:
            rids = []
            for k in range(CAUSES_WARM):
                rid = f"causes-{name}-warm-{k}"
                await chat(http, proxy.base, long, rid=rid)  # no salt: warm from the second
                rids.append(rid)
                await causes_idle(proxy, http, time.monotonic() + 120)
            return rids

        async def burst() -> list[str]:
            rids = []
            for wave in range(CAUSES_WAVES):
                batch = [
                    (f"causes-{name}-burst-{wave}-{k}", PROMPTS[(2 + k % 4) % len(PROMPTS)])
                    for k in range(CAUSES_BURST)
                ]
                await asyncio.gather(
                    *(chat(http, proxy.base, prompt, cache_salt=salt(), rid=rid)
                      for rid, prompt in batch)
                )  # fmt: skip
                rids += [rid for rid, _ in batch]
            return rids

        await phase("control", control)
        await phase("warm_served", warm)
        await phase("salted_burst", burst)
        status = await proxy.status(http)
        m = await proxy.metrics(http)
    finally:
        proxy.stop()
    return {
        "phases": phases,
        "triage": status.get("triage"),
        "attribution": "defaults",
        "primary_tokens": (status.get("shadow") or {}).get("primary_tokens"),
        "triage_dropped": series(m, "detproxy_triage_dropped_total"),
    }


async def step_causes(ctx: Ctx) -> dict[str, Any]:
    """Issue 48: stock and batch-invariant, each with and without
    --enable-prompt-tokens-details where those instances run, all at once (separate engines
    on one GPU share no batch)."""
    names = [n for n in ("stock", "bi", "stock_ptd", "bi_ptd") if n in ctx.url]
    got = await asyncio.gather(*(causes_one(ctx, n) for n in names), return_exceptions=True)
    return {
        n: (g if not isinstance(g, BaseException) else {"status": "error", "error": repr(g)})
        for n, g in zip(names, got, strict=True)
    }


async def step_triage(ctx: Ctx) -> dict[str, Any]:
    got = await asyncio.gather(
        triage_load(ctx, "bi", 24, TRIAGE_N), triage_load(ctx, "stock", 24, TRIAGE_N)
    )
    return {"bi": got[0], "stock": got[1]}


async def step_diagnose(ctx: Ctx) -> dict[str, Any]:
    """``detproxy diagnose`` on the stock, batch-invariant and n-gram recipes (the n-gram one
    against the stock one as its --reference), side by side."""
    prompts = ctx.work / "diagnose-prompts.txt"
    prompts.write_text("\n".join(PROMPTS[i % len(PROMPTS)] for i in (0, 3, 9)) + "\n")

    async def one(name: str, reference: str | None) -> dict[str, Any]:
        args = ["diagnose", "--upstream", ctx.url[name], "--model", MODEL, "--prompts",
                str(prompts), "--json"]  # fmt: skip
        if reference:
            args += ["--reference", ctx.url[reference]]
        t0 = time.monotonic()
        code, out, err = await run_cli(args, max(30, ctx.left() - 10))
        try:
            rep: dict[str, Any] = orjson.loads(out)
        except orjson.JSONDecodeError:
            rep = {"stdout": out[-2000:]}
        rep["exit_code"] = code
        rep["wall_s"] = round(time.monotonic() - t0, 1)
        rep["stderr_tail"] = err[-1500:]
        return rep

    # One after another: the n-gram recipe's reference is the stock instance, which must not
    # carry another diagnose's fillers (2026-12-04: run at once, the reference disagreed with
    # itself).
    return {
        "stock": await one("stock", None),
        "bi": await one("bi", None),
        "spec_vs_stock": await one("spec", "stock"),
    }


async def step_diagnose_spec(ctx: Ctx) -> dict[str, Any]:
    """Only the n-gram recipe against the stock one, nothing else running."""
    prompts = ctx.work / "diagnose-prompts.txt"
    prompts.write_text("\n".join(PROMPTS[i % len(PROMPTS)] for i in (0, 3, 9)) + "\n")
    args = ["diagnose", "--upstream", ctx.url["spec"], "--model", MODEL, "--prompts",
            str(prompts), "--json", "--reference", ctx.url["stock"]]  # fmt: skip
    t0 = time.monotonic()
    code, out, err = await run_cli(args, max(30, ctx.left() - 10))
    try:
        rep: dict[str, Any] = orjson.loads(out)
    except orjson.JSONDecodeError:
        rep = {"stdout": out[-2000:]}
    rep |= {"exit_code": code, "wall_s": round(time.monotonic() - t0, 1)}
    rep["stderr_tail"] = err[-1500:]
    return rep


LOOP_ROUNDS = 2  # loops_default: rounds of every prompt, streamed and not


async def step_loops_default(ctx: Ctx) -> dict[str, Any]:
    """Issue 40's measure: detproxy with its defaults and --loop-policy retry in front of the
    stock instance, the looping prompts and four that do not loop, 1024 tokens, 8 in flight,
    streamed and not: how many loops end with stop and content, and whether any request was
    retried whose attempt did not loop (each loop incident's evidence is kept)."""
    http, base = ctx.http, ctx.url["stock"]
    plain = PROMPTS[:4] if len(PROMPTS) > 4 else PROMPTS[:1]
    prompts = LOOPING + plain
    direct: dict[int, dict[str, Any]] = {}
    for i, prompt in enumerate(prompts):
        r = await chat(http, base, prompt, max_tokens=1024, cache_salt=salt())
        direct[i] = {"finish": r.get("finish"), "looped": looped(r.get("text") or "")}
    # The defaults and the retry policy; the loops' units kept so that the evidence can be read.
    cfg = {"loops": {"policy": "retry"}, "incidents": {"store_text": True}}
    proxy = Detproxy(base, cfg, ctx.work, "loops-default")
    got: list[dict[str, Any]] = []
    try:
        await proxy.ready(http)
        sem = asyncio.Semaphore(8)

        async def one(i: int, stream: bool, round_: int) -> None:
            async with sem:
                t0 = time.monotonic()
                r = await chat(http, proxy.base, prompts[i], stream=stream, max_tokens=1024,
                               rid=f"ld-{i}-{int(stream)}-{round_}")  # fmt: skip
            got.append(
                {
                    "prompt": i,
                    "stream": stream,
                    "round": round_,
                    "status": r["status"],
                    "finish": r.get("finish"),
                    "content_chars": len(r.get("text") or ""),
                    "still_looping": looped(r.get("text") or ""),
                    "attempts": r.get("attempts"),
                    "recovered": r.get("recovered"),
                    "strategy": r.get("strategy"),
                    "restart_marks": r.get("restart_marks"),
                    "wall_s": round(time.monotonic() - t0, 2),
                }
            )

        # LOOP_ROUNDS rounds of every prompt, streamed and not: the batch each request meets
        # differs from round to round, so whether it loops does too.
        await asyncio.gather(
            *(
                one(i, s, r)
                for r in range(LOOP_ROUNDS)
                for i in range(len(prompts))
                for s in (False, True)
            )
        )
        incidents = [i for i in await proxy.incidents(http) if i.get("kind") == "loop"]
        m = await proxy.metrics(http)
    finally:
        proxy.stop()
    acted = [g for g in got if g["attempts"] not in (None, "1", 1)]
    ended = [g for g in acted if g["finish"] == "stop" and g["content_chars"] > 0]
    looped_ids = {str(i.get("request_id")) for i in incidents}
    return {
        "prompts": len(prompts),
        "direct_looped": [i for i, d in direct.items() if d["looped"]],
        "direct_finish": [d["finish"] for d in direct.values()],
        "requests": sorted(got, key=lambda g: (g["prompt"], g["stream"], g["round"])),
        "client_errors": sum(1 for g in got if g["status"] != 200),
        "acted": len(acted),
        "ended_stop_with_content": len(ended),
        "acted_by_stream": {
            "streamed": sum(1 for g in acted if g["stream"]),
            "not": sum(1 for g in acted if not g["stream"]),
        },
        "acted_on_plain_prompts": [
            (g["prompt"], g["stream"]) for g in acted if g["prompt"] >= len(LOOPING)
        ],
        "loop_incidents": len(incidents),
        "loop_incident_examples": incidents[:6],
        # Every loop's evidence, compactly: a retried prompt that looped under load is read
        # from here (what repeated, how often, from where), not taken on trust.
        "loop_evidence": [
            {
                k: i.get(k)
                for k in (
                    "request_id",
                    "channel",
                    "source",
                    "period",
                    "repeats",
                    "start_offset",
                    "attempt",
                    "preview",
                )
            }
            for i in incidents
        ],
        "loop_incident_request_ids": sorted(looped_ids)[:40],
        "loops_total": series(m, "detproxy_loops_total"),
        "policy_actions": series(m, "detproxy_policy_actions_total"),
    }


STREAM_CANDIDATES: dict[str, dict[str, Any]] = {
    "restart": {"stream_mode": "restart"},
    "continue": {"stream_mode": "continue", "hold_back_chars": 0},
    "continue+hold256": {"stream_mode": "continue", "hold_back_chars": 256},
}


async def stream_as_sdk(
    http: aiohttp.ClientSession, base: str, prompt: str, max_tokens: int, rid: str
) -> dict[str, Any]:
    """One greedy streamed chat request read as the openai SDK reads it: comments dropped,
    content deltas joined; with the first token's time and the time per content chunk."""
    body = {
        "model": MODEL,
        "temperature": 0,
        "max_tokens": max_tokens,
        "stream": True,
        "messages": [{"role": "user", "content": prompt}],
    }
    t0 = time.monotonic()
    first: float | None = None
    last = t0
    chunks = comments = 0
    text: list[str] = []
    info: dict[str, Any] | None = None
    finish = None
    async with http.post(
        base + "/v1/chat/completions", json=body, headers={"X-Request-Id": rid}
    ) as resp:
        status = resp.status
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
                if isinstance(chunk.get("detproxy"), dict):
                    info = chunk["detproxy"]
                for choice in chunk.get("choices") or []:
                    finish = choice.get("finish_reason") or finish
                    delta = (choice.get("delta") or {}).get("content")
                    if delta:
                        now = time.monotonic()
                        first = first if first is not None else now - t0
                        last = now
                        chunks += 1
                        text.append(delta)
    per_chunk = (last - t0 - first) / (chunks - 1) if first is not None and chunks > 1 else None
    return {
        "status": status,
        "text": "".join(text),
        "finish": finish,
        "ttft": first,
        "per_chunk": per_chunk,
        "detproxy": info,
        "comments": comments,
    }


def loop_onset(text: str) -> int | None:
    """Where detproxy's own detector sees the greedy answer's loop end its first unit
    (start_offset + period), fed as a stream would feed it; None: no loop."""
    from proxy.loops.detector import DetectorConfig, LoopDetector

    detector = LoopDetector(DetectorConfig())
    for at in range(0, len(text), 16):
        report = detector.feed(text[at : at + 16])
        if report is not None:
            return int(report.start_offset + report.period)
    return None


async def step_stream_candidates(ctx: Ctx) -> dict[str, Any]:
    """Issue 40's choice of the streamed recovery, on the real engine: each candidate
    (restart; continue; continue with a 256-char hold-back) with the defaults and the retry
    policy in front of the stock instance; the looping prompts streamed at 8 in flight, then
    four calm ones, read as the openai SDK reads them. Per candidate: loops ended with stop
    and content, answers spliced (a restart after shown text), repeats the client was shown
    past the greedy answer's first unit, first token on looping and calm prompts, time per
    chunk, and the tokens recoveries cost."""
    http, base = ctx.http, ctx.url["stock"]
    max_tokens = 512
    greedy: dict[int, tuple[str, int | None]] = {}
    for i, prompt in enumerate(LOOPING):
        r = await chat(http, base, prompt, max_tokens=max_tokens, cache_salt=salt())
        text = r.get("text") or ""
        greedy[i] = (text, loop_onset(text))
    calm = PROMPTS[:4] if len(PROMPTS) > 4 else PROMPTS[:1]
    out: dict[str, Any] = {
        "greedy_looping": [i for i, (_, onset) in greedy.items() if onset is not None]
    }
    for name, loops in STREAM_CANDIDATES.items():
        cfg = {"loops": {"policy": "retry"} | loops}
        proxy = Detproxy(base, cfg, ctx.work, f"stream-{name}")
        try:
            await proxy.ready(http)
            looping = await asyncio.gather(
                *(
                    stream_as_sdk(http, proxy.base, p, max_tokens, f"sc-{name}-{i}")
                    for i, p in enumerate(LOOPING)
                )
            )
            calm_rows = await asyncio.gather(
                *(
                    stream_as_sdk(http, proxy.base, p, 256, f"sc-{name}-c{i}")
                    for i, p in enumerate(calm)
                )
            )
            m = await proxy.metrics(http)
        finally:
            proxy.stop()
        rows = []
        for i, got in enumerate(looping):
            text, onset = greedy[i]
            info = got["detproxy"]
            rows.append(
                {
                    "prompt": i,
                    "greedy_looped": onset is not None,
                    "acted": info is not None,
                    "recovered": bool(info and info.get("recovered")),
                    "stop_with_content": got["finish"] == "stop" and bool(got["text"].strip()),
                    "finish": got["finish"],
                    "spliced": got["comments"] > 0,
                    "repeats_shown": (
                        max(0, common_prefix(text, got["text"]) - onset) if onset is not None else 0
                    ),
                    "ttft": got["ttft"],
                    "per_chunk": got["per_chunk"],
                    "status": got["status"],
                }
            )
        acted = [r for r in rows if r["acted"]]
        out[name] = {
            "acted": len(acted),
            "ended_stop_with_content": sum(r["stop_with_content"] for r in acted),
            "spliced": sum(r["spliced"] for r in acted),
            "repeats_shown_chars": spread(
                [float(r["repeats_shown"]) for r in rows if r["greedy_looped"]]
            ),
            "ttft_looping_s": spread([r["ttft"] for r in rows if r["ttft"] is not None]),
            "ttft_calm_s": spread([c["ttft"] for c in calm_rows if c["ttft"] is not None]),
            "per_chunk_s": spread(
                [r["per_chunk"] for r in rows + list(calm_rows) if r["per_chunk"] is not None]
            ),
            "recovery_tokens": series(m, "detproxy_recovery_tokens_total"),
            "client_errors": sum(1 for r in rows if r["status"] != 200)
            + sum(1 for c in calm_rows if c["status"] != 200),
            "rows": rows,
        }
    return out


async def step_graphs(ctx: Ctx) -> dict[str, Any]:
    """vLLM's production default (torch.compile, CUDA graphs) instead of --enforce-eager: its
    own serial reference against the eager one, and the audit at 16 and 32 in flight."""
    url = ctx.url.get("graphs")
    if not url or not await engine_up(ctx.http, url, min(240, ctx.left() - 120)):
        return {"status": "skipped", "reason": "graphs instance not up"}
    ref = await reference(ctx, "graphs")
    eager, graphs = ctx.refs["stock"], ctx.refs["graphs"]
    out: dict[str, Any] = {
        "reference": ref,
        "graphs_vs_eager_serial": {
            "text_differs": [p for p, r in enumerate(graphs) if r["text"] != eager[p]["text"]],
            "logprobs_differ": [p for p, r in enumerate(graphs) if r["lp"] != eager[p]["lp"]],
            "first_token_diff": [
                first_diff(graphs[p]["lp"], eager[p]["lp"]) for p in range(len(PROMPTS))
            ],
        },
    }
    for conc in (16, 32):
        out[f"c{conc}"] = await audit_load(ctx, f"graphs-c{conc}", "graphs", "graphs", conc, N_LOAD)
    return out


async def step_gguf(ctx: Ctx) -> dict[str, Any]:
    """The NaN-logprob GGUF served as is, detproxy --sample-rate 1.0: do clients get errors?"""
    http = ctx.http
    base = ctx.url["gguf"]
    if not await engine_up(http, base, min(90, ctx.left() - 40)):
        return {"status": "skipped", "reason": "gguf instance not up"}
    q = "What is the capital of France?"
    direct = []
    for lp in (False, True):
        for stream in (False, True):
            r = await chat(http, base, q, stream=stream, logprobs=lp, max_tokens=16)
            nulls = sum(1 for e in r.get("lp") or [] if e[1] is None)
            direct.append(
                {
                    "endpoint": "chat",
                    "logprobs": lp,
                    "stream": stream,
                    "status": r["status"],
                    "error": (r.get("error") or "")[:120],
                    "null_logprobs": nulls,
                    "text": (r.get("text") or "")[:60],
                }
            )
            c = await complete(http, base, "The capital of France is", stream=stream,
                               logprobs=1 if lp else None, max_tokens=16)  # fmt: skip
            direct.append(
                {
                    "endpoint": "completions",
                    "logprobs": lp,
                    "stream": stream,
                    "status": c["status"],
                    "error": (c.get("error") or "")[:120],
                    "null_logprobs": sum(1 for x in c.get("lp") or [] if x is None),
                    "text": (c.get("text") or "")[:60],
                }
            )
    proxy = Detproxy(base, {"audit": {"sample_rate": 1.0}}, ctx.work, "gguf")
    try:
        await proxy.ready(http)
        sem = asyncio.Semaphore(8)
        kinds = [(e, s) for e in ("chat", "completions") for s in (False, True)]
        jobs = [(e, s, i) for e, s in kinds for i in range(24)]
        random.Random(3).shuffle(jobs)
        got: list[tuple[str, bool, dict[str, Any]]] = []

        async def one(e: str, s: bool, i: int) -> None:
            async with sem:
                if e == "chat":
                    r = await chat(http, proxy.base, f"{q} ({i})", stream=s, max_tokens=32)
                else:
                    r = await complete(http, proxy.base, f"Fact {i}: the capital of France is",
                                       stream=s, max_tokens=32)  # fmt: skip
                got.append((e, s, r))

        await asyncio.gather(*(one(*j) for j in jobs))
        asked = []
        for stream in (False, True):
            r = await chat(http, proxy.base, q, stream=stream, logprobs=True, max_tokens=16)
            asked.append({"stream": stream, "status": r["status"]})
        await asyncio.sleep(3)
        st = await proxy.status(http)
        m = await proxy.metrics(http)
    finally:
        proxy.stop()
    errors: dict[str, int] = {}
    for e, s, r in got:
        if r["status"] != 200:
            key = f"{e} {'stream' if s else 'json'} {r['status']}"
            errors[key] = errors.get(key, 0) + 1
    return {
        "direct": direct,
        "client_requests": len(got),
        "client_errors": sum(errors.values()),
        "client_errors_by_kind": errors,
        "client_asking_logprobs_through_detproxy": asked,
        "audit": st["audit"],
        "injection": st.get("injection"),
        "fallbacks": series(m, "detproxy_fallbacks_total"),
        "injection_failures": series(m, "detproxy_injection_failures_total"),
        "injection_suspended": series(m, "detproxy_injection_suspended"),
    }


async def prefix_one(ctx: Ctx, name: str) -> dict[str, Any]:
    base = ctx.url[name]
    m0 = await engine_metrics(ctx.http, base)
    rows = []
    for p, prompt in enumerate(PROMPTS):
        cold = await chat(ctx.http, base, prompt, logprobs=True, cache_salt=salt())
        s = salt()
        first = await chat(ctx.http, base, prompt, logprobs=True, cache_salt=s)
        warm = await chat(ctx.http, base, prompt, logprobs=True, cache_salt=s)
        nosalt = await chat(ctx.http, base, prompt, logprobs=True)
        rows.append(
            {
                "p": p,
                "first_equals_cold": (first["text"], first["lp"]) == (cold["text"], cold["lp"]),
                "warm_text_equal": warm["text"] == cold["text"],
                "warm_logprobs_equal": warm["lp"] == cold["lp"],
                "warm_first_diff": first_diff(warm["lp"], cold["lp"]),
                "nosalt_text_equal": nosalt["text"] == cold["text"],
                "nosalt_logprobs_equal": nosalt["lp"] == cold["lp"],
            }
        )
    m1 = await engine_metrics(ctx.http, base)
    q = msum(m1, "vllm:prefix_cache_queries_total") - msum(m0, "vllm:prefix_cache_queries_total")
    h = msum(m1, "vllm:prefix_cache_hits_total") - msum(m0, "vllm:prefix_cache_hits_total")
    return {
        "rows": rows,
        "warm_text_differs": [r["p"] for r in rows if not r["warm_text_equal"]],
        "warm_logprobs_differ": [r["p"] for r in rows if not r["warm_logprobs_equal"]],
        "prefix_cache_hit_tokens": h,
        "prefix_cache_query_tokens": q,
    }


async def step_prefix(ctx: Ctx) -> dict[str, Any]:
    got = await asyncio.gather(prefix_one(ctx, "stock"), prefix_one(ctx, "bi"))
    return {"stock": got[0], "bi": got[1]}


async def step_disconnect(ctx: Ctx) -> dict[str, Any]:
    """A client that goes away: is vLLM's request aborted (num_requests_running back to 0)?"""
    base = ctx.url["stock"]
    proxy = Detproxy(base, {"server": {}}, ctx.work, "disconnect")
    trials = []

    async def running() -> float:
        return msum(await engine_metrics(ctx.http, base), "vllm:num_requests_running")

    async def back_to_zero(t_close: float) -> float | None:
        while time.monotonic() - t_close < 10:
            if await running() == 0:
                return round(time.monotonic() - t_close, 3)
            await asyncio.sleep(0.01)
        return None

    try:
        await proxy.ready(ctx.http)
        body = {
            "model": MODEL,
            "temperature": 0,
            "max_tokens": 3000,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": LONG}],
        }
        for _ in range(3):
            resp = await ctx.http.post(proxy.base + "/v1/chat/completions", json=body | {
                "stream": True})  # fmt: skip
            events = 0
            async for line in resp.content:
                if line.startswith(b"data: "):
                    events += 1
                    if events >= 5:
                        break
            was = await running()
            t_close = time.monotonic()
            resp.close()
            trials.append({"stream": True, "running_before_close": was,
                           "back_to_zero_s": await back_to_zero(t_close)})  # fmt: skip
        task = asyncio.ensure_future(
            ctx.http.post(proxy.base + "/v1/chat/completions", json=body | {"stream": False})
        )
        await asyncio.sleep(1.0)
        was = await running()
        t_close = time.monotonic()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
            await task
        trials.append({"stream": False, "running_before_close": was,
                       "back_to_zero_s": await back_to_zero(t_close)})  # fmt: skip
        m = await proxy.metrics(ctx.http)
    finally:
        proxy.stop()
    return {"trials": trials, "client_disconnects": msum(m, "detproxy_client_disconnects_total")}


async def run_cli(args: list[str], limit: float) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "proxy",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), limit)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return -9, "", "timeout"
    return proc.returncode or 0, out.decode(), err.decode()


async def step_probe(ctx: Ctx) -> dict[str, Any]:
    prompts = ctx.work / "probe-prompts.txt"
    prompts.write_text("\n".join(PROMPTS[:4]) + "\n")

    async def one(name: str) -> dict[str, Any]:
        args = ["probe", "--upstream", ctx.url[name], "--model", MODEL, "--prompts",
                str(prompts), "--runs", str(PROBE_RUNS), "--concurrency", PROBE_LEVELS,
                "--json"]  # fmt: skip
        code, out, err = await run_cli(args, max(30, ctx.left() - 20))
        rep = orjson.loads(out) if out.strip() else {"error": err[-400:]}
        rep["exit_code"] = code
        return rep

    got = await asyncio.gather(one("stock"), one("bi"))
    return {"stock": got[0], "bi": got[1]}


async def step_loops(ctx: Ctx) -> dict[str, Any]:
    """Loops through detproxy with vLLM's repetition_detection injected and the retry ladder."""
    base = ctx.url["stock"]
    http = ctx.http
    direct = []
    for prompt in LOOPING:
        r = await chat(http, base, prompt, max_tokens=384, cache_salt=salt())
        direct.append({"finish": r.get("finish"), "looped": looped(r.get("text") or "")})
    cfg = {
        "audit": {"sample_rate": 0.0},
        "loops": {"policy": "retry"},
        "loops.engine_detection": {"min_pattern_size": 1, "max_pattern_size": 64, "min_count": 8},
    }
    proxy = Detproxy(base, cfg, ctx.work, "loops")
    got = []
    try:
        await proxy.ready(http)
        sem = asyncio.Semaphore(4)

        async def one(prompt: str, stream: bool) -> None:
            async with sem:
                r = await chat(http, proxy.base, prompt, stream=stream, max_tokens=384,
                               cache_salt=salt())  # fmt: skip
                got.append(
                    {
                        "stream": stream,
                        "status": r["status"],
                        "finish": r.get("finish"),
                        "looped": looped(r.get("text") or ""),
                        "attempts": r.get("attempts"),
                        "recovered": r.get("recovered"),
                    }
                )

        await asyncio.gather(*(one(p, s) for p in LOOPING for s in (False, True)))
        m = await proxy.metrics(http)
    finally:
        proxy.stop()
    finish: dict[str, int] = {}
    for g in got:
        finish[str(g["finish"])] = finish.get(str(g["finish"]), 0) + 1
    return {
        "direct": direct,
        "direct_looped": sum(1 for d in direct if d["looped"]),
        "direct_finish": [d["finish"] for d in direct],
        "through_detproxy": got,
        "client_errors": sum(1 for g in got if g["status"] != 200),
        "client_finish": finish,
        "client_still_looping": sum(1 for g in got if g["looped"]),
        "loops_total": series(m, "detproxy_loops_total"),
        "policy_actions": series(m, "detproxy_policy_actions_total"),
    }


def common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


Row = Callable[[str, bool, dict[str, Any]], dict[str, Any]]


async def looping_through(
    ctx: Ctx, base: str, cfg: dict[str, Any], name: str, max_tokens: int, row: Row
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """The looping prompts through a detproxy of ``cfg`` in front of ``base``, streamed and
    not, 4 in flight: ``row(prompt, stream, what the client got)`` for each, and the metrics."""
    http = ctx.http
    proxy = Detproxy(base, cfg, ctx.work, name)
    got: list[dict[str, Any]] = []
    try:
        await proxy.ready(http)
        sem = asyncio.Semaphore(4)

        async def one(prompt: str, stream: bool) -> None:
            async with sem:
                r = await chat(http, proxy.base, prompt, stream=stream, max_tokens=max_tokens,
                               cache_salt=salt())  # fmt: skip
            got.append({"prompt": LOOPING.index(prompt), "stream": stream} | row(prompt, stream, r))

        await asyncio.gather(*(one(p, s) for p in LOOPING for s in (False, True)))
        metrics = await proxy.metrics(http)
    finally:
        proxy.stop()
    return sorted(got, key=lambda g: (g["prompt"], g["stream"])), metrics


def series(metrics: dict[str, float], name: str) -> dict[str, float]:
    """The samples of one metric family, by their full names."""
    return {k: v for k, v in metrics.items() if k.startswith(name)}


def continued_row(direct: dict[str, str]) -> Row:
    def row(prompt: str, stream: bool, r: dict[str, Any]) -> dict[str, Any]:
        text = r.get("text") or ""
        return {
            "status": r["status"],
            "error": r.get("error"),
            "finish": r.get("finish"),
            "looped": looped(text),
            "attempts": r.get("attempts"),
            "chars": len(text),
            "greedy_prefix_kept_chars": common_prefix(text, direct[prompt]),
        }

    return row


async def step_loops_strategies(ctx: Ctx) -> dict[str, Any]:
    """The default ladder's attempts as restarts, then the same attempts continuing from the
    loop's onset (``continue_final_message`` on vLLM): recovered, looped again, tokens spent
    and kept, and how much of the greedy answer before the loop the client still got."""
    direct: dict[str, str] = {}
    for prompt in LOOPING:
        r = await chat(ctx.http, ctx.url["stock"], prompt, max_tokens=384, cache_salt=salt())
        direct[prompt] = r.get("text") or ""
    attempts = [
        {"temperature": 0.7, "top_p": 0.95, "presence_penalty": 1.5, "seed": 1},
        {"frequency_penalty": 1.0},
    ]
    out: dict[str, Any] = {"direct_looped": [p for p, t in direct.items() if looped(t)]}
    for strategy in ("restart", "continue"):
        ladder = [{"models": "*", "attempts": [a | {"strategy": strategy} for a in attempts]}]
        cfg = {"audit": {"sample_rate": 0.0}, "loops": {"policy": "retry", "ladders": ladder}}
        got, m = await looping_through(
            ctx, ctx.url["stock"], cfg, f"loops-{strategy}", 384, continued_row(direct)
        )
        on_looping = [g for g in got if looped(direct[LOOPING[g["prompt"]]])]
        out[strategy] = {
            "client_errors": sum(1 for g in got if g["status"] != 200),
            "client_still_looping": sum(1 for g in got if g["looped"]),
            "finish": {
                f: sum(1 for g in got if str(g["finish"]) == f)
                for f in sorted({str(g["finish"]) for g in got})
            },
            "greedy_prefix_kept_chars_on_looping_prompts": spread(
                [float(g["greedy_prefix_kept_chars"]) for g in on_looping]
            ),
            "recoveries": series(m, "detproxy_recoveries_total"),
            "recovery_tokens": series(m, "detproxy_recovery_tokens_total"),
            "loops_total": msum(m, "detproxy_loops_total"),
            "rows": got,
        }
    return out


async def tokenize(http: aiohttp.ClientSession, base: str, body: dict[str, Any]) -> list[int]:
    status, raw, _ = await post(http, base + "/tokenize", {"model": MODEL, **body}, {})
    if status != 200:
        raise RuntimeError(f"/tokenize {status}: {raw[:200]!r}")
    tokens: list[int] = orjson.loads(raw)["tokens"]
    return tokens


async def step_retokenize(ctx: Ctx) -> dict[str, Any]:
    """Is a continued prefix what the engine generated? For each looping prompt: the greedy
    answer with its token ids; the prefix detproxy keeps (cut on a word end) and the raw cut
    (onset + one unit); each rendered as a final assistant message by vLLM's /tokenize
    (``continue_final_message``) against the prompt's own tokens followed by the generated
    ones; then the greedy continuation of the kept prefix against the original's rest."""
    from policies.base import Trigger
    from proxy.loops.continuation import prefix_of
    from proxy.loops.detector import LoopDetector

    base, http = ctx.url["stock"], ctx.http
    rows: list[dict[str, Any]] = []
    for prompt in LOOPING:
        user = [{"role": "user", "content": prompt}]
        status, raw, _ = await post(
            http,
            base + "/v1/chat/completions",
            {"model": MODEL, "messages": user, "temperature": 0, "max_tokens": 384,
             "logprobs": True, "return_tokens_as_token_ids": True, "cache_salt": salt()},
            {},
        )  # fmt: skip
        if status != 200:
            rows.append({"prompt": prompt, "error": raw[:200].decode(errors="replace")})
            continue
        choice = orjson.loads(raw)["choices"][0]
        text = choice["message"]["content"] or ""
        tokens = [str(e.get("token")) for e in (choice.get("logprobs") or {}).get("content") or []]
        if not tokens or not all(t.startswith("token_id:") for t in tokens):
            rows.append({"prompt": prompt, "error": "no token ids (return_tokens_as_token_ids)"})
            continue
        ids = [int(t.split(":", 1)[1]) for t in tokens]
        report = LoopDetector().feed(text)
        if report is None:
            rows.append({"prompt": prompt, "loop": False})
            continue
        trigger = Trigger("proxy", "content", 0, report.period, report.repeats,
                          report.start_offset)  # fmt: skip
        prompt_ids = await tokenize(http, base, {"messages": user, "add_generation_prompt": True})
        row: dict[str, Any] = {"prompt": prompt, "loop": True, "generated_tokens": len(ids)}
        raw_cut = text[: report.start_offset + report.period]
        for name, prefix in (("kept", prefix_of(text, trigger) or ""), ("raw_cut", raw_cut)):
            rendered = await tokenize(
                http,
                base,
                {"messages": [*user, {"role": "assistant", "content": prefix}],
                 "add_generation_prompt": False, "continue_final_message": True},
            )  # fmt: skip
            own = rendered[len(prompt_ids) :]
            row[name] = {
                "chars": len(prefix),
                "ends_on": repr(text[len(prefix) - 1 : len(prefix) + 1]),
                "prompt_part_equal": rendered[: len(prompt_ids)] == prompt_ids,
                "faithful": rendered[: len(prompt_ids)] == prompt_ids and own == ids[: len(own)],
                "tokens": len(own),
            }
        kept = prefix_of(text, trigger) or ""
        cont = await chat(
            http, base, prompt, max_tokens=384 - row["kept"]["tokens"], cache_salt=salt(),
            extra={"messages": [*user, {"role": "assistant", "content": kept}],
                   "continue_final_message": True, "add_generation_prompt": False},
        )  # fmt: skip
        rest = text[len(kept) :]
        got = cont.get("text") or ""
        row["greedy_continuation"] = {
            "chars": len(got),
            "original_rest_chars": len(rest),
            "common_prefix_chars": common_prefix(got, rest),
            "equal_over_common_length": got[: len(rest)] == rest[: len(got)],
        }
        rows.append(row)
    looping = [r for r in rows if r.get("loop")]
    return {
        "looping": len(looping),
        "kept_faithful": sum(r["kept"]["faithful"] for r in looping),
        "raw_cut_faithful": sum(r["raw_cut"]["faithful"] for r in looping),
        "continuation_equal": sum(
            r["greedy_continuation"]["equal_over_common_length"] for r in looping
        ),
        "rows": rows,
    }


REASON_TOKENS = 512
REASON_ATTEMPTS = [
    {"temperature": 0.7, "top_p": 0.95, "presence_penalty": 1.5, "seed": 1},
    {"frequency_penalty": 1.0},
]


async def step_close_reasoning(ctx: Ctx) -> dict[str, Any]:
    """Reasoning loops on the stand-in reasoning model (think_tokenizer.py, vLLM's
    deepseek_r1 parser): the default ladder's attempts as restarts, then closing the
    reasoning; streamed and not, 4 in flight. Then one non-streamed close against the same
    continuation asked directly."""
    base, http = ctx.url.get("think"), ctx.http
    if not base:
        return {"status": "skipped", "reason": "no think server"}
    direct = {}
    for prompt in LOOPING:
        r = await chat(http, base, prompt, max_tokens=REASON_TOKENS, cache_salt=salt())
        direct[prompt] = r
    out: dict[str, Any] = {
        "direct": [
            {"status": r["status"], "finish": r.get("finish"),
             "reasoning_chars": len(r.get("reasoning") or ""),
             "content_chars": len(r.get("text") or ""),
             "reasoning_looped": looped(r.get("reasoning") or "")}
            for r in direct.values()
        ],
    }  # fmt: skip
    for strategy in ("restart", "close_reasoning"):
        ladder = [
            {"models": "*", "attempts": [a | {"strategy": strategy} for a in REASON_ATTEMPTS]}
        ]
        cfg = {"audit": {"sample_rate": 0.0}, "loops": {"policy": "retry", "ladders": ladder}}
        rows, m = await looping_through(
            ctx, base, cfg, f"reason-{strategy}", REASON_TOKENS, reasoning_row(direct)
        )
        out[strategy] = {
            "client_errors": sum(1 for g in rows if g["status"] != 200),
            "answered": sum(1 for g in rows if g["answered"]),
            "requests": len(rows),
            "streamed_reasoning_shown_once": sum(
                1 for g in rows if g["stream"] and g["reasoning_is_greedy_prefix"]
            ),
            "restart_marks": sum(g["restart_marks"] or 0 for g in rows),
            "recoveries": series(m, "detproxy_recoveries_total"),
            "recovery_tokens": series(m, "detproxy_recovery_tokens_total"),
            "loops_total": series(m, "detproxy_loops_total"),
            "rows": rows,
        }
    out["faithful"] = await closed_against_direct(ctx, base, direct)
    return out


def reasoning_row(direct: dict[str, dict[str, Any]]) -> Row:
    def row(prompt: str, stream: bool, r: dict[str, Any]) -> dict[str, Any]:
        content, reasoning = r.get("text") or "", r.get("reasoning") or ""
        greedy: str = direct[prompt].get("reasoning") or ""
        return {
            "status": r["status"],
            "error": r.get("error"),
            "finish": r.get("finish"),
            "attempts": r.get("attempts"),
            "strategy": r.get("strategy"),
            "reasoning_chars": len(reasoning),
            "content_chars": len(content),
            "answered": r["status"] == 200
            and r.get("finish") in ("stop", "length")
            and bool(content.strip())
            and not looped(content),
            # Streamed: what the client saw of the reasoning is the greedy one (nothing
            # shown twice) unless a restart started it again.
            "reasoning_is_greedy_prefix": greedy.startswith(reasoning),
            "restart_marks": r.get("restart_marks"),
            "ids": r.get("ids"),
            "content_head": content[:120],
        }

    return row


async def closed_against_direct(
    ctx: Ctx, base: str, direct: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """One non-streamed close_reasoning at greedy (frequency_penalty 1.0) through detproxy, on
    the first prompt whose greedy reasoning detproxy's detector finds a loop in, against the
    continuation of its kept reasoning asked of vLLM directly."""
    from proxy.loops.continuation import closed_reasoning
    from proxy.loops.detector import LoopDetector

    looping = [p for p, r in direct.items() if LoopDetector().feed(r.get("reasoning") or "")]
    if not looping:
        return {"status": "skipped", "reason": "no reasoning loop"}

    http = ctx.http
    greedy = {"strategy": "close_reasoning", "frequency_penalty": 1.0}
    ladder = [{"models": "*", "attempts": [greedy], "on_exhausted": "observe"}]
    cfg = {"audit": {"sample_rate": 0.0}, "loops": {"policy": "retry", "ladders": ladder}}
    proxy = Detproxy(base, cfg, ctx.work, "reason-faithful")
    prompt = looping[0]
    try:
        await proxy.ready(http)
        r = await chat(http, proxy.base, prompt, max_tokens=REASON_TOKENS, cache_salt=salt())
        m = await proxy.metrics(http)
    finally:
        proxy.stop()
    kept_tokens = int(msum(m, "detproxy_recovery_tokens_total", kind="kept"))
    kept = r.get("reasoning") or ""
    closed = closed_reasoning(kept, "<think>", "</think>")
    messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": closed}]
    d = await chat(
        http, base, prompt, max_tokens=REASON_TOKENS - kept_tokens, cache_salt=salt(),
        extra={"messages": messages, "continue_final_message": True,
               "add_generation_prompt": False, "frequency_penalty": 1.0},
    )  # fmt: skip
    # vLLM's deepseek_r1 parser reads output without </think> as reasoning: all of it is
    # what the engine wrote after the closed reasoning.
    written = (d.get("reasoning") or "") + (d.get("text") or "")
    return {
        "strategy": r.get("strategy"),
        "kept_chars": len(kept),
        "kept_tokens": kept_tokens,
        "content_chars": len(r.get("text") or ""),
        "direct_chars": len(written),
        "equal": (r.get("text") or "") == written,
        "common_prefix_chars": common_prefix(r.get("text") or "", written),
    }


def sweep_step(name: str) -> Callable[[Ctx], Awaitable[dict[str, Any]]]:
    async def run(ctx: Ctx) -> dict[str, Any]:
        args = ["sweep", "--upstream", ctx.url[name], "--model", MODEL, "--concurrency",
                SWEEP_LEVELS, "--duration", str(SWEEP_DURATION), "--repeats", "2",
                "--json"]  # fmt: skip
        code, out, err = await run_cli(args, max(30, ctx.left() - 10))
        if not out.strip():
            return {"exit_code": code, "error": err[-400:]}
        rep = orjson.loads(out)
        levels = [
            {
                "concurrency": lv["concurrency"],
                "tok_s_mean": lv["tokens_per_s"]["mean"],
                "tok_s_min": lv["tokens_per_s"]["min"],
                "tok_s_max": lv["tokens_per_s"]["max"],
                "spread": lv["tokens_per_s"]["spread"],
                "ttft_p50_s": lv["ttft_s"]["p50"],
                "itl_p50_s": lv["itl_s"]["p50"],
                "requests": lv["requests"],
                "errors": lv["errors"],
            }
            for lv in rep["levels"]
        ]
        return {
            "exit_code": code,
            "levels": levels,
            "fingerprint_changed": rep["fingerprint"]["changed"],
        }

    return run


# ---------------------------------------------------------------- issue 49: loop recovery

# Candidates for the looping prompts (issue 49 item 1): short creative, list and repetitive
# tasks across topics, on which a 135M model tends to fall into a loop greedily. The screen
# sends each straight to vLLM and keeps those that loop.
L49_CANDIDATES = [
    *(
        f"Write a poem about {t}."
        for t in (
            "the ocean",
            "love",
            "the moon",
            "the stars",
            "autumn",
            "a lighthouse",
            "the city at night",
            "a river",
            "friendship",
            "the wind",
            "snow",
            "a cat",
            "time",
            "the mountains",
            "rain",
        )
    ),
    *(
        f"Write a song about {t}."
        for t in ("summer", "the road", "home", "dancing", "a broken heart", "the sea")
    ),
    *(
        f"Write a letter to {t}."
        for t in (
            "a friend",
            "your future self",
            "your mother",
            "your teacher",
            "a pen pal in Japan",
            "your neighbour",
        )
    ),
    *(
        f"List {t}."
        for t in (
            "as many animals as you can",
            "50 fruits",
            "100 words that rhyme with day",
            "50 names for a dog",
            "all the colours you know",
            "50 countries",
            "100 verbs",
            "as many sports as you can",
            "50 kinds of flowers",
            "30 ideas for a birthday party",
            "20 things to do on a rainy day",
            "40 famous scientists",
        )
    ),
    *(
        f"Repeat {t}."
        for t in (
            "the word hello 100 times",
            "the sentence 'I love coding' 50 times",
            "after me: the sun is bright, the sun is bright",
            "the alphabet ten times",
        )
    ),
    "Count from 1 to 500.",
    "Write the multiplication table of 7 up to 100.",
    "Write a haiku about spring, then another, and keep going.",
    "Write a story about a dragon who loves to sing.",
    "Write a story about a boy and his dog.",
    "Write a fairy tale about a princess and a frog.",
    "Write a very long story about a dragon, a knight and a village, chapter by chapter.",
    "Write a speech for a graduation ceremony.",
    "Write a motivational message for someone starting a new job.",
    "Write a list of New Year's resolutions.",
    "Write a birthday wish for my sister.",
    "Write a description of a beautiful garden.",
    "Write a prayer for peace.",
    "Write a product description for a water bottle.",
    "Write a chant for a football team.",
    "Write a lullaby for a baby.",
    "Write twenty tweets about coffee.",
    "Describe your perfect day, hour by hour.",
    "Give me 30 tips for better sleep.",
    "Write a recipe for a chocolate cake.",
    "Write a nursery rhyme about a little star.",
]
L49_LENGTHS = {"1k": 1024, "4k": 4096}  # max_tokens (4k: less where the model's length is short)
L49_KEEP = 24  # the looping prompts kept from the screen (issue 49 asks for at least 24)
L49_SCREEN_CONC = 8
# The default ladder until 2026-12-07 evening (its second rung greedy with frequency_penalty 1.0)
# and a third rung (temperature 1.0, both penalties: the default's second rung since), 4 attempts.
L49_RUNG3: dict[str, Any] = {
    "max_attempts": 4,
    "ladders": [
        {
            "models": "*",
            "attempts": [
                {"temperature": 0.7, "top_p": 0.95, "presence_penalty": 1.5},
                {"frequency_penalty": 1.0},
                {
                    "temperature": 1.0,
                    "top_p": 0.95,
                    "presence_penalty": 1.5,
                    "frequency_penalty": 1.0,
                },
            ],
        }
    ],
}
# The configurations compared: [loops] policy = "retry" and these on top of the defaults.
L49_CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},  # stream_mode "continue" (again) since 2026-12-07 afternoon
    "restart": {"stream_mode": "restart"},
    # restart, the earlier default ladder and a third rung for the loops that survive both
    "rung3": {
        "stream_mode": "restart",
        **L49_RUNG3,
    },
    # one path, each rung with a repetition_penalty: vLLM's presence and frequency penalties
    # count only the tokens this request generated, never the kept text a continuation sends
    # as the start of its answer (the loop's unit included); repetition_penalty counts both
    "contrep": {
        "stream_mode": "continue",
        "max_attempts": 4,
        "ladders": [
            {
                "models": "*",
                "attempts": [
                    {
                        "temperature": 0.7,
                        "top_p": 0.95,
                        "presence_penalty": 1.5,
                        "repetition_penalty": 1.1,
                    },
                    {"frequency_penalty": 1.0, "repetition_penalty": 1.2},
                    {
                        "temperature": 1.0,
                        "top_p": 0.95,
                        "presence_penalty": 1.5,
                        "frequency_penalty": 1.0,
                        "repetition_penalty": 1.3,
                    },
                ],
            }
        ],
    },
    # one path (continue) with rung3's ladder
    "cont3": {
        "stream_mode": "continue",
        **L49_RUNG3,
    },
    "hold256": {"stream_mode": "continue", "hold_back_chars": 256},
    "ladder3": {
        "max_attempts": 4,
        "ladders": [
            {
                "models": "*",
                "attempts": [
                    {"repetition_penalty": 1.2},
                    {"temperature": 0.7, "top_p": 0.95, "presence_penalty": 1.5},
                    {"temperature": 1.0, "frequency_penalty": 1.0},
                ],
            }
        ],
    },
}
L49_CONCS = (8, 1)


def l49(ctx: Ctx) -> dict[str, Any]:
    """The loops49 state kept across calls: the screen's prompts and timings, the parts'."""
    state: dict[str, Any] = ctx.results.setdefault("loops49", {})
    return state


def l49_s_per_token(ctx: Ctx, conc: int) -> float:
    """Seconds a token takes at ``conc`` in flight (the screen's measure; else from t1)."""
    got = l49(ctx).get("s_per_token", {}).get(str(conc))
    if got:
        return float(got)
    return ctx.t1 / MAX_TOKENS * (1.0 if conc == 1 else 1.3)


async def direct_chat(
    http: aiohttp.ClientSession, base: str, prompt: str, max_tokens: int
) -> dict[str, Any]:
    """One greedy non-streamed request straight to the engine: text, finish, tokens, time,
    and whether it loops (the tail, and detproxy's own detector anywhere)."""
    body = {"model": MODEL, "temperature": 0, "max_tokens": max_tokens, "stream": False,
            "messages": [{"role": "user", "content": prompt}]}  # fmt: skip
    t0 = time.monotonic()
    try:
        status, raw, _ = await post(http, base + "/v1/chat/completions", body, {})
    except (TimeoutError, aiohttp.ClientError) as exc:
        return {"status": 0, "error": repr(exc)[:300]}
    latency = round(time.monotonic() - t0, 4)
    if status != 200:
        return {"status": status, "error": raw[:300].decode(errors="replace")}
    doc = orjson.loads(raw)
    choice = doc["choices"][0]
    text = choice["message"].get("content") or ""
    onset = loop_onset(text)
    return {
        "status": 200,
        "finish": choice.get("finish_reason"),
        "tokens": int((doc.get("usage") or {}).get("completion_tokens") or 0),
        "latency_s": latency,
        "chars": len(text),
        "tail_loops": looped(text),
        "onset": onset,
        "loops": onset is not None or looped(text),
    }


async def max_model_len(http: aiohttp.ClientSession, base: str) -> int | None:
    with contextlib.suppress(Exception):
        async with http.get(base + "/v1/models") as resp:
            value = (await resp.json())["data"][0].get("max_model_len")
            return int(value) if value else None
    return None


def l49_length(ctx: Ctx, label: str) -> int:
    """max_tokens of a length label: at most the model's length less room for the prompt."""
    mml = l49(ctx).get("max_model_len")
    want = L49_LENGTHS[label]
    return min(want, int(mml) - 256) if mml else want


async def step_loops49_screen(ctx: Ctx) -> dict[str, Any]:
    """Issue 49's prompt screen: every candidate straight to the stock engine, greedy, at the
    1k length, L49_SCREEN_CONC in flight; those that ended ``length`` without a loop again at
    the 4k length if the time left allows; the looping ones kept (at most L49_KEEP). Also the
    engine's time per token alone and at L49_SCREEN_CONC (the parts' estimates and baselines)."""
    http, base = ctx.http, ctx.url["stock"]
    state = l49(ctx)
    state["max_model_len"] = await max_model_len(http, base)
    short, long_ = l49_length(ctx, "1k"), l49_length(ctx, "4k")
    # alone: the time per token (two requests of half the short length)
    alone = [await direct_chat(http, base, p, short // 2) for p in L49_CANDIDATES[:2]]
    s1 = sum(a.get("latency_s", 0) for a in alone) / max(1, sum(a.get("tokens", 0) for a in alone))
    sem = asyncio.Semaphore(L49_SCREEN_CONC)

    async def one(prompt: str, max_tokens: int) -> dict[str, Any]:
        async with sem:
            return await direct_chat(http, base, prompt, max_tokens)

    t0 = time.monotonic()
    first = await asyncio.gather(*(one(p, short) for p in L49_CANDIDATES))
    screen_1k_s = time.monotonic() - t0
    ok = [r for r in first if r["status"] == 200]
    s8 = sum(r["latency_s"] for r in ok) / max(1, sum(r["tokens"] for r in ok))
    state["s_per_token"] = {"1": round(s1, 6), str(L49_SCREEN_CONC): round(s8, 6)}
    rows: list[dict[int, dict[str, Any]]] = [{short: r} for r in first]
    again = [i for i, r in enumerate(first) if r.get("finish") == "length" and not r.get("loops")]
    waves = -(-len(again) // L49_SCREEN_CONC)
    est_long = waves * long_ * s8 * 1.2 + 5
    screened_long = bool(again) and long_ > short and ctx.left() - 60 > est_long
    if screened_long:
        second = await asyncio.gather(*(one(L49_CANDIDATES[i], long_) for i in again))
        for i, r in zip(again, second, strict=True):
            rows[i][long_] = r
    looping = [i for i, r in enumerate(first) if r.get("loops")]
    looping += [i for i in again if (rows[i].get(long_) or {}).get("loops")]
    keep = looping[:L49_KEEP]
    state["prompts"] = [L49_CANDIDATES[i] for i in keep]
    # the direct answer of each kept prompt at each length: tokens, and latency alone and at
    # L49_SCREEN_CONC (measured at the 1k length in flight; else tokens x time per token)
    direct: dict[str, dict[str, Any]] = {}
    for i in keep:
        row = rows[i]
        d: dict[str, Any] = {}
        for label, mt in (("1k", short), ("4k", long_)):
            got = row.get(mt) or {}
            # a greedy loop runs to the length: what a longer request would generate
            tokens = got.get("tokens") or mt
            d[label] = {
                "tokens": tokens,
                "onset": got.get("onset") if got else row[short].get("onset"),
                "latency_c1_s": round(tokens * s1, 3),
                f"latency_c{L49_SCREEN_CONC}_s": got.get("latency_s") or round(tokens * s8, 3),
            }
        direct[L49_CANDIDATES[i]] = d
    state["direct"] = direct
    return {
        "candidates": len(L49_CANDIDATES),
        "max_model_len": state["max_model_len"],
        "lengths": {"1k": short, "4k": long_},
        "looping_at_1k": len([i for i, r in enumerate(first) if r.get("loops")]),
        "screened_at_4k": len(again) if screened_long else 0,
        "looping_total": len(looping),
        "kept": len(keep),
        "kept_prompts": state["prompts"],
        "s_per_token": state["s_per_token"],
        "screen_1k_wall_s": round(screen_1k_s, 1),
        "client_errors": sum(1 for r in first if r["status"] != 200),
        "rows": [
            {"prompt": p} | {str(mt): got for mt, got in r.items()}
            for p, r in zip(L49_CANDIDATES, rows, strict=True)
        ],
    }


def l49_cost(ctx: Ctx, label: str, conc: int) -> float:
    """Seconds a request of a part takes: measured on an earlier part of the same length and
    concurrency, else tokens guessed x the time per token: a non-streamed first attempt runs to
    the length, a streamed one is cut at the loop, then a retry."""
    seen = l49(ctx).get("request_s", {}).get(f"{label}_c{conc}")
    if seen:
        return float(seen)
    mt = l49_length(ctx, label)
    tokens = 0.6 * mt + 500
    per_token = l49_s_per_token(ctx, L49_SCREEN_CONC if conc > 1 else 1)
    return tokens * per_token / (conc if conc > 1 else 1)


def l49_estimate(cfg: str, label: str, conc: int) -> Callable[[Ctx], float]:
    def est(ctx: Ctx) -> float:
        n = 2 * len(l49(ctx).get("prompts") or L49_CANDIDATES[:24])
        if conc == 1:  # one at a time, a part stops when time is up and goes on next call
            n = min(n, 8)
        return n * l49_cost(ctx, label, conc) * 1.15 + 20

    return est


def truthy(value: Any) -> bool:
    return value is True or str(value).lower() == "true"


def same_beyond_repeats(a: str, b: str, max_unit: int = 2048) -> bool:
    """``a`` and ``b`` are one text but for whole repeats of a unit one of them shows more
    of, back to back right after an earlier copy of that unit (a stream's shown repeats)."""
    if a == b:
        return True
    x, y = (a, b) if len(a) > len(b) else (b, a)
    extra = len(x) - len(y)
    head = common_prefix(x, y)
    tail = common_prefix(x[::-1], y[::-1])
    if head + tail < len(y):
        return False
    # x == y[:q] + x[q:q+extra] + y[q:] for any q in [len(y) - tail, head]
    for q in range(max(0, len(y) - tail), head + 1):
        block = x[q : q + extra]
        for unit in range(1, min(extra, max_unit, q) + 1):
            if extra % unit == 0 and x[q - unit : q] * (extra // unit) == block:
                return True
    return False


async def sdk_row(http: aiohttp.ClientSession, base: str, prompt: str, mt: int, rid: str
                  ) -> dict[str, Any]:  # fmt: skip
    t0 = time.monotonic()
    try:
        got = await stream_as_sdk(http, base, prompt, mt, rid)
    except (TimeoutError, aiohttp.ClientError, orjson.JSONDecodeError) as exc:
        return {"status": 0, "error": repr(exc)[:300], "latency_s": time.monotonic() - t0}
    info = got.get("detproxy") or {}
    return {
        "status": got["status"],
        "text": got["text"],
        "finish": got["finish"],
        "attempts": info.get("attempts"),
        "recovered": info.get("recovered") if info else None,
        "strategy": info.get("strategy"),
        "comments": got["comments"],
        "ttft_s": got["ttft"],
        "latency_s": round(time.monotonic() - t0, 4),
    }


def l49_part(cfg_name: str, label: str, conc: int) -> Callable[[Ctx], Awaitable[dict[str, Any]]]:
    async def run(ctx: Ctx) -> dict[str, Any]:
        return await loops49_part(ctx, cfg_name, label, conc)

    return run


async def loops49_part(ctx: Ctx, cfg_name: str, label: str, conc: int) -> dict[str, Any]:
    """One configuration, one length, one concurrency: every kept looping prompt through a
    detproxy with ``[loops] policy = "retry"`` and the configuration's knobs, streamed (read as
    the openai SDK reads it) and not. Per request: finish, whether the content still loops at
    its end, attempts, what it said of recovery, added latency against the direct answer and
    (alone) the tokens the engine generated beyond it; then whether the streamed and
    non-streamed answers of each prompt are one text beyond the repeats the stream showed."""
    state = l49(ctx)
    prompts: list[str] = state.get("prompts") or []
    if not prompts:
        return {"status": "skipped", "reason": "no looping prompts (loops49_screen first)"}
    http, base = ctx.http, ctx.url["stock"]
    mt = l49_length(ctx, label)
    part = f"{cfg_name}_{label}_c{conc}"
    cfg = {"loops": {"policy": "retry"} | L49_CONFIGS[cfg_name], "incidents": {"store_text": True}}
    # one at a time, a part goes on over calls (--resume) from the prompts it has done
    progress: dict[str, Any] = state.setdefault("progress", {}).setdefault(
        part, {"rows": [], "texts": {}, "caught": [], "traffic_s": 0.0}
    )
    if conc > 1:
        progress.update({"rows": [], "texts": {}, "caught": [], "traffic_s": 0.0})
    done = {r["prompt"] for r in progress["rows"] if r["stream"]}  # plain, then streamed
    rows: list[dict[str, Any]] = [r for r in progress["rows"] if r["prompt"] in done]
    progress["rows"] = rows
    texts: dict[str, dict[str, str]] = progress["texts"]
    stopped = False
    proxy = Detproxy(base, cfg, ctx.work, f"l49-{part}")
    try:
        await proxy.ready(http)

        async def one(i: int, stream: bool) -> None:
            rid = f"l49-{part}-{i}-{int(stream)}"
            before = after = None
            if conc == 1:
                before = (await engine_metrics(http, base), await proxy.metrics(http))
            if stream:
                r = await sdk_row(http, proxy.base, prompts[i], mt, rid)
            else:
                r = await chat(http, proxy.base, prompts[i], max_tokens=mt, rid=rid)
            if conc == 1:
                after = (await engine_metrics(http, base), await proxy.metrics(http))
            text = r.get("text") or ""
            texts.setdefault(str(i), {})["stream" if stream else "plain"] = text
            finish = r.get("finish")
            qualifies = finish in ("stop", "tool_calls") and bool(text.strip()) and not looped(text)
            direct = (state.get("direct") or {}).get(prompts[i], {}).get(label, {})
            base_s = direct.get(f"latency_c{1 if conc == 1 else L49_SCREEN_CONC}_s")
            row: dict[str, Any] = {
                "prompt": i,
                "stream": stream,
                "status": r["status"],
                "error": r.get("error"),
                "finish": finish,
                "chars": len(text),
                "tail_loops": looped(text),
                "attempts": r.get("attempts"),
                "recovered": r.get("recovered"),
                "strategy": r.get("strategy"),
                "qualifies": qualifies,
                "latency_s": r.get("latency_s"),
                "added_s": round(r["latency_s"] - base_s, 3)
                if base_s is not None and r.get("latency_s") is not None
                else None,
                "restart_marks": r.get("comments", r.get("restart_marks")),
            }
            if before and after:
                gen = msum(after[0], "vllm:generation_tokens_total") - msum(
                    before[0], "vllm:generation_tokens_total"
                )
                rec = msum(after[1], "detproxy_recovery_tokens_total", kind="generated") - msum(
                    before[1], "detproxy_recovery_tokens_total", kind="generated"
                )
                row["engine_tokens"] = int(gen)
                row["recovery_tokens"] = int(rec)
                if direct.get("tokens"):
                    row["extra_tokens"] = int(gen - direct["tokens"])
            rows.append(row)

        t0 = time.monotonic()
        if conc == 1:
            key = f"{label}_c1"
            for i in range(len(prompts)):
                if i in done:
                    continue
                if ctx.left() < 2 * l49_cost(ctx, label, 1) * 1.5 + 15:
                    stopped = True
                    break
                t1 = time.monotonic()
                for stream in (False, True):
                    await one(i, stream)
                progress["traffic_s"] += time.monotonic() - t1
                state.setdefault("request_s", {})[key] = round(progress["traffic_s"] / len(rows), 3)
                ctx.save()
        else:
            sem = asyncio.Semaphore(conc)

            async def limited(i: int, stream: bool) -> None:
                async with sem:
                    await one(i, stream)

            await asyncio.gather(
                *(limited(i, s) for i in range(len(prompts)) for s in (False, True))
            )
        wall = time.monotonic() - t0
        incidents = [x for x in await proxy.incidents(http) if x.get("kind") == "loop"]
        m = await proxy.metrics(http)
    finally:
        proxy.stop()
    progress["caught"] = sorted(
        set(progress["caught"]) | {str(x.get("request_id")) for x in incidents}
    )
    caught = set(progress["caught"])
    for row in rows:
        rid = f"l49-{part}-{row['prompt']}-{int(row['stream'])}"
        attempts = row["attempts"]
        row["acted"] = (
            rid in caught or (attempts not in (None, "", "1", 1)) or row["finish"] == "repetition"
        )
        row["claimed_recovered"] = truthy(row["recovered"])
        row["dishonest"] = row["claimed_recovered"] and not row["qualifies"]
    rows.sort(key=lambda g: (g["prompt"], g["stream"]))
    # the per-request time, for the estimates of the parts still to run
    if conc > 1:
        state.setdefault("request_s", {})[f"{label}_c{conc}"] = round(wall / max(1, len(rows)), 3)
    one_path = []
    for key, pair in sorted(texts.items(), key=lambda kv: int(kv[0])):
        s, n = pair.get("stream", ""), pair.get("plain", "")
        acted = [r["acted"] for r in rows if r["prompt"] == int(key)]
        one_path.append(
            {
                "prompt": int(key),
                "both_acted": all(acted) and len(acted) == 2,
                "identical": s == n,
                "same_beyond_repeats": same_beyond_repeats(s, n),
                "diverge_at": common_prefix(s, n),
            }
        )
    l49_save_texts(ctx, part, {prompts[int(k)]: t for k, t in texts.items()})
    out = {
        "config": cfg_name,
        "knobs": L49_CONFIGS[cfg_name],
        "max_tokens": mt,
        "concurrency": conc,
        "prompts_done": len({r["prompt"] for r in rows}),
        "traffic_s": round(progress["traffic_s"] if conc == 1 else wall, 1),
        **l49_summary(rows, one_path),
        "recoveries": series(m, "detproxy_recoveries_total"),
        "recovery_tokens": series(m, "detproxy_recovery_tokens_total"),
        "loop_incidents": len(incidents),
        "one_path_rows": one_path,
        "rows": rows,
    }
    if stopped:  # the next call (--resume) goes on with the prompts left
        out["status"] = "partial"
        out["reason"] = f"{out['prompts_done']} of {len(prompts)} prompts, time is up"
    else:
        del state["progress"][part]
    return out


def l49_save_texts(ctx: Ctx, part: str, texts: dict[str, dict[str, str]]) -> None:
    """Every part's answers in one gzipped file, in --work and --out (at most 8 files of
    $OUT come back from the device)."""
    name = "loops49-texts.json.gz"
    path = ctx.work / name
    every = orjson.loads(gzip.decompress(path.read_bytes())) if path.exists() else {}
    every[part] = texts
    blob = gzip.compress(orjson.dumps(every))
    for folder in {ctx.work, ctx.args.out}:
        (folder / name).write_bytes(blob)


def l49_summary(rows: list[dict[str, Any]], one_path: list[dict[str, Any]]) -> dict[str, Any]:
    def by(stream: bool) -> dict[str, Any]:
        mine = [r for r in rows if r["stream"] == stream]
        acted = [r for r in mine if r["acted"]]
        finish: dict[str, int] = {}
        for r in acted:
            finish[str(r["finish"])] = finish.get(str(r["finish"]), 0) + 1
        return {
            "requests": len(mine),
            "acted": len(acted),
            "qualified": rate(sum(r["qualifies"] for r in acted), len(acted)),
            "finish_of_acted": finish,
            "tail_loops_of_acted": sum(r["tail_loops"] for r in acted),
            "claimed_recovered": sum(r["claimed_recovered"] for r in mine),
            "dishonest": [r["prompt"] for r in mine if r["dishonest"]],
            "attempts_of_acted": spread([float(r["attempts"]) for r in acted if r["attempts"]]),
            "added_s_of_acted": spread([r["added_s"] for r in acted if r["added_s"] is not None]),
            "extra_tokens_of_acted": spread(
                [float(r["extra_tokens"]) for r in acted if "extra_tokens" in r]
            ),
            "client_errors": sum(1 for r in mine if r["status"] != 200),
        }

    both = [p for p in one_path if p["both_acted"]]
    return {
        "plain": by(False),
        "streamed": by(True),
        "one_path": {
            "both_acted": len(both),
            "identical": sum(p["identical"] for p in both),
            "same_beyond_repeats": sum(p["same_beyond_repeats"] for p in both),
        },
    }


def l49_parts() -> list[tuple[str, str, int]]:
    """(configuration, length, concurrency) in the order they run: every configuration 8 in
    flight first (cheap: a batch costs about what one request does), then one at a time,
    each at 1024 tokens before 4096."""
    return [(c, label, k) for k in L49_CONCS for label in L49_LENGTHS for c in L49_CONFIGS]


def l49_overview(steps: dict[str, Any]) -> list[str]:
    """Every part run so far, one line each: the share of acted-on requests that ended stop
    with content that does not loop, streamed and not; dishonest claims; one path."""
    lines = [
        "| part | tokens | plain: qualified / acted | streamed: qualified / acted | "
        "recovered said, not qualifying | one path (beyond repeats / identical / both acted) | "
        "added s (median) plain / streamed | extra tokens, alone (median) plain / streamed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, s in steps.items():
        if not name.startswith("loops49_") or name == "loops49_screen":
            continue
        if s.get("status") not in ("done", "partial"):
            continue
        if s["status"] == "partial":
            name += f" (partial: {s['prompts_done']} prompts)"
        p, st, op = s["plain"], s["streamed"], s["one_path"]
        extra = (
            f"{p['extra_tokens_of_acted'].get('median', '-')} / "
            f"{st['extra_tokens_of_acted'].get('median', '-')}"
        )
        lines.append(
            f"| {name[8:]} | {s['max_tokens']} | {pct(p['qualified'])} | {pct(st['qualified'])} "
            f"| {len(p['dishonest']) + len(st['dishonest'])} | {op['same_beyond_repeats']} / "
            f"{op['identical']} / {op['both_acted']} | "
            f"{p['added_s_of_acted'].get('median', '-')} / "
            f"{st['added_s_of_acted'].get('median', '-')} | {extra} |"
        )
    lines += [
        "",
        "Per configuration, every part pooled (acted-on requests that ended stop or a tool "
        "call with content that does not loop at its end):",
        "",
        "| configuration | plain | streamed | all | one at a time | 8 in flight | recovered "
        "said, not qualifying | one path |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for cfg in L49_CONFIGS:
        parts = [
            s
            for n, s in steps.items()
            if n.startswith(f"loops49_{cfg}_") and s.get("status") in ("done", "partial")
        ]
        if not parts:
            continue

        def pooled(keep: Callable[[dict[str, Any], str], bool], parts: list[Any] = parts) -> str:
            k = n = 0
            for s in parts:
                for side in ("plain", "streamed"):
                    if keep(s, side):
                        k += s[side]["qualified"]["k"]
                        n += s[side]["qualified"]["n"]
            return pct(rate(k, n))

        dishonest = sum(len(s[x]["dishonest"]) for s in parts for x in ("plain", "streamed"))
        same = sum(s["one_path"]["same_beyond_repeats"] for s in parts)
        both = sum(s["one_path"]["both_acted"] for s in parts)
        lines.append(
            f"| {cfg} | {pooled(lambda s, x: x == 'plain')} | "
            f"{pooled(lambda s, x: x == 'streamed')} | {pooled(lambda s, x: True)} | "
            f"{pooled(lambda s, x: s['concurrency'] == 1)} | "
            f"{pooled(lambda s, x: s['concurrency'] > 1)} | {dishonest} | {same}/{both} |"
        )
    return lines


NEEDS_REFS = {f"audit_c{c}" for c in (8, 16, 32, 2, 4)} | {"random10", "spec", "graphs"}


def est_audit(ctx: Ctx, conc: int, n: int = N_LOAD, share: float = 1.0) -> float:
    # measured on the H200 (2026-12-01): 64 requests, t1 2.1 s: 213-230 s at 8, 16 and 32
    return n * share * ctx.t1 * 1.45 + (n / conc) * ctx.t1 * 3 + 20


STEPS: list[tuple[str, Callable[[Ctx], Awaitable[dict[str, Any]]], Callable[[Ctx], float]]] = [
    ("spec_fresh", step_spec_fresh, lambda c: 30),
    ("engine_truth", step_engine_truth, lambda c: 40),
    ("causes", step_causes, lambda c: 240),
    ("triage", step_triage, lambda c: 200),
    ("diagnose_spec", step_diagnose_spec, lambda c: 60),
    ("diagnose", step_diagnose, lambda c: 180),
    ("loops_default", step_loops_default, lambda c: 300),
    ("stream_candidates", step_stream_candidates, lambda c: 150),
    ("passthrough", step_passthrough, lambda c: 30),
    ("reference", step_reference, lambda c: len(PROMPTS) * REPS * c.t1 * 1.2 + 10),
    *[
        (f"audit_c{conc}", audit_pair(conc), lambda c, k=conc: est_audit(c, k))
        for conc in LOADS
    ],
    ("random10", step_random10, lambda c: est_audit(c, LOADS[-1], share=0.2)),
    (
        "spec",
        step_spec,
        lambda c: len(PROMPTS) * 2 * c.t1 * 3.5 + est_audit(c, 16, N_LOAD // 2) + 20,
    ),
    (
        "graphs",
        step_graphs,
        # a graphs request is about 4x faster than an eager one (12 ms a step, eager)
        lambda c: len(PROMPTS) * REPS * c.t1 / 3 + 2 * est_audit(c, 16) / 3 + 30,
    ),
    ("gguf_nan", step_gguf, lambda c: 40),
    ("prefix_cache", step_prefix, lambda c: len(PROMPTS) * 4 * c.t1 * 1.2 + 5),
    ("disconnect", step_disconnect, lambda c: 25),
    ("probe", step_probe, lambda c: 45),
    ("loops", step_loops, lambda c: 16 * 3 * c.t1 + 30),
    ("loops_strategies", step_loops_strategies, lambda c: 2 * 16 * 3 * c.t1 + 40),
    ("retokenize", step_retokenize, lambda c: len(LOOPING) * 6 * c.t1 + 10),
    # measured on the H200 (2026-12-01): 57 s with the serial request at 2-3.5 s
    ("close_reasoning", step_close_reasoning, lambda c: 16 * c.t1 + 30),
    *[
        (f"sweep_{n}", sweep_step(n),
         lambda c: len(SWEEP_LEVELS.split(",")) * SWEEP_DURATION * 2 + 15)
        for n in ("stock", "bi", "spec", "graphs")
    ],
    # Issue 49's loop recovery (opt-in: only when --steps names them, e.g. 'loops49*'): the
    # screen, then each configuration at each length, 8 in flight and one at a time.
    (
        "loops49_screen",
        step_loops49_screen,
        lambda c: L49_LENGTHS["1k"] * l49_s_per_token(c, 1)
        + -(-len(L49_CANDIDATES) // L49_SCREEN_CONC)
        * L49_LENGTHS["1k"]
        * l49_s_per_token(c, L49_SCREEN_CONC)
        + 20,
    ),
    *[
        (f"loops49_{cfg}_{label}_c{conc}", l49_part(cfg, label, conc),
         l49_estimate(cfg, label, conc))
        for cfg, label, conc in l49_parts()
    ],
]  # fmt: skip
OPT_IN = "loops49"  # steps that run only when --steps names them


# ---------------------------------------------------------------------------------- report


def pct(r: dict[str, Any]) -> str:
    if not r or r.get("rate") is None:
        return "n/a"
    lo, hi = r["ci95"]
    return f"{r['k']}/{r['n']} = {r['rate']:.1%} ({lo:.1%}-{hi:.1%})"


def md_audit(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| scenario | conc | requests | audited | client errors | detproxy unstable (95% CI) | "
        "truth: text differs (95% CI) | text level: both / only truth / only detproxy / neither "
        "| asked-logprobs clients, bitwise: truth / both / only truth / only detproxy "
        "| verdicts |",
        "|" + "---|" * 10,
    ]
    for s in rows:
        a, f = s["agreement_text"], s["agreement_full_asked"]
        lines.append(
            f"| {s['label']} | {s['concurrency']} | {s['requests']} | {s['audited']}"
            f"{'' if s['all_audited'] or s['sample_rate'] < 1 else ' (drops!)'} "
            f"| {s['client_errors']} | {pct(s['detproxy_rate'])} | {pct(s['truth_text_rate'])} "
            f"| {a['both']} / {a['only_truth']} / {a['only_detproxy']} / {a['neither']} "
            f"| {pct(s['truth_full_rate_asked'])} / {f['both']} / {f['only_truth']} / "
            f"{f['only_detproxy']} | {s['verdicts']} |"
        )
    lines.append("")
    for s in rows:
        lines.append(
            f"- {s['label']}: traffic {s['traffic_s']} s; first divergent token "
            f"{s['divergence_positions']}; margins (nats) {s['margins_nats']}; max |delta| "
            f"(nats) {s['max_abs_logprob_delta']}; distinct texts per prompt "
            f"{s['distinct_texts_per_prompt']}; logprob_drift on clients that did not ask "
            f"(text same) {s['drift_text_same_not_asked']}; leaked logprobs "
            f"{s['leaked_logprobs']}; overlapped shadows {s['overlapped_shadows']}; dropped "
            f"{s['dropped']}; fallbacks {s['fallbacks']}"
        )
        if s["disagreements"]:
            lines.append(f"  - disagreements: {s['disagreements']}")
    return lines


def markdown(res: dict[str, Any]) -> str:
    steps = res.get("steps", {})
    lines = [f"# vLLM validation results ({res.get('calls', [{}])[0].get('started')})", ""]
    lines.append(f"serial request time (stock, {MAX_TOKENS} max tokens): {res.get('t1_s')} s")
    lines.append("")
    lines.append("| step | status | wall s |")
    lines.append("|---|---|---|")
    for name, _, _ in STEPS:
        s = steps.get(name)
        if s:
            lines.append(
                f"| {name} | {s.get('status')} {s.get('reason') or ''} | {s.get('wall_s')} |"
            )
    lines.append("")
    if any(n.startswith("loops49_") and n != "loops49_screen" for n in steps):
        try:
            lines += ["## loops49: every part", "", *l49_overview(steps), ""]
        except Exception as exc:  # the json has it all
            lines += [f"(loops49 overview failed: {exc!r})", ""]
    for name, s in steps.items():
        if s.get("status") not in ("done", "partial"):
            if s.get("error"):
                lines += [f"## {name}: error", "", "```", s["error"][-1500:], "```", ""]
            continue
        try:
            lines += [f"## {name}", "", *md_step(name, s), ""]
        except Exception as exc:  # the json has it all; the summary must not fail the run
            lines += [f"## {name}", "", f"(summary failed: {exc!r})", ""]
    return "\n".join(lines) + "\n"


def md_step(name: str, s: dict[str, Any]) -> list[str]:
    if name.startswith("audit_") or name == "random10":
        return md_audit([s["stock"], s["bi"]])
    if name == "graphs":
        return [
            *md_audit([s["c16"], s["c32"]]),
            "",
            f"- graphs serial vs eager serial: {s['graphs_vs_eager_serial']}",
            f"- graphs reference: unstable prompts {s['reference']['unstable_prompts']}, mean "
            f"request {s['reference']['mean_request_s']} s, tokens {s['reference']['tokens']}",
        ]
    if name == "spec":
        if "serial" not in s:
            return [f"{s}"]
        lines = md_audit([s["serial"], s["load16"]])
        return [
            *lines,
            "",
            f"- serial spec vs serial plain: {s['spec_vs_plain_serial']}",
            f"- spec reference stable: unstable prompts {s['spec_reference']['unstable_prompts']}",
            f"- fingerprint speculative flag: at start {s['speculative_flag_at_start']}, at end "
            f"{s['speculative_flag_at_end']}; detproxy_upstream_changes_total "
            f"{s['upstream_changes_total']}; fresh server: requests before "
            f"{s['fresh_server_requests_before']}, draft tokens before "
            f"{s['fresh_server_draft_tokens_before']}, spec metrics present "
            f"{s['spec_metrics_present_before']}",
            f"- acceptance rate (engine counters over the step) {s['acceptance_rate_engine']}; "
            f"detproxy load gauges {s['load_gauges']}",
        ]
    if name == "reference":
        return [
            f"- {k}: {v}"
            if not isinstance(v, dict)
            else f"- {k}: unstable prompts "
            f"{v['unstable_prompts']}, mean request {v['mean_request_s']} s, tokens {v['tokens']}"
            for k, v in s.items()
            if k not in ("status", "wall_s")
        ]
    if name == "prefix_cache":
        return [
            f"- {k}: warm text differs {v['warm_text_differs']}, warm logprobs differ "
            f"{v['warm_logprobs_differ']}, prefix cache hit tokens {v['prefix_cache_hit_tokens']}"
            f" of {v['prefix_cache_query_tokens']}; first (cold, salted) equals cold: "
            f"{sum(r['first_equals_cold'] for r in v['rows'])}/{len(v['rows'])}; no salt equals "
            f"cold (text): {sum(r['nosalt_text_equal'] for r in v['rows'])}/{len(v['rows'])}"
            for k, v in s.items()
            if isinstance(v, dict)
        ]
    if name == "probe":
        lines = []
        for k in ("stock", "bi"):
            rep = s[k]
            lines.append(f"- {k}: exit {rep.get('exit_code')}")
            for r in rep.get("results", []):
                lines.append(
                    f"  - conc {r['concurrency']}: distinct {r['distinct_vectors']}, flip "
                    f"{r['first_token_flips']}, max |delta| {r['max_abs_delta']:.3g}: "
                    f"{r['prompt'][:40]!r}"
                )
        return lines
    if name == "loops49_screen":
        return [
            f"- {s['candidates']} candidates at {s['lengths']} max tokens (model length "
            f"{s['max_model_len']}): {s['looping_at_1k']} loop at 1k, {s['screened_at_4k']} "
            f"screened again at 4k, {s['looping_total']} loop, {s['kept']} kept; time per "
            f"token {s['s_per_token']}; client errors {s['client_errors']}",
            *(
                f"  - {r['prompt']!r}: "
                + "; ".join(
                    f"{k}: {v.get('finish')} {v.get('tokens')} tok, loops {v.get('loops')}"
                    for k, v in r.items()
                    if k != "prompt"
                )
                for r in s["rows"]
            ),
        ]
    if name.startswith("loops49_"):
        return [
            f"- {s['config']} {s['knobs']}, {s['max_tokens']} max tokens, {s['concurrency']} "
            f"in flight, {s['traffic_s']} s; loop incidents {s['loop_incidents']}",
            *(
                f"- {k}: acted {s[k]['acted']}/{s[k]['requests']}, qualified "
                f"{pct(s[k]['qualified'])}, finish {s[k]['finish_of_acted']}, still loop at the "
                f"end {s[k]['tail_loops_of_acted']}, recovered said {s[k]['claimed_recovered']} "
                f"(not qualifying: prompts {s[k]['dishonest']}), attempts "
                f"{s[k]['attempts_of_acted']}, added s {s[k]['added_s_of_acted']}, extra tokens "
                f"{s[k]['extra_tokens_of_acted']}, client errors {s[k]['client_errors']}"
                for k in ("plain", "streamed")
            ),
            f"- one path: {s['one_path']}",
            f"- recoveries {s['recoveries']}; recovery tokens {s['recovery_tokens']}",
        ]
    if name.startswith("sweep_"):
        lines = [
            f"exit {s.get('exit_code')}, fingerprint changed {s.get('fingerprint_changed')}",
            "",
            "| conc | tok/s mean | min | max | spread | TTFT p50 ms | ITL p50 ms | requests "
            "| errors |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for lv in s.get("levels", []):
            lines.append(
                f"| {lv['concurrency']} | {lv['tok_s_mean']:.0f} | {lv['tok_s_min']:.0f} | "
                f"{lv['tok_s_max']:.0f} | {lv['spread']} | "
                f"{(lv['ttft_p50_s'] or 0) * 1000:.1f} | {(lv['itl_p50_s'] or 0) * 1000:.2f} | "
                f"{lv['requests']} | {lv['errors']} |"
            )
        return lines
    return ["```", orjson.dumps(s, option=orjson.OPT_INDENT_2).decode()[:6000], "```"]


# ---------------------------------------------------------------------------------- main


def quick() -> None:
    """A smoke run (e.g. against detproxy's emulator): small everything."""
    global MAX_TOKENS, REPS, LOADS, N_LOAD, SWEEP_LEVELS, SWEEP_DURATION, PROBE_LEVELS
    global PROBE_RUNS
    MAX_TOKENS, REPS, LOADS, N_LOAD = 24, 2, (2, 4, 8), 12
    SWEEP_LEVELS, SWEEP_DURATION, PROBE_LEVELS, PROBE_RUNS = "1,2", 1.0, "1,2", 3
    del PROMPTS[4:]
    del LOOPING[2:]
    global L49_KEEP
    del L49_CANDIDATES[8:]
    L49_LENGTHS.update({"1k": 256, "4k": 512})
    L49_KEEP = 4


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    for name in ("stock", "bi", "spec", "gguf"):
        ap.add_argument(f"--{name}", required=True, help=f"{name} vLLM base URL")
    ap.add_argument("--graphs", help="vLLM base URL: CUDA graphs and torch.compile (optional)")
    ap.add_argument("--think", help="vLLM base URL: the stand-in reasoning model (optional)")
    ap.add_argument("--stock-ptd", help="stock with --enable-prompt-tokens-details (optional)")
    ap.add_argument("--bi-ptd", help="batch-invariant, --enable-prompt-tokens-details (optional)")
    ap.add_argument("--work", type=Path, required=True, help="state and logs (kept)")
    ap.add_argument("--out", type=Path, required=True, help="results.json, results.md")
    ap.add_argument("--logs", type=Path, help="vLLM logs to copy tails of into --out")
    ap.add_argument("--deadline-s", type=float, default=560)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument(
        "--steps",
        help="comma separated step names or globs, e.g. 'loops49*' (default: all but the "
        "opt-in loops49 steps)",
    )
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        quick()
    if args.logs:
        for name in ("stock", "bi", "spec", "gguf", "graphs", "think", "stock_ptd", "bi_ptd"):
            if getattr(args, name):
                PIDS[getattr(args, name)] = args.logs / f"vllm-{name}.pid"
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    wanted = args.steps.split(",") if args.steps else None
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=256)
    ) as http:
        ctx = Ctx(args, http)
        t0 = time.monotonic()
        # the loops49 steps need only the stock instance (on_device.sh setup-loops)
        needs_bi = not wanted or any(not w.startswith(OPT_IN) for w in wanted)
        up = await asyncio.gather(
            engine_up(http, args.stock, min(300, ctx.left() - 30)),
            *([engine_up(http, args.bi, min(300, ctx.left() - 30))] if needs_bi else []),
        )
        ctx.results["calls"][-1]["engines_up_after_s"] = round(time.monotonic() - t0, 1)
        ctx.results["calls"][-1]["stock_bi_up"] = up
        print(f"engines up {up} after {time.monotonic() - t0:.0f} s", flush=True)
        with contextlib.suppress(Exception):
            async with http.get(args.stock + "/version") as resp:
                ctx.results["vllm_version"] = (await resp.json()).get("version")
        for name, fn, est in STEPS:
            prev = ctx.results["steps"].get(name, {})
            if wanted is None and name.startswith(OPT_IN):
                continue
            if prev.get("status") == "done" or (
                wanted is not None and not any(fnmatch.fnmatchcase(name, w) for w in wanted)
            ):
                continue
            if name in NEEDS_REFS and not (ctx.refs.get("stock") and ctx.refs.get("bi")):
                ctx.results["steps"][name] = {"status": "skipped", "reason": "no reference"}
                continue
            need = est(ctx)
            if ctx.left() < need:
                ctx.results["steps"][name] = {
                    "status": "skipped",
                    "reason": f"needs ~{need:.0f} s, {ctx.left():.0f} s left",
                }
                ctx.save()
                continue
            t1 = time.monotonic()
            print(f"{name}: start (estimate {need:.0f} s, {ctx.left():.0f} s left)", flush=True)
            try:
                res = await asyncio.wait_for(fn(ctx), timeout=max(5.0, ctx.left() - 3))
                res.setdefault("status", "done")
            except Exception as exc:  # record and go on with the next step
                res = {"status": "error", "error": "".join(traceback.format_exception(exc))[-3000:]}
            res["wall_s"] = round(time.monotonic() - t1, 1)
            ctx.results["steps"][name] = res
            ctx.save()
            print(f"{name}: {res['status']} in {res['wall_s']} s", flush=True)
        ctx.save()
    if args.logs:
        # One file for every server's tail: a call brings back at most 8 files from $OUT
        # (2026-12-07: one per server left the step's results.json behind).
        tails = []
        for log in sorted(args.logs.glob("vllm-*.log")):
            lines = log.read_text(errors="replace").splitlines()
            keep = [x for x in lines if re.search(r"(?i)error|warn|backend|took|KV cache", x)]
            tails.append(f"== {log.name}\n" + "\n".join(keep[-60:] + lines[-30:]))
        (args.out / "vllm-tails.txt").write_text("\n\n".join(tails))
    print((args.out / "results.md").read_text())


if __name__ == "__main__":
    asyncio.run(main())
