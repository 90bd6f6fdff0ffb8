"""EmulatorServer: the emulator on a localhost port, for tests (aiohttp fake_server pattern)."""

from __future__ import annotations

from types import TracebackType
from typing import Any

from aiohttp import web

from .app import build_emulator_app
from .config import EmulatorConfig
from .generate import STATE_KEY
from .injections import EmulatorState


class EmulatorServer:
    """Run an emulator app on ``host:port`` (port 0 picks a free one)."""

    def __init__(
        self, config: EmulatorConfig | None = None, host: str = "127.0.0.1", port: int = 0
    ) -> None:
        self.config = config or EmulatorConfig()
        self.host = host
        self._requested_port = port
        self.app = build_emulator_app(self.config)
        self._runner: web.AppRunner | None = None
        self._port: int | None = None

    @property
    def state(self) -> EmulatorState:
        return self.app[STATE_KEY]

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("EmulatorServer is not started")
        return self._port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> str:
        """Start listening and return the base URL (``http://127.0.0.1:PORT``)."""
        if self._runner is not None:
            return self.url
        runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self._requested_port, reuse_address=True)
        await site.start()
        self._runner = runner
        self._port = int(runner.addresses[0][1])
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def injections(self, request_id: str | None = None) -> list[dict[str, Any]]:
        return self.state.injections(request_id)

    def stats(self) -> dict[str, int]:
        return self.state.stats()

    def reset(self) -> None:
        self.state.reset()

    async def __aenter__(self) -> EmulatorServer:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()
