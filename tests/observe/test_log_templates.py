"""The event log on chat templates read before a closed reasoning (proxy/loops/rendered.py):
one that drops assistant reasoning, or none readable, said once per model; one that keeps it
only at DEBUG."""

from __future__ import annotations

import logging

from proxy.events import TemplateProbed
from tests.observe.test_log import Lines, event_log, lines  # noqa: F401 (the fixture)


def test_what_a_models_template_does_is_said_once(lines: Lines) -> None:  # noqa: F811
    bus, _ = event_log(logging.DEBUG)
    bus.publish(TemplateProbed("qwq", True))
    bus.publish(TemplateProbed("qwq", True))  # asked again later: held back
    bus.publish(TemplateProbed("llama", None))
    bus.publish(TemplateProbed("qwen3", False))
    drops, unread = lines.at(logging.INFO)
    assert drops.startswith("model qwq's chat template drops the reasoning"), drops
    assert "/v1/completions" in drops
    assert unread.startswith("model llama's chat template could not be read"), unread
    held, keeps = lines.at(logging.DEBUG)
    assert held == drops
    assert keeps == "model qwen3's chat template keeps assistant reasoning"
