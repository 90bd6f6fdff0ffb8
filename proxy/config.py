"""The whole configuration: frozen pydantic models, merged from TOML, environment and flags.

Precedence, lowest first: defaults, the TOML file, ``DETPROXY_*`` environment variables,
command-line flags. Nested fields are reachable from the environment as
``DETPROXY_<SECTION>__<FIELD>`` (e.g. ``DETPROXY_UPSTREAM__READ_TIMEOUT_S=60``); the common
ones also have flat names (``DETPROXY_UPSTREAM``, ``DETPROXY_PORT``, ...). Any other
``DETPROXY_*`` variable (but ``OTHER_ENV``, read elsewhere) is refused, naming the closest
known one: a misspelt setting would otherwise be ignored without a word.
"""

from __future__ import annotations

import difflib
import os
import re
import tomllib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import orjson
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from yarl import URL

# This module is the leaf of detproxy's imports: what it validates lives here (the ladder's
# vocabulary, the loop detector's thresholds, the answer extractors' syntax), and the modules
# that use them import them from here.

# From measurement on llama-server + SmolLM2-135M (greedy, max_tokens 1024; 33 of the 55 prompts
# of tests/integration/loop_corpus.json loop). Each rung through detproxy as the first retry of
# a loop, continuing from its onset and one unit, as retries do by default
# (tests/bench/bench_rung.py, 2026-12-07): temperature 1.0, top_p 0.95 and both penalties ended
# 31 of 32 loops `stop` (none looped again, 1 `length`); temperature 0.7, top_p 0.95 and
# presence_penalty 1.5 (the first rung until then) 19 of 32 (4 looped again, 9 `length`);
# greedy with frequency_penalty 1.0 (the second until then; the first 12 looping prompts) 6 of
# 12 (5 looped again): greedy from the loop's onset, a continuation takes the loop up again
# before a penalty on its own tokens weighs (vLLM's penalties never count the kept text). As
# restarts, temperature 0.7 with presence_penalty 1.5 ended 32 of 33
# (tests/bench/bench_recovery_corpus.py, 2026-12-01): it stays as the second rung. No seed here:
# a retry is seeded from the request (its own seed, else a hash of it:
# proxy.loops.next_attempt.seeded), so that recoveries are reproducible per request.
DEFAULT_ATTEMPTS: tuple[Mapping[str, Any], ...] = (
    {"temperature": 1.0, "top_p": 0.95, "presence_penalty": 1.5, "frequency_penalty": 1.0},
    {"temperature": 0.7, "top_p": 0.95, "presence_penalty": 1.5},
)
# How an attempt recovers (an attempt's "strategy" key; restart when absent).
STRATEGIES = frozenset({"restart", "continue", "close_reasoning"})
SAMPLING_FIELDS = frozenset(
    {
        "temperature",
        "top_p",
        "top_k",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "seed",
        "min_p",
    }
)

# The loop detector's anchor: the tail suffix whose earlier occurrences give the candidate
# periods. Long enough that structured text (JSON records, table rows, list items) almost
# never repeats it exactly.
DETECTOR_ANCHOR_CHARS = 64


