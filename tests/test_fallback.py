"""Requests detproxy altered that the upstream refuses: the client's own request goes instead.

The scripted upstream below refuses exactly what real servers refuse: vLLM 0.23 answers 400
("Out of range float values are not JSON compliant: nan") to a non-streamed request asking for
logprobs a model computes as NaN, and streams them as ``null``; a server that opens a stream with
an error about logprobs; a server that rejects ``repetition_detection``. Every client request
through detproxy must answer as it does without detproxy. An error that is not about what
detproxy added (an unknown model, a 5xx, ...) is the client's: answered once, as it came.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import orjson
import pytest
from prometheus_client import CollectorRegistry

from proxy.app import BUS
from proxy.config import LogConfig
from proxy.observe.log import EventLog
from proxy.testing import MockUpstream, Received, Reply, answers
from tests.helpers.metrics import metric, metric_total
from tests.helpers.settings import NO_SHADOWS
from tests.helpers.sse import sse_event
from tests.helpers.upstreams import MOCK_URL
from tests.helpers.waiting import eventually, settle

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
NAN = "Out of range float values are not JSON compliant: nan"
STREAMED_LOGPROBS_REFUSED = {
    "message": "top_logprobs: streaming logprobs is not supported by this model",
    "type": "BadRequestError",
    "param": "top_logprobs",
    "code": 400,
}
AUDIT_ALL = {"DETPROXY_AUDIT__SAMPLE_RATE": "1.0", "DETPROXY_UPSTREAM__FINGERPRINT_INTERVAL_S": "0"}


def asks_logprobs(body: dict[str, Any]) -> bool:
    value = body.get("logprobs")
    return value is True or (isinstance(value, int) and not isinstance(value, bool))


def vllm_error(status: int, message: str) -> Reply:
    return Reply.error(status, message)


def json_answer(body: dict[str, Any]) -> Reply:
    """A whole answer as aiohttp's ``json_response`` writes it (``json.dumps``: spaced, which
    detproxy's own orjson would not write: its bytes show whether they were passed on)."""
    return Reply(
        200, (("Content-Type", "application/json; charset=utf-8"),), json.dumps(body).encode()
    )


def answer(path: str, body: dict[str, Any]) -> dict[str, Any]:
    if path == CHAT:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": "Paris."}}
    else:
        choice = {"index": 0, "text": " Paris."}
    choice |= {"finish_reason": "stop", "logprobs": None}
    return {"id": "x-1", "model": body.get("model"), "choices": [choice]}


def chunk(path: str, text: str, finish: str | None, lp: bool) -> bytes:
    logprobs = None
    if lp and path == CHAT:
        entry = {"token": text, "logprob": None, "top_logprobs": [{"token": text, "logprob": None}]}
        logprobs = {"content": [entry]}
    elif lp:
        logprobs = {"tokens": [text], "token_logprobs": [None], "top_logprobs": [{text: None}]}
    c: dict[str, Any] = {"index": 0, "logprobs": logprobs, "finish_reason": finish}
    c |= {"delta": {"content": text}} if path == CHAT else {"text": text}
    return sse_event({"id": "x-1", "choices": [c]})


class Refusing:
    """A scripted vLLM: ``mode`` says what it refuses. Records every body it was sent."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.bodies: list[dict[str, Any]] = []

    def route(self, upstream: MockUpstream) -> None:
        """Answer ``upstream``'s chat and completions requests."""
        upstream.on(CHAT, self.handle)
        upstream.on(COMPLETIONS, self.handle)

    def handle(self, request: Received) -> Reply:
        body = request.json()
        self.bodies.append(body)
        lp = asks_logprobs(body)
        if body.get("model") == "unknown":
            return vllm_error(404, "The model `unknown` does not exist.")
        if self.mode == "repetition" and "repetition_detection" in body:
            return vllm_error(400, "repetition_detection: Extra inputs are not permitted")
        if body.get("presence_penalty") is not None and self.mode == "no_overrides":
            return vllm_error(400, "presence_penalty is not supported")
        if not body.get("stream"):
            if lp and self.mode == "nan":
                return vllm_error(400, NAN)
            return json_answer(answer(request.path, body))
        if lp and self.mode == "stream_error_first":
            return Reply.sse([sse_event({"error": STREAMED_LOGPROBS_REFUSED})])
        nan = lp and self.mode == "nan"
        path = request.path
        return Reply.sse([chunk(path, " Paris", None, nan), chunk(path, ".", "stop", nan)])


