"""How a retried answer ended: ``recovered`` only for an answer that ended ``stop`` (or a tool
call) with content and no loop at its end; otherwise what it came to.

- ``length``: it ran into its token limit (a continuation that looped again below the
  detector's thresholds, or a long answer cut short): no recovery;
- ``unfinished``: it ended with another finish reason, or none;
- ``empty``: it stopped with nothing in it;
- ``looped_again``: its text ends in a loop (the detector run over the whole answer the client
  got, the repeats it was shown before a recovery included: a run that reaches its end).

Pure: the caller reads the finish reason and the text (``proxy.answer``, ``proxy.streaming``).
"""

from __future__ import annotations

from typing import Final

from proxy.loops.detector import DetectorConfig, LoopDetector

ENDED: Final = frozenset({"stop", "tool_calls"})
RECOVERED: Final = "recovered"


def ending(finish: object, answered: bool, text: str | None, config: DetectorConfig) -> str:
    """The outcome of a retry whose answer ended with ``finish`` (``answered``: content other
    than whitespace, or tool calls; ``text``: the whole content the client got, None where it
    was not kept)."""
    if finish not in ENDED:
        return "length" if finish == "length" else "unfinished"
    if not answered:
        return "empty"
    if text and loop_at_end(text, config):
        return "looped_again"
    return RECOVERED


def loop_at_end(text: str, config: DetectorConfig) -> bool:
    """Whether ``text`` ends in a loop the detector finds: a run of a repeated unit that reaches
    its end (trailing whitespace aside). A loop the answer left behind (the repeats a stream
    showed before its recovery) does not count."""
    return tail_loop(text, config) is not None


def tail_loop(text: str, config: DetectorConfig) -> tuple[int, int] | None:
    """The run of a repeated unit the detector finds at the end of ``text`` (trailing whitespace
    aside): where it starts and its period; None: ``text`` does not end in a loop."""
    text = text.rstrip()
    start = 0
    while start < len(text):
        report = LoopDetector(config).feed(text[start:])
        if report is None:
            return None
        period = report.period
        end = start + report.start_offset + report.covered_chars
        while end < len(text) and text[end] == text[end - period]:
            end += 1  # the run goes on past the check that found it
        if end >= len(text):
            return start + report.start_offset, period
        start = end
    return None
