"""Bounded load: ``c`` streaming workers for a fixed window, each request timed token by token.

A window ends hard: at the deadline every request still in flight is cancelled (its connection
closed, so the upstream stops generating) and counted as ``cut``. Tokens that arrived before the
deadline count toward the sustained rate; nothing after it does, and the next level starts on an
upstream with no leftover work from this one.

Every time is read from ``clock`` (``time.monotonic`` unless a caller, a test, injects one);
waiting goes through asyncio, so a loop with virtual time drives the whole window.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from proxy.http.errors import UpstreamError
from proxy.http.sse import SSEDecoder, SSEOverflow
from proxy.http.upstream import Upstream, UpstreamResponse, url_auth
from proxy.openai import choice_text, completion_tokens_of, error_message
from proxy.tasks import TaskOwner

ERROR_BACKOFF_S = 0.1  # a worker whose request failed waits this long before the next one
TICK_S = 0.25  # how often a running window reports progress

Clock = Callable[[], float]  # seconds, monotonic

DEFAULT_PROMPTS = (
    "Explain in a few sentences how a hash table works.",
    "Write a short story about a lighthouse keeper.",
    "List ten uses for a paperclip and explain each briefly.",
    "Describe the water cycle to a ten-year-old.",
    "What are the trade-offs between TCP and UDP?",
    "Summarise the plot of a detective novel you invent.",
    "Give step-by-step instructions for making a cup of tea.",
    "Compare the climates of deserts and rainforests.",
)


@dataclass(frozen=True, slots=True)
class Target:
    """What each request looks like: where it goes and the body around its prompt."""

    base_url: str  # without the trailing /v1
    model: str
    max_tokens: int
    endpoint: str = "chat"  # chat | completions
    extra_body: Mapping[str, Any] = field(default_factory=dict)
    prompts: Sequence[str] = DEFAULT_PROMPTS
    api_key: str | None = None
    timeout_s: float = 120.0

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"

    @property
    def url(self) -> str:
        return self.base_url + self.path

    def headers(self) -> dict[str, str]:
        # A fresh connection per request: llama-server (cpp-httplib) gives each open
        # connection a thread from a small pool, and kept-alive idle ones starve it into
        # dropping new requests.
        headers = {
            "Content-Type": "application/json",
            "Accept": "text/event-stream",
            "Connection": "close",
        } | url_auth(self.base_url)
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def body(self, index: int, max_tokens: int | None = None) -> bytes:
        prompt = self.prompts[index % len(self.prompts)]
        body: dict[str, Any] = {"model": self.model}
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        body |= {
            "temperature": 0,
            "max_tokens": self.max_tokens if max_tokens is None else max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        body |= dict(self.extra_body)
        return orjson.dumps(body)


@dataclass(slots=True)
class RequestRecord:
    """One request as the client saw it (seconds of the sweep's clock)."""

    sent: float
    first_token: float | None = None
    last_token: float | None = None
    chunk_tokens: int = 0  # chunks that carried text: one token each, as servers stream them
    gaps: list[float] = field(default_factory=list)  # between consecutive text chunks
    usage_tokens: int | None = None
    finish_seen: bool = False
    done: bool = False
    error: str | None = None

    @property
    def tokens(self) -> int:
        """The server's count when the request completed and reported usage, else the chunks."""
        if self.done and self.usage_tokens is not None:
            return self.usage_tokens
        return self.chunk_tokens

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.sent


def record_event(rec: RequestRecord, payload: Any, now: float, deadline: float) -> None:
    """Count one parsed SSE event of ``rec``'s stream, read at ``now``: its usage, an in-band
    error, a finish, and a token (a chunk with text) up to ``deadline``."""
    if not isinstance(payload, dict):
        return
    message = error_message(payload) if "choices" not in payload else None
    if message is not None:
        rec.error = f"in-band error: {message[:200]}"
        return
    tokens = completion_tokens_of(payload)
    if tokens is not None:
        rec.usage_tokens = tokens
    choices = payload.get("choices")
    if not isinstance(choices, list):
        return
    if any(isinstance(c, dict) and c.get("finish_reason") for c in choices):
        rec.finish_seen = True
    if now > deadline or not any(type(c) is dict and choice_text(c) for c in choices):
        return
    if rec.first_token is None:
        rec.first_token = now
    elif rec.last_token is not None:
        rec.gaps.append(now - rec.last_token)
    rec.last_token = now
    rec.chunk_tokens += 1


async def stream_request(
    upstream: Upstream,
    target: Target,
    body: bytes,
    rec: RequestRecord,
    deadline: float = float("inf"),
    clock: Clock = time.monotonic,
) -> None:
    """Send one streaming request and fill ``rec``; failures land in ``rec.error``. Cancelled
    (a window's end), its connection is closed: the upstream stops generating."""
    resp: UpstreamResponse | None = None
    try:
        async with asyncio.timeout(target.timeout_s):
            resp = await upstream.send("POST", target.path, target.headers(), body)
            await _read_stream(resp, rec, deadline, clock)
    except (UpstreamError, TimeoutError, SSEOverflow, orjson.JSONDecodeError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    finally:
        if resp is not None:
            resp.close()


async def _read_stream(
    resp: UpstreamResponse, rec: RequestRecord, deadline: float, clock: Clock
) -> None:
    if resp.status != 200:
        text = (await resp.read())[:300].decode("utf-8", "replace")
        rec.error = f"HTTP {resp.status}: {text}"
        return
    decoder = SSEDecoder()
    async for chunk in resp.chunks():
        now = clock()
        for event in decoder.feed(chunk):
            if event.data is None:
                continue
            if event.is_done:
                rec.done = now <= deadline
                return
            record_event(rec, orjson.loads(event.data), now, deadline)
            if rec.error is not None:
                return
    if rec.finish_seen:  # no [DONE], but the server said it had finished
        rec.done = clock() <= deadline
    else:
        rec.error = "stream ended before it finished"


@dataclass(slots=True)
class Window:
    """One level of one repeat while it runs (and after): what the workers recorded."""

    concurrency: int
    repeat: int
    duration_s: float
    start: float = 0.0
    records: list[RequestRecord] = field(default_factory=list)

    @property
    def deadline(self) -> float:
        return self.start + self.duration_s

    def tokens(self) -> int:
        return sum(r.tokens for r in self.records)


async def _worker(
    upstream: Upstream,
    target: Target,
    window: Window,
    counter: Iterator[int],
    clock: Clock,
) -> None:
    while (now := clock()) < window.deadline:
        rec = RequestRecord(sent=now)
        window.records.append(rec)
        body = target.body(next(counter))
        await stream_request(upstream, target, body, rec, window.deadline, clock)
        if rec.error is not None:
            await asyncio.sleep(max(0.0, min(ERROR_BACKOFF_S, window.deadline - clock())))


async def run_window(
    upstream: Upstream,
    target: Target,
    window: Window,
    on_tick: Callable[[Window], None] | None = None,
    clock: Clock = time.monotonic,
) -> Window:
    """Keep ``window.concurrency`` requests in flight until the deadline, then cut the rest."""
    window.start = clock()
    counter = itertools.count()
    owner = TaskOwner("sweep")
    tasks = [
        owner.spawn(_worker(upstream, target, window, counter, clock), name=f"worker-{i}")
        for i in range(window.concurrency)
    ]
    try:
        while (left := window.deadline - clock()) > 0:
            await asyncio.sleep(min(TICK_S, left))
            if on_tick is not None:
                on_tick(window)
    finally:
        for task in tasks:
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
    for result in results:
        if isinstance(result, Exception):
            raise result
    return window
