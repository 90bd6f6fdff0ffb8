"""Answers of the wrong shape reach the client as the upstream sent them.

A 200 answer whose fields hold the wrong JSON types (a string index, a list for usage, a
number for a delta, a missing key) is not detproxy's to judge: with the audit sampling every
request, the loop watch on and the passive checks running, the client gets the upstream's bytes
(less the logprobs the audit itself asked for), streamed or not. The compiled build (mypyc)
checks annotations at run time, so this module also runs on ``tests/compiled_tree.py``'s copy,
where a value that does not match a type annotation raises instead of passing through.

The answers are mutants of a well-formed vLLM answer, drawn from a fixed seed: each replaces a
few values anywhere in the tree with junk, or deletes them.
"""

from __future__ import annotations

import copy
import json
import random
from collections.abc import AsyncIterator, Iterator
from typing import Any

import orjson
import pytest

from proxy.testing import MockUpstream, Received, Reply, not_found
from tests.helpers.sse import parse_sse
from tests.helpers.upstreams import MOCK_URL

Path = tuple[str | int, ...]

JUNK: list[Any] = [None, 0, -1, 7, 1.5, 2**70, "", "x", "0", True, [], [1, "a"], {}, {"a": 1}]
MUTANTS = 200


def token(text: str) -> dict[str, Any]:
    entry = {"token": text, "logprob": -0.25, "bytes": list(text.encode())}
    return {**entry, "top_logprobs": [entry]}


def chunk(delta: dict[str, Any], finish: str | None = None, logprobs: bool = True) -> Any:
    text = delta.get("content") or delta.get("reasoning") or ""
    choice = {
        "index": 0,
        "delta": delta,
        "logprobs": {"content": [token(text)]} if logprobs and text else None,
        "finish_reason": finish,
    }
    return {
        "id": "chatcmpl-junk",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [choice],
    }


WORDS = [f" w{i}" for i in range(8)]
USAGE = {"prompt_tokens": 5, "completion_tokens": 16, "total_tokens": 21}


def legacy_logprobs(words: list[str]) -> dict[str, Any]:
    """/v1/completions' logprobs (vllm-api.md: the legacy shape)."""
    offsets = [sum(map(len, words[:i])) for i in range(len(words))]
    return {
        "text_offset": offsets,
        "token_logprobs": [-0.25] * len(words),
        "tokens": words,
        "top_logprobs": [{w: -0.25} for w in words],
    }


def text_chunk(text: str, finish: str | None = None) -> dict[str, Any]:
    choice = {
        "index": 0,
        "text": text,
        "logprobs": legacy_logprobs([text]) if text else None,
        "finish_reason": finish,
        "stop_reason": None,
    }
    return {"id": "cmpl-junk", "object": "text_completion", "created": 1, "model": "m",
            "choices": [choice]}  # fmt: skip


def well_formed_stream(endpoint: str) -> list[Any]:
    if endpoint == "completions":
        texts = [text_chunk(w) for w in WORDS] + [text_chunk("", "length")]
        return [*texts, {"id": "cmpl-junk", "object": "text_completion", "created": 1,
                         "model": "m", "choices": [], "usage": USAGE}]  # fmt: skip
    chunks = [chunk({"role": "assistant", "content": ""})]
    chunks += [chunk({"reasoning": w}) for w in WORDS]
    chunks += [chunk({"content": w}) for w in WORDS]
    chunks.append(chunk({"content": ""}, "stop"))
    chunks.append({"id": "chatcmpl-junk", "object": "chat.completion.chunk", "choices": [],
                   "usage": USAGE})  # fmt: skip
    return chunks


def well_formed_answer(endpoint: str) -> dict[str, Any]:
    if endpoint == "completions":
        choice = {
            "index": 0,
            "text": "".join(WORDS),
            "logprobs": legacy_logprobs(WORDS),
            "finish_reason": "length",
            "stop_reason": None,
            "prompt_logprobs": None,
        }
        return {"id": "cmpl-junk", "object": "text_completion", "created": 1, "model": "m",
                "choices": [choice], "usage": USAGE}  # fmt: skip
    return {
        "id": "chatcmpl-junk",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "reasoning": "".join(WORDS),
                    "content": "".join(WORDS),
                },
                "logprobs": {"content": [token(w) for w in WORDS]},
                "finish_reason": "stop",
            }
        ],
        "usage": USAGE,
    }


def paths(value: Any, here: Path = ()) -> Iterator[Path]:
    yield here
    if isinstance(value, dict):
        for key, child in value.items():
            yield from paths(child, (*here, key))
    elif isinstance(value, list):
        for i, child in enumerate(value):
            yield from paths(child, (*here, i))


def mutate(value: Any, rng: random.Random) -> Any:
    """``value`` with one to three of its values replaced by junk or deleted."""
    value = copy.deepcopy(value)
    for _ in range(rng.randint(1, 3)):
        path = rng.choice(list(paths(value)))
        if not path:
            return copy.deepcopy(rng.choice(JUNK))
        parent = value
        for step in path[:-1]:
            parent = parent[step]
        if isinstance(parent, dict) and rng.random() < 0.3:
            del parent[path[-1]]
        else:
            parent[path[-1]] = copy.deepcopy(rng.choice(JUNK))
    return value


