"""How busy the upstream says it is, from its /metrics: the sum of vLLM's
``vllm:num_requests_running`` over engines, or llama-server's ``llamacpp:requests_processing``
(exported with ``--metrics``: the slots busy with a request)."""

from __future__ import annotations

import logging

import aiohttp

from proxy.engine.promtext import sum_samples
from proxy.redact import mask_url

log = logging.getLogger(__name__)

RUNNING = ("vllm:num_requests_running", "llamacpp:requests_processing")


def parse_running(text: str) -> float | None:
    """The sum of the running gauges' samples; None when the text has none of them."""
    totals = sum_samples(text, RUNNING)
    return sum(totals.values()) if totals else None


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
            log.debug("cannot read %s: %r", mask_url(self._url), exc)
            return None
        value = parse_running(text)
        return None if value is None else int(value)
