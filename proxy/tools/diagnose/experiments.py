"""The experiments: requests to the upstream, one switch at a time, nothing decided here.

Per prompt, greedy with logprobs (top-k where the engine allows): a prefill probe at batch 1
(``max_tokens`` 1, serial, cold), serial full replays (cold, batch 1), the same beside
``level - 1`` filler requests per concurrency level, a primed warm group, and cold replays on
the reference upstream. Requests are built and answers read as ``detproxy probe`` does
(``proxy.audit.outcome``); ``verdicts`` compares them.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from proxy.attribution.experiments import cold_body, warm_body
from proxy.audit.outcome import ChoiceOutcome, outcome_from_response
from proxy.engine import fingerprint
from proxy.http.errors import UpstreamError
from proxy.http.h1 import H1Upstream
from proxy.http.upstream import Got, url_auth, whole
from proxy.http.upstream import Upstream as Client
from proxy.redact import mask_url
from proxy.tasks import TaskOwner
from proxy.tools.diagnose.engine import Engine, identify
from proxy.tools.probe import API_KEY_ENV, BACKGROUND_TOKENS, ProbeError, Vector

FILLER_PROMPTS = (
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle gear works.",
    "List ten fruits and one fact about each.",
    "Describe the water cycle to a child.",
)
Progress = Callable[[str], None]
JSON = {"Content-Type": "application/json"}


class DiagnoseError(ProbeError):
    """A usage or connection problem: exit code 2."""


@dataclass(frozen=True, slots=True)
class Settings:
    model: str
    runs: int
    max_tokens: int
    top_logprobs: int
    levels: tuple[int, ...]
    endpoint: str = "chat"
    load_settle: float = 0.3
    extra_body: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Answer:
    choice: ChoiceOutcome
    prompt_tokens: int | None


@dataclass(slots=True)
class PromptEvidence:
    """Everything measured for one prompt (filled in experiment by experiment)."""

    prompt: str
    prompt_tokens: int | None = None
    prefill: list[Vector] = field(default_factory=list)
    serial: list[ChoiceOutcome] = field(default_factory=list)
    concurrent: dict[int, list[ChoiceOutcome]] = field(default_factory=dict)
    prime: ChoiceOutcome | None = None  # the warm group's priming run (cold, its own salt)
    warm: list[ChoiceOutcome] | None = None  # None: not run
    reference: list[ChoiceOutcome] | None = None


class Upstream:
    """One OpenAI-compatible upstream: identity, and greedy requests with logprobs."""

    def __init__(
        self,
        url: str,
        settings: Settings,
        api_key: str | None,
        *,
        timeout_s: float = 300.0,
        max_connections: int = 8,
        client: Client | None = None,
    ) -> None:
        """Its requests go through ``client`` (by default its own ``H1Upstream`` to ``url``),
        closed by ``close``; each is bounded by ``timeout_s``."""
        self.client: Client = client or H1Upstream(
            url, read_timeout_s=timeout_s, max_connections=max_connections
        )
        self._timeout_s = timeout_s
        self.base = url.rstrip("/")
        self._s = settings
        self._chat = settings.endpoint == "chat"
        self._path = "/v1/chat/completions" if self._chat else "/v1/completions"
        self._url = self.base + self._path
        self._shown_base, self._shown = mask_url(self.base), mask_url(self._url)  # in messages
        self._api_key = api_key
        self._headers = url_auth(url) | ({"Authorization": f"Bearer {api_key}"} if api_key else {})
        self.top_k = settings.top_logprobs
        self.engine: Engine | None = None

    async def close(self) -> None:
        await self.client.close()

    async def _request(self, method: str, path: str, body: bytes | None = None) -> Got:
        headers = self._headers if body is None else self._headers | JSON
        return await whole(self.client, method, path, self._timeout_s, headers, body)

    async def _get_json(self, path: str) -> Any:
        try:
            got = await self._request("GET", path)
            return orjson.loads(got.body) if got.status == 200 else None
        except (UpstreamError, orjson.JSONDecodeError):
            return None

    async def identify(self) -> Engine:
        """Read /version, /v1/models and /props; unreachable is a DiagnoseError."""
        try:
            got = await self._request("GET", "/v1/models")
            status = got.status
            models = orjson.loads(got.body) if status == 200 else None
        except UpstreamError as exc:
            why = exc or type(exc).__name__
            raise DiagnoseError(f"cannot reach {self._shown_base}: {why}") from exc
        except orjson.JSONDecodeError:
            models, status = None, 200
        if status in (401, 403):
            raise self._refused(status)
        version, props = await asyncio.gather(self._get_json("/version"), self._get_json("/props"))
        engine = identify(version, models, props)
        self.engine = engine
        return engine

    async def running(self) -> float | None:
        """Requests the engine is running now (its /metrics), None where it does not say."""
        try:
            got = await self._request("GET", "/metrics")
        except UpstreamError:
            return None
        if got.status != 200:
            return None
        return fingerprint.parse_metrics(got.body.decode(errors="replace")).get("running")

    async def wait_idle(self, settle: float, deadline_s: float = 30.0) -> None:
        """Until the engine runs nothing (fillers a client left may still be generating);
        ``settle`` seconds where its /metrics cannot say."""
        loop = asyncio.get_running_loop()
        end = loop.time() + deadline_s
        while loop.time() < end:
            running = await self.running()
            if running is None:
                await asyncio.sleep(settle)
                return
            if running == 0:
                return
            await asyncio.sleep(0.05)

    def _refused(self, status: int) -> DiagnoseError:
        given = "the API key given was refused" if self._api_key else "no API key"
        return DiagnoseError(
            f"{self._shown_base} answered {status} ({given}): pass the key the server was started"
            f" with (--api-key, or {' or '.join(API_KEY_ENV)})"
        )

    def _body(self, prompt: str, max_tokens: int, extra: dict[str, Any]) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self._s.model, "temperature": 0, "max_tokens": max_tokens}
        if self._chat:
            body["messages"] = [{"role": "user", "content": prompt}]
            if self.top_k > 0:
                body |= {"logprobs": True, "top_logprobs": self.top_k}
        else:
            body["prompt"] = prompt
            if self.top_k > 0:
                body["logprobs"] = self.top_k
        merged: dict[str, Any] = body | extra | self._s.extra_body
        return merged

    async def _post(self, body: dict[str, Any]) -> tuple[int, bytes]:
        try:
            got = await self._request("POST", self._path, orjson.dumps(body))
        except UpstreamError as exc:
            raise DiagnoseError(f"cannot reach {self._shown}: {exc or type(exc).__name__}") from exc
        return got.status, got.body

    async def negotiate(self, prompt: str) -> int:
        """The largest top-k of (asked, 5, 1, 0) the engine accepts; 0: no logprobs at all."""
        for k in dict.fromkeys((self.top_k, min(self.top_k, 5), 1, 0)):
            self.top_k = k
            status, payload = await self._post(self._body(prompt, 1, {}))
            if status in (401, 403):
                raise self._refused(status)
            if status == 200:
                return k
            if status != 400:
                break
        raise DiagnoseError(
            f"{self._shown} answered {status}: {payload[:300].decode(errors='replace')}"
        )

    async def ask(self, prompt: str, max_tokens: int, extra: dict[str, Any]) -> Answer:
        status, payload = await self._post(self._body(prompt, max_tokens, extra))
        if status in (401, 403):
            raise self._refused(status)
        if status != 200:
            raise DiagnoseError(
                f"{self._shown} answered {status}: {payload[:300].decode(errors='replace')}"
            )
        try:
            body = orjson.loads(payload)
        except orjson.JSONDecodeError as exc:
            raise DiagnoseError(f"{self._shown} answered something that is not JSON") from exc
        outcome = outcome_from_response("chat" if self._chat else "completions", body)
        if outcome.error or not outcome.choices:
            raise DiagnoseError(f"{self._shown} answered no choice: {outcome.error or ''}")
        return Answer(outcome.choices[0], outcome.prompt_tokens)

    async def filler(self, prompt: str, stop: asyncio.Event, cold: Callable[[], Any]) -> None:
        """Keep one request in flight until told to stop."""
        while not stop.is_set():
            # Short, as probe's: frequent prefills share a batch with the probed request's
            # (decode-only company leaves some engines' logits unchanged).
            body = self._body(prompt, BACKGROUND_TOKENS, cold())
            with contextlib.suppress(UpstreamError):
                await self._request("POST", self._path, orjson.dumps(body))


def vector_of(choice: ChoiceOutcome) -> Vector:
    """The first token and its top-k, as ``detproxy probe`` compares them."""
    if not choice.tokens:
        return (choice.content[:1], ())
    first = choice.tokens[0]
    return first.token, tuple(first.top)


class Experiments:
    """Runs the experiments over all prompts, experiment by experiment, with progress lines."""

    def __init__(
        self,
        primary: Upstream,
        reference: Upstream | None,
        settings: Settings,
        progress: Progress,
    ) -> None:
        self.primary = primary
        self.reference = reference
        self.s = settings
        self.say = progress

    def _engine(self, upstream: Upstream) -> Engine:
        assert upstream.engine is not None
        return upstream.engine

    def _cold(self, upstream: Upstream) -> dict[str, Any]:
        """Fields of one cold request (a fresh salt each call), as triage's replays send."""
        return cold_body({}, self._engine(upstream).cold_method)

    async def _replays(self, up: Upstream, ev: PromptEvidence, cold: bool) -> list[ChoiceOutcome]:
        out = []
        for _ in range(self.s.runs):
            answer = await up.ask(ev.prompt, self.s.max_tokens, self._cold(up) if cold else {})
            if ev.prompt_tokens is None:
                ev.prompt_tokens = answer.prompt_tokens
            out.append(answer.choice)
        return out

    async def prefill(self, evidence: Sequence[PromptEvidence]) -> None:
        for i, ev in enumerate(evidence):
            for _ in range(self.s.runs):
                answer = await self.primary.ask(ev.prompt, 1, self._cold(self.primary))
                ev.prefill.append(vector_of(answer.choice))
            self.say(
                f"prefill probe (batch 1, cold, max_tokens 1): prompt {i + 1}/{len(evidence)},"
                f" {len(set(ev.prefill))} distinct top-{self.primary.top_k} vector(s)"
                f" of {self.s.runs}"
            )

    async def serial(self, evidence: Sequence[PromptEvidence]) -> None:
        for i, ev in enumerate(evidence):
            ev.serial = await self._replays(self.primary, ev, cold=True)
            self.say(
                f"serial replays (batch 1, cold): prompt {i + 1}/{len(evidence)},"
                f" {len(set(ev.serial))} distinct output(s) of {self.s.runs}"
            )

    async def concurrent(self, evidence: Sequence[PromptEvidence]) -> None:
        for level in self.s.levels:
            if level <= 1:
                continue
            stop = asyncio.Event()
            owner = TaskOwner("diagnose")
            fillers = [
                owner.spawn(
                    self.primary.filler(
                        FILLER_PROMPTS[i % len(FILLER_PROMPTS)] + f" ({i})",
                        stop,
                        lambda: self._cold(self.primary),
                    ),
                    name=f"filler-{i}",
                )
                for i in range(level - 1)
            ]
            try:
                await asyncio.sleep(self.s.load_settle)
                for i, ev in enumerate(evidence):
                    ev.concurrent[level] = await self._replays(self.primary, ev, cold=True)
                    differs = sum(1 for c in ev.concurrent[level] if c != ev.serial[0])
                    self.say(
                        f"concurrency {level} ({level - 1} filler(s), cold): prompt"
                        f" {i + 1}/{len(evidence)}, {differs} of {self.s.runs} differ from"
                        " the serial replay"
                    )
            finally:
                stop.set()
                for task in fillers:
                    task.cancel()
                await asyncio.gather(*fillers, return_exceptions=True)
                await self.primary.wait_idle(self.s.load_settle)

    async def warm(self, evidence: Sequence[PromptEvidence]) -> None:
        engine = self._engine(self.primary)
        if not engine.can_run_cold:
            self.say(f"cold against warm: not tested ({engine.how_cold})")
            return
        method = engine.cold_method
        for i, ev in enumerate(evidence):
            # The experiment's own salt (salted engines), shared by the prime and the warm
            # replays: they read what the prime wrote, as triage's warm group does.
            salt = uuid.uuid4().hex
            warm = warm_body({}, method, salt)
            ev.prime = (await self.primary.ask(ev.prompt, self.s.max_tokens, warm)).choice
            ev.warm = [
                (await self.primary.ask(ev.prompt, self.s.max_tokens, warm)).choice
                for _ in range(self.s.runs)
            ]
            same = sum(1 for c in ev.warm if c == ev.serial[0])
            how = "cache_prompt: true" if method == "cache_prompt" else "the prime's own salt"
            self.say(
                f"warm replays (primed, {how}):"
                f" prompt {i + 1}/{len(evidence)}, {same} of {self.s.runs} equal the cold replay"
            )

    async def against_reference(self, evidence: Sequence[PromptEvidence]) -> None:
        if self.reference is None:
            return
        for i, ev in enumerate(evidence):
            ev.reference = await self._replays(self.reference, ev, cold=True)
            same = sum(1 for c in ev.reference if c == ev.serial[0])
            self.say(
                f"reference replays (batch 1, cold): prompt {i + 1}/{len(evidence)},"
                f" {same} of {self.s.runs} equal the upstream's serial replay"
            )

    async def run_all(self, prompts: Sequence[str]) -> list[PromptEvidence]:
        evidence = [PromptEvidence(p) for p in prompts]
        await self.prefill(evidence)
        await self.serial(evidence)
        # Warm before the fillers ever ran: a prefix cached while other requests shared the
        # batch would carry the batch's numerics into the warm replays (llama-server's slots
        # keep the KV of the last request, computed beside the fillers).
        await self.warm(evidence)
        await self.concurrent(evidence)
        await self.against_reference(evidence)
        return evidence