def dumps(value: Any) -> bytes:
    # json, not orjson: orjson refuses integers past 64 bits, which an upstream may still send.
    return json.dumps(value, separators=(",", ":")).encode()


def without_logprobs(value: Any) -> Any:
    """What the client gets of an answer to a request whose logprobs only the audit asked for:
    every choice's logprobs back to null (``proxy.openai.strip_logprobs``'s contract)."""
    if isinstance(value, dict) and isinstance(value.get("choices"), list):
        value = copy.deepcopy(value)
        for choice in value["choices"]:
            if isinstance(choice, dict) and choice.get("logprobs") is not None:
                choice["logprobs"] = None
    return value


class JunkUpstream:
    """A vLLM stand-in (``mock``, detproxy's upstream) that answers every request with
    ``answer`` (bytes of JSON), or streams ``events`` (each one SSE event, in its own piece)."""

    def __init__(self) -> None:
        self.answer = b""
        self.events: list[bytes] = []
        self.mock = MockUpstream(self.reply)
        self.primary: dict[str, Any] = {}  # the last request that was not a shadow

    def injected(self, client: dict[str, Any]) -> bool:
        """Whether detproxy asked the last primary request for logprobs the client did not
        (it does not when the audit's rate limit skips a request)."""
        return "logprobs" in self.primary and "logprobs" not in client

    def reply(self, request: Received) -> Reply:
        if request.method != "POST":  # detproxy's probes (/version, /metrics)
            return not_found(request)
        body = orjson.loads(request.body)
        if request.headers.get("x-detproxy-shadow") is None:
            self.primary = body
        if body.get("stream"):
            return Reply.sse(self.events, done=False)
        return Reply(200, (("content-type", "application/json"),), self.answer)


@pytest.fixture
async def junk_upstream() -> AsyncIterator[JunkUpstream]:
    upstream = JunkUpstream()
    async with upstream.mock:
        yield upstream


AUDITED = {
    "DETPROXY_AUDIT__SAMPLE_RATE": "1",
    "DETPROXY_LOOPS__POLICY": "retry",
    "DETPROXY_AUDIT__MAX_SHADOWS_PER_S": "100000",
}


def request(endpoint: str, stream: bool, asks_logprobs: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "m", "temperature": 0, "max_tokens": 16, "stream": stream}
    if endpoint == "completions":
        body["prompt"] = "junk"
    else:
        body["messages"] = [{"role": "user", "content": "junk"}]
    if stream:
        body["stream_options"] = {"include_usage": True}
    if asks_logprobs:
        body.update({"logprobs": 1} if endpoint == "completions" else {"logprobs": True,
                     "top_logprobs": 1})  # fmt: skip
    return body


PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
ENDPOINTS = pytest.mark.parametrize("endpoint", ["chat", "completions"])


@ENDPOINTS
@pytest.mark.parametrize("asks_logprobs", [True, False], ids=["client-logprobs", "injected"])
async def test_a_junk_whole_answer_reaches_the_client_unchanged(
    make_proxy: Any, junk_upstream: JunkUpstream, asks_logprobs: bool, endpoint: str
) -> None:
    client = await make_proxy(MOCK_URL, upstream=junk_upstream.mock, env=AUDITED)
    rng = random.Random(16)
    body = request(endpoint, False, asks_logprobs)
    for n in range(MUTANTS):
        answer = mutate(well_formed_answer(endpoint), rng)
        junk_upstream.answer = dumps(answer)
        resp = await client.post(PATHS[endpoint], json=body)
        got = await resp.read()
        where = f"mutant {n}: {junk_upstream.answer!r}"
        assert resp.status == 200, where
        if junk_upstream.injected(body):
            assert orjson.loads(got) == without_logprobs(answer), where
        else:
            assert got == junk_upstream.answer, where


@ENDPOINTS
@pytest.mark.parametrize("stream_mode", ["restart", "hold_reasoning"])
@pytest.mark.parametrize("asks_logprobs", [True, False], ids=["client-logprobs", "injected"])
async def test_a_junk_stream_reaches_the_client_unchanged(
    make_proxy: Any,
    junk_upstream: JunkUpstream,
    asks_logprobs: bool,
    stream_mode: str,
    endpoint: str,
) -> None:
    env = {**AUDITED, "DETPROXY_LOOPS__STREAM_MODE": stream_mode}
    client = await make_proxy(MOCK_URL, upstream=junk_upstream.mock, env=env)
    rng = random.Random(17 if stream_mode == "restart" else 18)
    body = request(endpoint, True, asks_logprobs)
    for n in range(MUTANTS):
        chunks = well_formed_stream(endpoint)
        for i in rng.sample(range(len(chunks)), rng.randint(1, 4)):
            chunks[i] = mutate(chunks[i], rng)
        junk_upstream.events = [b"data: " + dumps(c) + b"\n\n" for c in chunks]
        junk_upstream.events.append(b"data: [DONE]\n\n")
        resp = await client.post(PATHS[endpoint], json=body)
        got = await resp.read()
        sent = b"".join(junk_upstream.events)
        where = f"mutant {n}: {sent!r}"
        assert resp.status == 200, where
        if not junk_upstream.injected(body):
            assert got == sent, where
        else:
            expected = [without_logprobs(c) for c in chunks] + ["[DONE]"]
            assert parse_sse(got) == expected, where
