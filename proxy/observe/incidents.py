"""The incident log: every non-identical audit and every loop as one JSON line, and a ring.

A subscriber of ``AuditCompleted``. Lines go to a size-rotated file (``path``,
``path.1``, ... ``path.N``) and to a bounded in-memory ring served newest first at
``/detproxy/incidents``. Prompts and outputs are kept only when ``store_text`` is on;
hashes always are.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from dataclasses import asdict
from typing import IO, Any

import orjson
from aiohttp import web

from proxy.config import IncidentConfig
from proxy.events import (
    AuditCompleted,
    EventBus,
    LoopDetected,
    UpstreamFingerprinted,
    UpstreamRestarted,
)

log = logging.getLogger(__name__)


def audit_incident(ev: AuditCompleted) -> dict[str, Any]:
    verdict = ev.verdict
    divergence = asdict(verdict.divergence) if verdict.divergence is not None else None
    record: dict[str, Any] = {
        "kind": "audit",
        "ts": ev.timestamp,
        "request_id": ev.request_id,
        "model": ev.model,
        "endpoint": ev.endpoint,
        "mode": ev.mode,
        "choice": ev.choice,
        "verdict": verdict.verdict,
        "reason": verdict.reason,
        "divergence": divergence,
        "max_abs_logprob_delta": verdict.max_abs_logprob_delta,
        "primary_hash": verdict.primary_hash,
        "shadow_hash": verdict.shadow_hash,
        "primary_tokens": verdict.primary_tokens,
        "shadow_tokens": verdict.shadow_tokens,
        "primary_answer": verdict.primary_answer,
        "shadow_answer": verdict.shadow_answer,
        "request_key": ev.request_key,
        "inflight_primary": ev.inflight_primary,
        "inflight_shadow": ev.inflight_shadow,
        "shadow_overlapped": ev.shadow_overlapped,
        "primary_latency_s": ev.primary_latency_s,
        "shadow_latency_s": ev.shadow_latency_s,
        "target": ev.target,
    }
    if ev.prompt is not None or ev.primary_text is not None:
        record["prompt"] = ev.prompt
        record["primary_text"] = ev.primary_text
        record["shadow_text"] = ev.shadow_text
    return record


def loop_incident(ev: LoopDetected, store_text: bool) -> dict[str, Any]:
    trigger = ev.trigger
    record: dict[str, Any] = {
        "kind": "loop",
        "ts": ev.timestamp,
        "request_id": ev.request_id,
        "model": ev.model,
        "endpoint": ev.endpoint,
        "stream": ev.stream,
        "attempt": ev.attempt,
        "source": trigger.source,
        "channel": trigger.channel,
        "choice": trigger.choice,
        "period": trigger.period,
        "repeats": trigger.repeats,
        "start_offset": trigger.start_offset,
    }
    if store_text:
        record["unit_preview"] = trigger.preview
    return record


class IncidentLog:
    def __init__(self, config: IncidentConfig) -> None:
        self._config = config
        self._ring: deque[dict[str, Any]] = deque(maxlen=config.ring_size)
        self._file: IO[bytes] | None = None
        self._size = 0
        self.written = 0
        self.write_errors = 0
        self._upstream: dict[str, Any] | None = None
        if config.path:
            self._open()

    def subscribe(self, bus: EventBus) -> None:
        bus.subscribe(AuditCompleted, self._on_audit)
        bus.subscribe(LoopDetected, self._on_loop)
        bus.subscribe(UpstreamFingerprinted, self._on_fingerprint)
        bus.subscribe(UpstreamRestarted, self._on_restart)

    def _on_fingerprint(self, ev: UpstreamFingerprinted) -> None:
        self._upstream = ev.fingerprint.summary()
        if ev.changed and ev.previous is not None:
            self.record(
                {
                    "kind": "upstream_change",
                    "ts": ev.fingerprint.read_at,
                    "before": ev.previous.summary() | {"identity": ev.previous.identity},
                    "after": self._upstream | {"identity": ev.fingerprint.identity},
                }
            )

    def _on_restart(self, ev: UpstreamRestarted) -> None:
        # The same identity back: not a change; kept so that audits after it can be read
        # against it. Only a change of identity is an "upstream_change".
        self.record(
            {
                "kind": "upstream_restart",
                "ts": ev.fingerprint.read_at,
                "down_s": ev.down_s,
                "evidence": ev.evidence,
            }
        )

    def _on_loop(self, ev: LoopDetected) -> None:
        self.record(loop_incident(ev, self._config.store_text))

    def _on_audit(self, ev: AuditCompleted) -> None:
        if ev.verdict.verdict != "identical":
            self.record(audit_incident(ev))

    def _open(self) -> None:
        assert self._config.path
        self._file = open(self._config.path, "ab")  # noqa: SIM115 (lives as long as the app)
        self._size = self._file.tell()

    def _rotate(self) -> None:
        assert self._file is not None and self._config.path
        self._file.close()
        path, backups = self._config.path, self._config.backups
        if backups == 0:
            os.truncate(path, 0)
        else:
            for i in range(backups - 1, 0, -1):
                if os.path.exists(f"{path}.{i}"):
                    os.replace(f"{path}.{i}", f"{path}.{i + 1}")
            os.replace(path, f"{path}.1")
        self._open()

    def record(self, incident: dict[str, Any]) -> None:
        if self._upstream is not None and "upstream" not in incident:
            incident["upstream"] = self._upstream  # which configuration produced it
        self._ring.append(incident)
        self.write(incident)

    def write(self, incident: dict[str, Any]) -> None:
        """Append one line to the file (the ring is for incidents only, not tallies)."""
        if self._file is None:
            return
        line = orjson.dumps(incident) + b"\n"
        try:
            if self._size and self._size + len(line) > self._config.max_bytes:
                self._rotate()
            self._file.write(line)
            self._file.flush()  # acknowledged means on its way to disk
            self._size += len(line)
            self.written += 1
        except OSError:
            self.write_errors += 1
            log.exception("cannot write incident log %s", self._config.path)

    def recent(self, limit: int) -> list[dict[str, Any]]:
        items = list(self._ring)[-limit:] if limit > 0 else []
        items.reverse()
        return items

    def close(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None

    async def handle(self, request: web.Request) -> web.Response:
        raw = request.query.get("limit", "100")
        try:
            limit = int(raw)
        except ValueError:
            limit = -1
        if limit < 0:
            body = {
                "error": {
                    "message": "limit must be a non-negative integer",
                    "type": "BadRequestError",
                    "param": "limit",
                    "code": 400,
                }
            }
            return web.json_response(body, status=400, dumps=lambda o: orjson.dumps(o).decode())
        return web.Response(body=orjson.dumps(self.recent(limit)), content_type="application/json")
