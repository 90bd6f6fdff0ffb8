"""InjectionGuard: failures in a row suspend an addition for a model, with backoff."""

from __future__ import annotations

from proxy.config import InjectionConfig
from proxy.events import EventBus, InjectionFailed, InjectionSuspended
from proxy.injection import LOGPROBS, REPETITION_DETECTION, InjectionGuard, blame, error_reason


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


def test_blame_names_the_addition_the_error_names() -> None:
    both = (LOGPROBS, REPETITION_DETECTION)
    assert blame(both, "Out of range float values are not JSON compliant: nan") == (LOGPROBS,)
    assert blame(both, "repetition_detection: extra inputs") == (REPETITION_DETECTION,)
    assert blame(both, "internal server error") == both
    assert blame((LOGPROBS,), "whatever") == (LOGPROBS,)


def test_error_reason_reads_every_error_shape() -> None:
    nested = b'{"error": {"message": "bad nan", "type": "BadRequestError", "code": 400}}'
    assert error_reason(400, nested) == "bad nan"
    assert error_reason(400, b'{"object": "error", "message": "flat one"}') == "flat one"
    assert error_reason(401, b'{"error": "Unauthorized"}') == "Unauthorized"
    assert error_reason(500, b"Internal Server Error") == "Internal Server Error"
    assert error_reason(502, b"") == "HTTP 502"
    assert len(error_reason(400, b"x" * 5000)) == 300
