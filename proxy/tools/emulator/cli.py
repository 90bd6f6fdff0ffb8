"""``python -m proxy.tools.emulator``: run the vLLM emulator until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import socket
import sys
from typing import Any, get_args

from aiohttp import web
from pydantic import ValidationError

from .app import build_emulator_app
from .config import EmulatorConfig, FaultKind, LoopChannel, ReasoningStyle


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="detproxy emulator",
        description="Emulate vLLM's OpenAI-compatible server with injectable nondeterminism.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Causes of divergence, one flag each (injection record kind in brackets):\n"
        "  intrinsic     --flip-probability P [flip]: random per request, even alone in flight\n"
        "  batch         --batch-divergence-slope S [batch_drift, batch_divergence]: only with\n"
        "                other requests in flight\n"
        "  prefix_cache  --warm-cache-divergence P [prefix_cache]: warm differs from cold\n"
        "  speculative   --speculative --speculative-divergence P [speculative]: differs from\n"
        "                the same emulator without --speculative\n"
        "  recipe_change restart with another --vllm-version or --model\n"
        "Records: GET /emulator/injections.\n\n"
        "Any setting can be changed for one request with the X-Emulator-Knobs header, a"
        ' JSON object of setting names with underscores, e.g. {"flip_probability": 1}.',
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8001, help="port to listen on (default 8001)")
    p.add_argument(
        "--model",
        action="append",
        dest="models",
        metavar="NAME",
        help="a model name it serves; repeat for several (default emulator-model)",
    )
    p.add_argument(
        "--max-model-len", type=int, metavar="N", help="context length in tokens (default 4096)"
    )
    p.add_argument(
        "--max-logprobs",
        type=int,
        metavar="N",
        help="largest top_logprobs accepted, as vLLM's --max-logprobs (default 20; -1: no limit)",
    )
    p.add_argument(
        "--vllm-version",
        "--version",
        dest="version",
        metavar="VERSION",
        help="the vLLM version /version reports (default: 0.23.0, the API shape emulated)",
    )
    p.add_argument(
        "--default-temperature",
        type=float,
        metavar="T",
        help="temperature of a request that sets none (default 1.0, vLLM's)",
    )
    p.add_argument(
        "--api-key",
        metavar="KEY",
        help="as vLLM's --api-key: /v1/* requests without 'Authorization: Bearer KEY' get 401",
    )
    p.add_argument(
        "--enable-request-id-headers",
        action="store_true",
        default=None,
        help="answers carry X-Request-Id, as with vLLM's flag of that name",
    )
    p.add_argument(
        "--reasoning-style",
        choices=get_args(ReasoningStyle),
        help="the field reasoning is sent in (default reasoning)",
    )
    p.add_argument(
        "--reasoning-tokens",
        type=int,
        metavar="N",
        help="reasoning tokens before each chat answer (default 0: none)",
    )
    p.add_argument(
        "--template-drops-reasoning",
        action="store_true",
        default=None,
        help="a chat template like DeepSeek-R1's distills' and QwQ's: assistant messages render"
        " as what follows their </think> (their reasoning field dropped), the generation prompt"
        " opens <think> (a continued closed reasoning, or content continued after a reasoning,"
        " is recorded as closed_reasoning, with the reasoning its prompt kept); without it,"
        " an assistant message's reasoning renders before its content",
    )
    p.add_argument(
        "--token-latency",
        type=float,
        dest="token_latency_s",
        metavar="S",
        help="seconds per engine step, i.e. per streamed chunk (default 0)",
    )
    p.add_argument(
        "--headers-delay",
        type=float,
        dest="headers_delay_s",
        metavar="S",
        help="seconds before the response headers (default 0)",
    )
    p.add_argument(
        "--end-delay",
        type=float,
        dest="end_delay_s",
        metavar="S",
        help="seconds between a stream's data: [DONE] and the end of its body (default 0)",
    )
    p.add_argument(
        "--tokens-per-chunk",
        "--stream-interval",
        type=int,
        dest="tokens_per_chunk",
        metavar="N",
        help="tokens per streamed chunk, as vLLM's --stream-interval (default 1)",
    )
    p.add_argument(
        "--speculative",
        action="store_true",
        default=None,
        help="speculative decoding: each step drafts tokens and accepts some (vllm:spec_decode_*)",
    )
    p.add_argument(
        "--speculative-tokens", type=int, metavar="N", help="draft tokens per step (default 3)"
    )
    p.add_argument(
        "--speculative-acceptance",
        type=float,
        metavar="P",
        help="probability each draft token is accepted (default 0.7)",
    )
    p.add_argument(
        "--flip-probability",
        type=float,
        metavar="P",
        help="share of greedy answers whose token at --flip-position is the runner-up (default 0)",
    )
    p.add_argument(
        "--flip-position",
        type=int,
        metavar="N",
        help="token index of that flip (default 0: the first token)",
    )
    p.add_argument(
        "--logprob-jitter",
        type=float,
        dest="logprob_jitter_probability",
        metavar="P",
        help="share of greedy answers whose logprobs drift, the text unchanged (default 0)",
    )
    p.add_argument(
        "--batch-divergence-slope",
        type=float,
        metavar="S",
        help="batch effects: with N requests in flight a greedy answer diverges with"
        " probability S x (N - 1) (default 0)",
    )
    p.add_argument(
        "--no-enable-prefix-caching",
        action="store_false",
        dest="enable_prefix_caching",
        default=None,
        help="turn the prefix cache off, as vLLM's flag (on by default; then nothing is warm)",
    )
    p.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        default=None,
        help="report usage.prompt_tokens_details.cached_tokens, as vLLM's flag",
    )
    p.add_argument(
        "--warm-cache-divergence",
        type=float,
        metavar="P",
        help="cause prefix_cache: for a share P of prompts (by prompt hash) a warm request (prompt"
        " found in the prefix cache; cache_salt partitions it) answers greedy with the runner-up"
        " token at a position fixed by the prompt (default 0)",
    )
    p.add_argument(
        "--speculative-divergence",
        type=float,
        metavar="P",
        help="cause speculative (with --speculative): for a share P of prompts (by prompt hash)"
        " the greedy answer differs from the plain recipe's at a position fixed by the prompt,"
        " the same run after run (default 0)",
    )
    p.add_argument(
        "--loop-channel",
        choices=get_args(LoopChannel),
        help="where greedy answers fall into a repetition loop (default none)",
    )
    p.add_argument(
        "--loop-after-tokens",
        type=int,
        metavar="N",
        help="tokens before the loop starts (default 5)",
    )
    p.add_argument("--loop-unit", metavar="TEXT", help="the text repeated in a loop")
    p.add_argument(
        "--loop-escape-probability",
        type=float,
        metavar="P",
        help="probability a retry with a penalty or temperature > 0 escapes the loop (default 0.7)",
    )
    p.add_argument(
        "--engine-repetition-detection",
        action="store_true",
        default=None,
        help="honour vLLM's repetition_detection request parameter (ends a loop itself)",
    )
    p.add_argument(
        "--nan-logprobs",
        action="store_true",
        default=None,
        help="logprobs come out NaN (a broken checkpoint): whole answers asking for them get 400",
    )
    p.add_argument(
        "--fault",
        choices=get_args(FaultKind),
        metavar="KIND",
        help="a transport or protocol fault to inject: " + ", ".join(get_args(FaultKind)),
    )
    p.add_argument(
        "--fault-after-tokens",
        type=int,
        metavar="N",
        help="tokens streamed before a stream fault fires (default 3; 0: before the first)",
    )
    p.add_argument(
        "--fault-probability",
        type=float,
        metavar="P",
        help="share of requests the fault hits (default 1)",
    )
    p.add_argument(
        "--seed", type=int, help="seed of every random draw: the same seed, the same answers"
    )
    return p


def config_from_args(args: argparse.Namespace) -> EmulatorConfig:
    """EmulatorConfig from parsed flags (flags left out keep the config defaults)."""
    fields: dict[str, Any] = {
        k: v for k, v in vars(args).items() if k not in {"host", "port"} and v is not None
    }
    return EmulatorConfig.model_validate(fields)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValidationError as exc:
        parser.error(str(exc))
    app = build_emulator_app(config)
    try:
        sock = socket.create_server((args.host, args.port))
    except OSError as exc:
        print(
            f"detproxy emulator: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}"
            " (choose another --port or stop what holds it)",
            file=sys.stderr,
        )
        return 2
    print(f"vLLM emulator {config.version} serving {', '.join(config.models)}")
    web.run_app(app, sock=sock, handler_cancellation=True, access_log=None)
    return 0
