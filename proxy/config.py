"""The whole configuration: frozen pydantic models, merged from TOML, environment and flags.

Precedence, lowest first: defaults, the TOML file, ``DETPROXY_*`` environment variables,
command-line flags. Nested fields are reachable from the environment as
``DETPROXY_<SECTION>__<FIELD>`` (e.g. ``DETPROXY_UPSTREAM__READ_TIMEOUT_S=60``); the common
ones also have flat names (``DETPROXY_UPSTREAM``, ``DETPROXY_PORT``, ...).
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from yarl import URL

from policies.ladder import DEFAULT_ATTEMPTS, SAMPLING_FIELDS, STRATEGIES
from proxy.inspect.loops import LoopConfig as DetectorConfig


def _http_url(value: str) -> str:
    url = URL(value)
    if url.scheme not in ("http", "https") or not url.host:
        raise ValueError("must be an http:// or https:// URL with a host")
    return str(url).rstrip("/")


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ServerConfig(_Section):
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    max_body_bytes: int = Field(default=16 * 1024 * 1024, gt=0)
    max_sse_event_bytes: int = Field(default=8 * 1024 * 1024, gt=0)
    shutdown_grace_s: float = Field(default=30.0, ge=0)
    admin_token: str | None = Field(default=None, min_length=16)  # bearer token for /detproxy/*
    admin_port: int | None = Field(default=None, ge=0, le=65535)  # a separate admin listener
    # auto: uvloop where it can be imported, else asyncio's own loop.
    event_loop: Literal["auto", "uvloop", "asyncio"] = "auto"
    # The garbage collector once serving (proxy/collector.py): start-up's objects frozen out of
    # its walks; gen-0 every 10,000 allocations instead of 700 (bench_paced.py --gc-timings).
    gc_freeze: bool = True
    gc_threshold: tuple[int, int, int] = (10_000, 50, 100)  # Python's own: (700, 10, 10)
    workers: int = Field(default=1, ge=1)  # serving processes on the port (proxy/workers.py)


class UpstreamConfig(_Section):
    url: str = "http://127.0.0.1:8000"
    connect_timeout_s: float = Field(default=10.0, gt=0)
    # Longest silence allowed on an upstream socket, waiting for the headers of a
    # non-streamed answer included: vLLM sends those only when generation is over.
    read_timeout_s: float = Field(default=3600.0, gt=0)
    max_connections: int = Field(default=1024, gt=0)
    # native: detproxy's own lean HTTP/1.1 client (proxy/h1.py); aiohttp: aiohttp's client,
    # slower per request (tests/bench/bench_proxy.py --aiohttp-client), kept as a fallback.
    client: Literal["native", "aiohttp"] = "native"
    keepalive_timeout_s: float = Field(default=4.0, gt=0)  # idle pooled connections
    max_logprobs: int = Field(default=20, ge=0)
    # Read /version, /v1/models, /metrics and /props this often (0: never).
    fingerprint_interval_s: float = Field(default=30.0, ge=0)

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        return _http_url(value)


class ClassifyConfig(_Section):
    # What the upstream uses when a request carries no temperature (vLLM: the model's
    # generation_config). Unknown by default, so such requests are not deterministic.
    default_temperature: float | None = Field(default=None, ge=0)
    seeded_is_deterministic: bool = False


class AuditConfig(_Section):
    sample_rate: float = Field(default=0.0, ge=0.0, le=1.0)
    # Per-model rates by glob pattern ("qwen3-*" = 0.5); the first match wins.
    model_rates: dict[str, float] = Field(default_factory=dict)
    # hash: the same request is always (or never) audited; random: independent draws.
    sample_by: Literal["hash", "random"] = "hash"
    shadow_mode: Literal["full", "prefill"] = "full"
    schedule: Literal["immediate", "quiet"] = "immediate"
    quiet_max_inflight: int = Field(default=0, ge=0)  # detproxy's own in-flight requests
    # vllm:num_requests_running, or llama-server's llamacpp:requests_processing
    quiet_max_upstream_running: int | None = Field(default=None, ge=0)
    quiet_deadline_s: float = Field(default=30.0, gt=0)
    quiet_poll_s: float = Field(default=0.05, gt=0)
    # Quiet must last this long: back-to-back client requests leave gaps of milliseconds.
    quiet_settle_s: float = Field(default=0.25, ge=0)
    cache_salt: bool = False  # a fresh cache_salt per shadow: a cold prefill (vLLM)
    # Merged into every shadow body, e.g. {cache_prompt = false} for llama.cpp's server.
    shadow_extra_body: dict[str, Any] = Field(default_factory=dict)
    reference_url: str | None = None  # replay to a control engine instead of the same upstream
    inject_top_logprobs: int = Field(default=5, ge=0)  # bounded by upstream.max_logprobs
    max_concurrent_shadows: int = Field(default=4, gt=0)
    max_shadows_per_s: float = Field(default=100.0, gt=0)
    max_token_share: float = Field(default=1.0, ge=0)  # shadow tokens / primary tokens
    queue_size: int = Field(default=256, ge=1)
    shadow_timeout_s: float = Field(default=600.0, gt=0)
    answer_extractor: str | None = None  # "json:$.path" or "regex:PATTERN"
    passive_checks: bool = True  # n > 1 choices and duplicate requests, at no extra cost
    duplicate_window_s: float = Field(default=300.0, gt=0)
    duplicate_max_entries: int = Field(default=10_000, gt=0)  # the memory store's bound
    duplicate_store: Literal["memory", "redis"] = "memory"  # redis: shared by replicas
    redis_url: str = "redis://127.0.0.1:6379/0"
    reuse_client_auth: bool = False  # shadows send the client's Authorization header
    service_api_key: str | None = None  # otherwise this key, if any

    @field_validator("model_rates")
    @classmethod
    def _rates(cls, value: dict[str, float]) -> dict[str, float]:
        for pattern, rate in value.items():
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"rate for {pattern!r} must be between 0 and 1")
        return value

    @field_validator("reference_url")
    @classmethod
    def _reference(cls, value: str | None) -> str | None:
        return None if value is None else _http_url(value)

    @field_validator("answer_extractor")
    @classmethod
    def _extractor(cls, value: str | None) -> str | None:
        if value is not None:
            from proxy.audit.extract import build_extractor

            build_extractor(value)
        return value


class IncidentConfig(_Section):
    path: str | None = None  # JSON lines file; None keeps incidents in memory only
    max_bytes: int = Field(default=50 * 1024 * 1024, gt=0)
    backups: int = Field(default=5, ge=0)
    ring_size: int = Field(default=1000, gt=0)
    store_text: bool = False  # prompts and outputs; hashes are always stored
    # Cumulative counts (the denominators of `detproxy report`) written this often.
    tally_interval_s: float = Field(default=60.0, gt=0)


class LadderConfig(_Section):
    models: str = "*"  # glob over the request's model
    action: Literal["retry", "abort", "observe"] = "retry"
    attempts: list[dict[str, Any]] = Field(
        default_factory=lambda: [dict(a) for a in DEFAULT_ATTEMPTS]
    )
    on_exhausted: Literal["abort", "observe"] = "abort"

    @field_validator("attempts")
    @classmethod
    def _overrides(cls, value: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for overrides in value:
            unknown = set(overrides) - SAMPLING_FIELDS - {"strategy"}
            if unknown:
                raise ValueError(f"not a sampling field: {', '.join(sorted(unknown))}")
            strategy = overrides.get("strategy", "restart")
            if strategy not in STRATEGIES:
                known = ", ".join(sorted(STRATEGIES))
                raise ValueError(f"strategy {strategy!r} is not one of {known}")
        return value


class EngineDetectionConfig(_Section):
    """vLLM >= 0.17's ``repetition_detection`` request parameter."""

    min_pattern_size: int = Field(default=1, ge=1)
    max_pattern_size: int = Field(default=64, ge=1)
    min_count: int = Field(default=8, ge=2)


