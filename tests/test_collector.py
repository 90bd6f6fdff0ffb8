"""The collector once ``detproxy serve`` serves: start-up frozen, thresholds from the config."""

from __future__ import annotations

import gc
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from proxy.cli import serve_app
from proxy.config import Settings, load_settings
from tests.helpers.processes import bare_env
from tests.helpers.served import ServedApp

ROOT = Path(__file__).resolve().parents[1]
Client = Callable[..., Awaitable[TestClient[Any, Any]]]


@pytest.fixture
def collector_state() -> Iterator[None]:
    """The test process's collector as it was, whatever the app under test did to it."""
    threshold = gc.get_threshold()
    gc.unfreeze()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


def settings(**server: object) -> Settings:
    env = {"DETPROXY_UPSTREAM__FINGERPRINT_INTERVAL_S": "0"}
    env |= {f"DETPROXY_SERVER__{k.upper()}": str(v) for k, v in server.items()}
    return load_settings(None, env)


async def test_serving_freezes_start_up_and_sets_the_thresholds(
    aiohttp_client: Client, collector_state: None
) -> None:
    config = settings(gc_threshold="[12345, 67, 89]")
    app = serve_app(config)
    assert gc.get_freeze_count() == 0 and gc.get_threshold() != (12345, 67, 89)
    client = await aiohttp_client(ServedApp(app, config))  # start-up runs: the app serves
    assert gc.get_threshold() == (12345, 67, 89)
    # What start-up kept (the app, its clients, its metrics) is in the permanent generation.
    frozen = gc.get_freeze_count()
    assert frozen > 1000
    assert (await client.get("/detproxy/health")).status == 200


async def test_default_settles_the_collector(aiohttp_client: Client, collector_state: None) -> None:
    await aiohttp_client(serve_app(settings()))
    assert gc.get_threshold() == Settings().server.gc_threshold != (700, 10, 10)
    assert gc.get_freeze_count() > 0


async def test_freeze_off_leaves_the_heap_unfrozen(
    aiohttp_client: Client, collector_state: None
) -> None:
    await aiohttp_client(serve_app(settings(gc_freeze="false", gc_threshold="[700, 10, 10]")))
    assert gc.get_freeze_count() == 0
    assert gc.get_threshold() == (700, 10, 10)


def test_importing_detproxy_leaves_the_collector_alone() -> None:
    # Only serving settles it: a library user (or a test) importing the app keeps its own.
    code = (
        "import gc; before = gc.get_threshold(); "
        "import proxy.cli, proxy.app, proxy.collector; "
        "assert gc.get_threshold() == before, gc.get_threshold(); "
        "assert gc.get_freeze_count() == 0, gc.get_freeze_count()"
    )
    run = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**bare_env(), "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
