"""The generation endpoints: request parsing, the token loop, streaming, faults and accounting."""

from __future__ import annotations

import asyncio
import random
import secrets
import time
from typing import Any

import orjson
import xxhash
from aiohttp import web

from .config import KNOBS_HEADER, EmulatorConfig, FaultKind, KnobsError
from .injections import EmulatorState, InjectionRecord
from .model import ChoiceGenerator, Step
from .plan import (
    PREFIX_BLOCK_SIZE,
    Endpoint,
    Job,
    build_chat_job,
    build_completion_job,
    choice_rng,
    with_prefix_hits,
)
from .responses import (
    NAN_LOGPROBS_MESSAGE,
    SSE_DONE,
    ChunkBuilder,
    chat_logprob_entry,
    chat_message,
    completion_logprobs,
    error_body,
    full_response,
    sse,
    usage,
)
from .schemas import RequestError

STATE_KEY = web.AppKey("emulator_state", EmulatorState)
CONFIG_KEY = web.AppKey("emulator_config", EmulatorConfig)
REQUEST_ID_HEADER = "X-Request-Id"
_STREAM_FAULTS = frozenset({"reset_mid_stream", "malformed_sse", "malformed_json", "inband_error"})
_HTTP_FAULTS: dict[str, tuple[int, str]] = {
    "http_500": (500, "InternalServerError"),
    "http_503": (503, "ServiceUnavailableError"),
}


def error_response(err: RequestError) -> web.Response:
    return web.Response(
        body=error_body(err.message, err.err_type, err.code, err.param),
        status=err.code,
        content_type="application/json",
    )


