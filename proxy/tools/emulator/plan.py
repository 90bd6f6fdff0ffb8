"""Turn a validated request plus the effective config into a Job: one ChoicePlan per choice.

All per-request decisions (limits, defaults, reasoning, loops, which injections fire) are made
here, before generation starts, so generation itself is a pure function of the plan.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

import xxhash

from .config import EmulatorConfig, ReasoningStyle
from .model import ChoicePlan, LoopPlan, Sampling, natural_length, prompt_key
from .schemas import (
    ChatRequest,
    CompletionRequest,
    RepetitionDetection,
    RequestError,
    answer_after_reasoning,
    closed_reasoning_in,
    completion_prompts,
    message_reasoning,
    parse,
    render_messages,
)
from .vocab import encode_pieces, split_text, vocabulary

Endpoint = Literal["chat", "completion"]
COMPLETION_DEFAULT_MAX_TOKENS = 16
PREFIX_BLOCK_SIZE = 16  # vLLM's default KV block size


def prefix_blocks(model: str, pieces: list[str], salt: str | None) -> tuple[int, ...]:
    """Chained hashes of the prompt's full KV blocks (vLLM's prefix-cache keys; ``cache_salt``
    goes into the first block's hash, so tenants with different salts share nothing)."""
    out: list[int] = []
    parent = int(xxhash.xxh64_intdigest(f"{model}\x00{salt or ''}".encode()))
    for start in range(0, len(pieces) - PREFIX_BLOCK_SIZE + 1, PREFIX_BLOCK_SIZE):
        block = "\x00".join(pieces[start : start + PREFIX_BLOCK_SIZE])
        parent = int(xxhash.xxh64_intdigest(block.encode(), seed=parent))
        out.append(parent)
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Job:
    endpoint: Endpoint
    request_id: str
    model: str
    stream: bool
    include_usage: bool
    continuous_usage: bool
    prompt_tokens: int
    sampling: Sampling
    plans: tuple[ChoicePlan, ...]
    # chat: top_logprobs when logprobs is true, else None; completions: the `logprobs` int.
    logprobs: int | None
    reasoning_active: bool
    include_reasoning: bool
    reasoning_style: ReasoningStyle
    # The model's logprobs are NaN (EmulatorConfig.nan_logprobs).
    nan_logprobs: bool = False
    # Per prompt: (its token count, its prefix-cache block hashes).
    prompts: tuple[tuple[int, tuple[int, ...]], ...] = ()
    # The answer to a closed reasoning, reported in the reasoning field(s) by the parser.
    answer_as_reasoning: bool = False
    # Prompt tokens found in the prefix cache (set once the cache was looked up).
    cached_tokens: int = 0
    # vLLM's --enable-prompt-tokens-details: usage reports cached_tokens.
    prompt_tokens_details: bool = False
    # A continuation of a closed reasoning: the reasoning its rendered prompt holds ("": the
    # template dropped it); None for any other request.
    closed_reasoning: str | None = None
    # A continuation of content after a reasoning: that content, as its prompt holds it.
    closed_answer: str = ""


def resolve_model(cfg: EmulatorConfig, model: str | None) -> str:
    if model is None:
        return cfg.models[0]
    if model not in cfg.models:
        raise RequestError(
            f"The model `{model}` does not exist.",
            code=404,
            err_type="NotFoundError",
            param="model",
        )
    return model


def _check_logprobs(cfg: EmulatorConfig, requested: int, param: str) -> None:
    num = len(vocabulary()) if requested == -1 else requested
    if cfg.max_logprobs != -1 and num > cfg.max_logprobs:
        raise RequestError(
            f"Requested sample logprobs of {num}, which is greater than max allowed: "
            f"{cfg.max_logprobs}",
            param=param,
        )


def _check_length(cfg: EmulatorConfig, prompt_tokens: int, max_tokens: int | None) -> int:
    limit = cfg.max_model_len
    if prompt_tokens >= limit:
        raise RequestError(
            f"This model's maximum context length is {limit} tokens. However, your request has "
            f"{prompt_tokens} input tokens. Please reduce the length of the input messages.",
            param="messages",
        )
    if max_tokens is None:
        return limit - prompt_tokens
    if prompt_tokens + max_tokens > limit:
        raise RequestError(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} "
            "in the completion). Please reduce the length of the messages or completion.",
            param="max_tokens",
        )
    return max_tokens


