"""What runs behind detproxy: the upstream's own account of itself, read at start and
periodically.

vLLM: ``/version``, ``/v1/models`` (ids, ``max_model_len``), ``/metrics`` (speculative
decoding counters, prefix cache hits, running and waiting requests) and, in its dev mode,
``/server_info`` (its config). llama.cpp's server: ``/props`` (build, slots, model file,
context, speculative types) and its ``llamacpp:*`` metrics. Whatever an upstream lacks is
simply absent. The identity fields (not the load) hash to a short fingerprint; a new
fingerprint under the same detproxy is a redeploy or a silent change.

A reading where nothing says what runs (refused, timed out, a server still loading) is an
outage, not an identity: the last identity is kept across it, and the same one coming back
is a restart, counted apart from changes (``FingerprintPoller``).

``speculative`` is what the server says it runs, never what its counters have counted so far
(a fresh server has drafted nothing): vLLM's ``/server_info`` (``speculative_config``) where it
answers, llama.cpp's ``speculative.types`` in ``/props``, else whether vLLM exports any
``vllm:spec_decode_*`` series (it does, at 0, from its start exactly when speculative decoding
is configured). ``None`` when nothing says; a reading that cannot tell (``/metrics`` did not
answer) keeps the previous reading's value.

The recipe (what the engine says it loaded: ``proxy.engine.follow.EngineTruth``, from its log
and from these endpoints) is part of the identity, as ``identity["recipe"]`` (its digest), but
not of the hash while it only grows: a fact learnt later (the log read after the first reading,
``/server_info`` answering later) is no change. A fact that moved from one known value to
another is: the fingerprint then hashes the new recipe's digest in, and keeps it until the next
move.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import orjson
import xxhash
from yarl import URL

from proxy.engine.identity import Fingerprint
from proxy.engine.promtext import samples
from proxy.events import EventBus, UpstreamFingerprinted, UpstreamRestarted, UpstreamUnreachable
from proxy.http.errors import UpstreamError, UpstreamFailure
from proxy.http.upstream import Upstream, get, url_auth
from proxy.redact import mask_url

if TYPE_CHECKING:
    from proxy.engine.facts import EngineFacts
    from proxy.engine.follow import EngineTruth

log = logging.getLogger(__name__)

# Counters read from /metrics, summed over label sets (engines, models).
_COUNTERS = {
    "drafts": ("vllm:spec_decode_num_drafts_total", "llamacpp:spec_decode_num_drafts_total"),
    "draft_tokens": (
        "vllm:spec_decode_num_draft_tokens_total",
        "llamacpp:spec_decode_num_draft_tokens_total",
    ),
    "accepted": (
        "vllm:spec_decode_num_accepted_tokens_total",
        "llamacpp:spec_decode_num_accepted_tokens_total",
    ),
    "cache_queries": ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
    "cache_hits": ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
    "running": ("vllm:num_requests_running", "llamacpp:requests_processing"),
    "waiting": ("vllm:num_requests_waiting", "llamacpp:requests_deferred"),
}

# Any series of these prefixes (vLLM V1's counters, V0's gauges) means speculative decoding is on.
_SPEC_PREFIXES = ("vllm:spec_decode_", "llamacpp:spec_decode_")
SPEC_SERIES = "spec_decode_series"  # parse_metrics' key: how many such samples were read
# prometheus_client's process collector (vLLM's API server exports it): when the process began.
_STARTED = "process_start_time_seconds"
STARTED = "started_at"  # parse_metrics' key for it
_WANTED = {name: key for key, names in _COUNTERS.items() for name in names}
_READ = (*_WANTED, *_SPEC_PREFIXES, _STARTED)  # the lines parse_metrics looks at
_SPEC_TEXT = re.compile(r"speculative_config=([A-Za-z_]\w*)")


def parse_metrics(text: str) -> dict[str, float]:
    """Sum each metric of interest over its label sets; ``SPEC_SERIES`` counts the samples of
    speculative-decoding series (present, even at 0, when the server runs it)."""
    totals: dict[str, float] = {}
    for name, value in samples(text, _READ):
        if name == _STARTED:
            totals[STARTED] = max(value, totals.get(STARTED, value))
            continue
        if name.startswith(_SPEC_PREFIXES):
            totals[SPEC_SERIES] = totals.get(SPEC_SERIES, 0.0) + 1
        key = _WANTED.get(name)
        if key is not None:
            totals[key] = totals.get(key, 0.0) + value
    return totals


def endpoint_facts(server_info: Any, props: Any, metrics_text: Any) -> EngineFacts:
    """What the endpoints say was loaded: vLLM's or SGLang's ``/server_info`` (told apart by
    shape: vLLM's has ``vllm_config``), ``vllm:cache_config_info``, llama.cpp's ``/props``."""
    from proxy.engine import sources  # the parsers load with the first reading, not at import

    facts = sources.facts_from_cache_config_info(
        metrics_text if isinstance(metrics_text, str) else ""
    )
    if isinstance(server_info, dict):
        if "vllm_config" in server_info:
            facts = facts.merged(sources.facts_from_vllm_server_info(server_info))
        elif server_info:
            facts = facts.merged(sources.facts_from_sglang_server_info(server_info))
    if isinstance(props, dict) and isinstance(props.get("build_info"), str):
        facts = facts.merged(sources.facts_from_llama_props(props))
    return facts


def _speculative_of_server_info(info: Any) -> bool | None:
    """vLLM's ``/server_info``: ``vllm_config`` as JSON (``?config_format=json``) or as the
    config's text (older servers, which ignore the query)."""
    config = info.get("vllm_config") if isinstance(info, dict) else None
    if isinstance(config, dict) and "speculative_config" in config:
        return config["speculative_config"] is not None
    if isinstance(config, str):
        found = _SPEC_TEXT.search(config)
        if found is not None:
            return found.group(1) != "None"
    return None


def _speculative_of_props(props: Any) -> bool | None:
    """llama.cpp's ``/props``: ``speculative.types`` ("none", or the draft kinds it runs) in
    the default generation settings (newer builds nest them under ``params``). Older builds
    show only ``speculative.n_max`` and the like, the same with or without a draft model."""
    settings = props.get("default_generation_settings") if isinstance(props, dict) else None
    if not isinstance(settings, dict):
        return None
    params = settings.get("params")
    for source in (params, settings) if isinstance(params, dict) else (settings,):
        for key in ("speculative.types", "speculative.type"):
            types = source.get(key)
            if isinstance(types, str):
                return types.strip().lower() not in ("", "none")
    return None


def speculative(
    kind: str, server_info: Any, props: Any, metrics: Mapping[str, float]
) -> bool | None:
    """Whether the upstream runs speculative decoding, from what it says it runs."""
    for said in (_speculative_of_server_info(server_info), _speculative_of_props(props)):
        if said is not None:
            return said
    if metrics.get(SPEC_SERIES):
        return True
    if kind == "vllm" and metrics:
        return False  # vLLM's /metrics answered without any spec-decode series
    return None


def build(
    version: Any,
    models: Any,
    props: Any,
    metrics: Mapping[str, float],
    previous: Mapping[str, float] | None,
    server_info: Any = None,
    speculative_before: bool | None = None,
) -> Fingerprint:
    """One reading; ``speculative_before`` is the previous reading's flag, kept when this one
    cannot tell."""
    identity: dict[str, Any] = {}
    kind = "unknown"
    version_str = None
    if isinstance(version, dict) and isinstance(version.get("version"), str):
        kind, version_str = "vllm", version["version"]
    if isinstance(props, dict) and isinstance(props.get("build_info"), str):
        kind, version_str = "llama.cpp", props["build_info"]
        settings = props.get("default_generation_settings")
        identity["llama"] = {
            "total_slots": props.get("total_slots"),
            "model_file": str(props.get("model_path", "")).rsplit("/", 1)[-1],
            "model_ftype": props.get("model_ftype"),
            "n_ctx": settings.get("n_ctx") if isinstance(settings, dict) else None,
        }
    ids: list[str] = []
    limits: dict[str, Any] = {}
    data = models.get("data") if isinstance(models, dict) else None
    for entry in data if isinstance(data, list) else []:
        if isinstance(entry, dict) and isinstance(entry.get("id"), str):
            ids.append(entry["id"])
            if entry.get("max_model_len") is not None:
                limits[entry["id"]] = entry["max_model_len"]
    identity |= {
        "kind": kind,
        "version": version_str,
        "models": sorted(ids),
        "max_model_len": limits,
    }
    spec = speculative(kind, server_info, props, metrics)
    identity["speculative"] = speculative_before if spec is None else spec
    load = {k: metrics[k] for k in ("running", "waiting") if k in metrics}
    prev = previous or {}

    def delta(key: str) -> float:
        return metrics.get(key, 0.0) - prev.get(key, 0.0)

    if delta("cache_queries") > 0:
        load["prefix_cache_hit_ratio"] = delta("cache_hits") / delta("cache_queries")
    if delta("draft_tokens") > 0:
        load["spec_decode_acceptance_rate"] = delta("accepted") / delta("draft_tokens")
    if delta("drafts") > 0:
        load["spec_decode_mean_acceptance_length"] = 1 + delta("accepted") / delta("drafts")
    digest = xxhash.xxh3_64_hexdigest(orjson.dumps(identity, option=orjson.OPT_SORT_KEYS))
    return Fingerprint(kind, version_str, tuple(sorted(ids)), identity, load, digest, time.time())


# What a reading is worth. Only a complete one is an identity: a failed reading (nothing
# answers, or the server answers but says nothing of itself yet) is an outage, never a change.
COMPLETE, PARTIAL, NOT_READY, UNREACHABLE = "complete", "partial", "not_ready", "unreachable"
IDENTITY_PATHS = ("/version", "/v1/models", "/props")  # the endpoints that say what runs
# Answers that mean "not now": a gateway without its engine, a server still loading
# (llama-server answers every path 503 "Loading model" until its model is in).
TRANSIENT = frozenset({502, 503, 504})
CLOCK_SLACK_S = 1.0  # between the engine's clock and detproxy's
DOWN_INTERVAL_S = 2.0  # readings while the upstream is down, at most this far apart


@dataclass(frozen=True, slots=True)
class Answer:
    """One endpoint's answer. ``status`` None: no HTTP answer (``error`` says why: refused,
    reset, timed out). ``body``: a 200's JSON (its text, for /metrics), else None."""

    status: int | None
    body: Any = None
    error: str = ""

    @property
    def transient(self) -> bool:
        return self.status is None or self.status in TRANSIENT


def says_what_runs(path: str, body: Any) -> bool:
    """Whether an identity endpoint's body says something of what runs."""
    if not isinstance(body, dict):
        return False
    if path == "/version":
        return isinstance(body.get("version"), str)
    if path == "/v1/models":
        return isinstance(body.get("data"), list)
    return isinstance(body.get("build_info"), str)  # llama.cpp's /props


def _describe(answers: Mapping[str, Answer], paths: tuple[str, ...]) -> str:
    """The answers of ``paths`` in words, grouped: "HTTP 503 on /version, /props"."""
    groups: dict[str, list[str]] = {}
    for path in paths:
        answer = answers[path]
        what = (answer.error or "no answer") if answer.status is None else f"HTTP {answer.status}"
        groups.setdefault(what, []).append(path)
    return "; ".join(f"{what} on {', '.join(where)}" for what, where in groups.items())


def assess(answers: Mapping[str, Answer]) -> tuple[str, str]:
    """What a reading is worth, and why in words.

    ``complete``: at least one identity endpoint (``/version``, ``/v1/models``, ``/props``)
    answered 200 with a body that says what runs, and none of the others failed in a way
    that may pass (no answer, 502, 503, 504): an identity. ``partial``: some said, but one
    that may hold part of the identity did not answer this time (a timeout under load): not
    an identity, and no outage either. ``not_ready``: answers, none of them an identity (a
    server loading, a gateway without its engine, a URL with a wrong path): an outage.
    ``unreachable``: no HTTP answer at all (refused, reset, timed out): an outage.
    """
    said = [p for p in IDENTITY_PATHS if answers[p].status == 200]
    said = [p for p in said if says_what_runs(p, answers[p].body)]
    if all(answers[p].status is None for p in IDENTITY_PATHS):
        return UNREACHABLE, answers["/v1/models"].error or "no answer"
    if not said:
        return NOT_READY, _describe(answers, IDENTITY_PATHS)
    failed = tuple(p for p in IDENTITY_PATHS if answers[p].transient)
    if failed:
        return PARTIAL, _describe(answers, failed)
    return COMPLETE, ""


def _error(exc: UpstreamError, timeout_s: float | None) -> str:
    """A failed request in a few words (no stack, no repr of the client)."""
    if isinstance(exc, TimeoutError) or exc.kind == "timeout":
        return f"no answer within {timeout_s:g} s" if timeout_s else "timed out"
    if isinstance(exc, UpstreamFailure) and exc.kind == "refused":
        cause = exc.__cause__
        if cause is None or isinstance(cause, ConnectionRefusedError):
            return "connection refused"
        if isinstance(cause, OSError):
            return f"cannot connect ({cause.strerror or type(cause).__name__})"
        return f"cannot connect ({type(cause).__name__})"
    if isinstance(exc, UpstreamFailure):
        return "connection closed before an answer"
    return "answer cut short"


class FingerprintPoller:
    """Reads the upstream's fingerprint now and every ``interval_s``; publishes what it finds.

    A complete reading is an identity (``UpstreamFingerprinted``; ``changed`` when it differs
    from the last identity). A failed one starts an outage (``UpstreamUnreachable``, once);
    the last identity is kept across it. The same identity is a restart
    (``UpstreamRestarted``) when its ``process_start_time_seconds`` says that its process
    began after the last identity was read (vLLM's /metrics with one API server;
    llama-server and vLLM's multi-process metrics export none), else when it comes back
    after an outage; after an outage with an older process start time, the engine was only
    out of detproxy's reach. A new identity is a change, outage or not.
    """

    def __init__(
        self,
        upstream: Upstream,
        base_url: str,
        bus: EventBus,
        interval_s: float,
        timeout_s: float = 5.0,
        truth: EngineTruth | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        """``upstream``: the client of the engine at ``base_url`` (the URL it is named by,
        and whose credentials the reads carry); ``headers``: what else they carry."""
        self._upstream = upstream
        self._headers = url_auth(base_url) | dict(headers or {})
        self._truth = truth
        self._recipe: dict[str, Any] = {}  # the recipe's facts at the last identity
        self._salt = ""  # the recipe digest hashed in since its last move ("" before any)
        self._base = base_url.rstrip("/")
        self._shown = mask_url(self._base)  # as logged and shown in status
        self._bus = bus
        self._interval = interval_s
        self._timeout_s = timeout_s
        self.current: Fingerprint | None = None  # the last identity read (complete reading)
        self._counters: dict[str, float] | None = None
        self._started: float | None = None  # the current identity's process start time
        self.up: bool | None = None  # None until the first reading
        self.since = time.time()  # of the current state
        self.reason = ""  # why it is down
        self._outage = False  # since the last identity
        self.restarts = 0
        self.changes = 0
        self.outages = 0  # outages after the upstream was up (not the wait before it)
        self.read_at: float | None = None
        self.hint: str | None = None  # a URL that looks wrong, said once

    async def _get(self, path: str, as_json: bool = True) -> Answer:
        try:
            got = await get(self._upstream, path, self._timeout_s, self._headers)
        except UpstreamError as exc:
            error = _error(exc, self._timeout_s)
            log.debug("fingerprint: %s%s unavailable: %s", self._shown, path, error)
            return Answer(None, error=error)
        if got.status != 200:
            return Answer(got.status)
        body = got.body
        if not as_json:
            return Answer(200, body.decode("utf-8", "replace"))
        try:
            return Answer(200, orjson.loads(body))
        except orjson.JSONDecodeError:
            return Answer(200)

    async def poll(self) -> Fingerprint:
        """One reading; returns it when it is an identity, else the last identity (else the
        failed reading, kind "unknown", when none was ever read)."""
        paths = (*IDENTITY_PATHS, "/metrics", "/server_info?config_format=json")
        answers = dict(
            zip(
                paths,
                await asyncio.gather(
                    self._get("/version"),
                    self._get("/v1/models"),
                    self._get("/props"),
                    self._get("/metrics", as_json=False),
                    self._get(paths[4]),  # vLLM with VLLM_SERVER_DEV_MODE=1
                ),
                strict=True,
            )
        )
        metrics = answers["/metrics"].body
        counters = parse_metrics(metrics) if isinstance(metrics, str) else {}
        before = self.current.identity.get("speculative") if self.current else None
        bodies = [answers[p].body for p in (*IDENTITY_PATHS, paths[4])]
        fp = build(bodies[0], bodies[1], bodies[2], counters, self._counters, bodies[3], before)
        worth, reason = assess(answers)
        if self._truth is not None and worth in (COMPLETE, PARTIAL):
            self._truth.endpoints_read(endpoint_facts(bodies[3], bodies[2], metrics))
        now = self.read_at = time.time()
        await self._check_prefix(answers)
        if worth in (UNREACHABLE, NOT_READY):
            self._down(reason, now)
        elif worth == PARTIAL:
            log.debug("fingerprint: %s read in part (%s): identity kept", self._shown, reason)
        else:
            if counters:  # a reading without /metrics keeps the last one's for the deltas
                self._counters = counters
            return self._identified(fp, counters.get(STARTED), now)
        return self.current or fp

    def _down(self, reason: str, now: float) -> None:
        self._outage = True
        if self.up is False:
            return  # said when it started
        was_up = self.up is True
        self.up, self.since, self.reason = False, now, reason
        self._bus.publish(UpstreamUnreachable(reason, now, was_up))
        if was_up:
            self.outages += 1
            log.warning("upstream %s down: %s; waiting for it to answer", self._shown, reason)
        else:
            log.info("waiting for upstream %s: %s", self._shown, reason)

    def _with_recipe(self, fp: Fingerprint) -> tuple[Fingerprint, list[str]]:
        """The reading with the recipe's digest in its identity, and the facts that moved
        since the last identity (see the module's docstring)."""
        truth = self._truth
        if truth is None:
            return fp, []
        values = dict(truth.said.values)
        recipe = truth.digest()
        from proxy.engine.follow import moved  # the parsers load with the first reading

        shifted = moved(self._recipe, values)
        self._recipe = {**self._recipe, **{k: v for k, v in values.items() if v is not None}}
        if shifted:
            self._recipe = {k: v for k, v in values.items() if v is not None}
            self._salt = recipe or ""
        digest = fp.fingerprint
        if self._salt:
            digest = xxhash.xxh3_64_hexdigest(f"{fp.fingerprint}:{self._salt}".encode())
        return replace(fp, identity={**fp.identity, "recipe": recipe}, fingerprint=digest), shifted

    def _identified(self, fp: Fingerprint, started: float | None, now: float) -> Fingerprint:
        fp, shifted = self._with_recipe(fp)
        if shifted:
            log.warning("upstream recipe moved: %s", ", ".join(shifted))
        previous, self.current = self.current, fp
        was_down = self.up is False
        down_s = now - self.since if was_down else None
        changed = previous is not None and previous.fingerprint != fp.fingerprint
        restart = None
        if previous is not None and not changed:
            if started is not None and self._started is not None:
                # A process that began after the last identity was read. (Behind a load
                # balancer the readings alternate between processes started long ago.)
                # One process reports one start time, to the hundredth of a second (Linux
                # jiffies); two processes started apart differ.
                moved = abs(started - self._started) >= 0.01
                if moved and started > previous.read_at - CLOCK_SLACK_S:
                    restart = "process_start_time"
            elif self._outage:
                restart = "outage"
        if started is not None or changed or restart:
            self._started = started  # else kept: this reading could not read /metrics
        if self.up is not True:
            self.up, self.since, self.reason = True, now, ""
        outage, self._outage = self._outage, False
        after = f" after {down_s:.0f} s down" if down_s is not None else ""
        if changed:
            self.changes += 1
        elif restart:
            self.restarts += 1
        self._bus.publish(UpstreamFingerprinted(fp, previous, changed))
        if changed:
            log.warning(
                "upstream changed%s: %s -> %s",
                after,
                previous.summary() if previous else None,
                fp.summary(),
            )
        elif restart:
            self._bus.publish(UpstreamRestarted(fp, down_s, restart))
            how = after or " with a new process start time"
            version = f" {fp.version}" if fp.version else ""
            log.warning(
                "upstream %s restarted: the same identity (%s%s) back%s",
                self._shown,
                fp.kind,
                version,
                how,
            )
        elif outage and previous is not None:
            log.warning(
                "upstream %s answers again%s, the same process (not restarted)", self._shown, after
            )
        elif was_down:
            log.debug("upstream %s answers%s", self._shown, after)
        return fp

    async def _check_prefix(self, answers: Mapping[str, Answer]) -> None:
        """A URL with the API's prefix in it (``http://host:8000/v1``, the openai SDK's base
        URL): detproxy asks ``<url>/v1/models``, which is 404, while ``<url>/models`` answers.
        Said once, in the log and in ``state()``."""
        if self.hint is not None or answers["/v1/models"].status != 404:
            return
        path = URL(self._base).path.rstrip("/")
        if not path:
            return
        alt = await self._get("/models")
        if alt.status == 200 and says_what_runs("/v1/models", alt.body):
            root = mask_url(self._base[: self._base.rstrip("/").rfind("/")])
            self.hint = (
                f"upstream URL {self._shown} looks like an API base URL: {self._shown}/models"
                f" answers but {self._shown}/v1/models is 404; detproxy adds /v1/... itself:"
                f" use {root}"
            )
            log.warning("%s", self.hint)

    def state(self) -> dict[str, Any]:
        """For /detproxy/status: up or down since when, why, and what was counted."""
        if self.up is None:
            state = "unknown"  # not read yet
        elif self.up:
            state = "up"
        else:
            state = "down" if self.current is not None else "waiting"
        return {
            "state": state,
            "since": self.since,
            "reason": self.reason or None,
            "last_reading_at": self.read_at,
            "changes": self.changes,
            "restarts": self.restarts,
            "outages": self.outages,
            "hint": self.hint,
        }

    async def run(self) -> None:
        while True:
            try:
                await self.poll()
            except Exception:  # a reading that fails must not stop the next one
                log.exception("fingerprint poll failed")
            # While it is down (or not up yet), read it more often: it is back, and up,
            # within seconds rather than a whole interval.
            down = self.up is not True
            await asyncio.sleep(min(self._interval, DOWN_INTERVAL_S) if down else self._interval)
