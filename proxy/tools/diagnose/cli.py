"""``detproxy diagnose``: why is this serving recipe nondeterministic, one switch at a time.

Per prompt, greedy with logprobs: a prefill probe at batch 1; serial cold replays (intrinsic);
the same beside filler requests at each --concurrency level (batch); cold against warm
(prefix_cache); against --reference (speculative, or another recipe difference); the
upstream's identity before and after (recipe_change). Cold means a fresh cache_salt per request
on vLLM, cache_prompt: false on llama.cpp's server. Progress goes to stderr.
Exit 0 when no cause is found, 1 when any is (each printed with its numbers and what to do),
2 on a usage or connection error.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import orjson

from proxy.config import api_root
from proxy.engine.fingerprint import FingerprintPoller
from proxy.events import EventBus
from proxy.http.upstream import Upstream as Client
from proxy.redact import mask_url
from proxy.tools.diagnose import render
from proxy.tools.diagnose.experiments import DiagnoseError, Experiments, Settings, Upstream
from proxy.tools.diagnose.verdicts import decide
from proxy.tools.probe import API_KEY_ENV
from proxy.tools.sweep.recipe import RecipeReader, describe_recipe

_STORY = (
    "The harbour town woke slowly. Fishing boats came in with the tide, gulls argued over the"
    " nets, and the baker opened his shutters to the smell of bread. At the end of the pier"
    " the old lighthouse keeper counted the boats as he did every morning, writing each name in"
    " a book that had been kept by his mother and her father before her. "
)
# Short prompts, and one long one: a prefix cache keeps only whole blocks (16 tokens on vLLM),
# and long prefills are where cached and cold attention part.
DEFAULT_PROMPTS = (
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about autumn rain.",
    "List the first ten prime numbers, separated by commas.",
    _STORY * 6 + "\nSummarise this text in two sentences.",
)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="detproxy diagnose",
        description=(__doc__ or "").replace("``", ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--upstream", required=True, metavar="URL", help="the engine's base URL")
    parser.add_argument("--model", required=True, metavar="M", help="model name sent")
    parser.add_argument(
        "--reference",
        metavar="URL",
        help="the same recipe without speculation (or the recipe to compare with)",
    )
    parser.add_argument(
        "--prompts",
        type=Path,
        metavar="FILE",
        help='one prompt per line, or JSONL (a string or {"prompt": ...} per line);'
        " default: 3 short prompts and a long one",
    )
    parser.add_argument("--runs", type=int, default=5, metavar="N", help="replays per group (5)")
    parser.add_argument(
        "--max-tokens", type=int, default=32, metavar="N", help="tokens per replay (32)"
    )
    parser.add_argument(
        "--top-logprobs",
        type=int,
        default=20,
        metavar="K",
        help="top-k logprobs asked (20; fewer, then none, where the engine refuses)",
    )
    parser.add_argument(
        "--concurrency",
        default="1,4,8",
        metavar="LIST",
        help="levels; at level L, L - 1 filler requests run beside the probed one (1,4,8)",
    )
    parser.add_argument(
        "--endpoint", choices=["chat", "completions"], default="chat", help="chat (default)"
    )
    parser.add_argument(
        "--api-key",
        metavar="KEY",
        help=f"bearer token (default: ${API_KEY_ENV[0]}, else ${API_KEY_ENV[1]})",
    )
    parser.add_argument(
        "--extra-body", default="{}", metavar="JSON", help="JSON merged into every request"
    )
    parser.add_argument(
        "--timeout", type=float, default=120.0, metavar="S", help="seconds per request (120)"
    )
    parser.add_argument(
        "--load-settle",
        type=float,
        default=0.3,
        metavar="S",
        help="seconds fillers run before a level is measured (0.3)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    if args.api_key is None:
        args.api_key = next((os.environ[n] for n in API_KEY_ENV if os.environ.get(n)), None)
    try:  # what serve and probe say of the same URL (.../v1 included)
        args.upstream = api_root(args.upstream)
    except ValueError as exc:
        parser.error(f"--upstream: {exc}")  # the URL not repeated: it may hold a password
    try:
        args.levels = tuple(sorted({int(x) for x in args.concurrency.split(",") if x.strip()}))
        args.extra_body = orjson.loads(args.extra_body)
    except (ValueError, orjson.JSONDecodeError) as exc:
        parser.error(f"bad --concurrency or --extra-body: {exc}")
    if not args.levels or min(args.levels) < 1 or max(args.levels) > 256:
        parser.error("--concurrency levels must be between 1 and 256")
    if args.runs < 2 or args.max_tokens < 1 or args.top_logprobs < 0:
        parser.error("--runs must be >= 2, --max-tokens >= 1, --top-logprobs >= 0")
    if not isinstance(args.extra_body, dict):
        parser.error("--extra-body must be a JSON object")
    return args


def _prompt_of(line: str, where: str) -> str:
    if not line.lstrip().startswith(("{", '"')):
        return line
    try:
        value = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise DiagnoseError(f"{where}: not JSON: {exc}") from exc
    if isinstance(value, dict):
        value = value.get("prompt")
    if not isinstance(value, str) or not value:
        raise DiagnoseError(f'{where}: a JSON line must be a string or {{"prompt": "..."}}')
    return value


def load_prompts(path: Path | None) -> list[str]:
    if path is None:
        return list(DEFAULT_PROMPTS)
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise DiagnoseError(f"cannot read {path}: {exc.strerror}") from exc
    prompts = [_prompt_of(line, f"{path}:{n}") for n, line in enumerate(lines, 1) if line.strip()]
    if not prompts:
        raise DiagnoseError(f"{path} holds no prompt")
    return prompts


async def run(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    prompts = load_prompts(args.prompts)
    settings = Settings(
        model=args.model,
        runs=args.runs,
        max_tokens=args.max_tokens,
        top_logprobs=args.top_logprobs,
        levels=args.levels,
        endpoint=args.endpoint,
        load_settle=args.load_settle,
        extra_body=args.extra_body,
    )

    def say(line: str) -> None:
        if not args.quiet:
            err.write(f"diagnose: {line}\n")
            err.flush()

    def upstream(url: str) -> Upstream:
        limit = max(args.levels) + 2
        return Upstream(url, settings, args.api_key, timeout_s=args.timeout, max_connections=limit)

    primary = upstream(args.upstream)
    reference = upstream(args.reference) if args.reference else None
    again = upstream(args.upstream)  # identified afresh after the experiments
    try:
        engine = await primary.identify()
        recipe = await read_recipe(primary.client, args.upstream, args.api_key)
        say(f"what loaded: {describe_recipe(recipe)}")
        await primary.negotiate(prompts[0])
        if reference is not None:
            await reference.identify()
            await reference.negotiate(prompts[0])
            reference.top_k = primary.top_k = min(primary.top_k, reference.top_k)
        groups = 2 + sum(1 for lv in args.levels if lv > 1) + (1 if engine.can_run_cold else 0)
        groups += 1 if reference is not None else 0
        say(
            f"{engine.kind} {engine.version or ''} at {primary.base}; cold by {engine.how_cold};"
            f" {len(prompts)} prompt(s) x {groups} group(s) x {args.runs} runs"
            f" (about {len(prompts) * (groups * args.runs + 1)} requests)"
        )
        experiments = Experiments(primary, reference, settings, say)
        evidence = await experiments.run_all(prompts)
        after = await again.identify()
    finally:
        for each in (primary, reference, again):
            if each is not None:
                await each.close()
    diagnosis = decide(
        evidence, engine, args.levels, identity_after=after, reference_given=reference is not None
    )
    shown: dict[str, Any] = {
        "runs": args.runs,
        "max_tokens": args.max_tokens,
        "top_logprobs": primary.top_k,
        "concurrency": list(args.levels),
        "reference": mask_url(args.reference) if args.reference else None,  # CI logs keep it
    }
    if args.json:
        out.write(render.as_json(diagnosis, engine, shown, recipe) + "\n")
    else:
        out.write(render.text(diagnosis, engine, shown, recipe) + "\n")
    return 0 if diagnosis.stable else 1


async def read_recipe(
    client: Client, url: str, api_key: str | None = None
) -> dict[str, Any] | None:
    """What the engine at ``url`` says it loaded, read from its endpoints as the fingerprint
    reads them (a verdict says what it measured); None where they say nothing."""
    recipes = RecipeReader(None)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    poller = FingerprintPoller(
        client, url, EventBus(), interval_s=0.0, truth=recipes.truth, headers=headers
    )
    await poller.poll()
    return recipes.snapshot()


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as exc:  # argparse: usage errors exit 2 already
        return int(exc.code or 0)
    try:
        return asyncio.run(run(args, sys.stdout, sys.stderr))
    except DiagnoseError as exc:
        print(f"detproxy diagnose: {exc}", file=sys.stderr)
        return 2