@dataclass(frozen=True, slots=True)
class DetectorConfig:
    """Thresholds of the loop detector (``proxy.loops.detector``, whose docstring says why these
    defaults); the ``[loops.detector]`` table of the configuration."""

    min_period: int = 4
    max_period: int = 4096
    min_repeats: int = 4
    min_short_repeats: int = 16
    short_period: int = 16
    min_covered_chars: int = 256
    min_trivial_covered_chars: int | None = 1024
    window_chars: int = 17408
    check_every_chars: int = 32

    def __post_init__(self) -> None:
        if self.min_period < 1:
            raise ValueError("min_period must be >= 1")
        if self.max_period < self.min_period:
            raise ValueError("max_period must be >= min_period")
        if self.min_repeats < 2 or self.min_short_repeats < 2:
            raise ValueError("min_repeats and min_short_repeats must be >= 2")
        if self.short_period < 0:
            raise ValueError("short_period must be >= 0")
        if self.min_covered_chars < 2 * DETECTOR_ANCHOR_CHARS:
            raise ValueError(f"min_covered_chars must be >= {2 * DETECTOR_ANCHOR_CHARS}")
        if self.min_trivial_covered_chars is not None and self.min_trivial_covered_chars < 1:
            raise ValueError("min_trivial_covered_chars must be >= 1 (or None to disable)")
        if self.check_every_chars < 1:
            raise ValueError("check_every_chars must be >= 1")
        need = self.max_required_chars()
        if self.window_chars < need + self.check_every_chars:
            raise ValueError(
                f"window_chars must be >= {need + self.check_every_chars} "
                "(the longest required run plus check_every_chars)"
            )

    def required_chars(self, period: int, trivial: bool = False) -> int | None:
        """Characters a back-to-back run of a ``period``-char unit must cover to fire.

        ``trivial`` (a unit without letters or digits) and periods below ``min_period`` use
        ``min_trivial_covered_chars``; ``None`` means such a run never fires.
        """
        reps = self.min_short_repeats if period < self.short_period else self.min_repeats
        need = max(self.min_covered_chars, period * reps)
        if trivial or period < self.min_period:
            if self.min_trivial_covered_chars is None:
                return None
            need = max(need, self.min_trivial_covered_chars)
        return need

    def max_required_chars(self) -> int:
        """The longest run any unit up to ``max_period`` may need: the look-back to keep."""
        reps = self.min_short_repeats if self.max_period < self.short_period else self.min_repeats
        longest = max(self.min_covered_chars, self.max_period * reps)
        if self.short_period > 0:
            short = min(self.short_period - 1, self.max_period)
            longest = max(longest, short * self.min_short_repeats)
        if self.min_trivial_covered_chars is not None:
            longest = max(longest, self.min_trivial_covered_chars)
        return longest


_PATH_SEGMENT = re.compile(
    r"""\.([^.\[\]\s]+)|\[\s*(-?\d+)\s*\]|\[\s*'([^']*)'\s*\]|\[\s*"([^"]*)"\s*\]"""
)


def json_path_segments(path: str) -> tuple[str | int, ...]:
    """The keys and indices of an answer extractor's JSON path (``$.items[0]['a key']``)."""
    if not path.startswith("$"):
        raise ValueError(f"JSON path {path!r} must start with '$' (e.g. $.answer.date)")
    segments: list[str | int] = []
    pos = 1
    while pos < len(path):
        match = _PATH_SEGMENT.match(path, pos)
        if match is None:
            raise ValueError(
                f"JSON path {path!r}: unexpected {path[pos:]!r} at position {pos}; "
                "expected .key, [N], ['key'] or [\"key\"]"
            )
        key, number, single, double = match.groups()
        if number is not None:
            segments.append(int(number))
        else:
            segments.append(next(s for s in (key, single, double) if s is not None))
        pos = match.end()
    return tuple(segments)


def answer_extractor_spec(spec: str) -> tuple[Literal["json", "regex"], str]:
    """``("json", path)`` or ``("regex", pattern)`` of ``"json:$.path"`` or
    ``"regex:PATTERN"``, both checked; a bad spec raises ValueError saying why."""
    if not isinstance(spec, str):
        raise ValueError(f"answer extractor must be a string, got {type(spec).__name__}")
    kind, sep, argument = spec.partition(":")
    kind = kind.strip().lower()
    if not sep or kind not in ("json", "regex"):
        raise ValueError(
            f"answer extractor {spec!r}: expected 'json:$.path' (e.g. json:$.answer.date) "
            "or 'regex:PATTERN'"
        )
    if kind == "json":
        path = argument.strip()
        if not path:
            raise ValueError(f"answer extractor {spec!r}: the JSON path is empty")
        json_path_segments(path)
        return "json", path
    if not argument:
        raise ValueError(f"answer extractor {spec!r}: the regex is empty")
    try:
        re.compile(argument)
    except re.error as exc:
        raise ValueError(f"regex {argument!r} does not compile: {exc}") from None
    return "regex", argument


STATE_DIR_ENV = "DETPROXY_STATE_DIR"
INCIDENT_FILE = "incidents.jsonl"


