from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry

from proxy.app import build_app
from proxy.config import STATE_DIR_ENV, load_settings
from proxy.testing import FakeUpstream, Handler, MockUpstream
from proxy.tools.emulator import EmulatorConfig, EmulatorServer
from tests.helpers.processes import redis_server
from tests.helpers.served import ServedApp

ProxyFactory = Callable[..., Awaitable[TestClient[Any, Any]]]


def pytest_configure(config: pytest.Config) -> None:
    """Tests never write into the real home: detproxy's default state directory (the default
    incident log's folder) is a temporary one for the whole session, set before collection
    (settings built there resolve it too) and inherited by the detproxy processes tests start."""
    state = tempfile.mkdtemp(prefix="detproxy-state-")
    config.stash[_STATE_DIR] = (state, os.environ.get(STATE_DIR_ENV))
    os.environ[STATE_DIR_ENV] = state


def pytest_unconfigure(config: pytest.Config) -> None:
    state, before = config.stash.get(_STATE_DIR, (None, None))
    if state is None:
        return
    if before is None:
        os.environ.pop(STATE_DIR_ENV, None)
    else:
        os.environ[STATE_DIR_ENV] = before
    shutil.rmtree(state, ignore_errors=True)


_STATE_DIR = pytest.StashKey[tuple[str, str | None]]()


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def make_proxy(
    aiohttp_client: Callable[..., Awaitable[TestClient[Any, Any]]],
    registry: CollectorRegistry,
) -> ProxyFactory:
    """Start detproxy (real app, real sockets) in front of ``upstream_url``."""
    shared = registry

    used: list[CollectorRegistry] = []

    async def factory(
        upstream_url: str,
        env: dict[str, str] | None = None,
        registry: CollectorRegistry | None = None,
        **kwargs: Any,
    ) -> TestClient[Any, Any]:
        """The first proxy reports to the ``registry`` fixture; later ones to their own."""
        settings = load_settings(env=env or {}, flags={"upstream": upstream_url})
        reg = registry or (shared if not used else CollectorRegistry())
        used.append(reg)
        app = build_app(settings, registry=reg, **kwargs)
        return await aiohttp_client(ServedApp(app, settings))

    return factory


@pytest.fixture
async def mock_upstream() -> AsyncIterator[MockUpstream]:
    """An in-process upstream (``proxy.testing.MockUpstream``, no socket) that answers only what
    a test routes (404 elsewhere): ``make_proxy(MOCK_URL, upstream=mock_upstream)``
    (``tests.helpers.upstreams.MOCK_URL``). What a handler raised is raised again at the end."""
    async with MockUpstream(routes={}) as mock:
        yield mock


@pytest.fixture
def upstream_app() -> web.Application:
    """A scripted upstream on a socket, for tests about the wire: tests add the routes they
    need (a test that is not about the wire uses ``mock_upstream``)."""
    return web.Application()


@pytest.fixture
async def upstream(
    aiohttp_server: Callable[..., Awaitable[TestServer]], upstream_app: web.Application
) -> Callable[[], Awaitable[str]]:
    async def start() -> str:
        server = await aiohttp_server(upstream_app)
        return str(server.make_url("")).rstrip("/")

    return start


@pytest.fixture
async def emulator() -> AsyncIterator[EmulatorServer]:
    """The emulator with its default config, in process; modules that need another config
    override this fixture."""
    async with EmulatorServer(EmulatorConfig()) as srv:
        yield srv


@pytest.fixture
async def fake_upstream() -> AsyncIterator[Callable[..., Awaitable[FakeUpstream]]]:
    """Starts a ``proxy.testing.FakeUpstream`` (its arguments: a handler, routes, ...),
    stopped when the test ends: on a socket, for tests about what detproxy's client writes on
    the wire (a test that is not uses ``mock_upstream``)."""
    async with contextlib.AsyncExitStack() as stack:

        async def start(handler: Handler | None = None, **kwargs: Any) -> FakeUpstream:
            return await stack.enter_async_context(FakeUpstream(handler, **kwargs))

        yield start


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    """A real redis-server of the test's own (tests using it carry ``NEEDS_REDIS``)."""
    with redis_server(tmp_path) as url:
        yield url
