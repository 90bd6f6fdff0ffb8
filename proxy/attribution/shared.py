"""Experiments shared by the workers of one server (``serve --workers N``): one experiment per
request and recipe for the whole server, as in one process.

A burst's incidents of one prompt land on several workers; each would otherwise replay the same
request. A worker about to run an experiment claims its key (an exclusive ``flock`` on a file
named by the key's hash, in the folder the workers share): one that finds it claimed waits for
that worker's replays instead of making its own. Finished replays are written there (one JSON
file per key, replaced atomically) and read back by any worker for ``reuse_s``, as its own.
A worker that dies releases its claim with its file descriptor.
"""

from __future__ import annotations

import fcntl
import os
import time
from dataclasses import dataclass
from typing import Any

import orjson
import xxhash

from proxy.attribution.experiments import Observed, Plan
from proxy.audit.logprobs import TokenLogprob
from proxy.audit.outcome import ChoiceOutcome, Outcome


@dataclass(frozen=True, slots=True)
class SharedResult:
    """An experiment's replays as another worker (or this one) wrote them."""

    replays: tuple[Observed, ...]
    missing: tuple[str, ...]
    plan: Plan
    at: float  # wall clock: the workers share no monotonic clock
    experiment: str  # the request id whose replays these are


def _token(t: TokenLogprob) -> list[Any]:
    return [t.token, t.logprob, [list(pair) for pair in t.top]]


def _outcome(o: Outcome) -> dict[str, Any]:
    return {
        "choices": [
            [
                c.index,
                c.content,
                c.reasoning,
                None if c.tokens is None else [_token(t) for t in c.tokens],
                c.finish_reason,
                c.stop_reason,
            ]
            for c in o.choices
        ],
        "error": o.error,
        "usage": [o.prompt_tokens, o.completion_tokens, o.cached_tokens],
    }


def _outcome_of(d: dict[str, Any]) -> Outcome:
    choices = tuple(
        ChoiceOutcome(
            index,
            content,
            reasoning,
            None
            if tokens is None
            else tuple(
                TokenLogprob(tok, lp, tuple((str(a), b) for a, b in top)) for tok, lp, top in tokens
            ),
            finish,
            stop,
        )
        for index, content, reasoning, tokens, finish, stop in d["choices"]
    )
    prompt, completion, cached = d["usage"]
    return Outcome(choices, d["error"], prompt, completion, cached)


def encode(result: SharedResult) -> bytes:
    plan = result.plan
    return orjson.dumps(
        {
            "replays": [
                {
                    "name": r.name,
                    "target": r.target,
                    "cache": r.cache,
                    "alone": r.alone,
                    "inflight": r.inflight,
                    "identity": r.identity,
                    "outcome": None if r.outcome is None else _outcome(r.outcome),
                    "error": r.error,
                }
                for r in result.replays
            ],
            "missing": list(result.missing),
            "plan": [
                plan.cold_replays,
                plan.warm_replays,
                plan.reference_replays,
                plan.cold_method,
                plan.reference,
                plan.limit,
            ],
            "at": result.at,
            "experiment": result.experiment,
        }
    )


def decode(data: bytes) -> SharedResult:
    d = orjson.loads(data)
    replays = tuple(
        Observed(
            r["name"],
            r["target"],
            r["cache"],
            r["alone"],
            r["inflight"],
            r["identity"],
            None if r["outcome"] is None else _outcome_of(r["outcome"]),
            r["error"],
        )
        for r in d["replays"]
    )
    cold, warm, reference_replays, method, reference, limit = d["plan"]
    plan = Plan(cold, warm, reference_replays, method, reference, limit)
    return SharedResult(replays, tuple(d["missing"]), plan, d["at"], d["experiment"])


class Claim:
    """A key claimed by this worker: released once its result is written (or it gave up)."""

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


class SharedExperiments:
    def __init__(self, folder: str, reuse_s: float) -> None:
        os.makedirs(folder, exist_ok=True)
        self._folder = folder
        self._reuse_s = reuse_s

    def _path(self, key: tuple[Any, ...], suffix: str) -> str:
        name = xxhash.xxh3_128_hexdigest(orjson.dumps(list(key)))
        return os.path.join(self._folder, name + suffix)

    def claim(self, key: tuple[Any, ...]) -> Claim | None:
        """This worker's to run, or None: another worker is running it."""
        fd = os.open(self._path(key, ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return Claim(fd)

    def publish(self, key: tuple[Any, ...], result: SharedResult) -> None:
        path = self._path(key, ".json")
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(encode(result))
        os.replace(tmp, path)  # readers see the old file or the new one, never half of one

    def finished(self, key: tuple[Any, ...]) -> SharedResult | None:
        """The replays written for ``key`` within ``reuse_s``, by any worker."""
        try:
            with open(self._path(key, ".json"), "rb") as f:
                result = decode(f.read())
        except (OSError, ValueError, KeyError, TypeError):
            return None  # none yet (or from an older detproxy: run again)
        return result if time.time() - result.at <= self._reuse_s else None


def shared_experiments(
    processes: int, shared_dir: str | None, reuse_s: float
) -> SharedExperiments | None:
    """For several workers sharing a folder; None for one process (its own memory serves)."""
    if processes > 1 and shared_dir:
        return SharedExperiments(os.path.join(shared_dir, "triage", "experiments"), reuse_s)
    return None
