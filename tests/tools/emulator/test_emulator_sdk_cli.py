"""The official openai SDK parses the emulator's answers; the CLI builds the right config."""

from __future__ import annotations

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from proxy.tools.emulator import EmulatorConfig
from proxy.tools.emulator.cli import build_parser, config_from_args

from .conftest import MakeClient


async def test_openai_sdk_chat(make_client: MakeClient) -> None:
    client, _ = await make_client(reasoning_tokens=3)
    sdk = openai.AsyncOpenAI(base_url=client.base + "/v1", api_key="x", max_retries=0)
    try:
        messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]
        full = await sdk.chat.completions.create(
            model="emulator-model",
            messages=messages,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
        )
        assert full.choices[0].finish_reason == "stop"
        content = full.choices[0].message.content
        assert content
        assert full.choices[0].logprobs is not None
        stream = await sdk.chat.completions.create(
            model="emulator-model",
            messages=messages,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        parts: list[str] = []
        finish = None
        usage = None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                parts.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
        assert "".join(parts) == content
        assert finish == "stop"
        assert usage is not None and full.usage is not None
        assert usage.completion_tokens == full.usage.completion_tokens
        comp = await sdk.completions.create(model="emulator-model", prompt="hi", temperature=0)
        assert comp.choices[0].finish_reason == "length"
        with pytest.raises(openai.NotFoundError):
            await sdk.chat.completions.create(model="zzz", messages=messages)
    finally:
        await sdk.close()


def test_cli_config() -> None:
    args = build_parser().parse_args(
        [
            "--port", "9000", "--model", "a", "--model", "b", "--reasoning-style", "both",
            "--reasoning-tokens", "4", "--token-latency", "0.01", "--flip-probability", "0.5",
            "--flip-position", "2", "--logprob-jitter", "0.1", "--batch-divergence-slope",
            "0.25", "--loop-channel", "reasoning", "--loop-after-tokens", "7", "--fault",
            "malformed_sse", "--seed", "5", "--loop-escape-probability", "0.4",
            "--stream-interval", "2", "--speculative", "--speculative-tokens", "5",
            "--speculative-acceptance", "0.5",
        ]
    )  # fmt: skip
    cfg = config_from_args(args)
    assert args.port == 9000
    assert cfg == EmulatorConfig(
        models=("a", "b"),
        reasoning_style="both",
        reasoning_tokens=4,
        token_latency_s=0.01,
        flip_probability=0.5,
        flip_position=2,
        logprob_jitter_probability=0.1,
        batch_divergence_slope=0.25,
        loop_escape_probability=0.4,
        tokens_per_chunk=2,
        speculative=True,
        speculative_tokens=5,
        speculative_acceptance=0.5,
        loop_channel="reasoning",
        loop_after_tokens=7,
        fault="malformed_sse",
        seed=5,
    )
    assert config_from_args(build_parser().parse_args([])) == EmulatorConfig()


def test_config_is_frozen() -> None:
    cfg = EmulatorConfig()
    with pytest.raises(ValueError):
        cfg.seed = 3  # type: ignore[misc]
