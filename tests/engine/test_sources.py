"""What the engines' endpoints say: vLLM /server_info and vllm:cache_config_info, SGLang
/server_info, llama.cpp /props; junk in gives nothing out, never an exception."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from proxy.engine.facts import EngineFacts
from proxy.engine.sources import (
    facts_from_cache_config_info,
    facts_from_llama_props,
    facts_from_sglang_server_info,
    facts_from_vllm_server_info,
)

FIXTURES = Path(__file__).parent / "fixtures"
JUNK: list[Any] = [None, 1, "x", b"\x00", [], {}, {"vllm_config": 3}, {"a": {"b": [1]}}]


@pytest.mark.parametrize("junk", JUNK)
def test_junk_gives_no_facts(junk: Any) -> None:
    assert facts_from_vllm_server_info(junk) == EngineFacts()
    assert facts_from_sglang_server_info(junk) == EngineFacts()
    assert facts_from_llama_props(junk) == EngineFacts()
    assert facts_from_cache_config_info(junk) == EngineFacts()


def test_cache_config_info_samples() -> None:
    on = facts_from_cache_config_info(
        (FIXTURES / "vllm-0.23.0-cache-config-info-prefix.txt").read_text()
    )
    off = facts_from_cache_config_info(
        (FIXTURES / "vllm-0.23.0-cache-config-info-noprefix.txt").read_text()
    )
    assert dict(on.values) == {"engine": "vllm", "prefix_caching": True, "kv_cache_dtype": "auto"}
    assert dict(off.values) == {"engine": "vllm", "prefix_caching": False, "kv_cache_dtype": "auto"}
    assert set(on.sources.values()) == {"cache_config_info"}
    assert facts_from_cache_config_info("# HELP x\nvllm:num_requests_running 0\n") == EngineFacts()


def test_vllm_server_info_json_config_and_env() -> None:
    info = {
        "vllm_config": {
            "model_config": {
                "model": "/models/smollm2-bf16",
                "dtype": "torch.bfloat16",
                "quantization": None,
                "enforce_eager": False,
            },
            "cache_config": {"cache_dtype": "auto", "enable_prefix_caching": False},
            "scheduler_config": {"enable_chunked_prefill": True},
            "compilation_config": {"mode": 3, "cudagraph_mode": "FULL_AND_PIECEWISE"},
            "kernel_config": {"moe_backend": "auto", "linear_backend": "cutlass"},
            "speculative_config": {
                "method": "eagle3",
                "model": "/models/draft",
                "num_speculative_tokens": 3,
            },
            "attention_config": {"backend": None},
        },
        "vllm_env": {"VLLM_BATCH_INVARIANT": "1", "VLLM_LOGGING_LEVEL": "INFO"},
        "declared_env": ["VLLM_BATCH_INVARIANT", "VLLM_ATTENTION_BACKEND"],
    }
    facts = facts_from_vllm_server_info(info)
    assert dict(facts.values) == {
        "engine": "vllm",
        "model": "/models/smollm2-bf16",
        "dtype": "bfloat16",
        "quantization": "none",
        "enforce_eager": False,
        "kv_cache_dtype": "auto",
        "prefix_caching": False,
        "chunked_prefill": True,
        "compilation_mode": "VLLM_COMPILE",
        "cudagraph_mode": "FULL_AND_PIECEWISE",
        "cudagraphs": True,
        "linear_backend": "cutlass",
        "speculative": "eagle3",
        "speculative_draft": "/models/draft",
        "num_speculative_tokens": 3,
        "batch_invariant": True,
    }
    assert facts.unknown_env == ("VLLM_ATTENTION_BACKEND",)
    assert set(facts.sources.values()) == {"server_info"}


def test_vllm_server_info_text_config_reads_like_the_log_line() -> None:
    line = next(
        x
        for x in (FIXTURES / "vllm-0.23.0-eager-triton-noprefix.log").read_text().splitlines()
        if "Initializing a V1" in x
    )
    text = line.split("with config: ", 1)[1]
    facts = facts_from_vllm_server_info({"vllm_config": text})
    assert facts.values["enforce_eager"] is True
    assert facts.values["prefix_caching"] is False
    assert facts.values["cudagraphs"] is False
    assert facts.values["dtype"] == "bfloat16"
    assert "version" not in facts.values


def test_sglang_server_info() -> None:
    facts = facts_from_sglang_server_info(
        {
            "model_path": "/models/qwen3",
            "dtype": "auto",
            "quantization": None,
            "attention_backend": "fa3",
            "moe_runner_backend": "auto",
            "speculative_algorithm": None,
            "speculative_draft_model_path": None,
            "enable_deterministic_inference": True,
            "disable_cuda_graph": False,
            "disable_radix_cache": True,
            "chunked_prefill_size": -1,
            "version": "0.5.6",
        }
    )
    assert dict(facts.values) == {
        "engine": "sglang",
        "version": "0.5.6",
        "model": "/models/qwen3",
        "dtype": "auto",
        "quantization": "none",
        "attention_backend": "fa3",
        "moe_backend": "auto",
        "batch_invariant": True,
        "cudagraphs": True,
        "prefix_caching": False,
        "chunked_prefill": False,
        "speculative": False,
    }
    assert set(facts.sources.values()) == {"sglang_server_info"}


def test_llama_props() -> None:
    facts = facts_from_llama_props(
        {
            "build_info": "b4589-1d1e6a90",
            "model_path": "/models/smollm2.gguf",
            "total_slots": 4,
            "default_generation_settings": {
                "n_ctx": 2048,
                "params": {
                    "cache_prompt": True,
                    "speculative.n_max": 16,
                    "speculative.type": "none",
                },
            },
        }
    )
    assert dict(facts.values) == {
        "engine": "llama.cpp",
        "version": "b4589-1d1e6a90",
        "model": "/models/smollm2.gguf",
        "speculative": False,
        "prefix_caching": True,
    }
    assert set(facts.sources.values()) == {"props"}
