"""What runs behind detproxy: the upstream's own account of itself, read at start and
periodically.

vLLM: ``/version``, ``/v1/models`` (ids, ``max_model_len``), ``/metrics`` (speculative
decoding counters, prefix cache hits, running and waiting requests) and, in its dev mode,
``/server_info`` (its config). llama.cpp's server: ``/props`` (build, slots, model file,
context, speculative types) and its ``llamacpp:*`` metrics. Whatever an upstream lacks is
simply absent. The identity fields (not the load) hash to a short fingerprint; a new
fingerprint under the same detproxy is a redeploy or a silent change.

``speculative`` is what the server says it runs, never what its counters have counted so far
(a fresh server has drafted nothing): vLLM's ``/server_info`` (``speculative_config``) where it
answers, llama.cpp's ``speculative.types`` in ``/props``, else whether vLLM exports any
``vllm:spec_decode_*`` series (it does, at 0, from its start exactly when speculative decoding
is configured). ``None`` when nothing says; a reading that cannot tell (``/metrics`` did not
answer) keeps the previous reading's value.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Mapping
from typing import Any

import aiohttp
import orjson
import xxhash

from proxy.engine.identity import Fingerprint
from proxy.engine.promtext import samples
from proxy.events import EventBus, UpstreamFingerprinted

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
_WANTED = {name: key for key, names in _COUNTERS.items() for name in names}
_READ = (*_WANTED, *_SPEC_PREFIXES)  # the lines parse_metrics looks at
_SPEC_TEXT = re.compile(r"speculative_config=([A-Za-z_]\w*)")


def parse_metrics(text: str) -> dict[str, float]:
    """Sum each metric of interest over its label sets; ``SPEC_SERIES`` counts the samples of
    speculative-decoding series (present, even at 0, when the server runs it)."""
    totals: dict[str, float] = {}
    for name, value in samples(text, _READ):
        if name.startswith(_SPEC_PREFIXES):
            totals[SPEC_SERIES] = totals.get(SPEC_SERIES, 0.0) + 1
        key = _WANTED.get(name)
        if key is not None:
            totals[key] = totals.get(key, 0.0) + value
    return totals


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


class FingerprintPoller:
    """Reads the upstream's fingerprint now and every ``interval_s``; publishes each reading."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        base_url: str,
        bus: EventBus,
        interval_s: float,
        timeout_s: float = 5.0,
    ) -> None:
        self._session = session
        self._base = base_url.rstrip("/")
        self._bus = bus
        self._interval = interval_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.current: Fingerprint | None = None
        self._counters: dict[str, float] | None = None

    async def _get(self, path: str, as_json: bool = True) -> Any:
        try:
            async with self._session.get(self._base + path, timeout=self._timeout) as resp:
                if resp.status != 200:
                    return None
                body = await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.debug("fingerprint: %s%s unavailable: %r", self._base, path, exc)
            return None
        if not as_json:
            return body.decode("utf-8", "replace")
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError:
            return None

    async def poll(self) -> Fingerprint:
        version, models, props, metrics, server_info = await asyncio.gather(
            self._get("/version"),
            self._get("/v1/models"),
            self._get("/props"),
            self._get("/metrics", as_json=False),
            self._get("/server_info?config_format=json"),  # vLLM with VLLM_SERVER_DEV_MODE=1
        )
        counters = parse_metrics(metrics) if isinstance(metrics, str) else {}
        before = self.current.identity.get("speculative") if self.current else None
        fp = build(version, models, props, counters, self._counters, server_info, before)
        self._counters = counters
        previous, self.current = self.current, fp
        changed = previous is not None and previous.fingerprint != fp.fingerprint
        self._bus.publish(UpstreamFingerprinted(fp, previous, changed))
        if changed:
            log.warning(
                "upstream changed: %s -> %s", previous.summary() if previous else None, fp.summary()
            )
        return fp

    async def run(self) -> None:
        while True:
            try:
                await self.poll()
            except Exception:  # a reading that fails must not stop the next one
                log.exception("fingerprint poll failed")
            await asyncio.sleep(self._interval)
