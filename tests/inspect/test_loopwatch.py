from __future__ import annotations

from typing import Any

from proxy.inspect.loops import LoopConfig
from proxy.inspect.loopwatch import LoopWatch

UNIT = " and then the model says the same thing again."


def delta(index: int = 0, finish: str | None = None, **fields: Any) -> dict[str, Any]:
    return {"choices": [{"index": index, "delta": fields, "finish_reason": finish}]}


def test_content_loop_per_choice() -> None:
    watch = LoopWatch("chat", LoopConfig())
    trigger = None
    for _ in range(40):
        watch.on_chunk(delta(0, content="ordinary text that varies " + str(_)))
        trigger = trigger or watch.on_chunk(delta(1, content=UNIT))
    assert trigger is not None
    assert (trigger.source, trigger.channel, trigger.choice, trigger.period) == (
        "proxy",
        "content",
        1,
        len(UNIT),
    )


def test_duplicated_reasoning_fields_count_once() -> None:
    # vLLM 0.11.1-0.15 sends the same text as reasoning and reasoning_content.
    watch = LoopWatch("chat", LoopConfig())
    fed = 0
    trigger = None
    while trigger is None and fed < 5000:
        trigger = watch.on_chunk(delta(reasoning=UNIT, reasoning_content=UNIT))
        fed += len(UNIT)
    assert trigger is not None and trigger.channel == "reasoning"
    assert trigger.start_offset is not None and trigger.start_offset < len(UNIT)
    assert fed <= LoopConfig().required_chars(len(UNIT)) + 2 * len(UNIT) + 32  # type: ignore[operator]


def test_engine_repetition_and_runaway() -> None:
    watch = LoopWatch("chat", LoopConfig())
    watch.on_chunk(delta(content="hello"))
    trigger = watch.on_chunk(delta(finish="repetition"))
    assert trigger is not None and (trigger.source, trigger.channel) == ("engine", "content")
    watch = LoopWatch("chat", LoopConfig())
    watch.on_chunk(delta(reasoning_content="thinking and thinking"))
    trigger = watch.on_chunk(delta(finish="length"))
    assert trigger is not None and (trigger.source, trigger.channel) == ("runaway", "reasoning")
    watch = LoopWatch("chat", LoopConfig(), runaway=False)
    watch.on_chunk(delta(reasoning="thinking"))
    assert watch.on_chunk(delta(finish="length")) is None


def test_whole_answers_and_completions() -> None:
    answer = {
        "choices": [
            {"index": 0, "finish_reason": "length", "message": {"content": "intro. " + UNIT * 20}}
        ]
    }
    trigger = LoopWatch("chat", LoopConfig()).on_answer(answer)
    assert trigger is not None and trigger.period == len(UNIT)
    completion = {"choices": [{"index": 0, "text": "x" * 3 + UNIT * 20, "finish_reason": "length"}]}
    assert LoopWatch("completions", LoopConfig()).on_answer(completion) is not None
    normal = {
        "choices": [
            {
                "index": 0,
                "finish_reason": "stop",
                "message": {"content": "\n".join(f"{i}. item {i}" for i in range(300))},
            }
        ]
    }
    assert LoopWatch("chat", LoopConfig()).on_answer(normal) is None
    assert LoopWatch("chat", LoopConfig()).on_answer({"choices": "junk"}) is None
