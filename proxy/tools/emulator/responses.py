"""Builders for vLLM-shaped bodies: errors, chat/completions responses and stream chunks."""

from __future__ import annotations

from typing import Any

import orjson

from .model import Candidate, Step
from .plan import Job

LOGPROB_FLOOR = -9999.0
# What vLLM answers (HTTP 400) when a non-streamed body holds a NaN logprob: Python's JSON encoder
# refuses it. Streamed chunks are serialised by pydantic, which writes NaN as null.
NAN_LOGPROBS_MESSAGE = "Out of range float values are not JSON compliant: nan"


def error_body(message: str, err_type: str, code: int, param: str | None = None) -> bytes:
    """vLLM >= 0.10.1 nested error body."""
    return orjson.dumps(
        {"error": {"message": message, "type": err_type, "param": param, "code": code}}
    )


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def _top(step: Step, k: int) -> list[Candidate]:
    """vLLM V1 order: the sampled token first, then the top-k (deduplicated), first k kept."""
    chosen = next(c for c in step.candidates if c.token_id == step.token_id)
    ordered = [chosen, *(c for c in step.candidates if c.token_id != step.token_id)]
    if k < 0:
        return ordered
    return ordered[:k]


def _lp(value: float, nan: bool = False) -> float | None:
    """The reported value: clamped like vLLM; None (JSON null) for a NaN model's value."""
    return None if nan else max(value, LOGPROB_FLOOR)


def chat_logprob_entry(step: Step, k: int, nan: bool = False) -> dict[str, Any]:
    return {
        "token": step.text,
        "logprob": _lp(step.logprob, nan),
        "bytes": list(step.text.encode()),
        "top_logprobs": [
            {"token": c.text, "logprob": _lp(c.logprob, nan), "bytes": list(c.text.encode())}
            for c in _top(step, k)
        ],
    }


def completion_logprobs(
    steps: list[Step], n_top: int, offset: int, nan: bool = False
) -> dict[str, Any]:
    """Legacy completions logprobs; ``offset`` is the text offset of the first step."""
    tokens: list[str] = []
    token_lps: list[float | None] = []
    tops: list[dict[str, float | None]] = []
    offsets: list[int] = []
    for step in steps:
        tokens.append(step.text)
        token_lps.append(_lp(step.logprob, nan))
        ranked = step.candidates if n_top < 0 else step.candidates[:n_top]
        chosen = next(c for c in step.candidates if c.token_id == step.token_id)
        entries = [chosen, *(c for c in ranked if c.token_id != step.token_id)]
        tops.append({c.text: _lp(c.logprob, nan) for c in entries})
        offsets.append(offset)
        offset += len(step.text)
    return {
        "tokens": tokens,
        "token_logprobs": token_lps,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def usage(job: Job, completion_tokens: int, reasoning_tokens: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        "prompt_tokens": job.prompt_tokens,
        "total_tokens": job.prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": (
            {"cached_tokens": job.cached_tokens} if job.prompt_tokens_details else None
        ),
    }
    if job.reasoning_active:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


def reasoning_fields(job: Job, text: str | None) -> dict[str, Any]:
    style = job.reasoning_style
    if style == "reasoning":
        return {"reasoning": text}
    if style == "reasoning_content":
        return {"reasoning_content": text}
    return {"reasoning": text, "reasoning_content": text}


def chat_delta(job: Job, steps: list[Step]) -> dict[str, Any]:
    """The delta of a chunk holding ``steps`` (reasoning first, then content; ``{}`` if none)."""
    reasoning = "".join(s.text for s in steps if s.channel == "reasoning")
    content = "".join(s.text for s in steps if s.channel == "content")
    if job.answer_as_reasoning:
        reasoning, content = reasoning + content, ""
    delta: dict[str, Any] = reasoning_fields(job, reasoning) if reasoning else {}
    if content:
        delta["content"] = content
        if job.reasoning_style == "both" and not reasoning:
            delta["reasoning_content"] = None
    return delta


class ChunkBuilder:
    """Stream chunk payloads for one job (fixed id, created and model)."""

    def __init__(self, job: Job, created: int) -> None:
        self.job = job
        self.created = created
        chat = job.endpoint == "chat"
        self.object = "chat.completion.chunk" if chat else "text_completion"
        self.id = ("chatcmpl-" if chat else "cmpl-") + job.request_id

    def _wrap(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.job.model,
            "choices": choices,
        }

    def role(self, index: int) -> dict[str, Any]:
        delta = {"role": "assistant", "content": ""}
        return self._wrap(
            [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}]
        )

    def tokens(
        self,
        index: int,
        steps: list[Step],
        offset: int,
        finish_reason: str | None = None,
        stop_reason: str | None = None,
    ) -> dict[str, Any]:
        """One chunk with ``steps`` (possibly none); the last one of a choice carries its
        ``finish_reason`` and ``stop_reason``. ``offset``: text offset of the first step."""
        job = self.job
        lps: dict[str, Any] | None = None
        choice: dict[str, Any] = {"index": index}
        if job.endpoint == "chat":
            if job.logprobs is not None and steps:
                k, nan = job.logprobs, job.nan_logprobs
                lps = {"content": [chat_logprob_entry(s, k, nan) for s in steps]}
            choice |= {"delta": chat_delta(job, steps), "logprobs": lps}
            choice["finish_reason"] = finish_reason
            if finish_reason is not None:
                choice["stop_reason"] = stop_reason
            return self._wrap([choice])
        if job.logprobs is not None and steps:
            lps = completion_logprobs(steps, job.logprobs, offset, job.nan_logprobs)
        choice |= {
            "text": "".join(s.text for s in steps),
            "logprobs": lps,
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
        }
        return self._wrap([choice])

    def usage(self, body: dict[str, Any]) -> dict[str, Any]:
        out = self._wrap([])
        out["usage"] = {k: v for k, v in body.items() if v is not None}
        return out


def chat_message(job: Job, reasoning: str, content: str) -> dict[str, Any]:
    if job.answer_as_reasoning:
        reasoning, content = reasoning + content, ""
    msg: dict[str, Any] = {
        "role": "assistant",
        "content": content if content or not job.reasoning_active else None,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
    }
    msg |= reasoning_fields(job, reasoning if reasoning else None)
    return msg


def full_response(
    job: Job, created: int, choices: list[dict[str, Any]], usage_body: dict[str, Any]
) -> dict[str, Any]:
    chat = job.endpoint == "chat"
    return {
        "id": ("chatcmpl-" if chat else "cmpl-") + job.request_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": job.model,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": None,
        "usage": usage_body,
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "kv_transfer_params": None,
    }
