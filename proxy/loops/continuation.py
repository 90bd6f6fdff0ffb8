"""Recovering from a loop by continuing instead of restarting.

The detector knows where the repetition starts. The output up to that onset, plus one
occurrence of the repeated unit (a legitimate sentence the first time), goes back to the engine
as the start of its answer, with the ladder's sampling overrides: chat as a final assistant
message with ``continue_final_message: true, add_generation_prompt: false`` (vLLM; llama.cpp's
server reads the same fields), completions as the prompt followed by that prefix. The engine
answers the continuation (llama.cpp's server, non-streamed: with the prefix in front); the
client gets prefix + continuation as one answer (streamed: the continuation goes on after what
the client already has, under the same id). A chat answer that reasoned before its content
goes back with that reasoning, as the final message's ``reasoning`` (vLLM renders it where
the template keeps assistant reasoning; where it drops it, ``proxy.loops.rendered``), so that
the engine continues the answer the model wrote; what it writes then is content, and the
client gets the reasoning as it came.

``close_reasoning`` is the same for a loop in the reasoning channel of a chat answer: the
reasoning up to the onset and one unit, between the model's reasoning markers
(``[[loops.reasoning_markers]]``, ``<think>`` and ``</think>`` by default), becomes the final
assistant message, so the engine goes on with the answer. Whatever it writes then is the
answer's content, in whichever field it comes: a reasoning parser that sees no end marker in
the output (vLLM's ``deepseek_r1``) reports it all as reasoning. The client gets the kept
reasoning as its reasoning (streamed: it has it already, or, held, gets it in one chunk) and
that answer as its content. It relies on the model's chat template rendering a final
assistant message's reasoning: for templates that keep only what follows ``</think>`` of
assistant messages (DeepSeek-R1's distills, QwQ) the continuation goes through the rendered
prompt on ``/v1/completions`` instead (``proxy.loops.rendered``).

Where continuing cannot keep the answer whole, the attempt restarts instead: a loop the engine
reported (no onset known), a loop in the reasoning channel for ``continue`` (the reasoning
parser would read a continued message as content), several choices, logprobs the client asked
for (the prefix's would be missing), a prompt that is not one string.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from policies.base import Trigger
from proxy.openai import REASONING_KEYS, first_choice, first_message, reasoning_of, stream_event

LIMIT_FIELDS = ("max_completion_tokens", "max_tokens")
SNAP_CHARS = 64  # how far back a prefix's cut may move to end on a word


@dataclass(frozen=True, slots=True)
class Continued:
    """What the next attempt goes on from: the kept text of the looping attempt's channel,
    whether that text is reasoning the attempt closes (what the engine writes next is the
    answer's content), and the final assistant message sent for it (the closed reasoning, or
    the prefix itself)."""

    prefix: str
    closes_reasoning: bool = False
    message: str = ""
    # A continued content's: the reasoning the looping answer had before it, sent with it
    # (chat: the assistant message's ``reasoning``; rendered: between the markers) so that
    # the engine goes on from the answer as the model wrote it; "" where it had none.
    reasoning: str = ""
    # A stream's, written before the continuation: the part of the prefix its client was not
    # shown (held back), or the rest of a loop's unit it was shown part of; "" where neither
    # (or not streamed).
    missing: str = ""
    # The text of its channel the client holds before the continuation (a stream: what it was
    # shown, repeats included, and ``missing``; not streamed: the prefix).
    shown: str = ""


def prefix_of(text: str, trigger: Trigger) -> str | None:
    """The text to keep: up to the loop's onset and one unit, ended on a word's end."""
    if trigger.start_offset is None or trigger.period is None:
        return None
    end = trigger.start_offset + trigger.period
    if not 0 < end <= len(text):
        return None
    return text[: word_end(text, end)]


def periodic_completion(shown: str, kept: int, onset: int, period: int) -> str:
    """What a stream that showed ``shown``, past the kept text (its first ``kept`` chars: the
    loop's onset and one unit), writes before the continuation so that its client's text is
    the kept text with whole units of the loop inserted: the loop's text from where ``shown``
    ends to the next point in the kept end's phase. A stream caught mid-unit would otherwise
    join the continuation to a partial unit ("A love that" + "wind,"). "" where ``shown``
    does not repeat one unit from ``onset`` (nothing is written then)."""
    end = len(shown)
    if period <= 0 or onset < 0 or end <= kept or end - period < onset:
        return ""
    if any(shown[i] != shown[i - period] for i in range(max(onset + period, kept), end)):
        return ""
    need = (kept - end) % period  # to the next point in the kept end's phase
    return shown[end - period : end - period + need]


def word_end(text: str, end: int) -> int:
    """``end``, or the nearest word end before it (a non-space followed by a space), within
    ``SNAP_CHARS``. Byte-level BPE and SentencePiece tokenizers attach a space to the word
    after it, so a prefix cut there tokenises into the tokens the engine generated for it (on
    llama-server, 31 of 32 loop prefixes against 27 of 32 cut at the unit's end:
    tests/bench/bench_recovery_corpus.py --retok-only); and ending on a non-space, it loses
    nothing to a chat template that trims the message."""
    if end == len(text) or (text[end].isspace() and not text[end - 1].isspace()):
        return end
    for at in range(end - 1, max(0, end - SNAP_CHARS), -1):
        if text[at].isspace() and not text[at - 1].isspace():
            return at
    return end


def can_continue(endpoint: str, body: Mapping[str, Any], trigger: Trigger) -> bool:
    if trigger.source != "proxy" or trigger.channel != "content" or trigger.choice != 0:
        return False
    if body.get("n") not in (None, 1) or body.get("logprobs") or body.get("echo"):
        return False
    if endpoint == "chat":
        return isinstance(body.get("messages"), list)
    return isinstance(body.get("prompt"), str)


def can_continue_shown(endpoint: str, body: Mapping[str, Any], trigger: Trigger) -> bool:
    """Whether an answer can go on from the text of the trigger's channel under one path
    (``proxy.loops.next_attempt``: any source, the text is known; logprobs too for a stream,
    whose shown tokens had theirs)."""
    if trigger.choice != 0 or body.get("n") not in (None, 1) or body.get("echo"):
        return False
    if endpoint == "chat":
        return isinstance(body.get("messages"), list)
    return trigger.channel == "content" and isinstance(body.get("prompt"), str)


def can_close_reasoning(endpoint: str, body: Mapping[str, Any], trigger: Trigger) -> bool:
    if endpoint != "chat" or trigger.source != "proxy" or trigger.channel != "reasoning":
        return False
    if trigger.choice != 0 or body.get("n") not in (None, 1) or body.get("logprobs"):
        return False
    return isinstance(body.get("messages"), list)


def closed_reasoning(reasoning: str, start: str, end: str) -> str:
    """The final assistant message that ends the reasoning at ``reasoning``."""
    return f"{start}\n{reasoning.strip(chr(10))}\n{end}\n\n"


def continuation_body(
    endpoint: str,
    base: Mapping[str, Any],
    overrides: Mapping[str, Any],
    prefix: str,
    prefix_tokens: int,
    reasoning: str = "",
) -> dict[str, Any] | None:
    """The request that continues ``prefix`` (chat: after ``reasoning``, where the answer had
    some); None when no token would be left to generate."""
    body: dict[str, Any] = {**base, **overrides}
    for name in LIMIT_FIELDS:
        limit = body.get(name)
        if isinstance(limit, int) and not isinstance(limit, bool):
            if limit - prefix_tokens < 1:
                return None
            body[name] = limit - prefix_tokens
    if endpoint == "chat":
        message = {"role": "assistant", "content": prefix}
        if reasoning:
            # vLLM renders an assistant message's ``reasoning`` (``reasoning_content`` is read
            # as it), for templates that keep it (reference/vllm-api.md section 2).
            message["reasoning"] = reasoning
        body["messages"] = [*base["messages"], message]
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False
    else:
        body["prompt"] = base["prompt"] + prefix
    return body


def estimate_tokens(kept: str) -> int:
    """The tokens of a kept prefix, estimated from its text alone: 4 UTF-8 bytes a token.

    One computation from the text a retry keeps, and nothing else: a stream stopped at its loop
    and a whole answer read to its end count their own tokens over different texts, so a share
    of either count would give the same loop two limits, and a greedy request two answers,
    depending on ``stream``. Bytes, not chars: a script of several bytes a char (CJK) is
    nearer a token a char than four chars a token."""
    return max(1, len(kept.encode()) // 4)


def merge_answer(
    endpoint: str,
    answer: dict[str, Any],
    prefix: str,
    prompt_tokens: Any,
    reasoning: str = "",
    keys: tuple[str, ...] = (),
) -> None:
    """Make a continuation's answer the whole answer, in place: the prefix in front of its
    text, the prefix's tokens counted as completion (the continuation counted them as prompt,
    over the client request's own ``prompt_tokens``). ``reasoning``: what the continued content
    came after, the answer's again in the fields ``keys`` the looping answer carried it in;
    all the engine wrote after the prefix is content (a parser that sees no end marker in the
    output, vLLM's ``deepseek_r1``, reports it as reasoning)."""
    # vLLM answers the continuation alone; llama.cpp's server answers a non-streamed
    # continuation with the prefix in front already (its stream carries the continuation only).
    if endpoint == "chat":
        message = first_message(answer)
        if message is not None:
            own = message.get("content")
            if reasoning:
                parsed = reasoning_of(message) or ""
                if parsed.strip("\n") == reasoning.strip("\n"):
                    parsed = ""  # the sent reasoning given back (llama.cpp's server)
                own = parsed + (own if isinstance(own, str) else "")
                for key in REASONING_KEYS:
                    message.pop(key, None)
                for key in keys or REASONING_KEYS[:1]:
                    message[key] = reasoning
            message["content"] = _joined(prefix, own)
    else:
        choice = first_choice(answer)
        if choice is None:
            return
        choice["text"] = _joined(prefix, choice.get("text"))
    _kept_as_completion(answer, prompt_tokens)


def merge_closed(
    answer: dict[str, Any],
    continued: Continued,
    keys: tuple[str, ...],
    prompt_tokens: Any,
) -> None:
    """Make the answer to a closed reasoning the whole answer, in place: the kept reasoning
    in the fields ``keys`` the looping answer carried it in, and all the engine wrote after it
    (reasoning or content, as its parser read it) as the content."""
    message = first_message(answer)
    if message is None:
        return
    reasoning = continued.prefix
    own = message.get("content")
    own = own if isinstance(own, str) else ""
    parsed = reasoning_of(message) or ""
    # llama.cpp's server answers a non-streamed continuation with the final assistant message
    # in front: the closed reasoning, markers included, in the content (or, parsed, the kept
    # reasoning as its reasoning). Neither is what the engine wrote after it.
    sent = continued.message
    if sent and own.startswith(sent):
        own = own[len(sent) :]
    elif parsed.strip("\n") == reasoning.strip("\n"):
        parsed = ""
    written = parsed + own
    for key in REASONING_KEYS:
        message.pop(key, None)
    for key in keys or REASONING_KEYS[:1]:
        message[key] = reasoning
    message["content"] = written
    _kept_as_completion(answer, prompt_tokens)


def _kept_as_completion(answer: dict[str, Any], prompt_tokens: Any) -> None:
    """The prefix's tokens, counted as prompt by the continuation (over the client request's
    own ``prompt_tokens``), counted as completion."""
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


def content_of(
    endpoint: str, answer: Mapping[str, Any] | None, channel: str = "content"
) -> str | None:
    """The text of a non-streamed answer's first choice in ``channel`` (chat: its content or
    its reasoning)."""
    if answer is None:
        return None
    if endpoint == "chat":
        message = first_message(answer)
        if message is None:
            return None
        if channel == "reasoning":
            return reasoning_of(message)
        text = message.get("content")
    else:
        choice = first_choice(answer)
        text = choice.get("text") if choice is not None else None
    return text if isinstance(text, str) else None


def reasoning_keys(endpoint: str, answer: Mapping[str, Any] | None) -> tuple[str, ...]:
    """The fields a non-streamed chat answer carries its reasoning in."""
    message = first_message(answer) if answer is not None and endpoint == "chat" else None
    if message is None:
        return ()
    return tuple(k for k in REASONING_KEYS if isinstance(message.get(k), str))


def reasoning_event(chunk_id: str | None, model: str, text: str, keys: tuple[str, ...]) -> bytes:
    """One streamed chunk carrying ``text`` as reasoning, in the fields ``keys``: the kept
    reasoning of a closed one, for a client that never saw it (it was held)."""
    choice = {
        "index": 0,
        "delta": dict.fromkeys(keys, text),
        "logprobs": None,
        "finish_reason": None,
    }
    return stream_event("chat", chunk_id, model, choice)


def text_event(endpoint: str, chunk_id: str | None, model: str, text: str) -> bytes:
    """One streamed chunk carrying ``text`` as the first choice's content: the part of a
    continuation's prefix that was held back from the client."""
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": None}
    if endpoint == "chat":
        choice["delta"] = {"content": text}
    else:
        choice["text"] = text
    return stream_event(endpoint, chunk_id, model, choice)