async def direct(upstream: MockUpstream, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
    """What the client gets from the upstream without detproxy: its request sent to it."""
    head = {"Content-Type": "application/json"}
    resp = await upstream.send("POST", path, head, orjson.dumps(body))
    return resp.status, await resp.read()


def request_body(path: str, stream: bool, model: str = "m") -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "temperature": 0, "max_tokens": 8, "stream": stream}
    if path == CHAT:
        body["messages"] = [{"role": "user", "content": "Capital of France?"}]
    else:
        body["prompt"] = "The capital of France is"
    return body


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize(
    ("mode", "stream"),
    [("nan", False), ("stream_error_first", True)],
)
async def test_audited_requests_answer_as_without_detproxy(
    mock_upstream: MockUpstream,
    make_proxy: Any,
    registry: CollectorRegistry,
    path: str,
    mode: str,
    stream: bool,
) -> None:
    scripted = Refusing(mode)
    scripted.route(mock_upstream)
    proxy = await make_proxy(MOCK_URL, upstream=mock_upstream, env=AUDIT_ALL)
    body = request_body(path, stream)
    expected_status, expected = await direct(mock_upstream, path, body)
    assert expected_status == 200
    scripted.bodies.clear()
    for _ in range(5):
        resp = await proxy.post(path, json=body)
        got = await resp.read()
        assert resp.status == 200, got
        assert got == expected  # byte for byte: the scripted answers carry no ids or times
    endpoint = "chat" if path == CHAT else "completions"
    failures = metric(
        registry,
        "detproxy_injection_failures_total",
        model="m",
        endpoint=endpoint,
        kind="logprobs",
        status="200" if stream else "400",
    )
    assert failures == 3  # then suspended: the 4th and 5th are not altered
    assert metric(registry, "detproxy_injection_suspended", model="m", kind="logprobs") == 1
    state = (await (await proxy.get("/detproxy/status")).json())["injection"]["m"]["logprobs"]
    assert state["suspended"] is True
    assert state["failures_total"] == 3
    assert state["last_reason"]
    # Three refused altered requests, each followed by the client's own (no shadow: the
    # client's own answer has no logprobs to compare), then two sent as the client sent them.
    assert len(scripted.bodies) == 3 * 2 + 2
    assert [asks_logprobs(b) for b in scripted.bodies] == [True, False] * 3 + [False] * 2


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_streamed_nan_logprobs_are_relayed_and_refused_shadows_suspend_the_audit(
    mock_upstream: MockUpstream, make_proxy: Any, registry: CollectorRegistry, path: str
) -> None:
    """vLLM streams NaN logprobs as null (the stream works) but refuses them non-streamed, so
    every shadow fails: three in a row suspend the model's logprob injection."""
    scripted = Refusing("nan")
    scripted.route(mock_upstream)
    proxy = await make_proxy(MOCK_URL, upstream=mock_upstream, env=AUDIT_ALL)
    body = request_body(path, stream=True)
    _, expected = await direct(mock_upstream, path, body)
    for _ in range(3):
        resp = await proxy.post(path, json=body)
        assert resp.status == 200
        assert await resp.read() == expected
        # One at a time: each shadow is answered before the next request is planned.
        await eventually(
            lambda: any(not b.get("stream") for b in scripted.bodies[-1:]),
            what="the shadow sent upstream",
        )
    endpoint = "chat" if path == CHAT else "completions"
    await eventually(
        lambda: metric(registry, "detproxy_injection_suspended", model="m", kind="logprobs") == 1,
        what="logprobs injection suspended",
    )
    labels = {"model": "m", "endpoint": endpoint, "kind": "logprobs", "status": "400"}
    assert metric(registry, "detproxy_injection_failures_total", **labels) == 3
    assert metric(registry, "detproxy_shadow_dropped_total", reason="upstream_error") == 3
    scripted.bodies.clear()
    resp = await proxy.post(path, json=body)
    assert await resp.read() == expected
    assert [asks_logprobs(b) for b in scripted.bodies] == [False]  # suspended: sent as is


