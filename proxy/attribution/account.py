"""Triage's budget account: the experiments started (paced by ``max_per_minute``) and the
tokens their replays spent (at most ``max_token_share`` of the deterministic primaries' tokens
plus ``token_allowance``), for the whole server.

One process (``LocalAccount``): in memory. Several (``serve --workers N``, ``SharedAccount``):
one small JSON ledger in the folder the workers share, read and written under an exclusive
``flock``, so N workers start and spend what one process would. Each worker adds its own
primaries' count to the ledger when it asks, so the share is of the whole server's tokens. The
ledger is touched only when an experiment starts or settles (a few times a minute), never on the
request path.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Callable
from typing import Protocol

import orjson

from proxy.audit.shadow import TokenBucket
from proxy.config import AttributionConfig


class TriageAccount(Protocol):
    def start(self, cost: int, primary_tokens: int) -> str | None:
        """Start an experiment reserving ``cost`` tokens; None when started, else what held it
        back (``token_budget`` or ``rate_limit``). ``primary_tokens``: this process's."""
        ...

    def wait_s(self) -> float:
        """How long until the rate allows a start (0: now)."""
        ...

    def could_start(self, cost: int, primary_tokens: int) -> bool:
        """Whether ``start`` would start it now (nothing is taken)."""
        ...

    def settle(self, delta: int) -> None:
        """Tokens to add to what was reserved (negative: give back)."""
        ...

    def tokens(self) -> int:
        """Spent (and reserved) so far."""
        ...

    def budget(self, primary_tokens: int) -> float:
        """Tokens allowed so far."""
        ...


class LocalAccount:
    def __init__(self, config: AttributionConfig) -> None:
        self._config = config
        self._bucket = TokenBucket(config.max_per_minute / 60.0)
        self._tokens = 0

    def budget(self, primary_tokens: int) -> float:
        return self._config.token_allowance + self._config.max_token_share * primary_tokens

    def start(self, cost: int, primary_tokens: int) -> str | None:
        if self._tokens + cost > self.budget(primary_tokens):
            return "token_budget"
        if not self._bucket.take():
            return "rate_limit"
        self._tokens += cost
        return None

    def wait_s(self) -> float:
        return self._bucket.wait_s()

    def could_start(self, cost: int, primary_tokens: int) -> bool:
        fits = self._tokens + cost <= self.budget(primary_tokens)
        return fits and self._bucket.wait_s() == 0.0

    def settle(self, delta: int) -> None:
        self._tokens += delta

    def tokens(self) -> int:
        return self._tokens


class SharedAccount:
    """The server's ledger: ``{"tokens": n, "next_at": t, "primary": {pid: n}}`` (``next_at``
    in wall-clock seconds: the workers share no monotonic clock)."""

    def __init__(
        self,
        config: AttributionConfig,
        path: str,
        clock: Callable[[], float] = time.time,
        worker: str | None = None,
    ) -> None:
        self._config = config
        self._path = path
        self._clock = clock
        self._me = worker or str(os.getpid())  # whose primaries these are
        os.makedirs(os.path.dirname(path), exist_ok=True)

    def _update(self, change: Callable[[dict[str, object]], str | None]) -> str | None:
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            raw = b""
            while chunk := os.read(fd, 65536):
                raw += chunk
            try:
                ledger = orjson.loads(raw) if raw else {}
            except orjson.JSONDecodeError:
                ledger = {}  # a torn ledger (a crash mid-write) starts over
            if not isinstance(ledger, dict):
                ledger = {}
            answer = change(ledger)
            data = orjson.dumps(ledger)
            os.lseek(fd, 0, os.SEEK_SET)
            os.ftruncate(fd, 0)
            os.write(fd, data)
            return answer
        finally:
            os.close(fd)  # releases the lock

    def _read(self) -> dict[str, object]:
        try:
            with open(self._path, "rb") as f:
                ledger = orjson.loads(f.read() or b"{}")
        except (OSError, orjson.JSONDecodeError):
            return {}
        return ledger if isinstance(ledger, dict) else {}

    def _budget_of(self, ledger: dict[str, object]) -> float:
        primary = ledger.get("primary")
        total = sum(int(v) for v in primary.values()) if isinstance(primary, dict) else 0
        return self._config.token_allowance + self._config.max_token_share * total

    @staticmethod
    def _int(ledger: dict[str, object], key: str) -> int:
        value = ledger.get(key)
        return int(value) if isinstance(value, (int, float)) else 0

    def _interval_s(self) -> float:
        return 60.0 / self._config.max_per_minute

    def start(self, cost: int, primary_tokens: int) -> str | None:
        def change(ledger: dict[str, object]) -> str | None:
            primary = ledger.get("primary")
            if not isinstance(primary, dict):
                primary = ledger["primary"] = {}
            primary[self._me] = primary_tokens
            tokens = self._int(ledger, "tokens")
            if tokens + cost > self._budget_of(ledger):
                return "token_budget"
            now = self._clock()
            next_at = ledger.get("next_at")
            if isinstance(next_at, (int, float)) and now < next_at:
                return "rate_limit"
            ledger["tokens"] = tokens + cost
            ledger["next_at"] = now + self._interval_s()
            return None

        return self._update(change)

    def wait_s(self) -> float:
        next_at = self._read().get("next_at")
        if not isinstance(next_at, (int, float)):
            return 0.0
        return max(0.0, min(self._interval_s(), next_at - self._clock()))

    def could_start(self, cost: int, primary_tokens: int) -> bool:
        ledger = self._read()
        if self._int(ledger, "tokens") + cost > self._budget_of(ledger):
            return False
        next_at = ledger.get("next_at")
        return not isinstance(next_at, (int, float)) or self._clock() >= next_at

    def settle(self, delta: int) -> None:
        def change(ledger: dict[str, object]) -> None:
            ledger["tokens"] = self._int(ledger, "tokens") + delta

        self._update(change)

    def tokens(self) -> int:
        return self._int(self._read(), "tokens")

    def budget(self, primary_tokens: int) -> float:
        return self._budget_of(self._read())


def triage_account(
    config: AttributionConfig, processes: int, shared_dir: str | None
) -> TriageAccount:
    """In memory for one process; ``shared_dir/triage-ledger.json`` for several."""
    if processes > 1 and shared_dir:
        return SharedAccount(config, os.path.join(shared_dir, "triage", "ledger.json"))
    return LocalAccount(config)
