"""The event log on what the engine loaded: one WARNING per new set of unmet declarations."""

from __future__ import annotations

import logging

import pytest

from proxy.config import LogConfig
from proxy.engine.expect import Mismatch
from proxy.engine.facts import EngineFacts
from proxy.events import EngineFactsRead, EventBus
from proxy.observe.log import EVENTS, EventLog

FACTS = EngineFacts({"attention_backend": "FLASH_ATTN"}, {}, (), (), (), False)


def read(*mismatches: Mismatch) -> EngineFactsRead:
    return EngineFactsRead(FACTS, mismatches, (), ("attention_backend",), 0.0)


def test_a_mismatch_is_one_warning_until_it_changes(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=EVENTS)
    bus = EventBus()
    EventLog(LogConfig(), "http://engine:8000").subscribe(bus)
    wrong = Mismatch("attention_backend", "FLASHINFER", "FLASH_ATTN")
    bus.publish(read(wrong))
    bus.publish(read(wrong))  # the next reading says the same
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "attention_backend: declared 'FLASHINFER', loaded 'FLASH_ATTN'" in warnings[0]
    bus.publish(read())
    said = [r.getMessage() for r in caplog.records]
    assert said[-1] == "engine: every declared [upstream.expect] field is met", said
    assert bus.failures == {}