class LoopConfig(_Section):
    # What a loop leads to when no ladder is configured (the --loop-policy flag).
    policy: Literal["retry", "abort", "observe"] = "observe"
    enabled: bool = True
    stream_mode: Literal["restart", "hold_reasoning"] = "restart"
    hold_max_bytes: int = Field(default=256 * 1024, gt=0)
    max_attempts: int = Field(default=3, ge=1)
    # The recovery budget (policies/budget.py): per model, the extra tokens recoveries make the
    # engine generate over recovery_window_s are at most recovery_token_share of what its client
    # requests generated, and recovery_token_floor is always allowed.
    recovery_token_share: float = Field(default=1.0, ge=0)
    recovery_token_floor: int = Field(default=32768, ge=0)
    recovery_window_s: int = Field(default=300, ge=1)
    runaway: bool = True
    ladders: list[LadderConfig] = Field(default_factory=list)
    engine_detection: EngineDetectionConfig | None = None  # inject repetition_detection
    detector: dict[str, int | None] = Field(default_factory=dict)  # LoopDetector thresholds

    # Replaced by the token budget above: accepted only to say so at start.
    retry_budget: float | None = None
    retry_budget_min: int | None = None

    @field_validator("retry_budget", "retry_budget_min")
    @classmethod
    def _replaced(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError(
                "replaced by the token budget: recovery_token_share, recovery_token_floor,"
                " recovery_window_s"
            )
        return value

    @field_validator("detector")
    @classmethod
    def _detector(cls, value: dict[str, int | None]) -> dict[str, int | None]:
        try:
            DetectorConfig(**value)  # type: ignore[arg-type]
        except (TypeError, ValueError) as exc:
            raise ValueError(str(exc)) from None
        return value

    def ladder_list(self) -> list[LadderConfig]:
        return self.ladders or [LadderConfig(action=self.policy)]


class InjectionConfig(_Section):
    """When the upstream refuses what detproxy adds to requests (logprobs for an audit, vLLM's
    repetition_detection): the client's own request is sent instead, and after this many
    failures in a row for a model the addition is suspended for it, then tried again."""

    failures_to_suspend: int = Field(default=3, ge=1)
    suspend_s: float = Field(default=60.0, gt=0)  # doubled at each suspension in a row
    max_suspend_s: float = Field(default=3600.0, gt=0)


class Settings(_Section):
    server: ServerConfig = ServerConfig()
    upstream: UpstreamConfig = UpstreamConfig()
    injection: InjectionConfig = InjectionConfig()
    classify: ClassifyConfig = ClassifyConfig()
    audit: AuditConfig = AuditConfig()
    loops: LoopConfig = LoopConfig()
    incidents: IncidentConfig = IncidentConfig()


class ConfigError(Exception):
    """A configuration that cannot start; the message names the field and where it came from."""


ENV_PREFIX = "DETPROXY_"
# Flat names for the common settings (environment variables and flags alike).
FLAT = {
    "upstream": ("upstream", "url"),
    "host": ("server", "host"),
    "port": ("server", "port"),
    "sample_rate": ("audit", "sample_rate"),
    "shadow_mode": ("audit", "shadow_mode"),
    "loop_policy": ("loops", "policy"),
    "event_loop": ("server", "event_loop"),
    "workers": ("server", "workers"),
}


def _set(
    tree: dict[str, Any],
    path: tuple[str, ...],
    value: Any,
    origin: str,
    origins: dict[tuple[str, ...], str],
) -> None:
    node = tree
    for key in path[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(path)}: {key!r} is not a section ({origin})")
        node = child
    node[path[-1]] = value
    origins[path] = origin


def _env_value(raw: str) -> Any:
    # Lists and tables can be given as JSON; scalars stay strings for pydantic to coerce.
    if raw[:1] in "[{":
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            return raw
    return raw


def load_settings(
    path: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> Settings:
    tree: dict[str, Any] = {}
    origins: dict[tuple[str, ...], str] = {}
    if path is not None:
        try:
            with open(path, "rb") as fh:
                tree = tomllib.load(fh)
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc
    for name, raw in sorted((env or {}).items()):
        if not name.startswith(ENV_PREFIX) or name == ENV_PREFIX + "CONFIG":
            continue
        key = name[len(ENV_PREFIX) :].lower()
        if key in FLAT:
            _set(tree, FLAT[key], _env_value(raw), name, origins)
        elif "__" in key:
            _set(tree, tuple(key.split("__")), _env_value(raw), name, origins)
    for key, value in (flags or {}).items():
        if value is not None:
            _set(tree, FLAT[key], value, "--" + key.replace("_", "-"), origins)
    try:
        return Settings.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, origins, path)) from None


def _describe(
    exc: ValidationError, origins: dict[tuple[str, ...], str], path: str | Path | None
) -> str:
    lines = []
    for err in exc.errors():
        loc = tuple(str(p) for p in err["loc"])
        origin = origins.get(loc) or (str(path) if path else "defaults")
        lines.append(f"{'.'.join(loc)}: {err['msg']} (from {origin})")
    return "invalid configuration:\n  " + "\n  ".join(lines)
