"""``python -m proxy.tools.emulator``: run the vLLM emulator until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
from typing import Any, get_args

from aiohttp import web
from pydantic import ValidationError

from .app import build_emulator_app
from .config import EmulatorConfig, FaultKind, LoopChannel, ReasoningStyle


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="detproxy emulator",
        description="Emulate vLLM's OpenAI-compatible server with injectable nondeterminism.",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--model", action="append", dest="models", metavar="NAME")
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--max-logprobs", type=int)
    p.add_argument("--version", dest="version")
    p.add_argument("--default-temperature", type=float)
    p.add_argument("--api-key")
    p.add_argument("--enable-request-id-headers", action="store_true", default=None)
    p.add_argument("--reasoning-style", choices=get_args(ReasoningStyle))
    p.add_argument("--reasoning-tokens", type=int)
    p.add_argument("--token-latency", type=float, dest="token_latency_s")
    p.add_argument("--headers-delay", type=float, dest="headers_delay_s")
    p.add_argument("--end-delay", type=float, dest="end_delay_s")
    p.add_argument("--tokens-per-chunk", "--stream-interval", type=int, dest="tokens_per_chunk")
    p.add_argument("--speculative", action="store_true", default=None)
    p.add_argument("--speculative-tokens", type=int)
    p.add_argument("--speculative-acceptance", type=float)
    p.add_argument("--flip-probability", type=float)
    p.add_argument("--flip-position", type=int)
    p.add_argument("--logprob-jitter", type=float, dest="logprob_jitter_probability")
    p.add_argument("--batch-divergence-slope", type=float)
    p.add_argument("--loop-channel", choices=get_args(LoopChannel))
    p.add_argument("--loop-after-tokens", type=int)
    p.add_argument("--loop-unit")
    p.add_argument("--loop-escape-probability", type=float)
    p.add_argument("--engine-repetition-detection", action="store_true", default=None)
    p.add_argument("--nan-logprobs", action="store_true", default=None)
    p.add_argument("--fault", choices=get_args(FaultKind))
    p.add_argument("--fault-after-tokens", type=int)
    p.add_argument("--fault-probability", type=float)
    p.add_argument("--seed", type=int)
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
    print(f"vLLM emulator {config.version} serving {', '.join(config.models)}")
    web.run_app(app, host=args.host, port=args.port, handler_cancellation=True, access_log=None)
    return 0