async def test_suspension_stops_injecting(
    mock_upstream: MockUpstream, make_proxy: Any, registry: CollectorRegistry
) -> None:
    scripted = Refusing("nan")
    scripted.route(mock_upstream)
    env = AUDIT_ALL | {"DETPROXY_INJECTION__FAILURES_TO_SUSPEND": "2"}
    proxy = await make_proxy(MOCK_URL, upstream=mock_upstream, env=env)
    body = request_body(CHAT, stream=False)
    for _ in range(2):
        assert (await proxy.post(CHAT, json=body)).status == 200
    scripted.bodies.clear()
    for _ in range(3):
        resp = await proxy.post(CHAT, json=body)
        assert resp.status == 200
    # Suspended: each request went upstream once, as the client sent it; no shadows either.
    assert len(scripted.bodies) == 3
    assert not any(asks_logprobs(b) for b in scripted.bodies)
    assert metric(registry, "detproxy_shadow_dropped_total", reason="injection_suspended") == 3
    assert (
        metric(
            registry, "detproxy_fallbacks_total", model="m", endpoint="chat", outcome="recovered"
        )
        == 2
    )


async def test_a_client_that_asks_logprobs_itself_is_still_audited_while_suspended(
    mock_upstream: MockUpstream, make_proxy: Any, registry: CollectorRegistry
) -> None:
    scripted = Refusing("stream_error_first")
    scripted.route(mock_upstream)
    env = AUDIT_ALL | {"DETPROXY_INJECTION__FAILURES_TO_SUSPEND": "1"}
    proxy = await make_proxy(MOCK_URL, upstream=mock_upstream, env=env)
    await (await proxy.post(CHAT, json=request_body(CHAT, stream=True))).read()
    assert metric(registry, "detproxy_injection_suspended", model="m", kind="logprobs") == 1
    scripted.bodies.clear()
    own = request_body(CHAT, stream=False) | {"logprobs": True}
    resp = await proxy.post(CHAT, json=own)
    assert resp.status == 200
    await resp.read()
    # Its own logprobs need no injection: the primary and its shadow both went upstream.
    await eventually(lambda: len(scripted.bodies) == 2, what="the primary and its shadow upstream")


MAX_LOGPROBS = "Requested sample logprobs of 20, which is greater than max allowed: 5"


async def test_an_error_the_clients_own_request_gets_too_is_relayed_and_not_blamed(
    mock_upstream: MockUpstream, make_proxy: Any, registry: CollectorRegistry
) -> None:
    """The refusal names logprobs, so the client's own request goes; the upstream refuses
    that too (a prompt over the context): its error is the client's answer, and neither the
    injection nor the audit is blamed for it."""
    upstream = mock_upstream
    too_long = Reply.error(400, "This model's maximum context length is 16 tokens.")

    def refuses(request: Received) -> Reply:
        return Reply.error(400, MAX_LOGPROBS) if asks_logprobs(request.json()) else too_long

    upstream.on(CHAT, refuses)
    proxy = await make_proxy(MOCK_URL, upstream=upstream, env=AUDIT_ALL)
    body = request_body(CHAT, stream=False)
    expected = await direct(upstream, CHAT, body)
    for _ in range(4):
        resp = await proxy.post(CHAT, json=body)
        assert (resp.status, await resp.read()) == expected
    fallbacks = {"model": "m", "endpoint": "chat"}
    assert metric(registry, "detproxy_fallbacks_total", outcome="same_error", **fallbacks) == 4
    assert metric_total(registry, "detproxy_injection_failures_total") == 0
    assert metric_total(registry, "detproxy_shadow_dropped_total") == 0  # a failed primary
    assert (await (await proxy.get("/detproxy/status")).json())["injection"] == {}


