"""The sweep: a test request, the fingerprint, then every level of every repeat, interleaved."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from proxy.engine.fingerprint import FingerprintPoller
from proxy.engine.follow import moved
from proxy.engine.identity import Fingerprint
from proxy.events import EventBus
from proxy.http.h1 import H1Upstream
from proxy.http.upstream import Upstream
from proxy.redact import mask_url
from proxy.tools.sweep.load import Clock, RequestRecord, Target, Window, run_window, stream_request
from proxy.tools.sweep.recipe import RecipeReader
from proxy.tools.sweep.stats import SCHEMA, level_summary, warnings_for

PREFLIGHT_MAX_TOKENS = 8


class SweepError(Exception):
    """The sweep could not start: the upstream is unreachable or refuses the request."""


@dataclass(frozen=True, slots=True)
class SweepConfig:
    target: Target
    concurrency: Sequence[int] = (1, 2, 4, 8, 16)
    duration_s: float = 10.0
    repeats: int = 3
    spread_warn: float = 0.10
    extra: dict[str, Any] = field(default_factory=dict)  # echoed into the report's config
    engine_log: str | None = None  # the engine's log, read for what loaded beside each run


def normalise_base(url: str) -> str:
    """``http://h:8000/v1/`` and ``http://h:8000`` both mean the server at ``http://h:8000``."""
    base = url.rstrip("/")
    return base[:-3] if base.endswith("/v1") else base


async def preflight(upstream: Upstream, target: Target, clock: Clock = time.monotonic) -> None:
    """One short request: fail fast on a refused connection, a wrong model or a bad body."""
    rec = RequestRecord(sent=clock())
    body = target.body(0, PREFLIGHT_MAX_TOKENS)
    await stream_request(upstream, target, body, rec, clock=clock)
    if rec.error is not None:
        raise SweepError(f"test request to {target.url} failed: {rec.error}")


async def run_sweep(
    config: SweepConfig,
    on_tick: Callable[[Window, int], None] | None = None,
    *,
    clock: Clock = time.monotonic,
    upstream: Upstream | None = None,
) -> dict[str, Any]:
    """Run the whole sweep and return the report (see ``stats`` for its parts).

    ``on_tick(window, index)`` is called a few times a second; ``index`` counts runs from 0.
    ``clock`` times everything; ``upstream`` (kept open) replaces the sweep's own client:
    every request of the sweep goes through it, the engine's reads included.
    """
    started = datetime.now(UTC)
    t0 = clock()
    if upstream is not None:
        return await _sweep(config, on_tick, clock, upstream, started, t0)
    target = config.target
    own = H1Upstream(
        target.base_url,
        read_timeout_s=target.timeout_s,
        max_connections=max(config.concurrency) + 4,
    )
    try:
        return await _sweep(config, on_tick, clock, own, started, t0)
    finally:
        await own.close()


async def _sweep(
    config: SweepConfig,
    on_tick: Callable[[Window, int], None] | None,
    clock: Clock,
    upstream: Upstream,
    started: datetime,
    t0: float,
) -> dict[str, Any]:
    target = config.target
    await preflight(upstream, target, clock)
    recipes = RecipeReader(config.engine_log)
    try:
        recipes.refresh()
    except OSError as exc:
        raise SweepError(f"cannot read the engine log {config.engine_log}: {exc}") from exc
    poller = FingerprintPoller(
        upstream,
        target.base_url,
        EventBus(),
        interval_s=0.0,
        truth=recipes.truth,
        headers={"Connection": "close"},  # no idle connection kept (``Target.headers``)
    )
    try:
        before = current = await poller.poll()
        recipe_before = recipes.snapshot()
        changes: list[dict[str, Any]] = []
        windows: list[Window] = []
        run_recipes: dict[tuple[int, int], str | None] = {}
        for repeat in range(1, config.repeats + 1):
            for c in config.concurrency:
                window = Window(c, repeat, config.duration_s)
                index = len(windows)
                tick = None if on_tick is None else (lambda w, i=index: on_tick(w, i))
                windows.append(await run_window(upstream, target, window, tick, clock))
                with contextlib.suppress(OSError):  # a log gone mid-sweep: endpoints still say
                    recipes.refresh()
                fp = await poller.poll()
                run_recipes[(repeat, c)] = recipes.truth.digest()
                if fp.fingerprint != current.fingerprint:
                    changes.append(_change(repeat, c, current, fp))
                    current = fp
        recipe_after = recipes.snapshot()
    finally:
        recipes.close()
    fingerprint = {
        "before": before.summary(),
        "after": current.summary(),
        "changed": bool(changes),
        "changes": changes,
    }
    levels = [
        level_summary(c, [w for w in windows if w.concurrency == c], config.spread_warn)
        for c in config.concurrency
    ]
    for level in levels:  # what loaded, as read right after each run
        for run in level["runs"]:
            run["recipe"] = run_recipes.get((run["repeat"], run["concurrency"]))
    recipe = {
        "read_from": recipes.sources(),
        "before": recipe_before,
        "after": recipe_after,
        # facts that went from one known value to another (a redeploy, a fallback): the
        # fingerprint changes with them; a fact learnt later is no move
        "moved": moved(
            (recipe_before or {}).get("facts") or {}, (recipe_after or {}).get("facts") or {}
        ),
    }
    warnings = warnings_for(levels, fingerprint, config.spread_warn)
    return {
        "schema": SCHEMA,
        "upstream": mask_url(target.base_url),  # a result file is shared: no password
        "model": target.model,
        "started_at": started.isoformat(timespec="seconds"),
        "elapsed_s": round(clock() - t0, 3),
        "config": {
            "concurrency": list(config.concurrency),
            "duration_s": config.duration_s,
            "repeats": config.repeats,
            "max_tokens": target.max_tokens,
            "endpoint": target.endpoint,
            "timeout_s": target.timeout_s,
            "spread_warn": config.spread_warn,
            "extra_body": dict(target.extra_body),
            "prompts": len(target.prompts),
            **config.extra,
        },
        "fingerprint": fingerprint,
        "recipe": recipe,
        "levels": levels,
        "warnings": warnings,
        "ok": not warnings,
    }


def _change(repeat: int, concurrency: int, old: Fingerprint, new: Fingerprint) -> dict[str, Any]:
    return {
        "after_repeat": repeat,
        "after_concurrency": concurrency,
        "from": old.summary(),
        "to": new.summary(),
    }