async def read_json_object(request: web.Request) -> dict[str, Any]:
    if request.content_type != "application/json":
        raise RequestError("Unsupported Media Type: Only 'application/json' is allowed")
    raw = await request.read()
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise RequestError(f"Invalid JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise RequestError("The request body must be a JSON object.")
    return body


async def handle_generation(request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    base = request.app[CONFIG_KEY]
    rid = request.headers.get(REQUEST_ID_HEADER)
    try:
        try:
            cfg = base.with_knobs_header(request.headers.get(KNOBS_HEADER))
        except KnobsError as exc:
            raise RequestError(str(exc), param=KNOBS_HEADER) from None
        body = await read_json_object(request)
        if rid is None:
            body_rid = body.get("request_id")
            rid = body_rid if isinstance(body_rid, str) and body_rid else secrets.token_hex(16)
        rng = state.rng if cfg.seed == base.seed else random.Random(cfg.seed)
        if endpoint == "chat":
            job = build_chat_job(cfg, body, rid, rng, state.seen)
        else:
            job = build_completion_job(cfg, body, rid, rng, state.seen, state.decode)
    except RequestError as err:
        return error_response(err)
    state.requests += 1
    state.prompt_tokens += job.prompt_tokens
    if cfg.enable_prefix_caching:
        hits = [state.prefix_lookup(t, blocks, PREFIX_BLOCK_SIZE) for t, blocks in job.prompts]
        job = with_prefix_hits(cfg, job, hits)
    fault: FaultKind = cfg.fault
    if fault != "none" and cfg.fault_probability < 1.0 and rng.random() >= cfg.fault_probability:
        fault = "none"
    return await Run(request, state, cfg, job, fault).execute()


class _Reset(Exception):
    """Raised after the emulator cut the connection on purpose."""


class Run:
    """One accepted generation request."""

    def __init__(
        self,
        request: web.Request,
        state: EmulatorState,
        cfg: EmulatorConfig,
        job: Job,
        fault: FaultKind,
    ) -> None:
        self.request = request
        self.state = state
        self.cfg = cfg
        self.job = job
        self.fault = fault
        self.fault_fired = False
        self.created = int(time.time())
        self.gens = [
            ChoiceGenerator(p, job.sampling, choice_rng(job.sampling, p.index)) for p in job.plans
        ]
        self.steps: list[list[Step]] = [[] for _ in self.gens]
        self.tokens = 0
        if job.closed_reasoning is not None:
            closed = {"endpoint": job.endpoint, "reasoning": job.closed_reasoning}
            if job.closed_answer:
                closed["content"] = job.closed_answer  # a continued content after it
            rec = InjectionRecord(
                job.request_id, "closed_reasoning", None, None, closed, state.running
            )
            state.record(rec)
        for plan in job.plans:
            if plan.loop_escaped:
                detail = {"probability": cfg.loop_escape_probability}
                rec = InjectionRecord(
                    job.request_id, "loop_escape", plan.index, None, detail, state.running
                )
                state.record(rec)
        self.spec_rngs = [
            random.Random(xxhash.xxh64_intdigest(f"{cfg.seed}:{job.request_id}:{p.index}".encode()))
            for p in job.plans
        ]

    async def execute(self) -> web.StreamResponse:
        state = self.state
        state.running += 1
        try:
            return await self._execute()
        except _Reset:
            raise asyncio.CancelledError() from None
        except (asyncio.CancelledError, ConnectionError):
            state.aborted += 1
            raise
        finally:
            state.running -= 1
            state.running_reported = state.running  # the step that finished it

    def _record_fault(self, position: int | None, **detail: Any) -> None:
        self.fault_fired = True
        self.state.faulted += 1
        rec = InjectionRecord(
            self.job.request_id,
            "fault",
            None,
            position,
            {"fault": self.fault, **detail},
            self.state.running,
        )
        self.state.record(rec)

    def _reset(self) -> None:
        self._record_fault(self.tokens)
        transport = self.request.transport
        if transport is not None:
            transport.abort()
        raise _Reset()

    async def _execute(self) -> web.StreamResponse:
        cfg = self.cfg
        delay = cfg.headers_delay_s
        if self.fault == "slow_headers":
            self._record_fault(None, delay_s=cfg.slow_headers_delay_s)
            delay = cfg.slow_headers_delay_s
        if delay > 0:
            await asyncio.sleep(delay)
        http_fault = _HTTP_FAULTS.get(self.fault)
        if http_fault is not None:
            code, err_type = http_fault
            self._record_fault(None, code=code)
            err = RequestError(f"Injected {code} by the emulator.", code=code, err_type=err_type)
            return error_response(err)
        if self.job.stream:
            return await self._stream()
        return await self._full()

    def _step(self, i: int) -> Step | None:
        gen = self.gens[i]
        step = gen.step(self.state.running)
        self.state.running_reported = self.state.running  # the gauges, once per step
        for rec in gen.events:
            self.state.record(rec)
        gen.events.clear()
        if step is None:
            assert gen.finish_reason is not None
            self.state.finished[gen.finish_reason] += 1
            return None
        self.steps[i].append(step)
        self.tokens += 1
        self.state.generation_tokens += 1
        return step

    def _engine_step(self, i: int) -> list[Step]:
        """One engine step of choice ``i``: one token, or 1 + accepted drafts with speculative
        decoding. The choice is finalised (finish_reason set) as soon as it ends with them."""
        cfg = self.cfg
        gen = self.gens[i]
        size = 1
        if cfg.speculative:
            rng = self.spec_rngs[i]
            while size <= cfg.speculative_tokens and rng.random() < cfg.speculative_acceptance:
                size += 1
        out: list[Step] = []
        while len(out) < size:
            step = self._step(i)
            if step is None:
                break
            out.append(step)
            if gen.finish_due():
                self._step(i)
                break
        if cfg.speculative and out:
            self.state.spec_step(len(out) - 1, cfg.speculative_tokens)
        return out

    def _chunk(self, i: int) -> tuple[list[Step], int]:
        """The tokens of choice ``i``'s next stream chunk (at least tokens_per_chunk unless it
        ends) and the number of engine steps they took."""
        out: list[Step] = []
        steps = 0
        while len(out) < self.cfg.tokens_per_chunk and not self.gens[i].done:
            out += self._engine_step(i)
            steps += 1
        return out, steps

    def _usage(self) -> dict[str, Any]:
        reasoning = sum(1 for steps in self.steps for s in steps if s.channel == "reasoning")
        return usage(self.job, self.tokens, reasoning)

    async def _tick(self, engine_steps: int = 1) -> None:
        if self.cfg.token_latency_s > 0 and engine_steps > 0:
            await asyncio.sleep(self.cfg.token_latency_s * engine_steps)

    async def _full(self) -> web.Response:
        while any(not g.done for g in self.gens):
            for i, gen in enumerate(self.gens):
                if not gen.done:
                    self._engine_step(i)
            await self._tick()
        if self.fault == "reset_mid_stream":
            self._reset()
        if self.fault == "inband_error":
            self._record_fault(self.tokens)
            err = RequestError(
                "Injected generation error.", code=500, err_type="InternalServerError"
            )
            return error_response(err)
        if self._nan_logprobs():
            # vLLM generated the answer, then failed to serialise its NaN logprobs.
            err = RequestError(NAN_LOGPROBS_MESSAGE)
            return error_response(err)
        body = orjson.dumps(self._full_body())
        if self.fault == "malformed_json":
            self._record_fault(self.tokens)
            body = body[: len(body) // 2]
        self.state.completed += 1
        return web.Response(body=body, content_type="application/json")

    def _nan_logprobs(self) -> bool:
        """True (and recorded) when this request's logprobs come out NaN."""
        job = self.job
        if not job.nan_logprobs or job.logprobs is None:
            return False
        status = 200 if job.stream else 400
        rec = InjectionRecord(
            job.request_id, "nan_logprobs", None, None, {"status": status}, self.state.running
        )
        self.state.record(rec)
        return True

    def _full_body(self) -> dict[str, Any]:
        job = self.job
        choices: list[dict[str, Any]] = []
        for gen, steps in zip(self.gens, self.steps, strict=True):
            choice: dict[str, Any] = {"index": gen.plan.index}
            if job.endpoint == "chat":
                shown = [s for s in steps if s.channel == "content" or job.include_reasoning]
                reasoning = "".join(s.text for s in shown if s.channel == "reasoning")
                content = "".join(s.text for s in shown if s.channel == "content")
                choice["message"] = chat_message(job, reasoning, content)
                lps = None
                if job.logprobs is not None:
                    k = job.logprobs
                    entries = [chat_logprob_entry(s, k, job.nan_logprobs) for s in shown]
                    lps = {"content": entries}
                choice["logprobs"] = lps
            else:
                choice["text"] = "".join(s.text for s in steps)
                choice["logprobs"] = (
                    None
                    if job.logprobs is None
                    else completion_logprobs(steps, job.logprobs, 0, job.nan_logprobs)
                )
                choice["prompt_logprobs"] = None
            choice["finish_reason"] = gen.finish_reason
            choice["stop_reason"] = gen.stop_reason
            choices.append(choice)
        return full_response(job, self.created, choices, self._usage())

    async def _emit(self, resp: web.StreamResponse, payload: dict[str, Any]) -> None:
        if self.job.continuous_usage:
            payload["usage"] = self._usage()
        await resp.write(sse(payload))

    async def _stream(self) -> web.StreamResponse:
        job = self.job
        resp = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
            }
        )
        await resp.prepare(self.request)
        self._nan_logprobs()
        chunks = ChunkBuilder(job, self.created)
        # fault_after_tokens 0: the stream fails before its first event (the role chunk).
        if await self._stream_fault(resp):
            return resp
        if job.endpoint == "chat":
            for gen in self.gens:
                await self._emit(resp, chunks.role(gen.plan.index))
        offsets = [0] * len(self.gens)
        while any(not g.done for g in self.gens):
            most = 0
            for i, gen in enumerate(self.gens):
                if gen.done:
                    continue
                if await self._stream_fault(resp):
                    return resp
                group, engine_steps = self._chunk(i)
                most = max(most, engine_steps)
                shown = [s for s in group if s.channel == "content" or job.include_reasoning]
                idx = gen.plan.index
                if gen.done:
                    assert gen.finish_reason is not None
                    payload = chunks.tokens(
                        idx, shown, offsets[i], gen.finish_reason, gen.stop_reason
                    )
                elif shown:
                    payload = chunks.tokens(idx, shown, offsets[i])
                else:
                    continue
                await self._emit(resp, payload)
                offsets[i] += sum(len(s.text) for s in shown)
            await self._tick(most)
        if job.include_usage:
            await resp.write(sse(chunks.usage(self._usage())))
        await resp.write(SSE_DONE)
        if self.cfg.end_delay_s > 0:
            await asyncio.sleep(self.cfg.end_delay_s)
        await resp.write_eof()
        self.state.completed += 1
        return resp

    async def _stream_fault(self, resp: web.StreamResponse) -> bool:
        """Fire the stream fault when due; True when the stream is over."""
        if self.fault_fired or self.fault not in _STREAM_FAULTS:
            return False
        if self.tokens < self.cfg.fault_after_tokens:
            return False
        if self.fault == "reset_mid_stream":
            self._reset()
        self._record_fault(self.tokens)
        if self.fault == "malformed_sse":
            await resp.write(b"garbage without data prefix\n\n")
        elif self.fault == "malformed_json":
            await resp.write(b"data: {not json\n\n")
        else:
            err = {
                "error": {
                    "message": "Injected in-band generation error.",
                    "type": "InternalServerError",
                    "param": None,
                    "code": 500,
                }
            }
            await resp.write(sse(err))
            await resp.write(SSE_DONE)
            await resp.write_eof()
            return True
        return False
