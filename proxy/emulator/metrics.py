"""Prometheus text for ``GET /metrics`` (written by hand: a few vLLM series, one app's state)."""

from __future__ import annotations

from .config import EmulatorConfig
from .injections import EmulatorState

FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


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

    family("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.")
    per_model("vllm:num_requests_running", float(state.running))
    family("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.")
    per_model("vllm:num_requests_waiting", 0.0)
    family("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.")
    per_model("vllm:kv_cache_usage_perc", min(state.running / 64.0, 1.0))
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
    return "\n".join(lines) + "\n"