def default_state_dir(env: Mapping[str, str] | None = None) -> Path | None:
    """Where detproxy keeps what it writes by default: ``$DETPROXY_STATE_DIR``, else
    ``$XDG_STATE_HOME/detproxy``, else ``~/.local/state/detproxy`` (None: no home to put it
    in). Read from ``env`` (the process environment by default) when called, never at import."""
    env = os.environ if env is None else env
    given = env.get(STATE_DIR_ENV, "")
    if given:
        return Path(given).expanduser()
    xdg = env.get("XDG_STATE_HOME", "")
    if xdg and Path(xdg).is_absolute():  # the XDG spec: a relative one is to be ignored
        return Path(xdg) / "detproxy"
    try:
        home = Path.home()
    except (KeyError, RuntimeError):  # no $HOME and no passwd entry
        return None
    return home / ".local" / "state" / "detproxy"


def default_incident_path(env: Mapping[str, str] | None = None) -> str | None:
    """``incidents.path`` when the configuration does not set it (``detproxy report`` with no
    argument reads it): ``<state dir>/incidents.jsonl``."""
    state = default_state_dir(env)
    return str(state / INCIDENT_FILE) if state is not None else None


def _http_url(value: str) -> str:
    url = URL(value)
    if url.scheme not in ("http", "https") or not url.host:
        raise ValueError("must be an http:// or https:// URL with a host")
    return str(url).rstrip("/")


