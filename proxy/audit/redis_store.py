"""The passive duplicate store on Redis, shared by every replica.

One key per canonical request (``detproxy:dup:<xxh3-128>``) holding the output digests, with
the window as its TTL. ``SET ... GET PX`` (Redis >= 6.2) swaps in the new digests and returns
the old ones in one round trip. Nothing but hashes and counts is stored: never prompt or
output text. A slow or absent Redis costs a skipped check, never a client's time: the check
runs off the request path, with a short timeout, and failures are counted.
"""

from __future__ import annotations

import asyncio
import logging

import redis.asyncio as redis
from redis.exceptions import RedisError

from proxy.audit.store import ChoiceDigest, decode_digests, encode_digests

log = logging.getLogger(__name__)

PREFIX = "detproxy:dup:"


class RedisDuplicateStore:
    def __init__(self, url: str, window_s: float, timeout_s: float = 0.5) -> None:
        self._client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        self._window_ms = max(1, int(window_s * 1000))
        self._timeout = timeout_s
        self.errors = 0

    async def check_and_put(
        self, key: str, digests: tuple[ChoiceDigest, ...]
    ) -> tuple[ChoiceDigest, ...] | None:
        try:
            async with asyncio.timeout(self._timeout):
                old = await self._client.set(
                    PREFIX + key, encode_digests(digests), px=self._window_ms, get=True
                )
        except (RedisError, OSError, TimeoutError) as exc:
            self.errors += 1
            log.warning("duplicate store unavailable: %r", exc)
            return None
        return decode_digests(old) if isinstance(old, bytes) else None

    async def close(self) -> None:
        await self._client.aclose()
