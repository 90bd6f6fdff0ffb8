"""A closed reasoning continued through the engine's rendered prompt, for chat templates that
drop the reasoning of assistant messages.

``close_reasoning`` (and a streamed reasoning loop under ``stream_mode = "continue"``) sends
the kept reasoning, between the model's markers, as a final assistant message with
``continue_final_message``. DeepSeek-R1's distills and QwQ render an assistant message as what
follows its ``</think>`` only: the reasoning is lost, and since the rendered chat no longer
holds the final message, transformers' ``apply_chat_template`` (vLLM's renderer) refuses to
continue it (vLLM answers 400: the retry is refused). For those templates the continuation is
sent to ``/v1/completions`` instead, its prompt the token ids of the conversation as the
engine's own template renders it (vLLM's ``POST /tokenize`` with ``messages`` and
``add_generation_prompt``) followed by the closed reasoning's (a list of ids: a string prompt
would get a second BOS); where the generation prompt opens the reasoning itself (both of those
templates do), the closed reasoning goes on from that marker. The answer comes back as the
chat answer the chat continuation gives (``RenderedResponse``): whole, a ``chat.completion``
shaped as the looping answer, under its id; streamed, ``chat.completion.chunk`` events with
``delta.content``.

A ``continue`` of content that came after a reasoning is the same case: the chat continuation
sends the reasoning as the final assistant message's ``reasoning``, which those templates drop
too (the engine would go on without it); the rendered prompt holds it between the markers,
the kept content after them, and what the engine writes is content.

Whether a model's template drops assistant reasoning is asked of the engine once per model (a
two-turn conversation rendered: do the assistant turn's reasoning tokens survive?) or declared
per model (``[[loops.reasoning_markers]]`` ``rendered_continuation``). Anything that fails on
the way (no vLLM ``/tokenize``: llama.cpp's server has another; a request ``/v1/completions``
cannot honour, such as tools) leaves the chat continuation as it was; a refused completions
request is the caller's refused retry. Nothing here runs for ordinary traffic: only a retry
that goes on after a reasoning asks.
"""

from __future__ import annotations

import asyncio
import fnmatch
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.config import ReasoningMarkersConfig
from proxy.events import EventBus, TemplateProbed
from proxy.http.errors import UpstreamError
from proxy.http.headers import HeaderFields
from proxy.http.sse import Decoded, SSEDecoder, SSEEvent
from proxy.http.upstream import Sink, Upstream, UpstreamResponse
from proxy.loops.continuation import Continued, closed_reasoning
from proxy.openai import REASONING_KEYS

# What the probe renders: a user turn and an assistant turn whose reasoning holds SENTINEL.
# Several words: the middle of their tokens is the same alone and in context.
PROBE_USER = "copper lantern meadow harbor"
SENTINEL = "amber falcon juniper seventeen quartz"
# A failed probe (no /tokenize, an engine down) is asked again after this long.
RETRY_PROBE_S = 300.0
MAX_MODELS = 1024  # probed models remembered (names come from clients)
# Fields of a chat request that /v1/completions cannot honour: the chat continuation stays.
UNSUPPORTED = frozenset(
    {
        "tools",
        "functions",
        "function_call",
        "response_format",
        "structured_outputs",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "logprobs",
        "top_logprobs",
        "prompt_logprobs",
        "echo",
        "audio",
        "modalities",
        "prediction",
        "web_search_options",
        "documents",
        "mm_processor_kwargs",
    }
)
# Chat-only fields: left out of the completions request (the template's, read by /tokenize).
CHAT_ONLY = frozenset(
    {
        "messages",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template",
        "chat_template_kwargs",
        "include_reasoning",
        "reasoning_effort",
        "tool_choice",
        "parallel_tool_calls",
        "max_completion_tokens",
        "max_tokens",
        "n",
    }
)
# Passed to /tokenize so that it renders as the chat request would have.
TEMPLATE_FIELDS = ("chat_template", "chat_template_kwargs")


@dataclass(frozen=True, slots=True)
class Template:
    """What a probe learnt of a model's template: whether it drops the reasoning of an
    assistant message, and the token ids of its reasoning start marker."""

    drops_reasoning: bool
    start_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Paths:
    tokenize: str
    completions: str


