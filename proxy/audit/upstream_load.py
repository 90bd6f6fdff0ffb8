"""How busy the upstream says it is: the sum of ``vllm:num_requests_running`` over engines."""

from __future__ import annotations

import logging

import aiohttp

log = logging.getLogger(__name__)

RUNNING = "vllm:num_requests_running"


def parse_running(text: str) -> float | None:
    total, seen = 0.0, False
    for line in text.splitlines():
        if line.startswith(RUNNING) and line[len(RUNNING) : len(RUNNING) + 1] in ("{", " "):
            try:
                total += float(line.rsplit(None, 1)[-1])
            except ValueError:
                continue
            seen = True
    return total if seen else None


class UpstreamLoad:
    def __init__(self, session: aiohttp.ClientSession, base_url: str, timeout_s: float = 2.0):
        self._session = session
        self._url = base_url.rstrip("/") + "/metrics"
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def running(self) -> int | None:
        """None when the upstream exports no such metric or cannot be reached."""
        try:
            async with self._session.get(self._url, timeout=self._timeout) as resp:
                if resp.status != 200:
                    return None
                text = await resp.text(errors="replace")
        except (TimeoutError, aiohttp.ClientError) as exc:
            log.debug("cannot read %s: %r", self._url, exc)
            return None
        value = parse_running(text)
        return None if value is None else int(value)