def api_root(value: str) -> str:
    """An upstream's root URL. detproxy adds ``/v1/...`` itself, so the openai SDK's base URL
    (``http://host:8000/v1``) would send every request to ``/v1/v1/...``, answered 404: a
    ValueError says so and gives the root (``serve``'s settings and ``probe``'s flag alike)."""
    url = _http_url(value)
    path = URL(url).path
    if path.endswith("/v1"):
        root = str(URL(url).with_user(None).with_path(path[: -len("/v1")] or "/")).rstrip("/")
        raise ValueError(f"ends in /v1: detproxy adds /v1/... itself; use {root}")
    return url


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
    # The admin listener's address (host's when not set): a loopback one serves status,
    # incidents and the explorer without a token, while host takes clients from anywhere.
    admin_host: str | None = None
    # How long a browser's login (the admin token exchanged for a cookie) lasts.
    session_ttl_s: int = Field(default=12 * 3600, ge=60, le=30 * 86400)
    # auto: uvloop where it can be imported, else asyncio's own loop.
    event_loop: Literal["auto", "uvloop", "asyncio"] = "auto"
    # The garbage collector once serving (proxy/collector.py): start-up's objects frozen out of
    # its walks; gen-0 every 10,000 allocations instead of 700 (bench_paced.py --gc-timings).
    gc_freeze: bool = True
    gc_threshold: tuple[int, int, int] = (10_000, 50, 100)  # Python's own: (700, 10, 10)
    # Serving processes on the port (proxy/workers.py): "auto" (one per core this process may
    # use, its cgroup's CPU quota included: proxy/cores.py), resolved by ``detproxy serve``;
    # 1: one process, no supervisor.
    workers: Annotated[int, Field(ge=1)] | Literal["auto"] = "auto"
    # Removed: every listener is detproxy's own HTTP/1.1 server (proxy/http/front.py). Kept as
    # a name only, so that a config still setting it is told so (``_removed_http``).
    http: None = Field(default=None, exclude=True, repr=False)
    keepalive_timeout_s: float = Field(default=75.0, gt=0)  # idle client connections

    @field_validator("admin_token", mode="before")
    @classmethod
    def _blank_token(cls, value: object) -> object:
        # DETPROXY_SERVER__ADMIN_TOKEN= (a compose file's ${VAR:-}, an empty Secret): not set.
        return None if isinstance(value, str) and not value.strip() else value

    @property
    def processes(self) -> int:
        """The processes serving the port: ``workers``, once ``detproxy serve`` resolved
        "auto"; 1 in an app nothing resolved it for (one built outside ``detproxy serve``)."""
        return self.workers if isinstance(self.workers, int) else 1

    @property
    def one_process(self) -> bool:
        """Whether this process serves every request of the server."""
        return self.processes == 1

    @field_validator("admin_host")
    @classmethod
    def _admin_host_needs_port(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and info.data.get("admin_port") is None:
            raise ValueError(
                "the address of the admin listener: set server.admin_port too (or remove"
                " admin_host)"
            )
        return value

    def admin_address(self) -> str:
        """The address the admin listener (``admin_port``) binds."""
        return self.admin_host or self.host

    @field_validator("http", mode="before")
    @classmethod
    def _removed_http(cls, value: object) -> None:
        raise ValueError(
            "server.http was removed: every listener is detproxy's own HTTP/1.1 server"
            " (proxy/http/front.py); delete this setting"
        )


class UpstreamExpectConfig(_Section):
    """What the operator declares the engine must run (``[upstream.expect]``); a key left out
    is not checked. Held against what the engine says it loaded (proxy.engine.expect)."""

    attention_backend: str | None = None  # e.g. "FLASH_ATTN", "FLASHINFER", "TRITON_ATTN"
    moe_backend: str | None = None
    linear_backend: str | None = None  # e.g. "CutlassFP8ScaledMMLinearKernel"
    quantization: str | None = None  # e.g. "fp8"; "none" for unquantized
    dtype: str | None = None  # e.g. "bfloat16"
    kv_cache_dtype: str | None = None  # e.g. "auto", "fp8"
    cudagraphs: bool | None = None
    enforce_eager: bool | None = None
    prefix_caching: bool | None = None
    chunked_prefill: bool | None = None
    speculative: bool | str | None = None  # off/on, or the method (e.g. "eagle3")
    batch_invariant: bool | None = None
    unknown_env: bool | None = None  # false: no unknown environment variable allowed

    def declared(self) -> dict[str, Any]:
        """The keys the operator set (None: not declared)."""
        return {k: v for k, v in self.model_dump().items() if v is not None}


class UpstreamConfig(_Section):
    url: str = "http://127.0.0.1:8000"
    connect_timeout_s: float = Field(default=10.0, gt=0)
    # Longest silence allowed on an upstream socket, waiting for the headers of a
    # non-streamed answer included: vLLM sends those only when generation is over.
    read_timeout_s: float = Field(default=3600.0, gt=0)
    max_connections: int = Field(default=1024, gt=0)
    # Removed: detproxy has one upstream client, its own (proxy/http/h1.py). Kept as a name
    # only, so that a config still setting it is told so (``_removed_client``).
    client: None = Field(default=None, exclude=True, repr=False)
    keepalive_timeout_s: float = Field(default=4.0, gt=0)  # idle pooled connections
    max_logprobs: int = Field(default=20, ge=0)
    # Read /version, /v1/models, /metrics and /props this often (0: never).
    fingerprint_interval_s: float = Field(default=30.0, ge=0)
    # The engine's own log, followed from its start across rotation ("-": detproxy's stdin,
    # for `vllm serve ... 2>&1 | detproxy serve ...`); what it says it loaded.
    engine_log: str | None = None
    expect: UpstreamExpectConfig = UpstreamExpectConfig()

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        return api_root(value)

    @field_validator("client", mode="before")
    @classmethod
    def _removed_client(cls, value: object) -> None:
        raise ValueError(
            "upstream.client was removed: detproxy has one upstream client, its own"
            " (proxy/http/h1.py); delete this setting"
        )


class ClassifyConfig(_Section):
    # What the upstream uses when a request carries no temperature (vLLM: the model's
    # generation_config). Unknown by default, so such requests are not deterministic.
    default_temperature: float | None = Field(default=None, ge=0)
    seeded_is_deterministic: bool = False


class AuditConfig(_Section):
    # On by default (SPEC 1.16): 5% of deterministic requests get a shadow replay, and a model
    # not audited for at_least_every_s gets its next one audited whatever the rate picked (a
    # repeated prompt is never picked by the hash; 5% of a handful is none); budgets below
    # bound what it costs. Off: sample_rate = 0 and at_least_every_s = 0.
    sample_rate: float = Field(default=0.05, ge=0.0, le=1.0)
    at_least_every_s: float = Field(default=60.0, ge=0.0)  # per model; 0: no floor
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
    # The budgets, all enforced before a shadow is sent (what does not fit is dropped and
    # counted in detproxy_shadow_dropped_total{reason}). Concurrency is the bound on the
    # engine's load: at most 4 sequences more in its batch (vLLM schedules up to 256 by
    # default: under 2% of its batch; a llama-server with few slots: lower it). The rate caps
    # bursts of short (prefill) shadows; at 5% it binds only above 2,000 greedy requests/s.
    max_concurrent_shadows: int = Field(default=4, gt=0)
    max_shadows_per_s: float = Field(default=100.0, gt=0)
    # Shadow tokens (prompt + completion) at most this share of the tokens of the deterministic
    # requests detproxy saw (since start), plus token_allowance always, so that the first
    # audits fit before any share has built up (like loops.recovery_token_floor). A full
    # shadow costs what its primary did: at 5% it spends about half of this share.
    max_token_share: float = Field(default=0.1, ge=0)  # shadow tokens / primary tokens
    token_allowance: int = Field(default=8192, ge=0)
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
        return None if value is None else api_root(value)

    @field_validator("answer_extractor")
    @classmethod
    def _extractor(cls, value: str | None) -> str | None:
        if value is not None:
            answer_extractor_spec(value)
        return value


class AttributionConfig(_Section):
    """Triage (SPEC 1.14): follow-up replays of a non-identical audit, off the request path,
    one at a time, at quiet times, that decide its cause. What does not fit the budgets is
    dropped, counted in detproxy_triage_dropped_total{reason}, and the incident's cause is
    ``unknown`` with the budget named as the missing evidence."""

    triage_rate: float = Field(default=1.0, ge=0.0, le=1.0)  # of non-identical audits; 0: off
    cold_replays: int = Field(default=4, ge=2)  # serial, each with a fresh cache_salt
    warm_replays: int = Field(default=2, ge=0)  # after a priming run, without salt; 0: none
    # where audit.reference_url is set; 3: a reference that flips now and then seldom agrees
    # with itself by chance (2 did, 1 in 22 flipped shadows, on the emulator 2026-12-07)
    reference_replays: int = Field(default=3, ge=0)
    # Replays stop this many tokens past the audit's first divergent token (max_tokens /
    # max_completion_tokens cut to it, never raised) and all runs are compared over those first
    # tokens; prefill audits, answer divergences and unknown positions replay whole.
    replay_margin_tokens: int = Field(default=16, ge=1)
    # How a replay runs cold: auto reads the upstream's kind (vLLM: cache_salt; llama.cpp's
    # server: cache_prompt false); "none" says the engine has no way (the evidence says so).
    cold_method: Literal["auto", "cache_salt", "cache_prompt", "none"] = "auto"
    # Experiments started per minute at most: a burst waits, paced, instead of being refused.
    max_per_minute: float = Field(default=6.0, gt=0)
    # Triage tokens (every replay's prompt + completion) at most this share of the tokens of
    # the deterministic requests detproxy saw, plus token_allowance always.
    max_token_share: float = Field(default=0.05, ge=0)
    token_allowance: int = Field(default=32768, ge=0)
    queue_size: int = Field(default=64, ge=1)  # experiments waiting (each explains many)
    # An experiment waits this long for the rate and the token budget; past it, the incidents
    # it would explain end unknown, naming the budget.
    max_wait_s: float = Field(default=600.0, gt=0)
    # An experiment's replays explain later incidents of the same request on the same recipe
    # (the upstream's identity unchanged) for this long, with no new replay.
    reuse_s: float = Field(default=600.0, ge=0)
    # Quiet: each replay waits until detproxy has at most this many client requests in flight
    # and no shadow running (and audit.quiet_max_upstream_running, where set), for at most
    # quiet_deadline_s; then the triage gives up (dropped: quiet_deadline).
    quiet_max_inflight: int = Field(default=0, ge=0)
    quiet_deadline_s: float = Field(default=60.0, gt=0)
    replay_timeout_s: float = Field(default=120.0, gt=0)


class IncidentConfig(_Section):
    # JSON lines file, default_incident_path() unless set (resolved when the settings are
    # built); "" keeps incidents in memory only. Its folder is created at start.
    path: str | None = Field(default_factory=lambda: default_incident_path())
    max_bytes: int = Field(default=50 * 1024 * 1024, gt=0)
    backups: int = Field(default=5, ge=0)
    # Lines waiting for the file's writer task; past it, a line is dropped and counted (status:
    # incidents.dropped), never waited for on the request path.
    queue_lines: int = Field(default=10_000, gt=0)
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


class ReasoningMarkersConfig(_Section):
    """How a model's reasoning is marked in its own output (``close_reasoning`` writes them
    around the kept reasoning): the first entry whose glob matches the model."""

    models: str = "*"
    start: str = "<think>"
    end: str = "</think>"
    # Whether a closed reasoning is continued through the prompt the engine's own template
    # renders, on /v1/completions (proxy/loops/rendered.py), instead of a final assistant
    # message, which templates dropping assistant reasoning (DeepSeek-R1's distills, QwQ) cut
    # (vLLM then refuses to continue it). auto: where the engine's /tokenize shows the model's
    # template drops it (asked once per model); always / never: declared.
    rendered_continuation: Literal["auto", "always", "never"] = "auto"


class LoopConfig(_Section):
    # What a loop leads to when no ladder is configured (the --loop-policy flag).
    policy: Literal["retry", "abort", "observe"] = "observe"
    enabled: bool = True
    # continue (the default): every retry, streamed or not, goes on from the loop's onset and
    # one unit, a stream after what its client was shown: a delta-reading client (the openai SDK
    # ignores SSE comments) gets one answer, the one a non-streamed request gets, up to the
    # repeats it was shown (one path); restart: every retry starts the answer again (a stream's
    # after an SSE comment: only for clients that read comments); hold_reasoning: reasoning held
    # back until it ends.
    stream_mode: Literal["continue", "restart", "hold_reasoning"] = "continue"
    # continue: the last chars of text a stream holds back from its client, so that a loop is
    # caught before its repeats are shown (0: none; each chunk then goes out as it comes).
    hold_back_chars: int = Field(default=0, ge=0)
    hold_max_bytes: int = Field(default=256 * 1024, gt=0)
    max_attempts: int = Field(default=3, ge=1)
    # The recovery budget (policies/budget.py): per model, the extra tokens recoveries make the
    # engine generate over recovery_window_s are at most recovery_token_share of what its client
    # requests generated, and recovery_token_floor is always allowed.
    recovery_token_share: float = Field(default=1.0, ge=0)
    recovery_token_floor: int = Field(default=32768, ge=0)
    recovery_window_s: int = Field(default=300, ge=1)
    # redis: the budget holds for every replica together (proxy/loops/budget_sync.py), synced
    # every recovery_budget_sync_s; memory: each replica's own.
    recovery_budget_store: Literal["memory", "redis"] = "memory"
    recovery_budget_redis_url: str = "redis://127.0.0.1:6379/0"
    recovery_budget_sync_s: float = Field(default=1.0, gt=0)
    runaway: bool = True
    ladders: list[LadderConfig] = Field(default_factory=list)
    engine_detection: EngineDetectionConfig | None = None  # inject repetition_detection
    reasoning_markers: list[ReasoningMarkersConfig] = Field(
        default_factory=lambda: [ReasoningMarkersConfig()]
    )
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


class LogConfig(_Section):
    """What ``detproxy serve`` logs (proxy/observe/log.py): never a header, prompt or output."""

    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["text", "json"] = "text"  # json: one object per line, for log pipelines
    access_log: bool = False  # one line per finished request
    # A notable event that repeats (the same kind, the same model) is logged at most once per
    # this many seconds; the next line says how many were left out (0: every one).
    repeat_s: float = Field(default=60.0, ge=0)

    @field_validator("level", "format", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return value.strip().lower() if isinstance(value, str) else value


class Settings(_Section):
    server: ServerConfig = ServerConfig()
    upstream: UpstreamConfig = UpstreamConfig()
    injection: InjectionConfig = InjectionConfig()
    classify: ClassifyConfig = ClassifyConfig()
    audit: AuditConfig = AuditConfig()
    attribution: AttributionConfig = AttributionConfig()
    loops: LoopConfig = LoopConfig()
    incidents: IncidentConfig = Field(default_factory=IncidentConfig)  # path: read at build
    log: LogConfig = LogConfig()


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
    "log_level": ("log", "level"),
    "log_format": ("log", "format"),
    "access_log": ("log", "access_log"),
}


# The DETPROXY_* variables that are not settings, and what reads them: accepted as they are
# (tests/test_config.py checks that every such name in the repository is here or a setting).
SERVER_ID_ENV = "DETPROXY_VIA_ID"  # a server's id, from the supervisor to its workers
OTHER_ENV = frozenset(
    {
        ENV_PREFIX + "CONFIG",  # the config file (--config)
        STATE_DIR_ENV,  # where incidents go by default
        SERVER_ID_ENV,
        "DETPROXY_API_KEY",  # probe's and diagnose's --api-key
        "DETPROXY_HEALTHCHECK_URL",  # the image's HEALTHCHECK (deploy/docker/Dockerfile)
        "DETPROXY_COMPILE",  # setup.py: the compiled build
        "DETPROXY_IMAGE_CACHE",  # deploy/docker/build_image.sh
        "DETPROXY_VERSION",  # the image's build arguments
        "DETPROXY_REVISION",
        "DETPROXY_CREATED",
        "DETPROXY_ENGINE_CACHE",  # tests/integration/build_llama_server.sh
    }
)


def _alternatives(annotation: Any) -> tuple[Any, ...]:
    """``X | Y`` as ``(X, Y)``; any other type alone (a list's item type is not its own)."""
    if get_origin(annotation) in (Union, UnionType):
        return get_args(annotation)
    return (annotation,)


def _section(annotation: Any) -> type[BaseModel] | None:
    """The section a field holds (``X``, or ``X | None``); None for a value."""
    for candidate in _alternatives(annotation):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _is_table(annotation: Any) -> bool:
    return any(get_origin(a) is dict for a in _alternatives(annotation))


def _is_field(model: type[BaseModel], path: Sequence[str]) -> bool:
    """``path`` names a field of ``model``, or of a section below it; anything below a table
    (``loops.detector``) is one of its keys."""
    field = model.model_fields.get(path[0])
    if field is None:
        return False
    if len(path) == 1:
        return True
    section = _section(field.annotation)
    if section is not None:
        return _is_field(section, path[1:])
    return _is_table(field.annotation)


def env_path(name: str) -> tuple[str, ...] | None:
    """The field a ``DETPROXY_*`` variable sets (a flat name, or ``<SECTION>__<FIELD>``);
    None for any other name."""
    key = name[len(ENV_PREFIX) :].lower()
    if key in FLAT:
        return FLAT[key]
    path = tuple(key.split("__"))
    return path if len(path) > 1 and _is_field(Settings, path) else None


def _field_names(model: type[BaseModel], prefix: str) -> Iterator[str]:
    for name, field in model.model_fields.items():
        if field.exclude:  # a removed setting: refused when set, never suggested
            continue
        full = prefix + name.upper()
        yield full
        section = _section(field.annotation)
        if section is not None:
            yield from _field_names(section, full + "__")


def env_names() -> list[str]:
    """Every ``DETPROXY_*`` name detproxy reads: the settings, then ``OTHER_ENV``."""
    nested = (n for n in _field_names(Settings, "") if "__" in n)
    flat = (key.upper() for key in FLAT)
    return [ENV_PREFIX + n for n in (*flat, *nested)] + sorted(OTHER_ENV)


def _unknown_env(name: str) -> str:
    """What to say of a ``DETPROXY_*`` variable that is nothing detproxy reads: a misspelt
    setting would otherwise be ignored without a word."""
    known = [n[len(ENV_PREFIX) :] for n in env_names()]
    close = difflib.get_close_matches(name[len(ENV_PREFIX) :].upper(), known, n=1)
    hint = (
        f"did you mean {ENV_PREFIX}{close[0]}?"
        if close
        else "a setting is DETPROXY_<SECTION>__<FIELD> (e.g. DETPROXY_AUDIT__SAMPLE_RATE),"
        " the sections and fields as 'detproxy config' prints them"
    )
    return f"environment variable {name} is not a detproxy setting; {hint} (unset or rename it)"


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
        if not name.startswith(ENV_PREFIX) or name in OTHER_ENV:
            continue
        field = env_path(name)
        if field is None:
            raise ConfigError(_unknown_env(name))
        _set(tree, field, _env_value(raw), name, origins)
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
        origin = _origin(loc, origins) or (str(path) if path else "defaults")
        lines.append(f"{'.'.join(loc)}: {err['msg']} (from {origin})")
    return "invalid configuration:\n  " + "\n  ".join(lines)


def _origin(loc: tuple[str, ...], origins: dict[tuple[str, ...], str]) -> str | None:
    """Where the value at ``loc`` came from: the variable or flag that set it, or a table
    above it (a key inside a table given as JSON)."""
    for end in range(len(loc), 0, -1):
        origin = origins.get(loc[:end])
        if origin is not None:
            return origin
    return None
