"""Prometheus text for ``GET /metrics`` (written by hand: a few vLLM series, one app's state).

Like vLLM's: request gauges, token and prefix-cache counters, ``vllm:cache_config_info``, and
the ``vllm:spec_decode_*`` counters only when speculative decoding is configured (they start at
0 and rise with traffic).
"""

from __future__ import annotations

from .config import EmulatorConfig
from .injections import EmulatorState
from .plan import PREFIX_BLOCK_SIZE

FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
NUM_GPU_BLOCKS = 4096


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render_metrics(cfg: EmulatorConfig, state: EmulatorState) -> str:
    lines: list[str] = []

    def family(name: str, kind: str, doc: str) -> None:
        lines.append(f"# HELP {name} {doc}")
        lines.append(f"# TYPE {name} {kind}")

    models = [_escape(m) for m in cfg.models]
    first = models[0]

    def per_model(name: str, value: float) -> None:
        for m in models:
            lines.append(f'{name}{{engine="0",model_name="{m}"}} {value if m == first else 0.0}')

    # vLLM's /metrics carries prometheus_client's process collector (Linux): a restart of the
    # server shows as a later start time.
    family("process_start_time_seconds", "gauge", "Start time of the process since unix epoch.")
    lines.append(f"process_start_time_seconds {state.started_at:.2f}")
    family("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.")
    per_model("vllm:num_requests_running", float(state.running_reported))
    family("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.")
    per_model("vllm:num_requests_waiting", 0.0)
    family("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.")
    per_model("vllm:kv_cache_usage_perc", min(state.running / 64.0, 1.0))
    family("vllm:prefix_cache_queries_total", "counter", "Prefix cache queries, in tokens.")
    per_model("vllm:prefix_cache_queries_total", float(state.prefix_queries))
    family("vllm:prefix_cache_hits_total", "counter", "Prefix cache hits, in tokens.")
    per_model("vllm:prefix_cache_hits_total", float(state.prefix_hits))
    family("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.")
    per_model("vllm:prompt_tokens_total", float(state.prompt_tokens))
    family("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.")
    per_model("vllm:generation_tokens_total", float(state.generation_tokens))
    family("vllm:request_success_total", "counter", "Count of successfully processed requests.")
    for reason in FINISH_REASONS:
        for m in models:
            value = float(state.finished[reason]) if m == first else 0.0
            lines.append(
                f'vllm:request_success_total{{engine="0",finished_reason="{reason}",'
                f'model_name="{m}"}} {value}'
            )
    if cfg.speculative:
        family("vllm:spec_decode_num_drafts_total", "counter", "Number of spec decoding drafts.")
        per_model("vllm:spec_decode_num_drafts_total", float(state.spec_drafts))
        family("vllm:spec_decode_num_draft_tokens_total", "counter", "Number of draft tokens.")
        per_model("vllm:spec_decode_num_draft_tokens_total", float(state.spec_draft_tokens))
        family(
            "vllm:spec_decode_num_accepted_tokens_total", "counter", "Number of accepted tokens."
        )
        per_model("vllm:spec_decode_num_accepted_tokens_total", float(state.spec_accepted))
        name = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
        family(name, "counter", "Accepted tokens per draft position.")
        for pos in range(cfg.speculative_tokens):
            for m in models:
                value = float(state.spec_accepted_per_pos[pos]) if m == first else 0.0
                lines.append(f'{name}{{engine="0",model_name="{m}",position="{pos}"}} {value}')
    family("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig.")
    lines.append(
        f'vllm:cache_config_info{{block_size="{PREFIX_BLOCK_SIZE}",cache_dtype="auto",'
        f'enable_prefix_caching="{cfg.enable_prefix_caching}",engine="0",'
        'gpu_memory_utilization="0.9",'
        f'num_gpu_blocks="{NUM_GPU_BLOCKS}"}} 1.0'
    )
    return "\n".join(lines) + "\n"
