"""``detproxy probe``: the two-minute instrument.

The same prompt N times at temperature 0, ``max_tokens=1``, ``top_logprobs=K``, one request
at a time: per prompt, how many distinct top-K vectors came back, whether the first token
flipped, and the largest |delta logprob|. ``--concurrency 1,2,4,8`` repeats the probe while
``level - 1`` background requests keep the engine busy, which separates batch effects (the
vector changes only under load) from intrinsic nondeterminism (it changes alone too).
Exit 0 when every prompt is bitwise stable at every level, 1 when any is not, 2 on a usage
or connection error.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

import orjson

from proxy.audit.outcome import outcome_from_response
from proxy.config import api_root
from proxy.http.errors import UpstreamError
from proxy.http.h1 import H1Upstream
from proxy.http.upstream import Got, Upstream, url_auth, whole
from proxy.redact import mask_url
from proxy.tasks import TaskOwner

Vector = tuple[str, tuple[tuple[str, float | None], ...]]  # None: an unknown (NaN) logprob
# Short background requests: frequent prefills, so the probe's own prefill often shares a
# batch with another one (decode-only company leaves some engines' first token unchanged).
BACKGROUND_TOKENS = 16
# Where --api-key comes from when it is not given, first found first.
API_KEY_ENV = ("DETPROXY_API_KEY", "OPENAI_API_KEY")


class ProbeError(Exception):
    """A usage or connection problem: exit code 2."""


@dataclass(frozen=True, slots=True)
class PromptResult:
    prompt: str
    concurrency: int
    runs: int
    distinct_vectors: int
    first_token_flips: bool
    first_tokens: dict[str, int]
    max_abs_delta: float  # nats, over tokens present in both vectors

    @property
    def stable(self) -> bool:
        return self.distinct_vectors == 1


def max_delta(a: Vector, b: Vector) -> float:
    """Over the tokens both vectors list with known values."""
    la, lb = dict(a[1]), dict(b[1])
    deltas = [
        abs(x - y)
        for x, y in ((la[t], lb[t]) for t in la.keys() & lb.keys())
        if x is not None and y is not None
    ]
    return max(deltas, default=0.0)


def summarise(prompt: str, level: int, vectors: Sequence[Vector], runs: int) -> PromptResult:
    firsts: dict[str, int] = {}
    for token, _ in vectors:
        firsts[token] = firsts.get(token, 0) + 1
    worst = max((max_delta(vectors[0], v) for v in vectors[1:]), default=0.0)
    return PromptResult(prompt, level, runs, len(set(vectors)), len(firsts) > 1, firsts, worst)


class Prober:
    def __init__(self, client: Upstream, args: argparse.Namespace) -> None:
        """``client``: the engine at ``args.upstream``'s (every request goes through it)."""
        self._client = client
        self._args = args
        self._chat = args.endpoint == "chat"
        self._path = "/v1/chat/completions" if self._chat else "/v1/completions"
        self._url = args.upstream.rstrip("/") + self._path
        self._shown = mask_url(self._url)  # in messages: no password
        self._headers = url_auth(args.upstream) | {"Content-Type": "application/json"}
        if args.api_key:
            self._headers["Authorization"] = f"Bearer {args.api_key}"

    async def _post(self, body: dict[str, Any]) -> Got:
        return await whole(
            self._client, "POST", self._path, self._args.timeout, self._headers, orjson.dumps(body)
        )

    def _body(self, prompt: str, max_tokens: int, logprobs: bool) -> dict[str, Any]:
        args = self._args
        body: dict[str, Any] = {"model": args.model, "temperature": 0, "max_tokens": max_tokens}
        if self._chat:
            body["messages"] = [{"role": "user", "content": prompt}]
            if logprobs:
                body |= {"logprobs": True, "top_logprobs": args.top_logprobs}
        else:
            body["prompt"] = prompt
            if logprobs:
                body["logprobs"] = args.top_logprobs
        merged: dict[str, Any] = body | args.extra_body
        return merged

    async def vector(self, prompt: str) -> Vector:
        try:
            got = await self._post(self._body(prompt, 1, True))
        except UpstreamError as exc:
            raise ProbeError(f"cannot reach {self._shown}: {exc}") from exc
        payload = got.body
        if got.status in (401, 403):
            given = "the API key given was refused" if self._args.api_key else "no API key"
            raise ProbeError(
                f"{self._shown} answered {got.status} ({given}): pass the key the server"
                f" was started with (--api-key, or {' or '.join(API_KEY_ENV)})"
            )
        if got.status != 200:
            raise ProbeError(
                f"{self._shown} answered {got.status}: {payload[:300].decode(errors='replace')}"
            )
        outcome = outcome_from_response(
            "chat" if self._chat else "completions", orjson.loads(payload)
        )
        if outcome.error or not outcome.choices or not outcome.choices[0].tokens:
            raise ProbeError(f"no logprobs in the answer of {self._shown}: {outcome.error or ''}")
        first = outcome.choices[0].tokens[0]
        return first.token, tuple(first.top)

    async def background(self, prompt: str, stop: asyncio.Event) -> None:
        """Keep one request in flight until told to stop (bounded by the probe's duration)."""
        while not stop.is_set():
            with contextlib.suppress(UpstreamError):
                await self._post(self._body(prompt, BACKGROUND_TOKENS, False))

    async def level(
        self,
        prompts: Sequence[str],
        level: int,
        progress: TextIO | None,
        serial: dict[str, Vector],
    ) -> list[PromptResult]:
        """Probe every prompt at this level. Under load, the vector measured alone (``serial``)
        counts as one of the vectors: a change that load makes shows even when consistent."""
        stop = asyncio.Event()
        owner = TaskOwner("probe")
        fillers = [
            owner.spawn(
                self.background(f"Background request {i}: tell a story.", stop),
                name=f"load-{i}",
            )
            for i in range(level - 1)
        ]
        try:
            if fillers:  # let the background load build up before measuring under it
                await asyncio.sleep(self._args.load_settle)
            results = []
            for p, prompt in enumerate(prompts):
                vectors = []
                for run in range(self._args.runs):
                    if progress is not None:
                        progress.write(
                            f"\rconcurrency {level}: prompt {p + 1}/{len(prompts)}, "
                            f"run {run + 1}/{self._args.runs}   "
                        )
                        progress.flush()
                    vectors.append(await self.vector(prompt))
                if level == 1:
                    serial.setdefault(prompt, vectors[0])
                elif prompt in serial:
                    vectors.insert(0, serial[prompt])
                results.append(summarise(prompt, level, vectors, self._args.runs))
            return results
        finally:
            stop.set()
            for task in fillers:
                task.cancel()
            await asyncio.gather(*fillers, return_exceptions=True)


