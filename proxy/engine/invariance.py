"""Declared batch invariance, checked: ``[upstream.expect] batch_invariant = true`` measured.

An engine rarely says whether its kernels are batch-invariant (vLLM 0.23 logs nothing of its own
when ``VLLM_BATCH_INVARIANT`` is off), so where the operator declares it, detproxy checks it:
``BATCH`` identical greedy requests at once against the same request alone, every run cold (a
fresh ``cache_salt`` on vLLM, ``cache_prompt: false`` on llama.cpp's server: the triage's
``cold_method``), ``MAX_TOKENS`` tokens each with logprobs. The batched answers must be bitwise
the lone one's (tokens and logprobs). Black-box: any OpenAI-compatible upstream.

When it runs: once the upstream first answers (its first identity reading, or ``/v1/models``
without a poller) and after each change of its identity (a redeploy, a recipe that moved), off
the request path (one owned task), each lone run at a quiet moment where one comes (at most
``[attribution] quiet_max_inflight`` client requests in flight, no shadow or triage running, up
to ``quiet_deadline_s``). One check per identity: an identity seen before reuses its result.

What it says, through ``EngineTruth.check_read`` (so the same path as the declared fields read
from the engine: status, gauge, incident, alert):

- ``passed``: every batched answer is the lone one's: ``batch_invariant`` known, true, source
  ``active_check`` (where the engine said nothing of it).
- ``failed``: some differ, and a second lone run agrees with the first: ``batch_invariant``
  false, a mismatch carrying the evidence (how many differed, the first divergent token).
- ``intrinsic``: the two lone runs differ from each other: the engine is not stable even alone,
  so batching is not blamed; the fact stays unknown and a WARNING says so.
- ``inconclusive``: the upstream did not answer, no model is known, the lone run never ran
  alone, or answers differ with no way to run cold (a prefix-cache hit could explain them).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import orjson

from proxy.attribution.cold import cold_method
from proxy.attribution.experiments import cold_body
from proxy.audit.compare import compare_choices
from proxy.audit.outcome import ChoiceOutcome, outcome_from_response
from proxy.audit.shadow import ProxyLoad, Replayed, replay, wait_quiet
from proxy.config import AttributionConfig, AuditConfig
from proxy.engine.follow import EngineTruth
from proxy.engine.identity import Fingerprint
from proxy.events import EventBus, RequestClassified, UpstreamFingerprinted
from proxy.http.upstream import Upstream
from proxy.tasks import TaskOwner

log = logging.getLogger(__name__)

FIELD = "batch_invariant"
BATCH = 4  # identical requests sent at once
MAX_TOKENS = 16  # generated per run: a check costs (BATCH + 2) * (prompt + 16) tokens at most
PROMPT = "List the first ten prime numbers, separated by commas."
LONE_TRIES = 3  # a lone run that did not run alone is tried again, this many times in all
MODELS_POLL_S = 2.0  # how often /v1/models is asked while no model is known
_KEPT = 64  # identities whose result is remembered
_CHAT = "/v1/chat/completions"
_COMPLETIONS = "/v1/completions"
_NO_CHAT = frozenset({400, 404, 405, 422, 501})  # the chat route refused: try completions


class _Inconclusive(Exception):
    pass


class BatchInvarianceCheck:
    """Runs the check (see the module's docstring) and hands its result to ``truth``."""

    def __init__(  # noqa: PLR0913 (what it reuses of the app, one argument each)
        self,
        truth: EngineTruth,
        upstream: Upstream,
        load: ProxyLoad,
        audit: AuditConfig,
        attribution: AttributionConfig,
        *,
        follows_identity: bool,
        busy: Callable[[], bool] | None = None,
        upstream_running: Callable[[], Awaitable[int | None]] | None = None,
        batch: int = BATCH,
        max_tokens: int = MAX_TOKENS,
    ) -> None:
        self._truth = truth
        self._upstream = upstream
        self._load = load
        self._audit = audit
        self._attribution = attribution
        self._busy = busy
        self._upstream_running = upstream_running
        self._batch = batch
        self._max_tokens = max_tokens
        self._tasks = TaskOwner("invariance")
        self._wake = asyncio.Event()
        # The identity to check ("" without a poller: the upstream as it answers), None: none yet.
        self._wanted: str | None = None if follows_identity else ""
        self._current: Fingerprint | None = None
        self._last_model: str | None = None
        self._results: OrderedDict[str, dict[str, Any]] = OrderedDict()
        # waiting | running | passed | failed | intrinsic | inconclusive | in_worker_0 (another
        # worker of ``serve --workers N`` checks: N checks at once would batch each other)
        self.state = "waiting"
        self.last: dict[str, Any] | None = None
        self.checks = 0  # checks run
        self.requests = 0  # requests sent upstream
        self.tokens = 0  # their tokens, as the upstream counted them (prompt + completion)
        truth.checks[FIELD] = self

    # -- wiring -------------------------------------------------------------------------------

    def subscribe(self, bus: EventBus) -> None:
        bus.subscribe(UpstreamFingerprinted, self._fingerprinted)
        bus.subscribe(RequestClassified, self._classified)

    def _classified(self, ev: RequestClassified) -> None:
        if ev.endpoint in ("chat", "completions") and ev.model:
            self._last_model = ev.model

    def _fingerprinted(self, ev: UpstreamFingerprinted) -> None:
        self._current = ev.fingerprint
        if ev.previous is not None and not ev.changed:
            return
        wanted = ev.fingerprint.fingerprint
        if wanted == self._wanted:
            return
        self._wanted = wanted
        known = self._results.get(wanted)
        if known is not None:  # a recipe checked before (a rollback): its result holds
            self._apply(known)
            return
        self._truth.check_read(FIELD, None)  # the last result was another recipe's
        self.state = "waiting"
        self._wake.set()

    def start(self) -> None:
        if self._wanted == "":
            self._wake.set()
        self._tasks.spawn(self._worker(), name="batch-invariance")

    async def close(self) -> None:
        await self._tasks.close()

    def status(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "checks": self.checks,
            "requests": self.requests,
            "tokens": self.tokens,
            "last": self.last,
        }

    # -- the check ----------------------------------------------------------------------------

    async def _worker(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            wanted = self._wanted
            if wanted is None or wanted in self._results:
                continue
            self.state = "running"
            try:
                result = await self._check()
            except _Inconclusive as exc:
                result = {"result": "inconclusive", "reason": str(exc)}
            except Exception as exc:
                log.exception("the batch invariance check failed")
                result = {"result": "inconclusive", "reason": f"error: {type(exc).__name__}"}
            self.checks += 1
            if self._wanted != wanted:  # the upstream changed under it: its result is moot
                if self._wanted not in self._results:
                    self.state = "waiting"
                continue
            result |= {"upstream": wanted or None, "at": time.time()}
            if result["result"] != "inconclusive":
                self._results[wanted] = result
                while len(self._results) > _KEPT:
                    self._results.popitem(last=False)
            self._apply(result)

    def _apply(self, result: Mapping[str, Any]) -> None:
        outcome = result["result"]
        self.state, self.last = outcome, dict(result)
        if outcome == "passed":
            log.info("batch invariance checked: %d identical answers at once", self._batch)
            self._truth.check_read(FIELD, True, result)
        elif outcome == "failed":
            self._truth.check_read(FIELD, False, result)
        else:
            self._truth.check_read(FIELD, None)
            if outcome == "intrinsic":
                log.warning(
                    "batch invariance not checked: two identical requests alone answered "
                    "differently (the engine is not stable even at batch 1)"
                )
            else:
                log.info("batch invariance not checked: %s", result.get("reason"))

    async def _model(self) -> str:
        """The first model the upstream serves, else the model of the latest request; waits
        (cancellable) until one is known."""
        while True:
            fp = self._current
            if fp is not None and fp.models:
                return fp.models[0]
            served = await self._served()
            if served is not None:
                return served
            if self._last_model is not None:
                return self._last_model
            await asyncio.sleep(MODELS_POLL_S)

    async def _served(self) -> str | None:
        try:
            async with asyncio.timeout(self._attribution.replay_timeout_s):
                resp = await self._upstream.send("GET", "/v1/models", self._headers("models"), None)
                try:
                    payload = await resp.read()
                finally:
                    resp.close()
            data = orjson.loads(payload).get("data") if resp.status == 200 else None
        except Exception:  # not up yet, or not an OpenAI server
            return None
        if isinstance(data, list) and data and isinstance(data[0], dict):
            model = data[0].get("id")
            return model if isinstance(model, str) and model else None
        return None

    def _headers(self, name: str) -> dict[str, str]:
        headers = {
            "Content-Type": "application/json",
            "X-Request-Id": f"detproxy-invariance-{self.checks}-{name}",
        }
        if self._audit.service_api_key:
            headers["Authorization"] = f"Bearer {self._audit.service_api_key}"
        return headers

    def _body(self, path: str, model: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model,
            "temperature": 0,
            "max_tokens": self._max_tokens,
            "stream": False,
        }
        if path == _CHAT:
            body["messages"] = [{"role": "user", "content": PROMPT}]
            body |= {"logprobs": True, "top_logprobs": 1}
        else:
            body |= {"prompt": PROMPT, "logprobs": 1}
        return body

    async def _quiet(self) -> bool:
        audit, cfg = self._audit, self._attribution
        running = self._upstream_running if audit.quiet_max_upstream_running is not None else None
        return await wait_quiet(
            self._load,
            cfg.quiet_max_inflight,
            running,
            audit.quiet_max_upstream_running,
            settle_s=audit.quiet_settle_s,
            deadline_s=cfg.quiet_deadline_s,
            poll_s=audit.quiet_poll_s,
            busy=self._busy,
        )

    async def _run(
        self, path: str, body: Mapping[str, Any], method: str | None, name: str
    ) -> tuple[Replayed, ChoiceOutcome | None]:
        self.requests += 1
        sent = await replay(
            self._upstream,
            self._load,
            path,
            self._headers(name),
            cold_body(body, method),
            self._attribution.replay_timeout_s,
        )
        if isinstance(sent, str):
            raise _Inconclusive(f"the upstream did not answer: {sent}")
        if sent.status != 200 or not isinstance(sent.parsed, dict):
            return sent, None
        outcome = outcome_from_response("chat" if path == _CHAT else "completions", sent.parsed)
        self.tokens += (outcome.prompt_tokens or 0) + (outcome.completion_tokens or 0)
        if outcome.error is not None or not outcome.choices:
            return sent, None
        return sent, outcome.choices[0]

    async def _lone(
        self, path: str, body: Mapping[str, Any], method: str | None, name: str
    ) -> ChoiceOutcome:
        """One run alone: at a quiet moment, and again where a client request ran beside it."""
        for attempt in range(LONE_TRIES):
            await self._quiet()
            sent, choice = await self._run(path, body, method, f"{name}-{attempt}")
            if choice is None:
                raise _Inconclusive(f"HTTP {sent.status} from {path}")
            if not sent.overlapped:
                return choice
        raise _Inconclusive("no quiet moment: the lone run never ran alone")

    async def _check(self) -> dict[str, Any]:
        model = await self._model()
        method = cold_method(self._attribution.cold_method, self._current, self._audit)
        path = _CHAT
        await self._quiet()
        sent, lone = await self._run(path, self._body(path, model), method, "lone")
        if lone is None and sent.status in _NO_CHAT:  # a model without a chat template
            path = _COMPLETIONS
        body = self._body(path, model)
        if lone is None or sent.overlapped:
            lone = await self._lone(path, body, method, "lone")
        runs = await asyncio.gather(
            *(self._run(path, body, method, f"batch-{i}") for i in range(self._batch))
        )
        batched = [c for _, c in runs]
        if any(c is None for c in batched):
            failed = next(s.status for s, c in runs if c is None)
            raise _Inconclusive(f"HTTP {failed} from {path} for a batched run")
        differed, first_divergence = _compare(lone, [c for c in batched if c is not None])
        evidence: dict[str, Any] = {
            "model": model,
            "endpoint": path,
            "cold_method": method,
            "batch": self._batch,
            "max_tokens": self._max_tokens,
            "logprobs": lone.tokens is not None,
            "differed": differed,
            "first_divergence": first_divergence,
        }
        if differed == 0:
            return {"result": "passed"} | evidence
        again = await self._lone(path, body, method, "lone-again")
        if _compare(lone, [again])[0]:
            return {"result": "intrinsic"} | evidence
        if method is None:
            raise _Inconclusive(
                f"{differed} of {self._batch} batched answers differ, but with no way to run "
                "cold a prefix-cache hit may explain them"
            )
        return {"result": "failed"} | evidence


def _compare(lone: ChoiceOutcome, others: list[ChoiceOutcome]) -> tuple[int, dict[str, Any] | None]:
    """How many of ``others`` differ from ``lone`` (tokens and logprobs, bitwise; text where
    either lacks logprobs), and the earliest divergence among them."""
    differed = 0
    first: dict[str, Any] | None = None
    for other in others:
        verdict = compare_choices(lone, other)
        if verdict.verdict == "identical":
            continue
        differed += 1
        d = verdict.divergence
        if d is not None and (first is None or d.index < first["index"]):
            first = {
                "index": d.index,
                "verdict": verdict.verdict,
                "lone_token": d.primary_token,
                "batched_token": d.shadow_token,
            }
        elif d is None and first is None:
            first = {"index": None, "verdict": verdict.verdict}
    return differed, first
