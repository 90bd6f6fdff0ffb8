"""``detproxy demo``: the first thing to run. It starts the vLLM emulator with injected
nondeterminism and repetition loops, detproxy in front of it (every greedy request audited,
loops retried), sends a short burst of traffic, prints what was detected and recovered and
where to look, and stops everything it started."""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from proxy.app import build_app
from proxy.config import load_settings
from proxy.serving import serving
from proxy.tools.emulator import EmulatorConfig, EmulatorServer

MODEL = "emulator-model"
PROMPTS = [
    "Extract the invoice date and total from: 'Invoice 2291, 3 March 2024, total 1,240.50 EUR'",
    "Summarise the plot of Hamlet in two sentences.",
    "What is 17 times 23? Answer with the number only.",
    "List three uses of a paperclip.",
    "Translate 'good morning' into French, German and Spanish.",
    "Write a haiku about autumn rain.",
]
LOOP_KNOBS = [
    {"loop_channel": "content", "loop_after_tokens": 6},
    {"loop_channel": "reasoning", "loop_after_tokens": 4, "reasoning_tokens": 8},
]


# What became of one client request, in the order the summary gives them.
OUTCOMES = ("answered as is", "recovered from a loop", "left looping", "failed")


@dataclass(frozen=True, slots=True)
class Sent:
    """One client request of the demo and what its client got."""

    request_id: str
    status: int
    stream: bool
    recovered_header: str | None  # X-Detproxy-Recovered (non-streamed answers carry it)


def outcome_of(sent: Sent, model_did: Counter[str]) -> str:
    """One of OUTCOMES. ``model_did``: what the emulator did on this request's attempts (its
    retries carry the same request id), counted by kind (``loop``, ``loop_escape``)."""
    if sent.status != 200:
        return "failed"
    if sent.recovered_header is not None:  # detproxy's own word on a non-streamed answer
        return "recovered from a loop" if sent.recovered_header == "true" else "left looping"
    if not model_did["loop"]:
        return "answered as is"
    return "recovered from a loop" if model_did["loop_escape"] else "left looping"


