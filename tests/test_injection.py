"""InjectionGuard: failures in a row suspend an addition for a model, with backoff."""

from __future__ import annotations

import orjson

from proxy.config import InjectionConfig
from proxy.events import EventBus, InjectionFailed, InjectionSuspended
from proxy.injection import (
    LOGPROBS,
    REPETITION_DETECTION,
    InjectionGuard,
    error_reason,
    refused_additions,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def guard(**config: float) -> tuple[InjectionGuard, Clock, list[object]]:
    bus = EventBus()
    seen: list[object] = []
    bus.subscribe(InjectionFailed, seen.append)
    bus.subscribe(InjectionSuspended, seen.append)
    clock = Clock()
    cfg = InjectionConfig(**{"failures_to_suspend": 2, "suspend_s": 10.0, **config})
    return InjectionGuard(cfg, bus, clock=clock, wall=lambda: 5.0), clock, seen


def fail(g: InjectionGuard, model: str = "m", kind: str = LOGPROBS) -> None:
    g.failed(model, "chat", [kind], 400, "nan")


def test_failures_in_a_row_suspend_then_the_addition_is_tried_again() -> None:
    g, clock, seen = guard()
    fail(g)
    assert g.allows("m", LOGPROBS)
    fail(g)
    assert not g.allows("m", LOGPROBS)
    assert g.allows("m", REPETITION_DETECTION)  # another kind, unaffected
    assert g.allows("other", LOGPROBS)  # another model, unaffected
    assert g.suspended() == [("m", LOGPROBS)]
    assert [type(e).__name__ for e in seen] == [
        "InjectionFailed",
        "InjectionFailed",
        "InjectionSuspended",
    ]
    clock.now += 9.9
    assert not g.allows("m", LOGPROBS)
    clock.now += 0.2
    assert g.allows("m", LOGPROBS)  # tried again
    assert seen[-1] == InjectionSuspended("m", LOGPROBS, False, 0.0, "nan")


def test_a_failure_after_a_suspension_suspends_again_for_twice_as_long() -> None:
    g, clock, seen = guard(max_suspend_s=25.0)
    fail(g)
    fail(g)
    clock.now += 10.1
    assert g.allows("m", LOGPROBS)
    fail(g)  # one failure is enough now
    assert not g.allows("m", LOGPROBS)
    assert isinstance(seen[-1], InjectionSuspended) and seen[-1].seconds == 20.0
    clock.now += 20.1
    assert g.allows("m", LOGPROBS)
    fail(g)
    assert isinstance(seen[-1], InjectionSuspended) and seen[-1].seconds == 25.0  # capped


def test_a_success_resets_the_count_and_the_backoff() -> None:
    g, clock, seen = guard()
    fail(g)
    g.succeeded("m", [LOGPROBS])
    fail(g)
    assert g.allows("m", LOGPROBS)  # not two in a row
    fail(g)
    assert not g.allows("m", LOGPROBS)
    clock.now += 10.1
    assert g.allows("m", LOGPROBS)
    g.succeeded("m", [LOGPROBS])
    fail(g)
    assert g.allows("m", LOGPROBS)  # the backoff was forgotten too: two in a row again
    fail(g)
    assert isinstance(seen[-1], InjectionSuspended) and seen[-1].seconds == 10.0


def test_snapshot_says_what_is_suspended_and_why() -> None:
    g, clock, _ = guard()
    fail(g)
    fail(g)
    clock.now += 4.0
    state = g.snapshot()["m"][LOGPROBS]
    assert state == {
        "suspended": True,
        "suspended_for_s": 6.0,
        "failures_in_a_row": 0,
        "failures_total": 2,
        "last_status": 400,
        "last_reason": "nan",
        "last_failed_at": 5.0,
    }


BOTH = (LOGPROBS, REPETITION_DETECTION)


def vllm_400(message: str, param: str | None = None) -> bytes:
    error = {"message": message, "type": "BadRequestError", "param": param, "code": 400}
    return orjson.dumps({"error": error})


def test_a_refusal_naming_an_addition_is_the_additions() -> None:
    cap = vllm_400("Requested sample logprobs of 20, which is greater than max allowed: 5")
    assert refused_additions(BOTH, 400, cap) == (LOGPROBS,)
    needs = vllm_400("Value error, when using `top_logprobs`, `logprobs` must be set to true")
    assert refused_additions(BOTH, 400, needs) == (LOGPROBS,)
    nan = vllm_400("Out of range float values are not JSON compliant: nan")
    assert refused_additions(BOTH, 400, nan) == (LOGPROBS,)
    assert refused_additions(BOTH, 400, vllm_400("out of range", param="top_logprobs")) == (
        LOGPROBS,
    )
    flat = b'{"object": "error", "message": "repetition_detection: Extra inputs", "code": 400}'
    assert refused_additions(BOTH, 400, flat) == (REPETITION_DETECTION,)
    fastapi = orjson.dumps(
        {"detail": [{"loc": ["body", "repetition_detection"], "msg": "Extra inputs"}]}
    )
    assert refused_additions(BOTH, 422, fastapi) == (REPETITION_DETECTION,)
    assert refused_additions(BOTH, 400, b"unknown field: logprobs") == (LOGPROBS,)  # not JSON
    assert refused_additions((REPETITION_DETECTION,), 400, cap) == ()  # logprobs not added


def test_any_other_error_is_the_clients_requests_own() -> None:
    # vLLM's request validation quotes the request back, injected fields and all.
    echo = (
        "[{'type': 'missing', 'loc': ('body', 'messages'), 'msg': 'Field required',"
        " 'input': {'model': 'm', 'logprobs': True, 'top_logprobs': 5}}]"
    )
    assert refused_additions(BOTH, 400, vllm_400(echo)) == ()
    pydantic = "1 validation error\nmessages\n  Field required [input_value={'logprobs': True}]"
    assert refused_additions(BOTH, 400, vllm_400(pydantic)) == ()
    fastapi = orjson.dumps(
        {"detail": [{"loc": ["body", "max_tokens"], "msg": "bad", "input": {"logprobs": True}}]}
    )
    assert refused_additions(BOTH, 422, fastapi) == ()
    too_long = vllm_400("This model's maximum context length is 16 tokens.", param="messages")
    assert refused_additions(BOTH, 400, too_long) == ()
    # Whatever they say, these statuses are never about a request's fields.
    for status in (401, 403, 404, 413, 429, 500, 501, 503):
        assert refused_additions(BOTH, status, vllm_400("logprobs out of range")) == ()
    unknown = orjson.dumps({"error": {"message": "The model `logprobs-7b` does not exist."}})
    assert refused_additions(BOTH, 404, unknown) == ()


def test_error_reason_reads_every_error_shape() -> None:
    nested = b'{"error": {"message": "bad nan", "type": "BadRequestError", "code": 400}}'
    assert error_reason(400, nested) == "bad nan"
    assert error_reason(400, b'{"object": "error", "message": "flat one"}') == "flat one"
    assert error_reason(401, b'{"error": "Unauthorized"}') == "Unauthorized"
    assert error_reason(500, b"Internal Server Error") == "Internal Server Error"
    assert error_reason(502, b"") == "HTTP 502"
    assert len(error_reason(400, b"x" * 5000)) == 300
