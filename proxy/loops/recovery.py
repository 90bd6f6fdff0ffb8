"""Loop recovery for one app, wired once: the ``RecoveryContext`` every request's attempts are
given (``proxy.attempts.Attempts`` owns a request's recovery: its watches, the policies' decision,
the budget its retries spend, what it tells), what the answers that relay those attempts read of
``[loops]`` (how a stream holds text back, how a closed reasoning is continued), and how a loop's
answer ends (an abort's last chunk, a retry's ``detproxy`` chunk, a non-streamed answer cut at
the loop). The body of the attempt a retry sends is ``proxy.loops.next_attempt``'s, a pure
function."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import orjson

from policies.base import PolicyChain, Trigger
from policies.budget import RecoveryBudget
from proxy.config import LoopConfig
from proxy.events import EventBus
from proxy.injection import REPETITION_DETECTION, InjectionGuard
from proxy.loops.context import BudgetGauge, RecoveryContext, loop_settings
from proxy.loops.detector import DetectorConfig
from proxy.loops.rendered import RenderedContinuation
from proxy.loops.watch import EMPTY
from proxy.openai import REASONING_KEYS, stream_event


class Recovery:
    """``[loops]`` for one app: the context its requests' attempts are given, and what the
    answers relaying them read. It keeps no service of its own for anyone to reach through:
    the policies, the bus and the budget go into ``context``, once."""

    def __init__(
        self,
        config: LoopConfig,
        chain: PolicyChain,
        bus: EventBus,
        guard: InjectionGuard | None = None,
        budget: RecoveryBudget | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        settings = loop_settings(config)
        # What every request's attempts are given: the settings, the policies, where events
        # go, and the budget (None: loops are off) with its gauge.
        self.context = RecoveryContext(settings, chain, bus, budget, BudgetGauge(clock))
        # What each request asks, read once: compiled, these are loads, and the frozen
        # configuration's fields attribute lookups.
        self._enabled = settings.enabled
        self._detector = settings.detector
        self._stream_continues = settings.one_path
        self._engine_detection = config.engine_detection
        self._hold_reasoning = config.stream_mode == "hold_reasoning"
        self._hold_back_chars = config.hold_back_chars if settings.one_path else 0
        self._hold_max_bytes = config.hold_max_bytes
        self._reads_answers = settings.enabled or chain.reads_clean_answers
        self._guard = guard
        # A closed reasoning continued on the rendered prompt where the template drops it.
        self.rendered = RenderedContinuation(config.reasoning_markers, bus, clock)

    @property
    def enabled(self) -> bool:
        return self._enabled

    @property
    def detector(self) -> DetectorConfig:
        """The loop detector's thresholds (a retried answer's end is read with them too)."""
        return self._detector

    @property
    def reads_answers(self) -> bool:
        """Whether a whole non-streamed answer is looked at: by the loop watch, or by a policy
        that reads answers without a trigger."""
        return self._reads_answers

    @property
    def hold_reasoning(self) -> bool:
        return self._hold_reasoning

    @property
    def stream_continues(self) -> bool:
        """Whether a streamed retry continues from exactly what the client was shown."""
        return self._stream_continues

    @property
    def hold_back_chars(self) -> int:
        """The tail a continuing stream holds back from its client (0: none)."""
        return self._hold_back_chars

    @property
    def hold_max_bytes(self) -> int:
        return self._hold_max_bytes

    def prepare(self, body: dict[str, Any], model: str) -> dict[str, Any]:
        """Add vLLM's repetition_detection where the operator says the upstream has it (and
        it has not been refused for ``model`` lately)."""
        engine = self._engine_detection
        if engine is None or "repetition_detection" in body:
            return body
        if self._guard is not None and not self._guard.allows(model, REPETITION_DETECTION):
            return body
        return {**body, "repetition_detection": engine.model_dump()}


def is_empty(endpoint: str, body: Mapping[str, Any] | None) -> bool:
    """Whether a non-streamed answer ended ``stop`` with nothing in it: no content (chat: no
    tool calls either) in its first choice."""
    choices = body.get("choices") if body is not None else None
    if type(choices) is not list or not choices or type(choices[0]) is not dict:
        return False
    choice = choices[0]
    if choice.get("finish_reason") != "stop":
        return False
    if endpoint != "chat":
        return not choice.get("text")
    message = choice.get("message")
    if type(message) is not dict:
        return False
    content = message.get("content")
    return not (isinstance(content, str) and content.strip()) and not message.get("tool_calls")


def recovery_info(recovered: bool, attempts: int, strategy: str) -> dict[str, Any]:
    """The ``detproxy`` object on the last chunk of a stream a policy acted on (SPEC 5)."""
    return {"recovered": recovered, "attempts": attempts, "strategy": strategy}


def abort_chunk(
    endpoint: str,
    chunk_id: str | None,
    model: str,
    choice: int,
    info: dict[str, Any] | None = None,
) -> bytes:
    """The last event of a stream ended by a policy: finish_reason ``repetition`` (vLLM's own
    for a loop it stopped), carrying ``info`` as its ``detproxy`` object, then ``[DONE]``."""
    end: dict[str, Any] = {"index": choice, "logprobs": None, "finish_reason": "repetition"}
    if endpoint == "chat":
        end["delta"] = {}
    else:
        end["text"] = ""
    event = stream_event(endpoint, chunk_id, model, end)
    if info is not None:
        event = event[: -len(b"}\n\n")] + b',"detproxy":' + orjson.dumps(info) + b"}\n\n"
    return event + b"data: [DONE]\n\n"


def recovery_chunk(endpoint: str, chunk_id: str | None, model: str, info: dict[str, Any]) -> bytes:
    """A chunk with no choice carrying ``info`` as its ``detproxy`` object: the last one before
    ``[DONE]`` of a stream a retry answered (choices empty, as a usage chunk's)."""
    chunk: dict[str, Any] = {
        "id": chunk_id or ("chatcmpl-detproxy" if endpoint == "chat" else "cmpl-detproxy"),
        "object": "chat.completion.chunk" if endpoint == "chat" else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [],
        "detproxy": info,
    }
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


def retry_comment(attempt: int, reason: str) -> bytes:
    """Marks a restart in the stream; SSE clients ignore comments."""
    safe = reason.replace("\n", " ").replace("\r", " ")
    return f": detproxy retry attempt={attempt} reason={safe}\n\n".encode()


def cut_answer(answer: dict[str, Any], endpoint: str, trigger: Trigger) -> None:
    """End a non-streamed answer at the loop: one unit kept, finish_reason ``repetition``."""
    if trigger.source == EMPTY:
        return  # an empty answer, no loop: it stays as it came
    for choice in answer.get("choices") or []:
        if not isinstance(choice, dict) or choice.get("index", 0) != trigger.choice:
            continue
        choice["finish_reason"] = "repetition"
        if trigger.start_offset is None or trigger.period is None:
            continue
        end = trigger.start_offset + trigger.period
        if endpoint != "chat":
            if isinstance(choice.get("text"), str):
                choice["text"] = choice["text"][:end]
            continue
        message = choice.get("message")
        if not isinstance(message, dict):
            continue
        names = REASONING_KEYS if trigger.channel == "reasoning" else ("content",)
        for name in names:
            if isinstance(message.get(name), str):
                message[name] = message[name][:end]