async def _traffic(http: aiohttp.ClientSession, proxy: str, requests: int) -> list[Sent]:
    sent: list[Sent] = []
    sem = asyncio.Semaphore(4)

    async def one(i: int) -> None:
        body: dict[str, Any] = {
            "model": MODEL,
            "temperature": 0,
            "max_tokens": 160,
            "stream": i % 2 == 1,
            "messages": [{"role": "user", "content": PROMPTS[i % 6]}],
        }
        headers = {"X-Request-Id": f"demo-{i:03d}"}
        if i % 5 == 4:  # a prompt that makes this model loop
            knobs = LOOP_KNOBS[(i // 5) % 2]
            headers["X-Emulator-Knobs"] = orjson.dumps(knobs).decode()
            body["stream_options"] = {"include_usage": True} if body["stream"] else None
            body = {k: v for k, v in body.items() if v is not None}
        async with (
            sem,
            http.post(proxy + "/v1/chat/completions", json=body, headers=headers) as resp,
        ):
            await resp.read()
            said = resp.headers.get("X-Detproxy-Recovered")
            sent.append(Sent(headers["X-Request-Id"], resp.status, bool(body["stream"]), said))

    await asyncio.gather(*(one(i) for i in range(requests)))
    return sorted(sent, key=lambda s: s.request_id)


async def _settle(http: aiohttp.ClientSession, proxy: str, deadline_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + deadline_s
    while True:
        status: dict[str, Any] = await (await http.get(proxy + "/detproxy/status")).json()
        shadow = status["shadow"]
        idle = shadow is None or (shadow["queued"] == 0 and shadow["running"] == 0)
        if idle or time.monotonic() > deadline:
            return status
        await asyncio.sleep(0.05)


def policy_actions(metrics: str) -> Counter[tuple[str, str]]:
    """``detproxy_policy_actions_total`` by (action, outcome), from the Prometheus text."""
    out: Counter[tuple[str, str]] = Counter()
    for family in text_string_to_metric_families(metrics):
        for sample in family.samples:
            if sample.name == "detproxy_policy_actions_total" and sample.value:
                out[(sample.labels["action"], sample.labels["outcome"])] += int(sample.value)
    return out


def _is_number(cell: object) -> bool:
    """A cell to right-align: a number, a percentage, or ``-`` for none."""
    if isinstance(cell, int | float) or cell == "-":
        return True
    try:
        float(str(cell).removesuffix("%"))
    except ValueError:
        return False
    return True


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain text table, numbers right-aligned, indented by two spaces."""
    cells = [[str(c) for c in headers], *([str(c) for c in row] for row in rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    numeric = [all(_is_number(row[i]) for row in rows) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        return (
            "  "
            + "  ".join(
                c.rjust(w) if num else c.ljust(w)
                for c, w, num in zip(row, widths, numeric, strict=True)
            ).rstrip()
        )

    rule = "  " + "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule, *map(line, cells[1:])]) + "\n"


def share(n: int, of: int) -> str:
    """``n`` of ``of`` as a whole percentage (``-`` when there is nothing to share)."""
    return f"{100 * n / of:.0f}%" if of else "-"


def joined(parts: Sequence[tuple[int, str]]) -> str:
    """``36 answered as is, 4 recovered`` (the zero counts left out; ``none`` when all are)."""
    kept = [f"{n} {what}" for n, what in parts if n]
    return ", ".join(kept) if kept else "none"


def nats(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


async def run(requests: int, workdir: Path, out: Any) -> int:
    incidents = workdir / "incidents.jsonl"
    emulator = EmulatorServer(
        EmulatorConfig(
            flip_probability=0.1,
            flip_position=3,
            logprob_jitter_probability=0.1,
            seed=7,
            token_latency_s=0.002,
        )
    )
    upstream = await emulator.start()
    settings = load_settings(
        env={
            "DETPROXY_AUDIT__SAMPLE_RATE": "1",
            "DETPROXY_AUDIT__MAX_SHADOWS_PER_S": "1000",
            "DETPROXY_LOOPS__POLICY": "retry",
            "DETPROXY_LOOPS__STREAM_MODE": "hold_reasoning",
            "DETPROXY_INCIDENTS__PATH": str(incidents),
        },
        flags={"upstream": upstream},
    )
    app = build_app(settings, registry=CollectorRegistry())
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    proxy = f"http://127.0.0.1:{listener.getsockname()[1]}"
    t0 = time.monotonic()
    try:
        # Served as ``detproxy serve`` serves it: the lean front, /detproxy/* on it too.
        async with serving(app, settings.server, listener), aiohttp.ClientSession() as http:
            out.write(
                f"The vLLM emulator (it flips tokens and loops on purpose) is on {upstream},\n"
                f"detproxy in front of it on {proxy}: every greedy request audited, loops"
                " retried.\n"
                f"Sending {requests} greedy chat requests (every other one streamed), 4 at a"
                " time...\n"
            )
            sent = await _traffic(http, proxy, requests)
            status = await _settle(http, proxy, 30)
            metrics = await (await http.get(proxy + "/detproxy/metrics")).text()
            recent = await (await http.get(proxy + "/detproxy/incidents?limit=1000")).json()
    finally:
        listener.close()
        await emulator.stop()
    injected = Counter(r["kind"] for r in emulator.injections())
    # What the model did on the client requests and their retries (not the shadows): each
    # looping attempt, and each retry whose penalty or temperature ended the loop.
    by_request: dict[str, Counter[str]] = {}
    for r in emulator.injections():
        if not r["request_id"].endswith("-shadow"):
            by_request.setdefault(r["request_id"], Counter())[r["kind"]] += 1
    primary = sum(by_request.values(), Counter[str]())
    outcomes = Counter(outcome_of(s, by_request.get(s.request_id, Counter())) for s in sent)
    write_summary(out, requests, time.monotonic() - t0, outcomes, injected, primary)
    write_audits(out, status["audit"], recent)
    write_loops(out, recent, primary, policy_actions(metrics))
    out.write(
        f"\nIncident log: {incidents}\n"
        f"  detproxy report {incidents}    (rates, agreement and the worst items)\n"
        "In production: /detproxy/metrics (Prometheus), /detproxy/incidents, /detproxy/status"
        "\nand /detproxy/ui. Everything the demo started has stopped.\n"
    )
    return 0


INJECTED = (
    ("flip", "a token flipped (text divergence)"),
    ("logprob_jitter", "logprobs jittered (logprob drift)"),
    ("loop", "a repetition loop started"),
    ("loop_escape", "a retry escaped the loop"),
)


def write_summary(
    out: Any,
    requests: int,
    seconds: float,
    outcomes: Counter[str],
    injected: Counter[str],
    primary: Counter[str],
) -> None:
    parts = [(outcomes[name], name) for name in OUTCOMES]
    parts += [(n, name) for name, n in sorted(outcomes.items()) if name not in OUTCOMES]
    out.write(f"\n{requests} requests in {seconds:.1f} s: {joined(parts)}.\n")
    rows = [
        (what, injected[kind], primary[kind], injected[kind] - primary[kind])
        for kind, what in INJECTED
    ]
    out.write(
        "\nWhat the emulator injected, on purpose (an audit compares two answers, so one flip"
        "\ncan show in more than one audit):\n"
    )
    out.write(table(("injected", "total", "client requests and retries", "shadows"), rows))


def write_audits(out: Any, audit: dict[str, Any], recent: list[dict[str, Any]]) -> None:
    verdicts: dict[str, int] = audit["verdicts"]
    total = int(audit["audits"])
    comparable = total - verdicts.get("incomparable", 0)
    modes = audit["modes"]
    how = joined(
        [
            (modes.get("full", 0), "shadow replays of a request"),
            (modes.get("prefill", 0), "first-token replays"),
            (modes.get("duplicate", 0), "identical requests seen twice"),
            (modes.get("n_choices", 0), "requests with n > 1 choices"),
        ]
    )
    out.write(f"\nAudits: {total} ({how}).\n")
    rows: list[tuple[str, int, str]] = [
        (verdict, verdicts.get(verdict, 0), share(verdicts.get(verdict, 0), comparable))
        for verdict in ("identical", "logprob_drift", "text_divergence", "answer_divergence")
    ]
    rows.append(("incomparable", verdicts.get("incomparable", 0), "-"))
    out.write(table(("verdict", "audits", f"share of {comparable} comparable"), rows))
    unstable = comparable - verdicts.get("identical", 0)
    diverged = verdicts.get("text_divergence", 0) + verdicts.get("answer_divergence", 0)
    out.write(
        f"Not bitwise identical: {unstable} of {comparable} ({share(unstable, comparable)}).\n"
        f"  {verdicts.get('logprob_drift', 0)} with the same text but other logprobs (logprob"
        " drift: a real engine under load\n  does that to most answers; no alert pages on it).\n"
        f"  {diverged} with different text: a client could have got another answer (this"
        " pages).\n"
    )
    divergences = sorted(
        (i for i in recent if i["kind"] == "audit" and i["divergence"]),
        key=lambda i: i["request_id"],
    )
    if divergences:
        shown = divergences[:4]
        out.write(
            f"\nWhere they diverged (the first {len(shown)} of {len(divergences)} incidents with a"
            " position):\n"
        )
        rows2 = [
            (
                i["request_id"],
                i["verdict"],
                i["divergence"]["index"],
                json.dumps(i["divergence"]["primary_token"], ensure_ascii=False),
                json.dumps(i["divergence"]["shadow_token"], ensure_ascii=False),
                nats(i["max_abs_logprob_delta"]),
            )
            for i in shown
        ]
        out.write(
            table(
                ("request", "verdict", "at token", "primary", "shadow", "max |delta| nats"), rows2
            )
        )


def write_loops(
    out: Any,
    recent: list[dict[str, Any]],
    primary: Counter[str],
    actions: Counter[tuple[str, str]],
) -> None:
    loops = [i for i in recent if i["kind"] == "loop"]
    where = Counter(i["channel"] for i in loops)
    first = sum(1 for i in loops if i.get("attempt", 1) <= 1)
    channels = joined([(where["reasoning"], "in reasoning"), (where["content"], "in content")])
    out.write(
        f"\nLoops: the model looped on {primary['loop']} attempts; detproxy detected"
        f" {len(loops)} ({channels}):\n  {first} on client requests and"
        f" {len(loops) - first} on their retries.\n"
    )
    retries = {o: n for (a, o), n in actions.items() if a == "retry"}
    if retries:
        parts = sorted(retries.items(), key=lambda o: (o[0] != "recovered", o))
        text = " + ".join(f"{n} {o.replace('_', ' ')}" for o, n in parts)
        out.write(f"Retries: {sum(retries.values())} = {text}.\n")
    aborts = {o: n for (a, o), n in actions.items() if a == "abort"}
    if aborts:
        text = ", ".join(f"{n} {o.replace('_', ' ')}" for o, n in sorted(aborts.items()))
        out.write(f"Aborted: {sum(aborts.values())} ({text}).\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="detproxy demo",
        description=(
            "The first thing to run: starts the vLLM emulator with injected nondeterminism and"
            " repetition loops, detproxy in front of it (every greedy request audited, loops"
            " retried), sends a short burst of traffic, prints what was detected and recovered"
            " and where to look, and stops everything it started."
        ),
    )
    parser.add_argument(
        "--requests", type=int, default=40, help="client requests to send (default 40)"
    )
    parser.add_argument(
        "--dir",
        type=Path,
        help="where to keep the incident log (default: a new temporary directory)",
    )
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    workdir = args.dir or Path(tempfile.mkdtemp(prefix="detproxy-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    return asyncio.run(run(max(1, args.requests), workdir, sys.stdout))
