"""GPU validation: does detproxy measure real batch nondeterminism on a CUDA serving stack?

Starts llama-server (CUDA, several slots), then for each scenario a detproxy in front of it
(its console entry point, as a user runs it), drives bounded concurrent greedy chat traffic
through it (prompts of several lengths, streamed and not), and measures the ground truth
separately: each prompt replayed alone with ``cache_prompt: false``, compared bit for bit
(tokens and logprobs) with what every client received. Writes results.json and results.md.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson

PARAGRAPH = (
    "The committee reviewed the quarterly figures for the northern region, noting that "
    "shipping delays in March pushed several large orders into April, while returns "
    "stayed flat and the new warehouse cut handling costs by a fifth. "
)
QUESTIONS = [
    "What is the main cause of the change in orders?",
    "Summarise the figures in two sentences.",
    "List three risks for next quarter.",
    "Write a short story about a robot who learns to paint. Use vivid details.",
    "Explain why the sky is blue to a ten year old.",
    "Extract every month mentioned, as a JSON list.",
]
# Six prompts from about 40 to about 1,600 tokens.
PROMPTS = [
    QUESTIONS[3],
    QUESTIONS[4],
    PARAGRAPH * 2 + QUESTIONS[0],
    PARAGRAPH * 10 + QUESTIONS[1],
    PARAGRAPH * 25 + QUESTIONS[2],
    PARAGRAPH * 45 + QUESTIONS[5],
]
MAX_TOKENS = 128
TOP = 5


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (max(0.0, c - h), min(1.0, c + h))


def signature(content: str, entries: list[dict[str, Any]]) -> Any:
    if entries and entries[-1].get("token") == "" and entries[-1].get("bytes") == []:
        entries = entries[:-1]  # llama-server's non-streamed EOS entry
    return (
        content,
        [
            (
                e["token"],
                e["logprob"],
                [(t["token"], t["logprob"]) for t in e.get("top_logprobs") or []],
            )
            for e in entries
        ],
    )


async def chat(
    http: aiohttp.ClientSession,
    base: str,
    prompt: str,
    *,
    stream: bool,
    rid: str | None = None,
    cold: bool = True,
) -> Any:
    body: dict[str, Any] = {
        "model": "smollm2",
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
        "logprobs": True,
        "top_logprobs": TOP,
        "stream": stream,
        "messages": [{"role": "user", "content": prompt}],
    }
    if cold:
        body["cache_prompt"] = False
    headers = {"X-Request-Id": rid} if rid else {}
    async with http.post(base + "/v1/chat/completions", json=body, headers=headers) as resp:
        raw = await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{resp.status}: {raw[:200]!r}")
    if not stream:
        choice = orjson.loads(raw)["choices"][0]
        return signature(choice["message"]["content"] or "", choice["logprobs"]["content"])
    content = ""
    entries: list[Any] = []
    for block in raw.split(b"\n\n"):
        if not block.startswith(b"data: ") or block == b"data: [DONE]":
            continue
        for choice in orjson.loads(block[6:]).get("choices", []):
            content += (choice.get("delta") or {}).get("content") or ""
            entries += ((choice.get("logprobs") or {}).get("content")) or []
    return signature(content, entries)


class Detproxy:
    def __init__(self, upstream: str, config: str, workdir: Path, name: str) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cfg = workdir / f"{name}.toml"
        cfg.write_text(config)
        self.log = open(workdir / f"{name}.log", "wb")  # noqa: SIM115
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
                str(cfg),
            ],
            stdout=self.log,
            stderr=self.log,
            env=os.environ.copy(),
        )

    async def ready(self, http: aiohttp.ClientSession) -> None:
        for _ in range(200):
            try:
                async with http.get(self.base + "/detproxy/health") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
        raise RuntimeError("detproxy did not start")

    async def settle(self, http: aiohttp.ClientSession, expected: int) -> dict[str, Any]:
        deadline = time.monotonic() + 300
        while True:
            status: dict[str, Any] = await (await http.get(self.base + "/detproxy/status")).json()
            done = status["audit"]["audits"] + sum(status["audit"]["shadows_dropped"].values())
            if done >= expected or time.monotonic() > deadline:
                return status
            await asyncio.sleep(0.2)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()


def config(
    sample_rate: float = 1.0, schedule: str = "quiet", cold: bool = True, sample_by: str = "hash"
) -> str:
    extra = "shadow_extra_body = { cache_prompt = false }\n" if cold else ""
    return (
        f'[audit]\nsample_rate = {sample_rate}\nsample_by = "{sample_by}"\n'
        "passive_checks = false\n"
        f'schedule = "{schedule}"\nquiet_max_inflight = 0\nquiet_settle_s = 1.0\n'
        "quiet_deadline_s = 600\nmax_concurrent_shadows = 1\nmax_shadows_per_s = 1000\n"
        "queue_size = 1000\n" + extra + "[loops]\nenabled = false\n"
    )


async def drive(
    http: aiohttp.ClientSession,
    base: str,
    runs: int,
    concurrency: int,
    cold: bool,
    rng: random.Random,
) -> dict[str, tuple[int, Any]]:
    jobs = [(f"p{p}-r{r}", p) for r in range(runs) for p in range(len(PROMPTS))]
    rng.shuffle(jobs)
    sem = asyncio.Semaphore(concurrency)
    received: dict[str, tuple[int, Any]] = {}

    async def one(rid: str, p: int) -> None:
        async with sem:
            received[rid] = (
                p,
                await chat(http, base, PROMPTS[p], stream=rng.random() < 0.5, rid=rid, cold=cold),
            )

    await asyncio.gather(*(one(rid, p) for rid, p in jobs))
    return received


async def reference(http: aiohttp.ClientSession, engine: str) -> list[Any]:
    """Each prompt alone and cold, three times: the serial reference must itself be stable."""
    refs = []
    for prompt in PROMPTS:
        answers = [await chat(http, engine, prompt, stream=False) for _ in range(3)]
        assert all(a == answers[0] for a in answers), "the serial reference is not stable"
        refs.append(answers[0])
    return refs


async def scenario(
    name: str,
    http: aiohttp.ClientSession,
    engine: str,
    refs: list[Any],
    workdir: Path,
    cfg: str,
    runs: int,
    concurrency: int,
    cold: bool,
    rng: random.Random,
) -> dict[str, Any]:
    proxy = Detproxy(engine, cfg, workdir, name)
    try:
        await proxy.ready(http)
        t0 = time.monotonic()
        received = await drive(http, proxy.base, runs, concurrency, cold, rng)
        traffic_s = time.monotonic() - t0
        audited_expected = len(received) if "sample_rate = 1.0" in cfg else 0
        status = await proxy.settle(http, audited_expected) if audited_expected else None
        if not audited_expected:
            await asyncio.sleep(5)
            for _ in range(600):
                status = await (await http.get(proxy.base + "/detproxy/status")).json()
                if status["shadow"]["queued"] == 0 and status["shadow"]["running"] == 0:
                    break
                await asyncio.sleep(0.2)
        incidents = await (await http.get(proxy.base + "/detproxy/incidents?limit=10000")).json()
    finally:
        proxy.stop()
    truth = {rid for rid, (p, got) in received.items() if got != refs[p]}
    audits = [i for i in incidents if i["kind"] == "audit"]
    reported = {
        i["request_id"]
        for i in audits
        if i["verdict"] in ("logprob_drift", "text_divergence", "answer_divergence")
    }
    assert status is not None
    verdicts = status["audit"]["verdicts"]
    n_audited = status["audit"]["audits"]
    unstable = sum(v for k, v in verdicts.items() if k not in ("identical", "incomparable"))
    comparable = sum(v for k, v in verdicts.items() if k != "incomparable")
    positions = sorted(
        i["divergence"]["index"]
        for i in audits
        if i["verdict"] == "text_divergence" and i["divergence"]
    )
    deltas = sorted(
        i["max_abs_logprob_delta"] for i in audits if i["max_abs_logprob_delta"] is not None
    )
    return {
        "scenario": name,
        "requests": len(received),
        "concurrency": concurrency,
        "traffic_s": round(traffic_s, 2),
        "audited": n_audited,
        "verdicts": verdicts,
        "reported_rate": unstable / comparable if comparable else None,
        "reported_ci": wilson(unstable, comparable),
        "truth_rate": len(truth) / len(received),
        "truth_ci": wilson(len(truth), len(received)),
        "truth_distinct_texts": {
            p: len({got[0] for rid, (q, got) in received.items() if q == p})
            for p in range(len(PROMPTS))
        },
        "agreement": {
            "both": len(truth & reported),
            "only_truth": len(truth - reported),
            "only_reported": len(reported - truth),
        },
        "divergence_positions": positions,
        "max_abs_logprob_delta": [round(d, 4) for d in deltas],
        "overlapped_shadows": sum(1 for i in audits if i.get("shadow_overlapped")),
        "dropped": status["audit"]["shadows_dropped"],
    }


def probe(engine: str, workdir: Path) -> dict[str, Any]:
    prompts = workdir / "probe-prompts.txt"
    prompts.write_text("\n".join(p.replace("\n", " ") for p in PROMPTS[:4]) + "\n")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "proxy",
            "probe",
            "--upstream",
            engine,
            "--model",
            "smollm2",
            "--prompts",
            str(prompts),
            "--runs",
            "10",
            "--concurrency",
            "1,2,4,8",
            "--json",
            "--extra-body",
            '{"cache_prompt": false}',
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=os.environ.copy(),
    )
    report = orjson.loads(done.stdout) if done.stdout.strip() else {"error": done.stderr[-500:]}
    report["exit_code"] = done.returncode
    return report


def markdown(results: dict[str, Any]) -> str:
    lines = [
        "| scenario | requests | conc | audited | detproxy rate (95% CI) | ground truth rate "
        "(95% CI) | agree | only truth | only detproxy | verdicts |",
        "|" + "---|" * 10,
    ]
    for s in results["scenarios"]:
        rr = (
            "n/a"
            if s["reported_rate"] is None
            else (f"{s['reported_rate']:.1%} ({s['reported_ci'][0]:.1%}-{s['reported_ci'][1]:.1%})")
        )
        a = s["agreement"]
        lines.append(
            f"| {s['scenario']} | {s['requests']} | {s['concurrency']} | {s['audited']} "
            f"| {rr} | {s['truth_rate']:.1%} ({s['truth_ci'][0]:.1%}-"
            f"{s['truth_ci'][1]:.1%}) | {a['both']} | {a['only_truth']} | "
            f"{a['only_reported']} | {s['verdicts']} |"
        )
    lines.append("")
    for s in results["scenarios"]:
        pos = s["divergence_positions"]
        lines.append(
            f"- {s['scenario']}: divergence positions {pos[:20]}"
            f"{' ...' if len(pos) > 20 else ''}; max |delta| (nats) "
            f"{s['max_abs_logprob_delta'][-5:]}; distinct texts per prompt "
            f"{s['truth_distinct_texts']}; overlapped shadows {s['overlapped_shadows']}"
        )
    pr = results.get("probe", {})
    lines.append("")
    lines.append(f"probe (exit {pr.get('exit_code')}):")
    for r in pr.get("results", []):
        lines.append(
            f"- conc {r['concurrency']}: distinct {r['distinct_vectors']}, flip "
            f"{r['first_token_flips']}, max |delta| {r['max_abs_delta']:.3g}: "
            f"{r['prompt'][:40]}"
        )
    return "\n".join(lines) + "\n"


def start_engine(args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], Any, int]:
    port = free_port()
    log = open(args.out / "llama-server.log", "wb")  # noqa: SIM115
    server = subprocess.Popen(
        [
            args.server,
            "-m",
            args.model,
            "-ngl",
            "99",
            "-np",
            str(args.slots),
            "-c",
            "32768",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "-a",
            "smollm2",
            "--metrics",
        ],
        stdout=log,
        stderr=log,
    )
    return server, log, port


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--server", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="2 short prompts, 32 tokens: a smoke run")
    args = ap.parse_args()
    if args.quick:
        global MAX_TOKENS
        MAX_TOKENS = 32
        del PROMPTS[2:]
    args.out.mkdir(parents=True, exist_ok=True)
    server, log, port = start_engine(args)
    engine = f"http://127.0.0.1:{port}"
    rng = random.Random(7)
    results: dict[str, Any] = {"slots": args.slots, "runs": args.runs, "prompts": len(PROMPTS)}
    try:
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(
            timeout=timeout, connector=aiohttp.TCPConnector(limit=64)
        ) as http:
            for _ in range(600):
                try:
                    async with http.get(engine + "/health") as resp:
                        if resp.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.1)
            props = await (await http.get(engine + "/props")).json()
            results["engine"] = {
                "build": props.get("build_info"),
                "slots": props.get("total_slots"),
            }
            refs = await reference(http, engine)
            work = args.out
            plans = [
                ("100% quiet cold, 8 in flight", config(), 8, True),
                ("30% random, quiet cold, 8 in flight", config(0.3, sample_by="random"), 8, True),
                ("control: 1 at a time, cold", config(), 1, True),
                ("100% immediate, 8 in flight", config(schedule="immediate"), 8, True),
                ("100% quiet, warm shadows, 8 in flight", config(cold=False), 8, True),
            ]
            results["scenarios"] = []
            for name, cfg, conc, cold in plans:
                t0 = time.monotonic()
                res = await scenario(
                    name, http, engine, refs, work, cfg, args.runs, conc, cold, rng
                )
                res["wall_s"] = round(time.monotonic() - t0, 1)
                results["scenarios"].append(res)
                print(
                    f"{name}: {res['verdicts']} truth {res['truth_rate']:.2f} "
                    f"agree {res['agreement']} in {res['wall_s']} s",
                    flush=True,
                )
        results["probe"] = probe(engine, work)
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
    (args.out / "results.json").write_bytes(
        orjson.dumps(results, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS)
    )
    (args.out / "results.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    asyncio.run(main())
