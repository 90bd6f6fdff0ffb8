"""What lives as long as the app (proxy/app.py): each resource in its own cleanup context,
released in the order that lets the later ones finish on the earlier ones."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestServer
from prometheus_client import CollectorRegistry

from proxy.app import READS, REFERENCE, RUNTIME, TARGET, build_app
from proxy.audit.auditor import Auditor
from proxy.audit.shadow import ShadowScheduler
from proxy.config import load_settings
from proxy.http.h1 import H1Upstream
from proxy.observe.incidents import IncidentLog
from tests.helpers.processes import free_port


def spy(monkeypatch: pytest.MonkeyPatch, cls: type, name: str, calls: list[str]) -> None:
    original = getattr(cls, name)

    if asyncio.iscoroutinefunction(original):

        async def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            calls.append(f"{cls.__name__}.{name}")
            return await original(self, *args, **kwargs)
    else:

        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:  # type: ignore[misc]
            calls.append(f"{cls.__name__}.{name}")
            return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, name, wrapper)


async def test_every_resource_is_released_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    app_tasks: list[list[str]] = []
    original_close = ShadowScheduler.close

    async def scheduler_close(self: ShadowScheduler) -> None:
        # The app's own background tasks are gone before the shadow workers stop.
        app_tasks.append(
            [t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith("app:")]
        )
        calls.append("ShadowScheduler.close")
        await original_close(self)

    monkeypatch.setattr(ShadowScheduler, "close", scheduler_close)
    spy(monkeypatch, Auditor, "close", calls)
    spy(monkeypatch, IncidentLog, "close", calls)
    spy(monkeypatch, H1Upstream, "close", calls)
    env = {
        "DETPROXY_AUDIT__SAMPLE_RATE": "1",
        "DETPROXY_AUDIT__REFERENCE_URL": f"http://127.0.0.1:{free_port()}",
        "DETPROXY_INCIDENTS__PATH": str(tmp_path / "incidents.jsonl"),
        "DETPROXY_UPSTREAM__FINGERPRINT_INTERVAL_S": "60",
    }
    settings = load_settings(env=env, flags={"upstream": f"http://127.0.0.1:{free_port()}"})
    app = build_app(settings, registry=CollectorRegistry())
    server = TestServer(app)
    await server.start_server()
    running = sorted(t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith("app:"))
    assert running == ["app:fingerprint", "app:tally"]
    writer = [t for t in asyncio.all_tasks() if t.get_name() == "incidents:writer"]
    assert len(writer) == 1, "the incident log's writer task is not running"
    assert isinstance(app[TARGET], H1Upstream) and isinstance(app[REFERENCE], H1Upstream)
    # The engine reads' own connections: a pool full of proxied requests holds none back.
    assert isinstance(app[READS], H1Upstream) and app[READS] is not app[TARGET]
    assert app[RUNTIME].scheduler is not None and app[RUNTIME].auditor is not None
    await server.close()
    assert app_tasks == [[]]
    assert calls == [
        "ShadowScheduler.close",
        "Auditor.close",
        "IncidentLog.close",
        "H1Upstream.close",  # the reference
        "H1Upstream.close",  # the engine reads'
        "H1Upstream.close",  # the target
    ]
    assert writer[0].done(), "the incident log's writer outlived the app"
    lines = (tmp_path / "incidents.jsonl").read_bytes().splitlines()
    assert b'"kind":"tally"' in lines[-1]  # the last word, written before the log closed


async def test_an_upstream_given_to_the_app_is_not_closed_with_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []
    spy(monkeypatch, H1Upstream, "close", calls)
    given = H1Upstream(
        f"http://127.0.0.1:{free_port()}",
        connect_timeout_s=1.0,
        read_timeout_s=1.0,
        keepalive_timeout_s=1.0,
        max_connections=1,
    )
    env = {"DETPROXY_UPSTREAM__FINGERPRINT_INTERVAL_S": "0"}
    app = build_app(load_settings(env=env), registry=CollectorRegistry(), upstream=given)
    server = TestServer(app)
    await server.start_server()
    assert app[TARGET] is given and app[READS] is given and app[REFERENCE] is None
    await server.close()
    assert calls == []