def paths_of(raw_path: str) -> Paths | None:
    """vLLM's /tokenize and /v1/completions beside a chat request's path (None: not one)."""
    path, sep, query = raw_path.partition("?")
    suffix = "/chat/completions"
    if not path.endswith("/v1" + suffix):
        return None
    root = path[: -len(suffix)]  # .../v1
    return Paths(root[: -len("/v1")] + "/tokenize", root + "/completions" + sep + query)


def supported(body: Mapping[str, Any]) -> bool:
    """Whether /v1/completions can answer this chat continuation as the chat endpoint would:
    one choice, no tools or structured output, text-only messages."""
    for name in UNSUPPORTED:
        if body.get(name):
            return False
    if body.get("n") not in (None, 1):
        return False
    messages = body.get("messages")
    if type(messages) is not list or len(messages) < 2:
        return False
    for message in messages:
        if type(message) is not dict:
            return False
        content = message.get("content")
        if type(content) is list:
            if any(type(p) is not dict or p.get("type") != "text" for p in content):
                return False
        elif content is not None and type(content) is not str:
            return False
    return True


def contains(ids: Sequence[int], part: Sequence[int]) -> bool:
    """Whether ``part`` (not empty) is a contiguous run of ``ids``."""
    n = len(part)
    if n == 0:
        return False
    first = part[0]
    for at in range(len(ids) - n + 1):
        if ids[at] == first and list(ids[at : at + n]) == list(part):
            return True
    return False


def core(ids: Sequence[int]) -> list[int]:
    """The middle of a text's tokens: the same alone and after other text."""
    return list(ids[1:-1]) if len(ids) >= 3 else list(ids)


def completion_body(
    body: Mapping[str, Any], prompt: list[int], max_model_len: int
) -> dict[str, Any]:
    """The /v1/completions request for a chat continuation ``body``: its sampling (the
    client's and the ladder's overrides), ``prompt`` the rendered token ids."""
    out = {k: v for k, v in body.items() if k not in CHAT_ONLY}
    limit = body.get("max_completion_tokens")
    if type(limit) is not int:
        limit = body.get("max_tokens")
    if type(limit) is not int:
        # The chat default (all that is left of the context); /v1/completions' is 16.
        limit = max_model_len - len(prompt)
    out["prompt"] = prompt
    out["max_tokens"] = limit
    return out