def render(results: Sequence[PromptResult], top_k: int) -> str:
    lines = [
        f"{'conc':>4} {'runs':>4} {f'distinct top-{top_k}':>14} {'flip':>5} "
        f"{'max |delta| nats':>17}  prompt"
    ]
    for r in results:
        prompt = r.prompt if len(r.prompt) <= 48 else r.prompt[:45] + "..."
        lines.append(
            f"{r.concurrency:>4} {r.runs:>4} {r.distinct_vectors:>14} "
            f"{'yes' if r.first_token_flips else 'no':>5} {r.max_abs_delta:>17.3g}  "
            f"{prompt}"
        )
    unstable = [r for r in results if not r.stable]
    if not unstable:
        lines.append("stable: every prompt gave one bitwise-identical vector at every level")
    else:
        levels = sorted({r.concurrency for r in unstable})
        alone = any(r.concurrency == 1 for r in unstable)
        kind = (
            "intrinsic (it varies even alone)"
            if alone
            else "batch effects (it varies only under concurrent load)"
        )
        lines.append(f"UNSTABLE at concurrency {','.join(map(str, levels))}: {kind}")
    return "\n".join(lines)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="detproxy probe",
        description=(__doc__ or "").replace("``", ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--upstream",
        required=True,
        metavar="URL",
        help="the engine's base URL, e.g. http://127.0.0.1:8000",
    )
    parser.add_argument(
        "--model", required=True, metavar="M", help="model name sent in each request"
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", metavar="TEXT", help="one prompt")
    source.add_argument(
        "--prompts", type=Path, metavar="FILE", help="a file with one prompt per line"
    )
    parser.add_argument(
        "--runs",
        type=int,
        default=10,
        metavar="N",
        help="requests per prompt and level (default 10)",
    )
    parser.add_argument(
        "--top-logprobs",
        type=int,
        default=20,
        metavar="K",
        help="logprobs compared per request (default 20; vLLM's --max-logprobs bounds it)",
    )
    parser.add_argument(
        "--concurrency",
        default="1",
        metavar="LIST",
        help="levels, e.g. 1,2,4,8,16: at level L, L - 1 background requests run (default 1)",
    )
    parser.add_argument(
        "--endpoint",
        choices=["chat", "completions"],
        default="chat",
        help="/v1/chat/completions (default) or /v1/completions",
    )
    parser.add_argument(
        "--api-key",
        metavar="KEY",
        help="sent as a bearer token, for a server started with --api-key (default:"
        f" ${API_KEY_ENV[0]}, else ${API_KEY_ENV[1]})",
    )
    parser.add_argument(
        "--extra-body",
        default="{}",
        metavar="JSON",
        help='JSON merged into every request, e.g. {"cache_prompt": false}',
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        metavar="S",
        help="seconds per request (default 120)",
    )
    parser.add_argument(
        "--load-settle",
        type=float,
        default=0.5,
        metavar="S",
        help="seconds the background load runs before a level is measured (default 0.5)",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    if args.api_key is None:
        args.api_key = next((os.environ[n] for n in API_KEY_ENV if os.environ.get(n)), None)
    try:  # what serve says of the same URL (an openai SDK base URL, .../v1, included)
        args.upstream = api_root(args.upstream)
    except ValueError as exc:
        parser.error(f"--upstream: {exc}")  # the URL not repeated: it may hold a password
    try:
        args.levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
        args.extra_body = orjson.loads(args.extra_body)
    except (ValueError, orjson.JSONDecodeError) as exc:
        parser.error(f"bad --concurrency or --extra-body: {exc}")
    if not args.levels or min(args.levels) < 1 or max(args.levels) > 256:
        parser.error("--concurrency levels must be between 1 and 256")
    if args.runs < 2 or args.top_logprobs < 1 or not isinstance(args.extra_body, dict):
        parser.error("--runs must be >= 2, --top-logprobs >= 1, --extra-body a JSON object")
    return args


def load_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompt is not None:
        return [args.prompt]
    try:
        lines = args.prompts.read_text().splitlines()
    except OSError as exc:
        raise ProbeError(f"cannot read {args.prompts}: {exc.strerror}") from exc
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise ProbeError(f"{args.prompts} holds no prompt")
    return prompts


async def run(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    prompts = load_prompts(args)
    progress = err if err.isatty() and not args.json else None
    results: list[PromptResult] = []
    client = H1Upstream(
        args.upstream, read_timeout_s=args.timeout, max_connections=max(args.levels) + 1
    )
    try:
        prober = Prober(client, args)
        serial: dict[str, Vector] = {}
        for level in sorted(set(args.levels)):
            results += await prober.level(prompts, level, progress, serial)
    finally:
        await client.close()
    if progress is not None:
        progress.write("\r" + " " * 60 + "\r")
    if args.json:
        out.write(
            orjson.dumps(
                {
                    "stable": all(r.stable for r in results),
                    "results": [asdict(r) | {"stable": r.stable} for r in results],
                },
                option=orjson.OPT_INDENT_2,
            ).decode()
            + "\n"
        )
    else:
        out.write(render(results, args.top_logprobs) + "\n")
    return 0 if all(r.stable for r in results) else 1


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as exc:  # argparse: usage errors exit 2 already
        return int(exc.code or 0)
    try:
        return asyncio.run(run(args, sys.stdout, sys.stderr))
    except ProbeError as exc:
        print(f"detproxy probe: {exc}", file=sys.stderr)
        return 2