def not_json(status: int, text: bytes) -> Reply:
    return Reply(status, (("Content-Type", "text/plain; charset=utf-8"),), text)


# Upstream errors that are not about what detproxy added, as vLLM (and servers in front of it)
# answer them. vLLM's request validation quotes the request back, injected logprobs and all.
ECHOED = (
    "[{'type': 'missing', 'loc': ('body', 'messages'), 'msg': 'Field required',"
    " 'input': {'model': 'm', 'temperature': 0, 'logprobs': True, 'top_logprobs': 5}}]"
)
CLIENTS_OWN = {
    "unknown_model": Reply.error(404, "The model `m` does not exist.", kind="NotFoundError"),
    "bad_messages": Reply.error(400, ECHOED),
    "unauthorized": Reply.json({"error": "Unauthorized"}, 401),
    "other_field": Reply.json(
        {"detail": [{"loc": ["body", "max_tokens"], "msg": "not an integer", "input": "x"}]}, 422
    ),
    "rate_limited": Reply.error(429, "Too many requests", kind="RateLimitError"),
    "long_body": not_json(400, b"no: " + b"x" * 100_000),  # over what is read to decide
    "internal": Reply.error(500, "EngineCore died", kind="InternalServerError"),
    "unavailable": not_json(503, b"upstream overloaded"),
}
# Each error on a non-streamed chat request and a streamed completion (vLLM answers a streamed
# request's refusal before its stream starts); the unknown model on all four.
SHAPES = [(CHAT, False), (COMPLETIONS, True)]
CASES = [(case, *shape) for case in CLIENTS_OWN for shape in SHAPES] + [
    ("unknown_model", CHAT, True),
    ("unknown_model", COMPLETIONS, False),
]