class RenderedContinuation:
    """Per app: which models' templates drop assistant reasoning, and the continuation of a
    closed reasoning through the rendered prompt for them."""

    def __init__(
        self,
        markers: Sequence[ReasoningMarkersConfig],
        bus: EventBus | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._markers = list(markers)
        self._bus = bus
        self._clock = clock
        # model -> what its probe learnt (None: it failed), and when.
        self._templates: dict[str, tuple[Template | None, float]] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def markers(self, model: str) -> ReasoningMarkersConfig:
        return next(
            (m for m in self._markers if fnmatch.fnmatchcase(model, m.models)),
            ReasoningMarkersConfig(),
        )

    async def open(
        self,
        upstream: Upstream,
        raw_path: str,
        headers: HeaderFields,
        body: Mapping[str, Any],
        continued: Continued,
        first: Mapping[str, Any] | None = None,
    ) -> UpstreamResponse | None:
        """Send ``body``, a chat continuation of a closed reasoning (or of content after a
        reasoning), as a completions request on the rendered prompt where the model's
        template drops assistant reasoning; its answer reads as the chat one (``first``: the
        looping attempt's whole answer, whose shape and id it takes). None: the chat
        continuation is sent instead. Raises what the upstream's ``send`` raises for the
        completions request itself."""
        model = body.get("model")
        paths = paths_of(raw_path)
        if (
            not (continued.closes_reasoning or continued.reasoning)
            or type(model) is not str
            or paths is None
            or not supported(body)
        ):
            return None
        messages = body["messages"]
        last = messages[-1]
        if last.get("role") != "assistant" or last.get("content") != continued.message:
            return None
        marks = self.markers(model)
        if marks.rendered_continuation == "never":
            return None
        template = await self._template(upstream, paths, headers, model, marks)
        if marks.rendered_continuation == "auto" and (
            template is None or not template.drops_reasoning
        ):
            return None
        start_ids = template.start_ids if template is not None else ()
        prompt = await self._prompt(upstream, paths, headers, body, continued, marks, start_ids)
        if prompt is None:
            return None
        ids, max_model_len = prompt
        request = completion_body(body, ids, max_model_len)
        if request["max_tokens"] < 1:
            return None
        inner = await upstream.send("POST", paths.completions, headers, orjson.dumps(request))
        stream = body.get("stream") is True
        return RenderedResponse(inner, stream, first)

    # -- the template --------------------------------------------------------------------------

    async def _template(
        self,
        upstream: Upstream,
        paths: Paths,
        headers: HeaderFields,
        model: str,
        marks: ReasoningMarkersConfig,
    ) -> Template | None:
        known = self._known(model)
        if known is not None:
            return known[0]
        # One probe per model: the recoveries that need it meanwhile wait for its answer.
        lock = self._locks.setdefault(model, asyncio.Lock())
        async with lock:
            known = self._known(model)
            if known is not None:
                return known[0]
            template = await self._probe(upstream, paths, headers, model, marks)
            if self._bus is not None:
                drops = template.drops_reasoning if template is not None else None
                self._bus.publish(TemplateProbed(model, drops))
            if len(self._templates) >= MAX_MODELS and model not in self._templates:
                self._templates.pop(next(iter(self._templates)))
            self._templates[model] = (template, self._clock())
        if len(self._locks) > MAX_MODELS:
            self._locks.clear()
        return template

    def _known(self, model: str) -> tuple[Template | None] | None:
        """What the model's probe learnt, where it holds (a failure is asked again later)."""
        known = self._templates.get(model)
        if known is None:
            return None
        template, at = known
        if template is None and self._clock() - at >= RETRY_PROBE_S:
            return None
        return (template,)

    async def _probe(
        self,
        upstream: Upstream,
        paths: Paths,
        headers: HeaderFields,
        model: str,
        marks: ReasoningMarkersConfig,
    ) -> Template | None:
        """Render a conversation whose assistant turn reasons SENTINEL: where its tokens are
        missing from the render (the user turn's present), the template drops it. The turn is
        rendered complete: continued, a template that cuts it is an error (transformers')."""
        conversation = [
            {"role": "user", "content": PROBE_USER},
            {
                "role": "assistant",
                "content": f"{marks.start}\n{SENTINEL}\n{marks.end}\n\nok",
            },
        ]
        rendered, sentinel, user, start = await asyncio.gather(
            _tokenize(
                upstream,
                paths,
                headers,
                {
                    "model": model,
                    "messages": conversation,
                    "add_generation_prompt": False,
                },
            ),
            _tokenize_text(upstream, paths, headers, model, SENTINEL),
            _tokenize_text(upstream, paths, headers, model, PROBE_USER),
            _tokenize_text(upstream, paths, headers, model, marks.start),
        )
        if rendered is None or sentinel is None or user is None or start is None:
            return None
        ids = rendered[0]
        if not contains(ids, core(user[0])):
            return None  # not a render of the conversation (another server's /tokenize)
        return Template(not contains(ids, core(sentinel[0])), tuple(start[0]))

    # -- the prompt ----------------------------------------------------------------------------

    async def _prompt(
        self,
        upstream: Upstream,
        paths: Paths,
        headers: HeaderFields,
        body: Mapping[str, Any],
        continued: Continued,
        marks: ReasoningMarkersConfig,
        start_ids: tuple[int, ...],
    ) -> tuple[list[int], int] | None:
        """The token ids of the conversation before the final message, rendered with its
        generation prompt, then of the closed reasoning (a continued content's: its reasoning
        between the markers, then the content); and the model's context length."""
        model = body["model"]
        request: dict[str, Any] = {
            "model": model,
            "messages": body["messages"][:-1],
            "add_generation_prompt": True,
        }
        for name in TEMPLATE_FIELDS:
            if body.get(name) is not None:
                request[name] = body[name]
        rendered = await _tokenize(upstream, paths, headers, request)
        if rendered is None:
            return None
        ids, max_model_len = rendered
        text = continued.message
        if not continued.closes_reasoning:
            text = closed_reasoning(continued.reasoning, marks.start, marks.end) + text
        at = opened(ids, start_ids)
        if at is not None and text.startswith(marks.start):
            # The generation prompt opens the reasoning itself (R1's distills, QwQ): the closed
            # reasoning goes on from its marker, not a second one.
            text = text[len(marks.start) :]
            if at:
                text = text.lstrip("\n")
        kept = await _tokenize_text(upstream, paths, headers, model, text)
        if kept is None:
            return None
        return ids + kept[0], max_model_len


def opened(ids: Sequence[int], start: Sequence[int]) -> bool | None:
    """Whether the rendered generation prompt ends with the reasoning start marker: False
    right at its end, True with a token or two after it (its newline); None: it does not."""
    n = len(start)
    if n == 0 or len(ids) < n:
        return None
    if list(ids[-n:]) == list(start):
        return False
    for after in (1, 2):
        if len(ids) >= n + after and list(ids[-n - after : -after]) == list(start):
            return True
    return None


async def _tokenize_text(
    upstream: Upstream, paths: Paths, headers: HeaderFields, model: str, text: str
) -> tuple[list[int], int] | None:
    request = {"model": model, "prompt": text, "add_special_tokens": False}
    return await _tokenize(upstream, paths, headers, request)


async def _tokenize(
    upstream: Upstream, paths: Paths, headers: HeaderFields, request: dict[str, Any]
) -> tuple[list[int], int] | None:
    """vLLM's /tokenize: the token ids and the model's context length; None when it failed
    or answered in another shape."""
    try:
        response = await upstream.send("POST", paths.tokenize, headers, orjson.dumps(request))
    except UpstreamError:
        return None
    try:
        if response.status != 200:
            return None
        payload = await response.read()
    except UpstreamError:
        return None
    finally:
        response.close()
    try:
        answer = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None
    if type(answer) is not dict:
        return None
    tokens, limit = answer.get("tokens"), answer.get("max_model_len")
    if type(tokens) is not list or type(limit) is not int:
        return None
    if not all(type(t) is int for t in tokens):
        return None
    return tokens, limit


# -- the answer, as chat -----------------------------------------------------------------------


def chat_id(completion_id: Any) -> Any:
    """A completions id as its chat form (vLLM: ``cmpl-`` and ``chatcmpl-``)."""
    if type(completion_id) is str and completion_id.startswith("cmpl-"):
        return "chat" + completion_id
    return completion_id


def chat_answer(answer: dict[str, Any], first: Mapping[str, Any] | None) -> dict[str, Any]:
    """A whole ``text_completion`` answer as a ``chat.completion``, shaped as ``first`` (the
    looping attempt's chat answer: its fields, id and model), the text as content."""
    choices = answer.get("choices")
    source = choices[0] if type(choices) is list and choices and type(choices[0]) is dict else {}
    text = source.get("text")
    first_choices = first.get("choices") if first is not None else None
    shape: Mapping[str, Any] = (
        first_choices[0]
        if type(first_choices) is list and first_choices and type(first_choices[0]) is dict
        else {}
    )
    shaped_message = shape.get("message")
    message: dict[str, Any] = (
        dict(shaped_message) if type(shaped_message) is dict else {"role": "assistant"}
    )
    message["content"] = text if type(text) is str else ""
    for key in REASONING_KEYS:
        if key in message:
            message[key] = None
    if message.get("tool_calls"):
        message["tool_calls"] = []
    choice: dict[str, Any] = dict(shape) if shape else {"index": 0}
    choice["message"] = message
    choice["logprobs"] = None
    choice["finish_reason"] = source.get("finish_reason")
    if "stop_reason" in source or "stop_reason" in choice:
        choice["stop_reason"] = source.get("stop_reason")
    out: dict[str, Any]
    if first is not None:
        out = dict(first)
    else:
        out = {k: v for k, v in answer.items() if k != "choices"}
        out["id"] = chat_id(answer.get("id"))
    out["object"] = "chat.completion"
    out["choices"] = [choice]
    if "usage" in answer:
        first_usage = first.get("usage") if first is not None else None
        details = type(first_usage) is dict and "completion_tokens_details" in first_usage
        out["usage"] = chat_usage(answer["usage"], details)
    return out


def chat_usage(usage: Any, details: bool) -> Any:
    """A completion's usage as a chat answer's: ``details``, with the reasoning tokens a
    reasoning parser counts (none: what follows a closed reasoning is the answer)."""
    if type(usage) is not dict or not details or "completion_tokens_details" in usage:
        return usage
    return {**usage, "completion_tokens_details": {"reasoning_tokens": 0}}


def chat_chunk(chunk: dict[str, Any]) -> dict[str, Any]:
    """A streamed ``text_completion`` chunk as a ``chat.completion.chunk``: each choice's
    text as its delta's content, its finish_reason carried, its usage kept."""
    out = dict(chunk)
    out["id"] = chat_id(chunk.get("id"))
    out["object"] = "chat.completion.chunk"
    if "usage" in chunk:
        # A reasoning parser is on (the loop was in the reasoning): its usage counts them.
        out["usage"] = chat_usage(chunk["usage"], True)
    choices = chunk.get("choices")
    if type(choices) is list:
        converted: list[Any] = []
        for choice in choices:
            if type(choice) is not dict:
                converted.append(choice)
                continue
            text = choice.get("text")
            new: dict[str, Any] = {
                "index": choice.get("index", 0),
                "delta": {"content": text if type(text) is str else ""},
                "logprobs": None,
                "finish_reason": choice.get("finish_reason"),
            }
            if "stop_reason" in choice and choice.get("finish_reason") is not None:
                new["stop_reason"] = choice["stop_reason"]
            converted.append(new)
        out["choices"] = converted
    return out


def role_chunk(chunk: Mapping[str, Any]) -> dict[str, Any]:
    """The first chunk of a chat stream (vLLM's): the assistant role, empty content."""
    return {
        "id": chat_id(chunk.get("id")),
        "object": "chat.completion.chunk",
        "created": chunk.get("created", int(time.time())),
        "model": chunk.get("model"),
        "choices": [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ],
    }


class ChatEvents:
    """Completions SSE bytes in (any split), chat SSE events out: each ``data:`` object
    converted, [DONE], comments and errors as they came."""

    def __init__(self) -> None:
        self._decoder = SSEDecoder()
        self._started = False

    def events(self, data: bytes) -> list[SSEEvent]:
        """The chat events of a read's complete completions events."""
        out: list[SSEEvent] = []
        for event in self._decoder.feed(data):
            payload = event.data
            if payload is None or event.is_done:
                out.append(event)
                continue
            try:
                chunk = orjson.loads(payload)
            except orjson.JSONDecodeError:
                out.append(event)
                continue
            if type(chunk) is not dict or "error" in chunk or "choices" not in chunk:
                out.append(event)
                continue
            if not self._started:
                self._started = True
                out.append(_event(role_chunk(chunk)))
            out.append(_event(chat_chunk(chunk)))
        return out

    def feed(self, data: bytes) -> bytes:
        """The chat events' bytes."""
        return b"".join([event.raw for event in self.events(data)])


def _event(chunk: dict[str, Any]) -> SSEEvent:
    data = orjson.dumps(chunk)
    return SSEEvent(b"data: " + data + b"\n\n", data)


class RenderedResponse:
    """The completions answer to a rendered continuation, read as the chat answer the chat
    continuation would have given; an error answer (not 200) as it came."""

    def __init__(
        self, inner: UpstreamResponse, stream: bool, first: Mapping[str, Any] | None
    ) -> None:
        self._inner = inner
        self._stream = stream
        self._first = first
        self._events = ChatEvents()
        self.status = inner.status
        self.raw_fields = inner.raw_fields

    @property
    def headers(self) -> Mapping[str, str]:
        return self._inner.headers

    def _convert(self, data: bytes) -> bytes:
        return self._events.feed(data) if self.status == 200 else data

    async def chunks(self) -> AsyncIterator[bytes]:
        async for data in self._inner.chunks():
            converted = self._convert(data)
            if converted:
                yield converted

    async def pump(self, sink: Sink) -> bool:
        def convert(data: bytes) -> bool:
            converted = self._convert(data)
            return sink(converted) if converted else True

        return await self._inner.pump(convert)

    async def pump_decoded(self, sink: Callable[[Decoded], bool]) -> bool:
        """As ``pump`` (a 200 stream), each read's chat events handed on as cut
        (``proxy.http.sse.DecodedReads``): the relay reads them without decoding the bytes
        they were encoded to again."""
        events = self._events

        def convert(data: bytes) -> bool:
            converted = events.events(data)
            return sink(Decoded(None, converted)) if converted else True

        return await self._inner.pump(convert)

    async def read(self) -> bytes:
        payload = await self._inner.read()
        if self.status != 200 or self._stream:
            return self._convert(payload) if self._stream else payload
        try:
            answer = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return payload
        if type(answer) is not dict:
            return payload
        return orjson.dumps(chat_answer(answer, self._first))

    def close(self) -> None:
        self._inner.close()
