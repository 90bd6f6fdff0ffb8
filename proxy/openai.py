"""Views of OpenAI-compatible bodies as vLLM and llama.cpp's server send them: one place for
the rules of where a text, a usage or an error message lives.

Every function reads a parsed JSON object (plain dicts, as orjson gives them) and never
raises on junk: a member of the wrong type reads as absent. They run once per SSE event on
the relay's hot path, so they use plain ``dict.get`` and ``type(x) is ...`` checks.

Two rewrite a parsed chunk in place, for whoever hands it on (the relay's rewrites, the whole
answer's): ``strip_logprobs`` (logprobs detproxy injected for an audit, set back to null) and
``move_reasoning_to_content`` (after a closed reasoning, reasoning is the answer's content).
They live here, beside the views, so that no stage imports another's package for them.

``stream_event`` is the one builder of a chunk detproxy writes itself (a policy's last event, a
held reasoning it hands back), shaped as the upstream's own.

Reasoning: vLLM sends it as ``reasoning_content`` (from 0.7.2), as ``reasoning`` with
``reasoning_content`` as a duplicate (0.11.1 to 0.15) and as ``reasoning`` alone (from 0.16;
``/work/shared/reference/vllm-api.md``). A delta carrying both carries the same text twice:
one is read, ``reasoning`` first.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import orjson

__all__ = [
    "REASONING_KEYS",
    "choice_text",
    "completion_tokens_of",
    "error_detail",
    "error_message",
    "first_choice",
    "first_message",
    "move_reasoning_to_content",
    "reasoning_of",
    "stream_event",
    "strip_logprobs",
    "usage_of",
]

# Where a chat delta or message holds its reasoning, the current name first.
REASONING_KEYS = ("reasoning", "reasoning_content")


def reasoning_of(part: dict[str, Any]) -> str | None:
    """The reasoning text of a chat delta or message; None when it carries none."""
    text = part.get("reasoning")
    if type(text) is str and text:
        return text
    text = part.get("reasoning_content")
    return text if type(text) is str and text else None


def choice_text(choice: Mapping[str, Any]) -> str | None:
    """The text a streamed choice carries: its delta's content, else its delta's reasoning
    (chat), or its ``text`` (completions); None when it carries none."""
    delta = choice.get("delta")
    if type(delta) is dict:
        text = delta.get("content")
        if type(text) is str and text:
            return text
        return reasoning_of(delta)
    text = choice.get("text")
    return text if type(text) is str and text else None


def first_choice(body: Mapping[str, Any]) -> dict[str, Any] | None:
    """The first of a body's ``choices`` when it is an object."""
    choices = body.get("choices")
    if type(choices) is not list or not choices:
        return None
    choice = choices[0]
    return choice if type(choice) is dict else None


def first_message(body: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``message`` of a non-streamed chat body's first choice when it is an object."""
    choice = first_choice(body)
    message = choice.get("message") if choice is not None else None
    return message if type(message) is dict else None


def stream_event(endpoint: str, chunk_id: str | None, model: str, choice: dict[str, Any]) -> bytes:
    """One SSE event of a chunk detproxy writes itself: ``choice`` under the stream's id."""
    chat = endpoint == "chat"
    chunk = {
        "id": chunk_id or ("chatcmpl-detproxy" if chat else "cmpl-detproxy"),
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
    }
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


def _int_or_none(value: Any) -> int | None:
    return value if type(value) is int else None  # bool is not a count


def usage_of(body: dict[str, Any]) -> tuple[int | None, int | None]:
    """A body's ``usage``: its prompt and completion tokens (None where absent)."""
    usage = body.get("usage")
    if type(usage) is not dict:
        return None, None
    return _int_or_none(usage.get("prompt_tokens")), _int_or_none(usage.get("completion_tokens"))


def cached_tokens_of(body: Mapping[str, Any]) -> int | None:
    """A body's ``usage.prompt_tokens_details.cached_tokens``: the prompt tokens the engine
    took from its prefix cache (vLLM with ``--enable-prompt-tokens-details``; None where not
    reported)."""
    usage = body.get("usage")
    if type(usage) is not dict:
        return None
    details = usage.get("prompt_tokens_details")
    if type(details) is not dict:
        return None
    return _int_or_none(details.get("cached_tokens"))


def completion_tokens_of(body: Mapping[str, Any]) -> int | None:
    """A body's ``usage.completion_tokens`` (a streamed usage chunk's included)."""
    usage = body.get("usage")
    if type(usage) is not dict:
        return None
    return _int_or_none(usage.get("completion_tokens"))


def error_detail(body: dict[str, Any]) -> str | None:
    """The message an error body carries, wherever its server put it: ``error.message``
    (OpenAI, vLLM >= 0.10.1, llama.cpp), ``error`` as a string, the flat ``message`` (older
    vLLM) or ``detail`` (FastAPI); None when it has none."""
    err = body.get("error")
    if type(err) is dict:
        message = err.get("message")
    elif type(err) is str:
        message = err
    else:
        message = None
    if message is None:
        message = body.get("message") or body.get("detail")
    return message if type(message) is str and message else None


def error_message(body: dict[str, Any]) -> str | None:
    """None unless ``body`` is an error (a non-null ``error``, nested since vLLM 0.10.1, or
    the older flat ``"object": "error"``); then its message, ``"error"`` when it has none."""
    if body.get("error") is None and body.get("object") != "error":
        return None
    return error_detail(body) or "error"


def strip_logprobs(answer: dict[str, Any]) -> bool:
    """Set every choice's logprobs back to null, in place (a chunk or a whole answer).

    Returns whether anything changed, so an unchanged chunk keeps its original bytes."""
    changed = False
    choices = answer.get("choices")
    if isinstance(choices, list):
        for choice in choices:
            if isinstance(choice, dict) and choice.get("logprobs") is not None:
                choice["logprobs"] = None
                changed = True
    return changed


def move_reasoning_to_content(chunk: dict[str, Any]) -> None:
    """A streamed chunk after closed reasoning: its reasoning delta is the answer's content."""
    choices = chunk.get("choices")
    if type(choices) is not list:
        return
    for choice in choices:
        delta = choice.get("delta") if type(choice) is dict else None
        if type(delta) is not dict:
            continue
        text = reasoning_of(delta)
        for key in REASONING_KEYS:
            delta.pop(key, None)
        if text:
            own = delta.get("content")
            delta["content"] = (own if type(own) is str else "") + text