@pytest.mark.parametrize(("case", "path", "stream"), CASES)
async def test_an_error_not_about_the_injection_is_answered_once_as_it_came(
    mock_upstream: MockUpstream,
    make_proxy: Any,
    registry: CollectorRegistry,
    caplog: pytest.LogCaptureFixture,
    case: str,
    path: str,
    stream: bool,
) -> None:
    refusal = CLIENTS_OWN[case]
    refusal = Reply(refusal.status, (*refusal.headers, ("X-Upstream", "as-sent")), refusal.body)
    upstream = mock_upstream
    upstream.on(path, refusal)
    proxy = await make_proxy(MOCK_URL, upstream=upstream, env=AUDIT_ALL)
    EventLog(LogConfig(repeat_s=0), MOCK_URL).subscribe(proxy.server.app[BUS])
    caplog.set_level(logging.DEBUG)
    resp = await proxy.post(path, json=request_body(path, stream))
    assert (resp.status, await resp.read()) == (refusal.status, refusal.body)
    assert resp.headers["X-Upstream"] == "as-sent"
    assert resp.headers["Content-Type"] == dict(refusal.headers)["Content-Type"]
    await settle(proxy)
    (sent,) = upstream.received(path)  # once: no fallback, and no shadow of a failed primary
    assert asks_logprobs(sent.json()), "the request was not audited with logprobs injected"
    endpoint = "chat" if path == CHAT else "completions"
    outcome = "client_error" if refusal.status < 500 else "upstream_error"
    code = str(refusal.status)
    responses = {"endpoint": endpoint, "code": code, "outcome": outcome}
    assert metric(registry, "detproxy_responses_total", **responses) == 1
    assert metric(registry, "detproxy_responses_total", **responses | {"outcome": "ok"}) == 0
    for name in ("shadow_dropped", "fallbacks", "injection_failures"):
        assert metric_total(registry, f"detproxy_{name}_total") == 0, name
    assert (await (await proxy.get("/detproxy/status")).json())["injection"] == {}
    said = caplog.text.lower()
    assert not [w for w in ("refused", "fallback", "client's own", "inject") if w in said], said


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "refusal",
    [
        Reply.error(400, MAX_LOGPROBS),
        Reply.error(400, "when using `top_logprobs`, `logprobs` must be set to true"),
        Reply.json({"detail": [{"loc": ["body", "logprobs"], "msg": "extra", "input": 1}]}, 422),
    ],
    ids=["max_logprobs", "top_logprobs", "fastapi_422"],
)
async def test_a_refusal_of_the_injected_logprobs_falls_back_to_the_clients_own(
    mock_upstream: MockUpstream,
    make_proxy: Any,
    registry: CollectorRegistry,
    path: str,
    stream: bool,
    refusal: Reply,
) -> None:
    upstream = mock_upstream
    upstream.on(path, answers())  # answers every request to it that is not scripted
    body = request_body(path, stream)
    expected = await direct(upstream, path, body)
    upstream.requests.clear()
    upstream.script(path, refusal)
    proxy = await make_proxy(MOCK_URL, upstream=upstream, env=AUDIT_ALL)
    resp = await proxy.post(path, json=body)
    assert (resp.status, await resp.read()) == expected  # the fallback's answer, as it came
    await settle(proxy)
    # The altered request, then the client's own (no shadow: it carries no logprobs).
    assert [asks_logprobs(b) for b in upstream.bodies(path)] == [True, False]
    endpoint = "chat" if path == CHAT else "completions"
    failures = {"model": "m", "endpoint": endpoint, "kind": "logprobs"}
    status = str(refusal.status)
    assert metric(registry, "detproxy_injection_failures_total", **failures, status=status) == 1
    fallbacks = {"model": "m", "endpoint": endpoint, "outcome": "recovered"}
    assert metric(registry, "detproxy_fallbacks_total", **fallbacks) == 1
    assert metric(registry, "detproxy_shadow_dropped_total", reason="injection_failed") == 1
    responses = {"endpoint": endpoint, "code": "200", "outcome": "ok"}
    assert metric(registry, "detproxy_responses_total", **responses) == 1


async def relayed_alike(
    mock_upstream: MockUpstream, make_proxy: Any, path: str, reply: Reply
) -> tuple[bytes, bytes, list[bool]]:
    """The same streamed answer through an audited detproxy and an unaudited one: what each
    client read, and whether each request the audited one sent asked for logprobs."""
    upstream = mock_upstream
    upstream.on(path, reply)
    body = request_body(path, stream=True)
    proxies = [
        await make_proxy(MOCK_URL, upstream=upstream, env=AUDIT_ALL),
        await make_proxy(MOCK_URL, upstream=upstream, env={"DETPROXY_AUDIT__SAMPLE_RATE": "0"}),
    ]
    audited, plain = [await (await p.post(path, json=body)).read() for p in proxies]
    await settle(proxies[0])
    *through_audited, _ = upstream.bodies(path)
    return audited, plain, [asks_logprobs(b) for b in through_audited]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_a_stream_opening_with_the_engines_own_error_is_relayed_once(
    mock_upstream: MockUpstream, make_proxy: Any, registry: CollectorRegistry, path: str
) -> None:
    error = {"message": "EngineCore died", "type": "InternalServerError", "code": 500}
    reply = Reply.sse([{"error": error}])
    audited, plain, sent = await relayed_alike(mock_upstream, make_proxy, path, reply)
    assert audited == plain == b"".join(reply.events or ())
    assert sent == [True]  # once
    assert metric_total(registry, "detproxy_fallbacks_total") == 0


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_a_stream_cut_before_its_first_event_is_relayed_once(
    mock_upstream: MockUpstream, make_proxy: Any, registry: CollectorRegistry, path: str
) -> None:
    reply = Reply.sse([{"choices": []}], cut_after=0)  # headers, then the connection is gone
    audited, plain, sent = await relayed_alike(mock_upstream, make_proxy, path, reply)
    assert audited == plain  # the in-band error and [DONE] an unaltered request gets
    assert audited.endswith(b"data: [DONE]\n\n") and b'"error"' in audited
    assert sent == [True]
    assert metric_total(registry, "detproxy_fallbacks_total") == 0
    assert metric_total(registry, "detproxy_shadow_dropped_total") == 0


