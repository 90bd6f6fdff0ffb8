"""What the upstream loaded, read beside each run of a sweep (SPEC 1.15), so that a benchmark
says what it measured: the engine's endpoints as the fingerprint reads them (vLLM's
``/server_info`` in dev mode and ``vllm:cache_config_info``, SGLang's ``/server_info``,
llama.cpp's ``/props``), and, with ``--engine-log FILE``, the engine's own start-up log."""

from __future__ import annotations

from typing import IO, Any

from proxy.engine.engine_log import EngineLogReader
from proxy.engine.follow import EngineTruth
from proxy.events import EventBus

MAX_READ = 1 << 20  # bytes of new log read at one time
UNSHOWN = ("non_default_args",)  # in the JSON, too long for the one-line account


class LogTail:
    """The engine log's new lines since the last read, fed to a reader (a sweep is short:
    rotation is not followed)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.reader = EngineLogReader()
        self._file: IO[bytes] | None = None
        self._rest = b""

    def read(self) -> None:
        """Feed what was appended; OSError when the file cannot be opened or read."""
        if self._file is None:
            self._file = open(self.path, "rb")  # noqa: SIM115 (closed by close())
        while chunk := self._file.read(MAX_READ):
            *lines, self._rest = (self._rest + chunk).split(b"\n")
            for line in lines:
                self.reader.feed(line.decode("utf-8", "replace"))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class RecipeReader:
    """The merged account of what loaded; ``snapshot()`` after each fingerprint reading."""

    def __init__(self, engine_log: str | None = None) -> None:
        self.truth = EngineTruth(EventBus(), {}, engine_log)
        self.tail = LogTail(engine_log) if engine_log else None

    def refresh(self) -> None:
        """Read what the log added (the endpoints are read by the fingerprint poller)."""
        if self.tail is not None:
            self.tail.read()
            self.truth.log_read(self.tail.reader.facts)

    def snapshot(self) -> dict[str, Any] | None:
        """``{digest, facts, sources, unknown_env, deprecated, fallbacks, start_failed}``;
        None while nothing is known of what loaded."""
        digest = self.truth.digest()
        if digest is None:
            return None
        return {"digest": digest, **self.truth.facts.as_dict()}

    def sources(self) -> str:
        return "the engine's endpoints" + (
            f" and its log {self.tail.path}" if self.tail is not None else ""
        )

    def close(self) -> None:
        if self.tail is not None:
            self.tail.close()


def describe_recipe(recipe: dict[str, Any] | None) -> str:
    """One line: the digest, then the facts that decide stability, as read."""
    if recipe is None:
        return "unknown (the endpoints say nothing of what loaded; --engine-log FILE reads it)"
    facts = recipe.get("facts") or {}
    shown = ", ".join(f"{k}={_value(v)}" for k, v in facts.items() if k not in UNSHOWN)
    extra = []
    if recipe.get("unknown_env"):
        extra.append("ignored unknown env: " + ", ".join(map(str, recipe["unknown_env"])))
    if recipe.get("fallbacks"):
        extra.append("fallbacks: " + "; ".join(map(str, recipe["fallbacks"])))
    if recipe.get("start_failed"):
        extra.append("a failed start")
    tail = "".join(f"; {e}" for e in extra)
    return f"{recipe['digest']}: {shown or 'no facts'}{tail}"


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list | tuple):
        return "[" + ",".join(map(str, value)) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{v}" for k, v in value.items()) + "}"
    return str(value)
