"""Recovering from a loop by continuing instead of restarting.

The detector knows where the repetition starts. The output up to that onset, plus one
occurrence of the repeated unit (a legitimate sentence the first time), goes back to the engine
as the start of its answer, with the ladder's sampling overrides: chat as a final assistant
message with ``continue_final_message: true, add_generation_prompt: false`` (vLLM; llama.cpp's
server reads the same fields), completions as the prompt followed by that prefix. The engine
answers the continuation (llama.cpp's server, non-streamed: with the prefix in front); the
client gets prefix + continuation as one answer (streamed: the continuation goes on after what
the client already has, under the same id).

Where continuing cannot keep the answer whole, the attempt restarts instead: a loop the engine
reported (no onset known), a loop in the reasoning channel (the reasoning parser would read a
continued message as content), several choices, logprobs the client asked for (the prefix's
would be missing), a prompt that is not one string.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from policies.base import Trigger
from proxy.openai import first_choice

LIMIT_FIELDS = ("max_completion_tokens", "max_tokens")


def prefix_of(text: str, trigger: Trigger) -> str | None:
    """The text to keep: up to the loop's onset and one unit."""
    if trigger.start_offset is None or trigger.period is None:
        return None
    end = trigger.start_offset + trigger.period
    return text[:end] if 0 < end <= len(text) else None


def can_continue(endpoint: str, body: Mapping[str, Any], trigger: Trigger) -> bool:
    if trigger.source != "proxy" or trigger.channel != "content" or trigger.choice != 0:
        return False
    if body.get("n") not in (None, 1) or body.get("logprobs") or body.get("echo"):
        return False
    if endpoint == "chat":
        return isinstance(body.get("messages"), list)
    return isinstance(body.get("prompt"), str)


def continuation_body(
    endpoint: str,
    base: Mapping[str, Any],
    overrides: Mapping[str, Any],
    prefix: str,
    prefix_tokens: int,
) -> dict[str, Any] | None:
    """The request that continues ``prefix``; None when no token would be left to generate."""
    body: dict[str, Any] = {**base, **overrides}
    for name in LIMIT_FIELDS:
        limit = body.get(name)
        if isinstance(limit, int) and not isinstance(limit, bool):
            if limit - prefix_tokens < 1:
                return None
            body[name] = limit - prefix_tokens
    if endpoint == "chat":
        body["messages"] = [*base["messages"], {"role": "assistant", "content": prefix}]
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False
    else:
        body["prompt"] = base["prompt"] + prefix
    return body


def estimate_tokens(prefix: str, text: str, tokens: int) -> int:
    """The prefix's share of the tokens the attempt generated for ``text`` (4 chars a token
    when the attempt's count is unknown)."""
    if tokens > 0 and text:
        return max(1, round(tokens * len(prefix) / len(text)))
    return max(1, len(prefix) // 4)


def merge_answer(endpoint: str, answer: dict[str, Any], prefix: str, prompt_tokens: Any) -> None:
    """Make a continuation's answer the whole answer, in place: the prefix in front of its
    text, the prefix's tokens counted as completion (the continuation counted them as prompt,
    over the client request's own ``prompt_tokens``)."""
    choice = first_choice(answer)
    if choice is None:
        return
    # vLLM answers the continuation alone; llama.cpp's server answers a non-streamed
    # continuation with the prefix in front already (its stream carries the continuation only).
    if endpoint == "chat":
        message = choice.get("message")
        if isinstance(message, dict):
            message["content"] = _joined(prefix, message.get("content"))
    else:
        choice["text"] = _joined(prefix, choice.get("text"))
    usage = answer.get("usage")
    if isinstance(usage, dict) and isinstance(prompt_tokens, int):
        cont_prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if isinstance(cont_prompt, int) and isinstance(completion, int):
            kept = max(0, cont_prompt - prompt_tokens)
            usage["prompt_tokens"] = prompt_tokens
            usage["completion_tokens"] = completion + kept
            usage["total_tokens"] = prompt_tokens + completion + kept


def _joined(prefix: str, text: Any) -> str:
    own = text if isinstance(text, str) else ""
    return own if own.startswith(prefix) else prefix + own


def content_of(endpoint: str, answer: Mapping[str, Any] | None) -> str | None:
    """The text of a non-streamed answer's first choice (chat: its content)."""
    choice = first_choice(answer) if answer is not None else None
    if choice is None:
        return None
    if endpoint == "chat":
        message = choice.get("message")
        text = message.get("content") if isinstance(message, dict) else None
    else:
        text = choice.get("text")
    return text if isinstance(text, str) else None