@pytest.mark.parametrize("stream", [False, True])
async def test_a_rejected_repetition_detection_falls_back_and_is_suspended(
    mock_upstream: MockUpstream, make_proxy: Any, registry: CollectorRegistry, stream: bool
) -> None:
    scripted = Refusing("repetition")
    scripted.route(mock_upstream)
    env = {
        "DETPROXY_UPSTREAM__FINGERPRINT_INTERVAL_S": "0",
        "DETPROXY_LOOPS__ENGINE_DETECTION": "{}",
        "DETPROXY_AUDIT__SAMPLE_RATE": "1.0",
    }
    proxy = await make_proxy(MOCK_URL, upstream=mock_upstream, env=env)
    body = request_body(CHAT, stream)
    _, expected = await direct(mock_upstream, CHAT, body)
    for _ in range(4):
        resp = await proxy.post(CHAT, json=body)
        assert resp.status == 200
        assert await resp.read() == expected
    # Both additions went together; the error names repetition_detection only.
    labels = {"model": "m", "endpoint": "chat", "status": "400"}
    assert (
        metric(registry, "detproxy_injection_failures_total", kind="repetition_detection", **labels)
        == 3
    )
    assert metric(registry, "detproxy_injection_failures_total", kind="logprobs", **labels) == 0
    assert (
        metric(registry, "detproxy_injection_suspended", model="m", kind="repetition_detection")
        == 1
    )
    assert "repetition_detection" not in scripted.bodies[-1]


UNIT = " and then the model says the same thing again."


class Looping(Refusing):
    """Loops under greedy decoding; a presence penalty ends the loop (``mode="ok"``) or is
    refused (``mode="no_overrides"``). Answers logprobs when asked."""

    def handle(self, request: Received) -> Reply:
        body = request.json()
        self.bodies.append(body)
        penalised = body.get("presence_penalty") is not None
        if penalised and self.mode == "no_overrides":
            return vllm_error(400, "presence_penalty is not supported by this model")
        texts = ["Fine."] if penalised else ["Well,"] + [UNIT] * 40
        finish = "stop" if penalised else "length"
        lp = asks_logprobs(body)
        if not body.get("stream"):
            reply = answer(CHAT, body)
            choice = reply["choices"][0]
            choice["message"]["content"] = "".join(texts)
            choice["finish_reason"] = finish
            if lp:
                choice["logprobs"] = {
                    "content": [{"token": t, "logprob": -0.5, "top_logprobs": []} for t in texts]
                }
            return json_answer(reply)
        events = []
        for i, text in enumerate(texts):
            last = i == len(texts) - 1
            event = orjson.loads(chunk(CHAT, text, finish if last else None, False)[6:])
            if lp:
                event["choices"][0]["logprobs"] = {
                    "content": [{"token": text, "logprob": -0.5, "top_logprobs": []}]
                }
            events.append(sse_event(event))
        return Reply.sse(events)


LOOP_RETRY = {"DETPROXY_UPSTREAM__FINGERPRINT_INTERVAL_S": "0", "DETPROXY_LOOPS__POLICY": "retry"}


async def test_a_refused_retry_gives_the_client_the_answer_it_had(
    mock_upstream: MockUpstream, make_proxy: Any, registry: CollectorRegistry
) -> None:
    scripted = Looping("no_overrides")
    scripted.route(mock_upstream)
    proxy = await make_proxy(
        MOCK_URL, upstream=mock_upstream, env=LOOP_RETRY | NO_SHADOWS
    )  # bytes as the engine's
    body = request_body(CHAT, stream=False)
    _, expected = await direct(mock_upstream, CHAT, body)
    resp = await proxy.post(CHAT, json=body)
    assert resp.status == 200
    assert await resp.read() == expected  # the looping answer, as without detproxy
    assert resp.headers["X-Detproxy-Recovered"] == "false"
    assert (
        metric(
            registry, "detproxy_policy_actions_total", model="m", action="retry", outcome="error"
        )
        == 1
    )


