"""The event log: one line per notable event, repeats held back, the access log, JSON lines,
the start-up summary; never a header, prompt or output in a line."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from policies.base import Trigger
from proxy.audit.verdict import Divergence, Verdict
from proxy.config import LogConfig, Settings
from proxy.engine.identity import Fingerprint
from proxy.events import (
    AuditCompleted,
    EventBus,
    InjectionFailed,
    InjectionSuspended,
    LoopDetected,
    PolicyActed,
    RequestFinished,
    ShadowDropped,
    UpstreamFailed,
    UpstreamFingerprinted,
)
from proxy.observe.log import (
    EVENTS,
    EventLog,
    JsonFormatter,
    Repeats,
    clean,
    configure,
    startup_lines,
)

SECRET_PROMPT = "my secret prompt about the merger"
SECRET_OUTPUT = "the confidential answer"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def at(self, level: int) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno == level]

    def text(self) -> str:
        return "\n".join(r.getMessage() for r in self.records)


@pytest.fixture
def lines() -> Iterator[Lines]:
    handler = Lines()
    loggers = [logging.getLogger(EVENTS), logging.getLogger("detproxy.access")]
    saved = [(lg.level, lg.propagate) for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.propagate = False
    yield handler
    for lg, (level, propagate) in zip(loggers, saved, strict=True):
        lg.removeHandler(handler)
        lg.setLevel(level)
        lg.propagate = propagate


def event_log(
    level: int = logging.INFO, clock: Clock | None = None, **config: object
) -> tuple[EventBus, Clock]:
    logging.getLogger(EVENTS).setLevel(level)
    logging.getLogger("detproxy.access").setLevel(level)
    clock = clock or Clock()
    bus = EventBus()
    EventLog(LogConfig.model_validate(config), "http://u:pw@engine:8000", clock).subscribe(bus)
    return bus, clock


def test_a_repeating_failure_is_one_line_per_window_then_says_how_many_were_left_out(
    lines: Lines,
) -> None:
    bus, clock = event_log(repeat_s=60)
    for _ in range(5):
        bus.publish(UpstreamFailed("chat", "refused", "headers"))
    warnings = lines.at(logging.WARNING)
    assert len(warnings) == 1, f"5 refusals in a window gave {len(warnings)} lines: {warnings}"
    assert "refused the connection before its response headers" in warnings[0]
    assert "pw" not in warnings[0] and "engine:8000" in warnings[0]  # the password masked
    clock.now += 61
    bus.publish(UpstreamFailed("chat", "refused", "headers"))
    warnings = lines.at(logging.WARNING)
    assert len(warnings) == 2 and "(4 more like it since the last such line)" in warnings[1]
    assert bus.failures == {}


def test_an_upstream_that_leads_back_is_one_error_naming_it(lines: Lines) -> None:
    """proxy/selfloop.py: each returning request is one event; the operator reads one ERROR
    naming the upstream (its password masked), then one per window with the count."""
    bus, clock = event_log(repeat_s=60)
    for _ in range(5):
        bus.publish(UpstreamFailed("chat", "loop", "headers"))
    errors = lines.at(logging.ERROR)
    assert len(errors) == 1 and not lines.at(logging.WARNING), lines.text()
    assert "upstream http://u:" in errors[0] and "@engine:8000 points back at" in errors[0]
    assert "pw@" not in errors[0] and "508 Loop Detected" in errors[0]
    clock.now += 61
    bus.publish(UpstreamFailed("other", "loop", "headers"))
    assert "(4 more like it" in lines.at(logging.ERROR)[1]


def test_repeats_left_out_go_to_debug_and_other_kinds_have_their_own_window(
    lines: Lines,
) -> None:
    bus, _ = event_log(logging.DEBUG)
    for _ in range(3):
        bus.publish(UpstreamFailed("chat", "timeout", "body"))
    bus.publish(UpstreamFailed("chat", "reset", "body"))
    assert len(lines.at(logging.WARNING)) == 2
    assert len(lines.at(logging.DEBUG)) == 2  # the two timeouts held back


def test_repeats_keeps_a_bounded_number_of_keys() -> None:
    clock = Clock()
    repeats = Repeats(60, clock, max_keys=3)
    assert [repeats.admit(("m", i)) for i in range(3)] == [0, 0, 0]
    # A fourth key while the three are fresh: it shares the overflow key.
    assert repeats.admit(("m", 3)) == 0
    assert repeats.admit(("m", 4)) is None
    clock.now += 61  # the old ones are stale: forgotten to make room
    assert repeats.admit(("m", 5)) == 0
    assert repeats.key_count <= 3


def test_no_prompt_output_or_upstream_message_reaches_a_line(lines: Lines) -> None:
    bus, _ = event_log(logging.DEBUG, access_log=True)
    verdict = Verdict(
        "text_divergence",
        None,
        Divergence(7, SECRET_OUTPUT, "other", (), (), None),
        0.5,
        "a",
        "b",
        10,
        10,
        primary_answer=SECRET_OUTPUT,
    )
    bus.publish(
        AuditCompleted(
            "req-1", "m", "chat", "full", 0, verdict, "key", 1, 1, 0.1, 0.1, "same", 0.0,
            prompt=SECRET_PROMPT, primary_text=SECRET_OUTPUT, shadow_text=SECRET_OUTPUT,
        )
    )  # fmt: skip
    trigger = Trigger("proxy", "content", 0, period=12, repeats=9, preview=SECRET_OUTPUT)
    bus.publish(LoopDetected("req-2", "m", "chat", True, 1, trigger, 0.0))
    bus.publish(InjectionFailed("m", "chat", "logprobs", 400, f"bad input: {SECRET_PROMPT}"))
    bus.publish(InjectionSuspended("m", "logprobs", True, 60.0, SECRET_PROMPT))
    text = lines.text()
    assert "text_divergence at token 7" in text and "req-1" in text
    assert "period 12 x 9" in text and "req-2" in text
    assert SECRET_PROMPT not in text and SECRET_OUTPUT not in text, text


def test_a_client_chosen_model_cannot_forge_a_line(lines: Lines) -> None:
    bus, _ = event_log()
    bus.publish(ShadowDropped("m", "queue_full"))
    bus.publish(InjectionFailed("evil\n2026-01-01 INFO forged", "chat", "logprobs", 400, ""))
    assert all("\n" not in r.getMessage() for r in lines.records)
    assert clean("x" * 500).endswith("...") and len(clean("x" * 500)) == 128


def test_loops_recoveries_and_an_exhausted_budget_are_said(lines: Lines) -> None:
    bus, _ = event_log()
    bus.publish(PolicyActed("r1", "m", "retry", "recovered", 1, "restart"))
    bus.publish(PolicyActed("r2", "m", "observe", "budget_exhausted", 1))
    bus.publish(PolicyActed("r3", "m", "retry", "looped_again", 1, "restart"))  # DEBUG
    bus.publish(InjectionSuspended("m", "logprobs", False, 0.0, ""))
    assert lines.at(logging.INFO) == [
        "loop recovered for model m: attempt 1 (restart), request r1",
        "trying logprobs on model m's requests again",
    ]
    (warning,) = lines.at(logging.WARNING)
    assert "recovery budget of model m exhausted" in warning and "relayed as it came" in warning


def test_the_first_identity_of_the_upstream_is_said_once(lines: Lines) -> None:
    bus, _ = event_log()
    fp = Fingerprint("vllm", "0.23.0", ("qwen",), {}, fingerprint="abc")
    bus.publish(UpstreamFingerprinted(fp, None, False))
    bus.publish(UpstreamFingerprinted(fp, fp, False))
    assert lines.at(logging.INFO) == [
        "upstream http://u:********@engine:8000 is vllm 0.23.0, serving qwen"
    ]


def test_the_access_log_is_one_line_per_request_only_when_asked(lines: Lines) -> None:
    finished = RequestFinished("chat", "m", True, True, 200, "ok", 0.0123, 0.001, "req-9")
    bus, _ = event_log()
    bus.publish(finished)
    assert lines.records == []  # off, and INFO: per-request events are not even subscribed
    bus, _ = event_log(access_log=True)
    bus.publish(finished)
    (record,) = lines.records
    assert record.name == "detproxy.access" and record.levelno == logging.INFO
    assert record.getMessage() == "chat m 200 stream deterministic 12.3ms ok req-9"
    assert record.fields["request_id"] == "req-9" and record.fields["status"] == 200  # type: ignore[attr-defined]


def test_json_lines_carry_ts_level_logger_msg_and_the_fields() -> None:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter(worker=2))
    logger = logging.getLogger("tests.json")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning("hello %s", "there", extra={"fields": {"model": "m", "status": 502}})
    finally:
        logger.removeHandler(handler)
    line = orjson.loads(out.getvalue())
    assert line.pop("ts").endswith("Z")
    assert line == {
        "level": "warning",
        "logger": "tests.json",
        "msg": "hello there",
        "worker": 2,
        "model": "m",
        "status": 502,
    }


def test_configure_sets_the_level_and_the_format() -> None:
    out = io.StringIO()
    root = logging.getLogger()
    saved = (root.level, root.handlers[:])
    try:
        configure(LogConfig(level="warning", format="json"), stream=out)
        logging.getLogger("x").info("not shown")
        logging.getLogger("x").warning("shown")
    finally:
        root.handlers[:] = saved[1]
        root.setLevel(saved[0])
    assert [orjson.loads(x)["msg"] for x in out.getvalue().splitlines()] == ["shown"]


def test_log_level_is_case_insensitive_and_checked() -> None:
    assert LogConfig.model_validate({"level": "DEBUG"}).level == "debug"
    with pytest.raises(ValueError, match="level"):
        LogConfig.model_validate({"level": "bogus"})


def test_the_startup_summary_says_what_runs_and_no_secret() -> None:
    settings = Settings.model_validate(
        {
            "server": {"admin_token": "t0ps3cr3t-token-123456", "admin_port": 9090},
            "upstream": {"url": "http://user:hunter2@engine:8000"},
            "audit": {
                "sample_rate": 0.25,
                "service_api_key": "sk-very-secret",
                "reference_url": "http://ref:pw2@ref:8000",
            },
            "incidents": {"path": ""},
        }
    )
    text = "\n".join(msg for msg, _ in startup_lines(settings))
    for secret in ("t0ps3cr3t", "hunter2", "sk-very-secret", "pw2"):
        assert secret not in text, f"{secret} in the summary:\n{text}"
    assert (
        "25% of deterministic requests (and one per model every 60s at least) replayed to" in text
    )
    assert "replayed to http://ref:********@ref:8000" in text
    assert "incidents: memory only" in text
    assert "admin endpoints on 127.0.0.1:9090, token required" in text


def _admin_line(settings: Settings, at: tuple[str, int]) -> tuple[str, dict[str, Any]]:
    (line,) = [x for x in startup_lines(settings, admin_at=at) if "admin endpoints" in x[0]]
    return line


def test_the_summary_says_what_the_admin_listener_serves_by_its_address() -> None:
    """Decided by the address the listener is bound to: all of it with a token or on
    loopback; else health and metrics only, and how to open the rest."""
    bare = Settings()
    closed, fields = _admin_line(bare, ("0.0.0.0", 8080))
    assert closed.startswith(
        "admin endpoints: health and metrics only on 0.0.0.0:8080 (not loopback, no"
        " server.admin_token); set it to open status, incidents and the explorer"
    ), closed
    assert (fields["admin_address"], fields["admin_all"]) == ("0.0.0.0:8080", False)
    assert "only on [::]:8080" in _admin_line(bare, ("::", 8080))[0]
    local, fields = _admin_line(bare, ("127.0.0.1", 8080))
    assert "under /detproxy/ on the main port (127.0.0.1:8080), no token (loopback" in local
    assert fields["admin_all"] is True
    token = Settings.model_validate({"server": {"admin_token": "t" * 16}})
    guarded, fields = _admin_line(token, ("0.0.0.0", 8080))
    assert "on the main port (0.0.0.0:8080), token required" in guarded
    assert fields["admin_all"] is True
    side = Settings.model_validate(
        {"server": {"host": "0.0.0.0", "admin_port": 9090, "admin_host": "127.0.0.1"}}
    )
    separate, _ = _admin_line(side, ("127.0.0.1", 9090))
    assert "admin endpoints on 127.0.0.1:9090, no token" in separate


def test_the_summary_says_when_the_default_incident_file_fell_back_to_memory() -> None:
    settings = Settings.model_validate({"incidents": {"path": "/nowhere/incidents.jsonl"}})
    on_disk = dict(startup_lines(settings, on_disk=True))
    fallen = dict(startup_lines(settings, on_disk=False))
    (line,) = [m for m in fallen if m.startswith("incidents:")]
    assert "memory only" in line and "/nowhere/incidents.jsonl cannot be written" in line, line
    assert fallen[line] == {"incidents_path": None}
    assert any(m.startswith("incidents: /nowhere/incidents.jsonl (rotated") for m in on_disk)
