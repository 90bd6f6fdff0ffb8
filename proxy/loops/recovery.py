"""Loop recovery for one app: each attempt's loop watch, the policies and the recovery budget a
request's attempts ask (``proxy.attempts.Attempts``), and how a loop's answer ends (an abort's
last chunk, a retry's ``detproxy`` chunk, a non-streamed answer cut at the loop). The body of
the attempt a retry sends is ``proxy.loops.next_attempt``'s, a pure function."""

from __future__ import annotations

import fnmatch
import time
from collections.abc import Callable, Mapping
from typing import Any

import orjson

from policies.base import PolicyChain, Trigger
from policies.budget import RecoveryBudget
from proxy.config import LoopConfig, ReasoningMarkersConfig
from proxy.events import EventBus
from proxy.injection import REPETITION_DETECTION, InjectionGuard
from proxy.loops.detector import DetectorConfig
from proxy.loops.rendered import RenderedContinuation
from proxy.loops.watch import EMPTY, LoopWatch
from proxy.openai import REASONING_KEYS, stream_event

MAX_PUBLISHED = 1024  # models whose budget gauge is rate-limited (client-controlled names)


class Recovery:
    def __init__(
        self,
        config: LoopConfig,
        chain: PolicyChain,
        bus: EventBus,
        guard: InjectionGuard | None = None,
        budget: RecoveryBudget | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config = config
        # What each request asks, read once: compiled, these are loads, and the frozen
        # configuration's fields attribute lookups.
        self._enabled = config.enabled
        self._runaway = config.runaway
        self._engine_detection = config.engine_detection
        self._guard = guard
        self.budget = budget  # None: loops are off
        self.max_attempts = config.max_attempts  # the one cap on a request's attempts
        self._clock = clock
        self._published: dict[str, int] = {}  # model -> second its budget gauge was last set
        self.chain = chain
        self.bus = bus
        self._detector = DetectorConfig(**config.detector)  # type: ignore[arg-type]
        # Whether some ladder continues: then a stream's text is kept for its prefix.
        self._continues = config.stream_mode == "continue" or any(
            attempt.get("strategy") in ("continue", "close_reasoning")
            for ladder in config.ladder_list()
            for attempt in ladder.attempts
        )
        # A streamed retry goes on from what the client was shown (restarts while nothing was).
        self._stream_continues = config.stream_mode == "continue"
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
        return self._enabled or self.chain.reads_clean_answers

    @property
    def hold_reasoning(self) -> bool:
        return self._config.stream_mode == "hold_reasoning"

    @property
    def stream_continues(self) -> bool:
        """Whether a streamed retry continues from exactly what the client was shown."""
        return self._stream_continues

    @property
    def hold_back_chars(self) -> int:
        """The tail a continuing stream holds back from its client (0: none)."""
        return self._config.hold_back_chars if self._stream_continues else 0

    @property
    def hold_max_bytes(self) -> int:
        return self._config.hold_max_bytes

    def watch(self, endpoint: str, empty_stop: bool = False) -> LoopWatch | None:
        """The loop watch of one streamed attempt (``empty_stop``: a retry's, where an answer
        that stops with nothing in it is a trigger too)."""
        if not self._enabled:
            return None
        return LoopWatch(
            endpoint,
            self._detector,
            runaway=self._runaway,
            keep=self._continues,
            empty_stop=empty_stop,
        )

    def prepare(self, body: dict[str, Any], model: str) -> dict[str, Any]:
        """Add vLLM's repetition_detection where the operator says the upstream has it (and
        it has not been refused for ``model`` lately)."""
        engine = self._engine_detection
        if engine is None or "repetition_detection" in body:
            return body
        if self._guard is not None and not self._guard.allows(model, REPETITION_DETECTION):
            return body
        return {**body, "repetition_detection": engine.model_dump()}

    def markers(self, model: str) -> tuple[str, str]:
        """The reasoning markers of ``model`` (``[[loops.reasoning_markers]]``)."""
        markers = next(
            (m for m in self._config.reasoning_markers if fnmatch.fnmatchcase(model, m.models)),
            ReasoningMarkersConfig(),
        )
        return markers.start, markers.end

    def budget_gauge_due(self, model: str, moved: bool) -> bool:
        """Whether ``RecoveryBudgetUsed`` for ``model`` is due: at once when a recovery moved
        its account (``moved``), else once a second per model (each request's tokens move
        "allowed" a little; not worth an update each)."""
        now = int(self._clock())
        if not moved and self._published.get(model) == now:
            return False
        if len(self._published) < MAX_PUBLISHED or model in self._published:
            self._published[model] = now
        return True


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