async def test_a_refused_streamed_retry_goes_on_with_the_clients_own_request(
    mock_upstream: MockUpstream, make_proxy: Any, registry: CollectorRegistry
) -> None:
    # stream_mode continue: the client was shown part of the answer; its own request (no
    # overrides) goes on from exactly that part, so it still reads one answer.
    scripted = Looping("no_overrides")
    scripted.route(mock_upstream)
    proxy = await make_proxy(
        MOCK_URL,
        upstream=mock_upstream,
        env=LOOP_RETRY | {"DETPROXY_LOOPS__STREAM_MODE": "continue"},
    )
    # Room after the kept text (its tokens, estimated from it, are taken off max_tokens).
    body = request_body(CHAT, stream=True) | {"max_tokens": 64}
    resp = await proxy.post(CHAT, json=body)
    assert resp.status == 200
    got = await resp.read()
    assert b'"error"' not in got and b": detproxy retry" not in got, got[-300:]
    assert [b.get("presence_penalty") for b in scripted.bodies] == [None, 1.5, None]
    own = scripted.bodies[2]
    assert own["continue_final_message"] is True, "the fallback did not go on from the shown part"
    shown = own["messages"][-1]["content"]
    chunks = [orjson.loads(e[6:]) for e in got.split(b"\n\n") if e.startswith(b"data: {")]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text.startswith(shown), "the client was not shown the continued part"
    assert b'"detproxy":{"recovered":false,"attempts":2' in got
    assert (
        metric(
            registry, "detproxy_policy_actions_total", model="m", action="retry", outcome="error"
        )
        == 1
    )


async def test_a_refused_streamed_retry_relays_the_clients_own_request(
    mock_upstream: MockUpstream, make_proxy: Any, registry: CollectorRegistry
) -> None:
    scripted = Looping("no_overrides")
    scripted.route(mock_upstream)
    proxy = await make_proxy(
        MOCK_URL,
        upstream=mock_upstream,
        env=LOOP_RETRY | {"DETPROXY_LOOPS__STREAM_MODE": "restart"},
    )
    body = request_body(CHAT, stream=True)
    _, expected = await direct(mock_upstream, CHAT, body)
    scripted.bodies.clear()
    resp = await proxy.post(CHAT, json=body)
    assert resp.status == 200
    got = await resp.read()
    assert b'"error"' not in got
    # The looping attempt, the restart marker, then the client's own request relayed whole.
    marker = b": detproxy retry attempt=2 reason=loop (proxy, content)\n\n"
    assert marker in got
    relayed = got.split(marker, 1)[1]
    # As the engine sent it, but the last chunk saying what the recovery came to (SPEC 5).
    body_part = relayed.rpartition(b"data: {")[0]
    trailer, _, done = relayed[len(body_part) :].partition(b"\n\n")
    assert body_part + done == expected, "the client's own request was not relayed whole"
    assert b'"detproxy":{"recovered":false,"attempts":2' in trailer, trailer
    assert [b.get("presence_penalty") for b in scripted.bodies] == [None, 1.5, None]
    assert (
        metric(
            registry, "detproxy_policy_actions_total", model="m", action="retry", outcome="error"
        )
        == 1
    )


@pytest.mark.parametrize("stream", [False, True])
async def test_a_retried_answer_carries_no_logprobs_the_client_did_not_ask_for(
    mock_upstream: MockUpstream, make_proxy: Any, stream: bool
) -> None:
    scripted = Looping("ok")
    scripted.route(mock_upstream)
    proxy = await make_proxy(
        MOCK_URL, upstream=mock_upstream, env=LOOP_RETRY | {"DETPROXY_AUDIT__SAMPLE_RATE": "1.0"}
    )
    resp = await proxy.post(CHAT, json=request_body(CHAT, stream))
    assert resp.status == 200
    got = await resp.read()
    assert b"Fine." in got
    assert b'"logprob"' not in got
    # The first attempt carried the audit's logprobs; the retry asked for none.
    assert [asks_logprobs(b) for b in scripted.bodies[:2]] == [True, False]


