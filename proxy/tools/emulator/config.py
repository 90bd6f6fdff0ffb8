"""EmulatorConfig: every knob of the vLLM emulator, frozen and validated.

Each field can also be overridden for one request with the ``X-Emulator-Knobs`` header (a JSON
object with the same field names), validated the same way as the config itself.
"""

from __future__ import annotations

import difflib
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

ReasoningStyle = Literal["reasoning", "reasoning_content", "both"]
LoopChannel = Literal["none", "reasoning", "content"]
FaultKind = Literal[
    "none",
    "reset_mid_stream",
    "http_500",
    "http_503",
    "slow_headers",
    "malformed_sse",
    "malformed_json",
    "inband_error",
]

KNOBS_HEADER = "X-Emulator-Knobs"
DEFAULT_SLOW_HEADERS_S = 30.0


class KnobsError(ValueError):
    """A per-request knobs header that is not a valid override of the config."""


class EmulatorConfig(BaseModel):
    """Configuration of one emulated vLLM server."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # Served model and server limits.
    models: tuple[str, ...] = Field(default=("emulator-model",), min_length=1)
    max_model_len: int = Field(default=4096, ge=16)
    max_logprobs: int = Field(default=20, ge=-1)
    # What /version answers (vLLM's release): the request and response shapes emulated are
    # 0.23's (reasoning, repetition_detection, the error nesting of >= 0.10.1).
    version: str = Field(default="0.23.0", min_length=1)
    seed: int = 0
    default_temperature: float = Field(default=1.0, ge=0.0)
    # vLLM's --api-key: /v1/* requests without ``Authorization: Bearer <key>`` get its 401.
    api_key: str | None = Field(default=None, min_length=1)
    # vLLM's --enable-request-id-headers: responses carry X-Request-Id only when it is on.
    enable_request_id_headers: bool = False

    # Reasoning channel (chat only).
    reasoning_tokens: int = Field(default=0, ge=0)
    reasoning_style: ReasoningStyle = "reasoning"
    # A chat request that continues a final assistant message ending the reasoning
    # (continue_final_message, its content containing "</think>") is answered without
    # reasoning; where the parser puts that answer: vLLM's deepseek_r1 reads output with no end
    # marker as reasoning ("reasoning"; the pitfall of vllm#17349 in reference/vllm-api.md:
    # the answer in reasoning, content null), qwen3 as content ("content").
    closed_reasoning_answer: Literal["reasoning", "content"] = "reasoning"
    # A chat template that drops the reasoning of assistant messages (DeepSeek-R1's distills,
    # QwQ: an assistant message renders as what follows its "</think>"), and whose generation
    # prompt opens the reasoning ("<think>\n"), as theirs do. The prompt a generation request is
    # conditioned on is then the template's: a continuation of a closed reasoning sent as a
    # final assistant message goes on without that reasoning (record closed_reasoning), as
    # does content continued with its ``reasoning`` field (which a keeping template renders
    # before the content: the record then holds that reasoning, and the content).
    template_drops_reasoning: bool = False

    # Injected nondeterminism (greedy requests only).
    # flip: the rank-2 token at flip_position.
    flip_probability: float = Field(default=0.0, ge=0.0, le=1.0)
    flip_position: int = Field(default=0, ge=0)
    # Logprob drift: from a position among the first ten to the end, every reported logprob
    # moves by up to ~1 nat (chosen token) / ~3 nats (top-k), the text unchanged.
    logprob_jitter_probability: float = Field(default=0.0, ge=0.0, le=1.0)
    # Batch effects: with N requests in flight a greedy choice is hit with p = min(1, slope *
    # (N - 1)): its logprobs drift from then on and its text diverges (the rank-2 token) at a
    # position among the first ten (answers shorter than that keep their text).
    batch_divergence_slope: float = Field(default=0.0, ge=0.0)
    # Prefix cache (vLLM's automatic prefix caching, on by default; vLLM's
    # --no-enable-prefix-caching turns it off). warm_cache_divergence: the share of prompts
    # (chosen by a hash of the prompt) whose greedy answer, when the prompt was found (partly)
    # cached, takes the runner-up token at a position fixed by that hash: cold agrees with cold,
    # warm with warm, cold differs from warm.
    enable_prefix_caching: bool = True
    warm_cache_divergence: float = Field(default=0.0, ge=0.0, le=1.0)
    # vLLM's --enable-prompt-tokens-details: usage.prompt_tokens_details = {cached_tokens}.
    enable_prompt_tokens_details: bool = False

    # Repetition loops. Greedy requests without a penalty always loop; an attempt with a
    # presence/frequency/repetition penalty or temperature > 0 escapes with this probability,
    # drawn from (seed, prompt, sampling parameters, choice) — and, for sampling without a
    # request seed, how often this emulator has seen that request.
    loop_escape_probability: float = Field(default=0.7, ge=0.0, le=1.0)
    loop_channel: LoopChannel = "none"
    loop_after_tokens: int = Field(default=5, ge=0)
    loop_unit: str = Field(default=" and then the model repeats itself.", min_length=1)
    engine_repetition_detection: bool = False

    # A model whose logprobs come out NaN (seen on real vLLM with a broken GGUF checkpoint): a
    # non-streamed request that asks for logprobs gets vLLM's 400 (the JSON encoder refuses NaN),
    # a streamed one gets ``"logprob": null`` values. Requests without logprobs answer normally.
    nan_logprobs: bool = False

    # Speed (token_latency_s is the time of one engine step).
    token_latency_s: float = Field(default=0.0, ge=0.0)
    headers_delay_s: float = Field(default=0.0, ge=0.0)
    # Between a stream's ``data: [DONE]`` and the end of its chunked framing. A real server
    # writes that end separately (uvicorn: the last, empty body message), so a proxy may read
    # it later, and a client that closes on [DONE] (the sync openai SDK) does not wait for it.
    end_delay_s: float = Field(default=0.0, ge=0.0)

    # Stream chunking. vLLM sends the tokens of one engine step in one chunk; the last token
    # shares its chunk with finish_reason. tokens_per_chunk > 1 is vLLM's --stream-interval:
    # a chunk waits for that many tokens (its logprobs list all of them).
    tokens_per_chunk: int = Field(default=1, ge=1)
    # Speculative decoding: every engine step drafts speculative_tokens tokens and accepts each
    # in turn with speculative_acceptance (seeded), emitting 1 + accepted tokens; the
    # vllm:spec_decode_* counters exist only when it is on (and start at 0).
    speculative: bool = False
    speculative_tokens: int = Field(default=3, ge=1)
    speculative_acceptance: float = Field(default=0.7, ge=0.0, le=1.0)
    # With speculative on: the share of prompts (chosen by a hash of the prompt) whose greedy
    # answer takes the runner-up token at a position fixed by that hash, so the speculative
    # recipe differs from the plain one but agrees with itself run after run.
    speculative_divergence: float = Field(default=0.0, ge=0.0, le=1.0)

    # Transport and protocol faults. Stream faults fire once fault_after_tokens tokens were
    # sent; at 0, before the first event (a stream that fails right after its 200 header).
    fault: FaultKind = "none"
    fault_after_tokens: int = Field(default=3, ge=0)
    fault_probability: float = Field(default=1.0, ge=0.0, le=1.0)

    def with_knobs(self, knobs: dict[str, Any]) -> EmulatorConfig:
        """Return a copy with ``knobs`` applied, validated like the config itself."""
        merged = self.model_dump()
        merged.update(knobs)
        return EmulatorConfig.model_validate(merged)

    def with_knobs_header(self, raw: str | None) -> EmulatorConfig:
        """Apply the ``X-Emulator-Knobs`` header value; raise KnobsError when it is invalid."""
        if raw is None or not raw.strip():
            return self
        try:
            knobs = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise KnobsError(f"{KNOBS_HEADER} is not valid JSON: {exc}") from exc
        if not isinstance(knobs, dict):
            raise KnobsError(f"{KNOBS_HEADER} must be a JSON object")
        try:
            return self.with_knobs(knobs)
        except ValidationError as exc:
            raise KnobsError(f"{KNOBS_HEADER} is invalid: {_describe(exc)}") from exc

    @property
    def slow_headers_delay_s(self) -> float:
        return self.headers_delay_s if self.headers_delay_s > 0 else DEFAULT_SLOW_HEADERS_S


def _describe(exc: ValidationError) -> str:
    parts = []
    unknown = False
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            unknown = True
            parts.append(f"{loc}: not a knob{_closest(loc)}")
        else:
            parts.append(f"{loc}: {err['msg']}")
    if unknown:  # a misspelt name: the whole list, as --help lists the flags
        parts.append("the knobs: " + ", ".join(EmulatorConfig.model_fields))
    return "; ".join(parts)


def _closest(name: str) -> str:
    close = difflib.get_close_matches(name, list(EmulatorConfig.model_fields), n=1)
    return f" (did you mean {close[0]}?)" if close else ""