def _sampling(cfg: EmulatorConfig, req: ChatRequest | CompletionRequest) -> Sampling:
    return Sampling(
        temperature=cfg.default_temperature if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=max(req.top_k or 0, 0),
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=req.repetition_penalty or 1.0,
        seed=req.seed,
    )


def _loop_plan(
    cfg: EmulatorConfig,
    channel: Literal["reasoning", "content"],
    detection: RepetitionDetection | None,
) -> LoopPlan:
    unit = tuple(encode_pieces(cfg.loop_unit))
    repeats: int | None = None
    if cfg.engine_repetition_detection and detection is not None:
        lo = max(detection.min_pattern_size, 1)
        hi = detection.max_pattern_size or len(unit)
        if lo <= len(unit) <= hi:
            repeats = detection.min_count
    return LoopPlan(channel, cfg.loop_after_tokens, unit, repeats)


_TWO64 = float(1 << 64)
DIVERGENCE_WINDOW = 10  # first divergent token index 0-9 on GPUs (gpu-llama-server.md)


def recipe_divergence(cause: str, key: int, share: float) -> int | None:
    """Where a recipe-dependent cause (``prefix_cache``, ``speculative``) changes the greedy
    answer to the prompt ``key``: a position among the first ten, or None for the prompts it
    spares. Both come from a hash of (cause, prompt): a prompt is always affected the same way."""
    if share <= 0:
        return None
    h = xxhash.xxh64_intdigest(f"{cause}\x00{key}".encode())
    if (h >> 11) / float(1 << 53) >= share:
        return None
    return h % DIVERGENCE_WINDOW