async def test_the_sdk_gets_no_error_from_an_emulated_vllm_with_nan_logprobs(
    make_proxy: Any, registry: CollectorRegistry
) -> None:
    """The H200 finding, against the emulator's NaN mode (vLLM 0.23 with a GGUF model): every
    request audited, chat and completions, streamed and not, 0 client-visible errors."""
    import openai

    from proxy.tools.emulator import EmulatorConfig, EmulatorServer

    # On a socket: the emulator is a server, and the SDK reads it directly for the answer
    # without detproxy.
    async with EmulatorServer(EmulatorConfig(nan_logprobs=True)) as emulator:
        proxy = await make_proxy(emulator.url, env=AUDIT_ALL)
        through = openai.AsyncOpenAI(
            base_url=str(proxy.make_url("/v1")), api_key="x", max_retries=0
        )
        direct_sdk = openai.AsyncOpenAI(base_url=emulator.url + "/v1", api_key="x", max_retries=0)
        model = "emulator-model"
        messages: Any = [{"role": "user", "content": "What is the capital of France?"}]

        async def texts(sdk: openai.AsyncOpenAI, i: int) -> list[str]:
            chat = {"model": model, "messages": messages, "temperature": 0, "max_tokens": 16}
            prompt = {"model": model, "prompt": f"Say {i}", "temperature": 0, "max_tokens": 16}
            answer = await sdk.chat.completions.create(**chat)
            completion = await sdk.completions.create(**prompt)
            streamed = await sdk.chat.completions.create(**chat, stream=True)
            chunks = [c async for c in streamed]
            streamed_completion = await sdk.completions.create(**prompt, stream=True)
            parts = [c async for c in streamed_completion]
            return [
                answer.choices[0].message.content or "",
                completion.choices[0].text,
                "".join(c.choices[0].delta.content or "" for c in chunks if c.choices),
                "".join(c.choices[0].text for c in parts if c.choices),
            ]

        try:
            for i in range(6):
                assert await texts(through, i) == await texts(direct_sdk, i)
            status = await (await proxy.get("/detproxy/status")).json()
        finally:
            await through.close()
            await direct_sdk.close()
    refused = sum(
        metric(
            registry,
            "detproxy_injection_failures_total",
            model=model,
            endpoint=e,
            kind="logprobs",
            status="400",
        )
        for e in ("chat", "completions")
    )
    # Non-streamed primaries fell back, streamed ones' shadows were refused: three of either in
    # a row suspend the model's logprobs (shadows already queued may still add theirs).
    assert refused >= 3
    assert metric(registry, "detproxy_injection_suspended", model=model, kind="logprobs") == 1
    assert status["injection"][model]["logprobs"]["last_reason"] == NAN
    assert status["injection"][model]["logprobs"]["suspended"] is True


async def test_a_client_that_leaves_before_the_first_event_closes_the_upstream(
    mock_upstream: MockUpstream, make_proxy: Any
) -> None:
    import aiohttp

    stalls = Reply.sse([b": ping\n\n"] * 200, done=False, interval_s=0.02)  # never an event
    mock_upstream.on(CHAT, stalls)
    proxy = await make_proxy(
        MOCK_URL, upstream=mock_upstream, env=AUDIT_ALL
    )  # audited: its first event is awaited
    with pytest.raises(asyncio.TimeoutError):
        await proxy.post(
            CHAT, json=request_body(CHAT, stream=True), timeout=aiohttp.ClientTimeout(total=0.2)
        )
    (upstream,) = mock_upstream.responses
    await eventually(lambda: upstream.closed, what="the upstream answer closed", timeout_s=2)
