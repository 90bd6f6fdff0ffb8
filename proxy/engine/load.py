"""How busy the upstream says it is, from its /metrics: the sum of vLLM's
``vllm:num_requests_running`` over engines, or llama-server's ``llamacpp:requests_processing``
(exported with ``--metrics``: the slots busy with a request)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from proxy.engine.promtext import sum_samples
from proxy.http.errors import UpstreamError
from proxy.http.upstream import Upstream, get, url_auth
from proxy.redact import mask_url

log = logging.getLogger(__name__)

RUNNING = ("vllm:num_requests_running", "llamacpp:requests_processing")
FINISHED = "vllm:request_success_total"  # every finished_reason, every engine


@dataclass(frozen=True, slots=True)
class EngineCounts:
    """One read of the engine's /metrics: requests running now, and requests finished so far
    (None where the engine exports no such counter)."""

    running: int
    finished: int | None


def parse_running(text: str) -> float | None:
    """The sum of the running gauges' samples; None when the text has none of them."""
    totals = sum_samples(text, RUNNING)
    return sum(totals.values()) if totals else None


class UpstreamLoad:
    """``upstream``: the client of the engine at ``base_url`` (the URL it is named by in the
    log, and whose credentials the read carries)."""

    def __init__(self, upstream: Upstream, base_url: str, timeout_s: float = 2.0):
        self._upstream = upstream
        self._url = base_url.rstrip("/") + "/metrics"
        self._headers = url_auth(base_url)
        self._timeout_s = timeout_s

    async def running(self) -> int | None:
        """None when the upstream exports no such metric or cannot be reached."""
        counts = await self.counts()
        return None if counts is None else counts.running

    async def counts(self) -> EngineCounts | None:
        """Running and finished in one read; None when the engine exports no running count or
        cannot be reached."""
        try:
            got = await get(self._upstream, "/metrics", self._timeout_s, self._headers)
        except UpstreamError as exc:
            log.debug("cannot read %s: %r", mask_url(self._url), exc)
            return None
        if got.status != 200:
            return None
        totals = sum_samples(got.body.decode("utf-8", "replace"), (*RUNNING, FINISHED))
        running = [v for k, v in totals.items() if k in RUNNING]
        if not running:
            return None
        finished = totals.get(FINISHED)
        return EngineCounts(int(sum(running)), None if finished is None else int(finished))