def with_prefix_hits(cfg: EmulatorConfig, job: Job, hits: list[int]) -> Job:
    """``job`` after its prefix-cache lookup: ``hits[p]`` cached tokens of prompt ``p``; a warm
    greedy choice of an affected prompt diverges (EmulatorConfig.warm_cache_divergence)."""
    plans = list(job.plans)
    if cfg.warm_cache_divergence > 0 and job.sampling.greedy:
        per_prompt = len(plans) // max(len(hits), 1)
        for i, plan in enumerate(plans):
            cached = hits[min(i // max(per_prompt, 1), len(hits) - 1)]
            if cached <= 0:
                continue
            pos = recipe_divergence("prefix_cache", plan.prompt_key, cfg.warm_cache_divergence)
            if pos is not None:
                plans[i] = replace(plan, warm_position=pos, warm_cached_tokens=cached)
    return replace(job, plans=tuple(plans), cached_tokens=sum(hits))


def _escapes(cfg: EmulatorConfig, sampling: Sampling, content: int, index: int) -> bool:
    """Whether choice ``index`` of a request that would loop escapes it (see EmulatorConfig)."""
    if sampling.greedy and not sampling.penalised:
        return False
    u = xxhash.xxh64_intdigest(f"{cfg.seed}:{content}:{index}".encode()) / _TWO64
    return u < cfg.loop_escape_probability


def content_key(key: int, sampling: Sampling, max_tokens: int, seen: Counter[int]) -> int:
    """What a request's tokens are a function of; for sampling without a seed, also how often
    this emulator has seen it (each such attempt draws anew, deterministically)."""
    base = int(xxhash.xxh64_intdigest(f"{key}:{sampling!r}:{max_tokens}".encode()))
    attempt = 0
    if not sampling.greedy and sampling.seed is None:
        if len(seen) > MAX_SEEN:
            seen.clear()
        attempt = seen[base]
        seen[base] += 1
    return int(xxhash.xxh64_intdigest(f"{base}:{attempt}".encode()))


MAX_SEEN = 100_000


@dataclass(frozen=True, slots=True)
class _Asked:
    """What one request asks of its choices."""

    request_id: str
    keys: list[int]  # one per prompt
    n: int
    max_tokens: int
    reasoning_tokens: int
    loop: LoopPlan | None
    sampling: Sampling
    ignore_eos: bool


def _choice_plans(
    cfg: EmulatorConfig, rng: random.Random, seen: Counter[int], asked: _Asked
) -> tuple[ChoicePlan, ...]:
    request_id, keys, n = asked.request_id, asked.keys, asked.n
    max_tokens, reasoning_tokens = asked.max_tokens, asked.reasoning_tokens
    loop, sampling, ignore_eos = asked.loop, asked.sampling, asked.ignore_eos
    plans: list[ChoicePlan] = []
    for p_idx, key in enumerate(keys):
        natural = natural_length(key)
        content = content_key(key, sampling, max_tokens, seen) if loop is not None else 0
        for i in range(n):
            index = p_idx * n + i
            flip = drift = None
            if sampling.greedy:
                if cfg.flip_probability > 0 and rng.random() < cfg.flip_probability:
                    flip = cfg.flip_position
                if cfg.logprob_jitter_probability > 0 and rng.random() < (
                    cfg.logprob_jitter_probability
                ):
                    expected = min(max_tokens, reasoning_tokens + natural, DIVERGENCE_WINDOW)
                    drift = rng.randrange(max(expected, 1))
            batch = sampling.greedy and cfg.batch_divergence_slope > 0
            spec = None
            if sampling.greedy and cfg.speculative:
                spec = recipe_divergence("speculative", key, cfg.speculative_divergence)
            escaped = loop is not None and _escapes(cfg, sampling, content, index)
            plans.append(
                ChoicePlan(
                    request_id=request_id,
                    index=p_idx * n + i,
                    prompt_key=key,
                    max_tokens=max_tokens,
                    reasoning_tokens=reasoning_tokens,
                    natural_tokens=None if ignore_eos else natural,
                    flip_position=flip,
                    drift_from=drift,
                    loop=None if escaped else loop,
                    batch_slope=cfg.batch_divergence_slope if batch else None,
                    batch_draw=rng.random() if batch else 1.0,
                    batch_from=rng.randrange(DIVERGENCE_WINDOW) if batch else 0,
                    drift_seed=rng.getrandbits(64) if drift is not None or batch else 0,
                    loop_escaped=escaped,
                    speculative_position=spec,
                )
            )
    return tuple(plans)


def choice_rng(sampling: Sampling, index: int) -> random.Random:
    """The sampling RNG of one choice: reproducible when the request carries a seed."""
    if sampling.seed is None:
        return random.Random()
    return random.Random(xxhash.xxh64_intdigest(f"{sampling.seed}:{index}".encode()))


def _stream_flags(req: ChatRequest | CompletionRequest) -> tuple[bool, bool, bool]:
    stream = bool(req.stream)
    if req.stream_options is not None and not stream:
        raise RequestError(
            "Stream options can only be defined when `stream=True`.", param="stream_options"
        )
    opts = req.stream_options
    usage = bool(opts and opts.include_usage)
    return stream, usage, bool(usage and opts and opts.continuous_usage_stats)


def build_chat_job(
    cfg: EmulatorConfig,
    body: dict[str, Any],
    request_id: str,
    rng: random.Random,
    seen: Counter[int],
) -> Job:
    req = parse(ChatRequest, body)
    model = resolve_model(cfg, req.model)
    stream, usage, continuous = _stream_flags(req)
    top = req.top_logprobs or 0
    if top != 0 and not req.logprobs:
        raise RequestError(
            "when using `top_logprobs`, `logprobs` must be set to true.", param="top_logprobs"
        )
    if req.logprobs:
        _check_logprobs(cfg, top, "top_logprobs")
    if cfg.template_drops_reasoning:
        # The template's own rendering (the prompt the engine is conditioned on).
        prompt = render_messages(
            req.messages,
            body.get("add_generation_prompt", True) is not False,
            body.get("continue_final_message") is True,
            drops_reasoning=True,
        )
    else:
        prompt = render_messages(req.messages)
    pieces = split_text(prompt)
    prompt_tokens = len(pieces)
    max_tokens = _check_length(cfg, prompt_tokens, req.max_completion_tokens or req.max_tokens)
    sampling = _sampling(cfg, req)
    kwargs = req.chat_template_kwargs or {}
    thinking = kwargs.get("enable_thinking", kwargs.get("thinking", True)) is not False
    parser = cfg.reasoning_tokens > 0 or cfg.loop_channel == "reasoning"
    closed = closes_reasoning(body)
    thinking = thinking and not closed  # the reasoning is over: the model answers
    kept, after = _kept_reasoning(cfg, req.messages) if closed else (None, "")
    reasoning = cfg.reasoning_tokens if parser and thinking else 0
    loop = None
    if cfg.loop_channel == "content" or (cfg.loop_channel == "reasoning" and parser and thinking):
        loop = _loop_plan(cfg, cfg.loop_channel, req.repetition_detection)
    keys = [prompt_key(model, prompt)]
    asked = _Asked(request_id, keys, req.n, max_tokens, reasoning, loop, sampling, req.ignore_eos)
    plans = _choice_plans(cfg, rng, seen, asked)
    return Job(
        endpoint="chat",
        request_id=request_id,
        model=model,
        stream=stream,
        include_usage=usage,
        continuous_usage=continuous,
        prompt_tokens=prompt_tokens,
        prompts=((prompt_tokens, prefix_blocks(model, pieces, req.cache_salt)),),
        sampling=sampling,
        plans=plans,
        logprobs=top if req.logprobs else None,
        reasoning_active=parser,
        include_reasoning=req.include_reasoning,
        reasoning_style=cfg.reasoning_style,
        nan_logprobs=cfg.nan_logprobs,
        prompt_tokens_details=cfg.enable_prompt_tokens_details,
        answer_as_reasoning=closed and parser and cfg.closed_reasoning_answer == "reasoning",
        closed_reasoning=kept,
        closed_answer=after,
    )


def _kept_reasoning(cfg: EmulatorConfig, messages: list[dict[str, Any]]) -> tuple[str, str]:
    """The closed reasoning a continued final message holds as the template renders it, and
    the content after it."""
    rendered = render_messages(
        messages, continue_final_message=True, drops_reasoning=cfg.template_drops_reasoning
    )
    return closed_reasoning_in(rendered) or "", answer_after_reasoning(rendered)


def closes_reasoning(body: dict[str, Any]) -> bool:
    """A continuation of a final assistant message that ends the reasoning: its content does,
    or it is content after a reasoning (its ``reasoning`` field)."""
    messages = body.get("messages")
    if body.get("continue_final_message") is not True or not isinstance(messages, list):
        return False
    last = messages[-1] if messages else None
    if not isinstance(last, dict) or last.get("role") != "assistant":
        return False
    content = last.get("content")
    if message_reasoning(last) is not None:
        return True
    return isinstance(content, str) and "</think>" in content


def build_completion_job(
    cfg: EmulatorConfig,
    body: dict[str, Any],
    request_id: str,
    rng: random.Random,
    seen: Counter[int],
    decode: Callable[[list[int]], str] | None = None,
) -> Job:
    """``decode``: the text of a prompt of token ids (the ids /tokenize handed out)."""
    req = parse(CompletionRequest, body)
    model = resolve_model(cfg, req.model)
    stream, usage, continuous = _stream_flags(req)
    if req.logprobs is not None:
        _check_logprobs(cfg, req.logprobs, "logprobs")
    prompts = completion_prompts(req.prompt)
    split = [split_text(p) for p in prompts]
    counts = [len(p) for p in split]
    max_req = COMPLETION_DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    max_tokens = min(_check_length(cfg, c, max_req) for c in counts)
    sampling = _sampling(cfg, req)
    # A prompt that closes the reasoning (a rendered continuation): the model answers.
    text = req.prompt if isinstance(req.prompt, str) else None
    if decode is not None and req.prompt and all(isinstance(t, int) for t in req.prompt):
        text = decode(req.prompt)  # type: ignore[arg-type]
    closed = closed_reasoning_in(text) if text is not None else None
    loop = None
    if cfg.loop_channel == "content" or (cfg.loop_channel == "reasoning" and closed is None):
        loop = _loop_plan(cfg, "content", req.repetition_detection)
    keys = [prompt_key(model, p) for p in prompts]
    asked = _Asked(request_id, keys, req.n, max_tokens, 0, loop, sampling, req.ignore_eos)
    plans = _choice_plans(cfg, rng, seen, asked)
    return Job(
        endpoint="completion",
        request_id=request_id,
        model=model,
        stream=stream,
        include_usage=usage,
        continuous_usage=continuous,
        prompt_tokens=sum(counts),
        prompts=tuple((len(p), prefix_blocks(model, p, req.cache_salt)) for p in split),
        sampling=sampling,
        plans=plans,
        logprobs=req.logprobs,
        reasoning_active=False,
        include_reasoning=False,
        reasoning_style=cfg.reasoning_style,
        nan_logprobs=cfg.nan_logprobs,
        prompt_tokens_details=cfg.enable_prompt_tokens_details,
        closed_reasoning=closed,
        closed_answer=answer_after_reasoning(text) if closed is not None and text else "",
    )
