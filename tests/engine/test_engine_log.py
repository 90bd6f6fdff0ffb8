"""EngineLogReader on real vLLM 0.23.0 logs, llama-server's own start-up log and hand-made
SGLang and llama.cpp samples: field by field, whatever prefix or colour, bounded."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.engine.engine_log import EngineLogReader
from proxy.engine.facts import EngineFacts

FIXTURES = Path(__file__).parent / "fixtures"


def lines(name: str) -> list[str]:
    return (FIXTURES / name).read_text(encoding="utf-8", errors="replace").splitlines()


def read(name: str, prefix: str = "", ansi: bool = False) -> EngineLogReader:
    reader = EngineLogReader()
    for line in lines(name):
        if ansi:
            line = line.replace(" INFO ", " \x1b[32mINFO\x1b[0m ").replace(
                " WARNING ", " \x1b[33mWARNING\x1b[0m "
            )
        reader.feed(prefix + line + "\n")
    return reader


def vals(name: str) -> dict[str, object]:
    values = dict(read(name).facts.values)
    values.pop("non_default_args", None)
    return values


COMMON = {
    "engine": "vllm",
    "version": "0.23.0",
    "model": "/models/smollm2-bf16",
    "dtype": "bfloat16",
    "quantization": "none",
    "kv_cache_dtype": "auto",
    "chunked_prefill": True,
    "speculative": False,
}
EAGER = {"enforce_eager": True, "cudagraphs": False, "compilation_mode": "NONE"}
EAGER |= {"cudagraph_mode": "NONE"}


def test_unknown_env_log_says_flash_attn_the_unknown_variables_and_the_deprecation() -> None:
    reader = read("vllm-0.23.0-eager-unknown-env.log")
    facts = reader.facts
    assert vals("vllm-0.23.0-eager-unknown-env.log") == COMMON | EAGER | {
        "attention_backend": "FLASH_ATTN",
        "flash_attn_version": 3,
        "prefix_caching": True,
    }
    assert facts.unknown_env == ("VLLM_FP8_MOE_BACKEND", "VLLM_ATTENTION_BACKEND")
    assert len(facts.deprecated) == 1
    assert facts.deprecated[0].startswith("VLLM_USE_FLASHINFER_MOE_FP4 is deprecated")
    assert facts.fallbacks == ()
    assert facts.start_failed is False
    assert facts.values["non_default_args"] == {
        "host": "127.0.0.1",
        "port": 8011,
        "model": "/models/smollm2-bf16",
        "dtype": "bfloat16",
        "max_model_len": 4096,
        "enforce_eager": True,
        "served_model_name": ["smollm2"],
        "gpu_memory_utilization": 0.12,
    }
    assert set(facts.sources.values()) == {"log"}
    assert set(facts.sources) == set(facts.values)
    # moe/linear backends: 'auto' in KernelConfig is what was asked, not what loaded
    assert "moe_backend" not in facts.values and "linear_backend" not in facts.values
    assert "batch_invariant" not in facts.values


def test_triton_noprefix_log_says_the_explicit_backend_and_no_prefix_caching() -> None:
    facts = read("vllm-0.23.0-eager-triton-noprefix.log").facts
    assert vals("vllm-0.23.0-eager-triton-noprefix.log") == COMMON | EAGER | {
        "attention_backend": "TRITON_ATTN",
        "prefix_caching": False,
    }
    assert facts.values["non_default_args"]["attention_backend"] == "TRITON_ATTN"
    assert facts.unknown_env == () and facts.deprecated == () and not facts.start_failed


def test_cudagraphs_oom_log_says_compile_mode_graphs_and_a_failed_start() -> None:
    facts = read("vllm-0.23.0-cudagraphs-oom.log").facts
    assert facts.start_failed is True
    assert vals("vllm-0.23.0-cudagraphs-oom.log") == COMMON | {
        "attention_backend": "FLASH_ATTN",
        "flash_attn_version": 3,
        "prefix_caching": True,
        "enforce_eager": False,
        "compilation_mode": "VLLM_COMPILE",
        "cudagraph_mode": "FULL_AND_PIECEWISE",
        "cudagraphs": True,
    }
    assert "enforce_eager" not in facts.values["non_default_args"]


def test_stock_served_log_reads_the_facts_and_ignores_and_counts_the_request_lines() -> None:
    reader = read("vllm-0.23.0-eager-stock-served.log")
    assert vals("vllm-0.23.0-eager-stock-served.log") == COMMON | EAGER | {
        "attention_backend": "FLASH_ATTN",
        "flash_attn_version": 3,
        "prefix_caching": True,
    }
    log = lines("vllm-0.23.0-eager-stock-served.log")
    total = len(log)
    requests = sum('"POST /v1/' in x or '"GET /' in x for x in log)
    assert requests > 100, "the fixture is not the served one"
    assert reader.read_lines == total
    assert reader.ignored_lines >= requests
    assert reader.ignored_lines < total


def test_prefixes_and_colour_give_the_same_facts() -> None:
    for name in ("vllm-0.23.0-eager-unknown-env.log", "vllm-0.23.0-cudagraphs-oom.log"):
        plain = read(name).facts
        for prefix in (
            "2026-12-04T04:41:38.123456789Z ",  # kubectl logs --timestamps
            "vllm-1  | ",  # docker compose
            "Dec 04 04:41:38 h200 vllm[1958]: ",  # journald
        ):
            assert read(name, prefix).facts == plain, f"prefix {prefix!r} changed the facts"
        assert read(name, ansi=True).facts == plain, "ANSI colour changed the facts"
        assert read(name, "vllm-1  | ", ansi=True).facts == plain


def test_the_engine_s_secrets_in_its_non_default_args_are_masked() -> None:
    """vLLM lists --api-key among its non-default args: it goes no further (status,
    incidents), nor does a token or a password in a URL."""
    reader = EngineLogReader()
    line = (
        "(APIServer pid=1) INFO 12-04 04:41:38 [api_utils.py:273] non-default args: {'model':"
        " 'Qwen/Qwen3-0.6B', 'api_key': ['sk-engine-key'], 'hf_token': 'hf_secret',"
        " 'kv_transfer_url': 'redis://:pw-in-url@h:6379/0', 'port': 8001}"
    )
    assert reader.feed(line + "\n")
    args = reader.facts.values["non_default_args"]
    assert args == {
        "model": "Qwen/Qwen3-0.6B",
        "api_key": ["********"],
        "hf_token": "********",
        "kv_transfer_url": "redis://:********@h:6379/0",
        "port": 8001,
    }


def test_junk_long_and_binary_lines_are_ignored_and_counted_in_bounded_memory() -> None:
    reader = EngineLogReader(max_line_chars=4096)
    assert reader.feed("hello, this is not a log line") is False
    assert reader.feed("x" * 1_000_000) is False
    assert reader.feed(bytes(range(256)).decode("latin-1") * 100) is False
    assert reader.feed("INFO 12-04 04:41:38 [api_utils.py:273] non-default args: {'a': (") is False
    assert reader.feed("INFO 12-04 04:41:38 [x.py:1] non-default args: {__import__('os')}") is False
    assert reader.facts == EngineFacts()
    assert (reader.read_lines, reader.ignored_lines) == (5, 5)
    # a log that grows without end: memory does not grow with it
    line = "(APIServer pid=1) INFO 12-04 04:41:38 [x.py:1] "
    line += "Unknown vLLM environment variable detected: "
    tracemalloc.start()
    for i in range(2000):
        reader.feed(line + f"VLLM_X{i}")
        reader.feed('(APIServer pid=1) INFO:     127.0.0.1:1 - "GET /health HTTP/1.1" 200 OK')
    first, _ = tracemalloc.get_traced_memory()
    for i in range(20000):
        reader.feed(line + f"VLLM_Y{i}")
        reader.feed('(APIServer pid=1) INFO:     127.0.0.1:1 - "GET /health HTTP/1.1" 200 OK')
    last, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert last - first < 200_000, f"memory grew by {last - first} bytes over 40000 lines"
    assert len(reader.facts.unknown_env) == 64


def test_a_cut_long_line_still_yields_its_head() -> None:
    reader = EngineLogReader(max_line_chars=200)
    assert reader.feed(
        "(EngineCore pid=1) INFO 12-04 04:41:57 [cuda.py:378] Using FLASH_ATTN attention "
        "backend out of potential backends: ['FLASH_ATTN', " + "'X', " * 100_000 + "]."
    )
    assert reader.facts.values["attention_backend"] == "FLASH_ATTN"


def test_feed_says_when_the_facts_changed() -> None:
    reader = EngineLogReader()
    line = "(EngineCore pid=1) INFO 12-04 04:41:57 [flash_attn.py:636] "
    line += "Using FlashAttention version 3"
    assert reader.feed(line) is True
    assert reader.feed(line) is False, "the same fact again is no change"
    assert reader.ignored_lines == 0


def test_a_new_banner_starts_over_and_reset_forgets() -> None:
    reader = read("vllm-0.23.0-eager-unknown-env.log")
    for line in lines("vllm-0.23.0-eager-triton-noprefix.log"):
        reader.feed(line)
    assert reader.facts == read("vllm-0.23.0-eager-triton-noprefix.log").facts
    assert reader.facts.unknown_env == (), "the earlier process's unknown variables were kept"
    reader.reset()
    assert reader.facts == EngineFacts()


@settings(max_examples=30, deadline=None)
@given(cut=st.integers(min_value=0, max_value=130), crlf=st.booleans())
def test_feeding_in_two_parts_gives_the_same_facts(cut: int, crlf: bool) -> None:
    name = "vllm-0.23.0-eager-unknown-env.log"
    whole = read(name).facts
    log = lines(name)
    reader = EngineLogReader()
    end = "\r\n" if crlf else "\n"
    for line in log[:cut]:
        reader.feed(line + end)
    head = reader.facts
    fresh = EngineLogReader()
    for line in log[:cut]:
        fresh.feed(line)
    assert head == fresh.facts, "a prefix read twice gave two accounts"
    for line in log[cut:]:
        reader.feed(line + end)
    assert reader.facts == whole, f"split at line {cut} changed the facts"


def test_sglang_sample() -> None:
    reader = read("sglang-sample.log")
    assert dict(reader.facts.values) == {
        "engine": "sglang",
        "model": "/models/qwen3-30b-a3b",
        "dtype": "bfloat16",
        "quantization": "fp8",
        "attention_backend": "fa3",
        "moe_backend": "triton",
        "cudagraphs": True,
        "prefix_caching": True,
        "chunked_prefill": True,
        "speculative": "EAGLE",
        "speculative_draft": "/models/qwen3-eagle",
        "batch_invariant": True,
        "kv_cache_dtype": "auto",
    }
    assert reader.ignored_lines == 3


def test_llama_cpp_cuda_sample() -> None:
    reader = read("llama-server-cuda-sample.log")
    assert dict(reader.facts.values) == {
        "engine": "llama.cpp",
        "backends": ("CUDA", "CPU"),
        "version": "4589 (1d1e6a90)",
        "model": "/models/qwen2.5-7b-instruct-q8_0.gguf",
        "quantization": "Q8_0",
        "gpu_layers": "29/29",
        "kv_cache_dtype": "q8_0",
        "attention_backend": "flash_attn",
        "speculative": False,
        "prefix_caching": True,
    }


def test_llama_server_real_start_up_logs() -> None:
    """Captured from the built llama-server (SmolLM2 Q4_1, CPU) at the default verbosity and at
    -lv 4: the default says only the model; -lv 4 says the build, quantization, KV type,
    flash attention, no speculative decoding and the prompt cache."""
    model = "/root/.cache/detproxy/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert dict(read("llama-server-default.log").facts.values) == {
        "engine": "llama.cpp",
        "model": model,
    }
    assert dict(read("llama-server-lv4.log").facts.values) == {
        "engine": "llama.cpp",
        "version": "1 (0c1e570)",
        "model": model,
        "quantization": "Q4_1",
        "kv_cache_dtype": "f16",
        "attention_backend": "flash_attn",
        "speculative": False,
        "prefix_caching": True,
    }


def test_kernel_selection_fallback_and_deprecation_lines() -> None:
    """Line formats from vLLM logs of quantized MoE models (not in the 0.23.0 fixtures)."""
    head = "2026-04-19 12:19:24.098 | (EngineCore pid=207) INFO 04-19 10:19:24 [x.py:1] "
    reader = EngineLogReader()
    for msg in (
        "Using FlashInferCutlassNvFp4LinearKernel for NVFP4 GEMM",
        "Using 'FLASHINFER_CUTLASS' NvFp4 MoE backend out of potential backends: ['MARLIN'].",
        "Using TritonExperts MoE backend",
        "Your GPU does not have native support for FP8 computation but FP8 quantization is "
        "being used. Weight-only FP8 compression will be used leveraging the Marlin kernel.",
        "Tried to force FLASHINFER_TRTLLM, but the kernel couldn't be implemented",
        "argument 'disable_log_requests' is deprecated and replaced with 'enable_log_requests'",
    ):
        reader.feed(head + msg)
        assert reader.ignored_lines == 0, f"not understood: {msg}"
    facts = reader.facts
    assert facts.values["linear_backend"] == "FlashInferCutlassNvFp4LinearKernel"
    assert facts.values["moe_backend"] == "FLASHINFER_CUTLASS", "the experts class overrode it"
    assert len(facts.fallbacks) == 2
    assert facts.fallbacks[0].startswith("FP8 weight-only Marlin")
    assert facts.fallbacks[1].startswith("Tried to force FLASHINFER_TRTLLM")
    assert facts.deprecated == (
        "argument 'disable_log_requests' is deprecated and replaced with 'enable_log_requests'",
    )
    selected = EngineLogReader()
    selected.feed(head + "Selected CutlassFP8ScaledMMLinearKernel for Fp8LinearMethod")
    selected.feed(head + "Using TRITON Unquantized MoE backend out of potential backends: [].")
    assert dict(selected.facts.values) == {
        "linear_backend": "CutlassFP8ScaledMMLinearKernel",
        "moe_backend": "TRITON",
    }


# The six vLLM 0.23.0 instances of tests/gpu/vllm/on_device.sh, their own logs as the H200 wrote
# them on 2026-12-04 (the engine_truth step followed them with [upstream] engine_log).
H200 = {"model": "/root/model", "attention_backend": "FLASH_ATTN", "flash_attn_version": 3}
H200 |= {"prefix_caching": True}


def test_h200_stock_eager() -> None:
    assert vals("vllm-0.23.0-h200-stock.log") == COMMON | EAGER | H200


def test_h200_batch_invariant_read_from_the_kernel_override_warning() -> None:
    # vLLM says nothing itself; torch's override warning names vLLM's batch_invariant module
    assert vals("vllm-0.23.0-h200-bi.log") == COMMON | EAGER | H200 | {"batch_invariant": True}
    assert "batch_invariant" not in vals("vllm-0.23.0-h200-stock.log"), "unknown, not false"


def test_h200_ngram_speculative() -> None:
    got = vals("vllm-0.23.0-h200-spec.log")
    assert got == COMMON | EAGER | H200 | {
        "speculative": "ngram",
        "speculative_draft": "None",
        "num_speculative_tokens": 4,
    }


def test_h200_gguf_with_an_unknown_attention_variable() -> None:
    reader = read("vllm-0.23.0-h200-gguf-unknown-env.log")
    assert vals("vllm-0.23.0-h200-gguf-unknown-env.log") == COMMON | EAGER | H200 | {
        "model": "/root/payload/model/model.gguf",
        "quantization": "gguf",
    }
    assert reader.facts.unknown_env == ("VLLM_ATTENTION_BACKEND",)


def test_h200_cuda_graphs_and_torch_compile() -> None:
    assert vals("vllm-0.23.0-h200-graphs.log") == COMMON | H200 | {
        "enforce_eager": False,
        "cudagraphs": True,
        "compilation_mode": "VLLM_COMPILE",
        "cudagraph_mode": "FULL_AND_PIECEWISE",
    }


def test_h200_reasoning_parser_instance_names_its_arguments() -> None:
    reader = read("vllm-0.23.0-h200-think.log")
    args = reader.facts.values["non_default_args"]
    assert args["reasoning_parser"] == "deepseek_r1", args
    assert vals("vllm-0.23.0-h200-think.log") == COMMON | EAGER | H200 | {
        "model": "/root/model-think"
    }
