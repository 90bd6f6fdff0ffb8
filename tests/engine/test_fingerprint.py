"""What runs behind detproxy: read, exported, stamped on incidents, and changes counted;
outages and restarts told apart from changes."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from prometheus_client import CollectorRegistry

from proxy.engine.fingerprint import (
    COMPLETE,
    DOWN_INTERVAL_S,
    NOT_READY,
    PARTIAL,
    UNREACHABLE,
    Answer,
    FingerprintPoller,
    assess,
    build,
    parse_metrics,
)
from proxy.events import EventBus, UpstreamFingerprinted, UpstreamRestarted, UpstreamUnreachable
from proxy.http.errors import UpstreamFailure
from proxy.http.h1 import H1Upstream
from proxy.http.upstream import get
from proxy.testing import MockUpstream, Received, Reply, not_found
from proxy.tools.emulator import EmulatorConfig, EmulatorServer
from tests.helpers.metrics import metric
from tests.helpers.processes import free_port
from tests.helpers.upstreams import MOCK_URL
from tests.helpers.waiting import eventually

VLLM_METRICS = """# HELP vllm:num_requests_running x
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:spec_decode_num_drafts_total{engine="0"} 10.0
vllm:spec_decode_num_draft_tokens_total{engine="0"} 30.0
vllm:spec_decode_num_accepted_tokens_total{engine="0"} 24.0
vllm:prefix_cache_queries_total{engine="0"} 1000.0
vllm:prefix_cache_hits_total{engine="0"} 250.0
"""


def test_vllm_reading_and_what_it_implies() -> None:
    counters = parse_metrics(VLLM_METRICS)
    assert counters["running"] == 5.0 and counters["waiting"] == 1.0
    fp = build(
        {"version": "0.17.1"},
        {"data": [{"id": "m", "max_model_len": 32768}, {"id": "m-lora"}]},
        None,
        counters,
        None,
    )
    assert (fp.kind, fp.version, fp.models) == ("vllm", "0.17.1", ("m", "m-lora"))
    assert fp.identity["speculative"] is True and fp.identity["max_model_len"] == {"m": 32768}
    assert fp.load["spec_decode_acceptance_rate"] == 0.8
    assert fp.load["spec_decode_mean_acceptance_length"] == 3.4  # 1 + 24 / 10
    assert fp.load["prefix_cache_hit_ratio"] == 0.25
    # The load moves, the identity does not: the same fingerprint.
    later = build(
        {"version": "0.17.1"},
        {"data": [{"id": "m", "max_model_len": 32768}, {"id": "m-lora"}]},
        None,
        counters | {"running": 0.0},
        counters,
    )
    assert later.fingerprint == fp.fingerprint and "prefix_cache_hit_ratio" not in later.load
    other = build(
        {"version": "0.18.0"}, {"data": [{"id": "m", "max_model_len": 32768}]}, None, counters, None
    )
    assert other.fingerprint != fp.fingerprint


MODELS = {"data": [{"id": "m", "max_model_len": 32768}]}
# A fresh vLLM started with --speculative-config: its spec-decode series exist, at 0.
FRESH_SPECULATIVE = """vllm:num_requests_running{engine="0",model_name="m"} 0.0
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 0.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 0.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 0.0
"""
PLAIN = 'vllm:num_requests_running{engine="0",model_name="m"} 0.0\n'


def test_speculative_is_what_the_server_runs_not_whether_it_drafted_yet() -> None:
    fresh = build({"version": "0.23.0"}, MODELS, None, parse_metrics(FRESH_SPECULATIVE), None)
    assert fresh.identity["speculative"] is True
    drafted = parse_metrics(FRESH_SPECULATIVE.replace(" 0.0\nvllm:spec", " 7.0\nvllm:spec"))
    later = build({"version": "0.23.0"}, MODELS, None, drafted, parse_metrics(FRESH_SPECULATIVE))
    assert later.fingerprint == fresh.fingerprint  # the first draft is no upstream change
    plain = build({"version": "0.23.0"}, MODELS, None, parse_metrics(PLAIN), None)
    assert plain.identity["speculative"] is False  # no spec-decode series: none configured
    assert plain.fingerprint != fresh.fingerprint


def test_vllm_server_info_says_what_runs() -> None:
    """/server_info (vLLM's dev mode): its vllm_config, as JSON or as the config's text."""
    on = {"vllm_config": {"model": "m", "speculative_config": {"method": "ngram"}}}
    off = {"vllm_config": {"model": "m", "speculative_config": None}}
    text_on = {"vllm_config": "model='m', speculative_config=SpeculativeConfig(method='eagle')"}
    text_off = {"vllm_config": "model='m', speculative_config=None, tokenizer='m'"}
    version = {"version": "0.23.0"}
    for info, expected in ((on, True), (off, False), (text_on, True), (text_off, False)):
        # It wins over the metrics, which a server may not have exported yet.
        fp = build(version, MODELS, None, {}, None, server_info=info)
        assert fp.identity["speculative"] is expected, info
        with_metrics = build(version, MODELS, None, parse_metrics(PLAIN), None, server_info=info)
        assert with_metrics.fingerprint == fp.fingerprint


def test_llama_cpp_props_say_whether_it_drafts() -> None:
    def props(params: dict[str, Any]) -> dict[str, Any]:
        settings = {"n_ctx": 4096, "params": params}
        return {"build_info": "b7000", "default_generation_settings": settings}

    metrics = {"running": 0.0}  # llama-server exports no spec-decode series
    draft = build(None, None, props({"speculative.types": "draft"}), metrics, None)
    assert draft.identity["speculative"] is True
    none = build(None, None, props({"speculative.types": "none"}), metrics, None)
    assert none.identity["speculative"] is False
    # Older builds list only n_max/n_min/p_min, the same with or without a draft model.
    older = props({"speculative.n_max": 16, "speculative.n_min": 0})
    assert build(None, None, older, metrics, None).identity["speculative"] is None


async def test_a_fresh_speculative_vllm_reads_the_same_before_and_after_its_first_draft() -> None:
    state = {"drafts": 0, "metrics_up": True}

    def metrics(request: Received) -> Reply:
        if not state["metrics_up"]:
            return Reply(503)
        n = state["drafts"]
        return Reply.text(FRESH_SPECULATIVE.replace(" 0.0\nvllm:spec", f" {n}.0\nvllm:spec"))

    engine = MockUpstream(
        routes={
            "/version": Reply.json({"version": "0.23.0"}),
            "/v1/models": Reply.json(MODELS),
            "/metrics": metrics,
        }
    )
    bus = EventBus()
    readings: list[UpstreamFingerprinted] = []
    bus.subscribe(UpstreamFingerprinted, readings.append)
    poller = FingerprintPoller(engine, "http://engine", bus, interval_s=0)
    first = await poller.poll()
    state["drafts"] = 12  # the first requests drafted
    await poller.poll()
    state["metrics_up"] = False  # a reading without /metrics knows nothing new
    await poller.poll()
    assert first.identity["speculative"] is True
    assert [r.changed for r in readings] == [False, False, False]
    assert readings[-1].fingerprint.fingerprint == first.fingerprint


def test_llama_cpp_reading() -> None:
    props = {
        "build_info": "b1-0c1e570",
        "total_slots": 4,
        "model_ftype": "Q4_1",
        "model_path": "/models/SmolLM2.gguf",
        "default_generation_settings": {"n_ctx": 4096},
    }
    fp = build(None, {"data": [{"id": "smollm2"}]}, props, {"running": 1.0}, None)
    assert (fp.kind, fp.version) == ("llama.cpp", "b1-0c1e570")
    assert fp.identity["llama"] == {
        "total_slots": 4,
        "model_file": "SmolLM2.gguf",
        "model_ftype": "Q4_1",
        "n_ctx": 4096,
    }
    assert build(None, None, None, {}, None).kind == "unknown"


async def test_exported_stamped_and_changes_counted(
    make_proxy: Any, mock_upstream: MockUpstream, registry: CollectorRegistry
) -> None:
    state = {"version": "0.16.0"}
    mock_upstream.on("/version", lambda request: Reply.json({"version": state["version"]}))
    models = {"object": "list", "data": [{"id": "m", "max_model_len": 8}]}
    mock_upstream.on("/v1/models", Reply.json(models))
    answer = {"choices": [{"index": 0, "finish_reason": "stop", "message": {"content": "x"}}]}
    mock_upstream.on("/v1/chat/completions", Reply.json(answer))
    client = await make_proxy(
        MOCK_URL, upstream=mock_upstream, env={"DETPROXY_UPSTREAM__FINGERPRINT_INTERVAL_S": "0.05"}
    )
    await eventually(lambda: fingerprint(client), what="the upstream's fingerprint read")
    labels = {"kind": "vllm", "version": "0.16.0", "model": "m"}
    text = await (await client.get("/detproxy/metrics")).text()
    assert 'detproxy_upstream_info{fingerprint="' in text and 'version="0.16.0"' in text
    assert metric(registry, "detproxy_upstream_changes_total") == 0
    body = {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": "q"}]}
    await client.post("/v1/chat/completions", json=body)
    state["version"] = "0.17.1"  # a redeploy under traffic
    await eventually(
        lambda: metric(registry, "detproxy_upstream_changes_total"), what="the redeploy read"
    )
    await client.post("/v1/chat/completions", json=body | {"temperature": 0.0, "n": 1})
    assert metric(registry, "detproxy_upstream_changes_total") == 1
    text = await (await client.get("/detproxy/metrics")).text()
    assert 'version="0.17.1"' in text and 'version="0.16.0"' not in text
    incidents = await (await client.get("/detproxy/incidents")).json()
    change = next(i for i in incidents if i["kind"] == "upstream_change")
    assert (change["before"]["version"], change["after"]["version"]) == ("0.16.0", "0.17.1")
    status = await (await client.get("/detproxy/status")).json()
    assert status["upstream_fingerprint"]["version"] == "0.17.1"
    assert labels["model"] in status["upstream_fingerprint"]["models"]


async def fingerprint(client: TestClient[Any, Any]) -> dict[str, Any] | None:
    status = await (await client.get("/detproxy/status")).json()
    return status["upstream_fingerprint"]  # type: ignore[no-any-return]


async def test_the_emulator_reads_as_vllm(make_proxy: Any, registry: CollectorRegistry) -> None:
    async with EmulatorServer(EmulatorConfig(version="0.15.1")) as emu:
        client = await make_proxy(emu.url)
        fp = await eventually(lambda: fingerprint(client), what="the upstream's fingerprint read")
        assert (fp["kind"], fp["version"], fp["models"]) == ("vllm", "0.15.1", ["emulator-model"])
        assert fp["load"]["running"] == 0.0
        # Incidents carry the configuration that produced them.
        body = {
            "model": "emulator-model",
            "temperature": 0,
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "twice"}],
        }
        await client.post("/v1/chat/completions", json=body)
        await client.post(
            "/v1/chat/completions",
            json=body,
            headers={"X-Emulator-Knobs": '{"logprob_jitter_probability": 1}'},
        )
        await client.post(
            "/v1/chat/completions",
            json=body | {"logprobs": True},
            headers={"X-Emulator-Knobs": '{"flip_probability": 1}'},
        )
        await client.post("/v1/chat/completions", json=body | {"logprobs": True})

        async def recorded() -> list[dict[str, Any]]:
            return list(await (await client.get("/detproxy/incidents")).json())

        incidents = await eventually(recorded, what="incidents recorded")
        assert all(i["upstream"]["version"] == "0.15.1" for i in incidents)


# --------------------------------------------------------------------- outages and restarts

FAST = {"DETPROXY_UPSTREAM__FINGERPRINT_INTERVAL_S": "0.05"}


async def upstream_state(client: TestClient[Any, Any]) -> dict[str, Any]:
    state: dict[str, Any] = (await (await client.get("/detproxy/status")).json())["upstream_state"]
    return state


async def reach(client: TestClient[Any, Any], state: str, restarts: int = 0) -> dict[str, Any]:
    async def check() -> dict[str, Any] | None:
        now = await upstream_state(client)
        return now if now["state"] == state and now["restarts"] >= restarts else None

    reached: dict[str, Any] = await eventually(check, what=f"upstream state {state!r}")
    return reached


async def more_readings(client: TestClient[Any, Any], state: dict[str, Any], n: int = 3) -> None:
    """Until the poller has read the upstream ``n`` more times after ``state``."""
    seen = state["last_reading_at"]
    for _ in range(n):

        async def later(after: float = seen) -> float | None:
            at = (await upstream_state(client))["last_reading_at"]
            return at if at > after else None

        seen = await eventually(later, what="another reading")


def counts(registry: CollectorRegistry) -> tuple[float, float, float | None]:
    """(changes, restarts, up) as exported."""
    return (
        metric(registry, "detproxy_upstream_changes_total"),
        metric(registry, "detproxy_upstream_restarts_total"),
        registry.get_sample_value("detproxy_upstream_up"),
    )


async def upstream_incidents(client: TestClient[Any, Any]) -> list[str]:
    incidents = await (await client.get("/detproxy/incidents")).json()
    return [i["kind"] for i in incidents if i["kind"].startswith("upstream")]


async def test_detproxy_started_before_its_engine_counts_no_change(
    make_proxy: Any, registry: CollectorRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    """The sidecar layout: detproxy up first, the engine on its port minutes later."""
    caplog.set_level(logging.INFO, "proxy.engine.fingerprint")
    port = free_port()
    client = await make_proxy(f"http://127.0.0.1:{port}", env=FAST)
    waiting = await reach(client, "waiting")
    assert waiting["reason"] == "connection refused", waiting
    assert counts(registry) == (0, 0, 0), "nothing answers: the upstream is down, not changed"
    status = await (await client.get("/detproxy/status")).json()
    assert status["upstream_fingerprint"] is None, "a failed reading is no identity"
    async with EmulatorServer(EmulatorConfig(version="0.23.0"), port=port):
        up = await reach(client, "up")
        await more_readings(client, up)
        assert counts(registry) == (0, 0, 1), f"the engine coming up is no change: {up}"
        assert await upstream_incidents(client) == []
        status = await (await client.get("/detproxy/status")).json()
        assert status["upstream_fingerprint"]["kind"] == "vllm"
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert said == [f"waiting for upstream http://127.0.0.1:{port}: connection refused"], said


async def test_an_engine_restarted_on_its_port_is_a_restart_not_a_change(
    make_proxy: Any, registry: CollectorRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    port = free_port()
    async with EmulatorServer(EmulatorConfig(version="0.23.0"), port=port):
        client = await make_proxy(f"http://127.0.0.1:{port}", env=FAST)
        await reach(client, "up")
    caplog.set_level(logging.INFO, "proxy.engine.fingerprint")
    down = await reach(client, "down")
    assert counts(registry) == (0, 0, 0), f"down is no change: {down}"
    async with EmulatorServer(EmulatorConfig(version="0.23.0"), port=port):
        state = await reach(client, "up", restarts=1)
        await more_readings(client, state)
        assert counts(registry) == (0, 1, 1), f"one restart, no change: {state}"
        assert (state["changes"], state["restarts"], state["outages"]) == (0, 1, 1)
        assert await upstream_incidents(client) == ["upstream_restart"]
    said = [r.getMessage() for r in caplog.records if r.name == "proxy.engine.fingerprint"]
    assert len(said) == 2, f"one line when it goes down, one when it is back: {said}"
    assert said[0].startswith(f"upstream http://127.0.0.1:{port} down: ")
    assert said[1].startswith(
        f"upstream http://127.0.0.1:{port} restarted: the same identity (vllm 0.23.0) back after "
    ), said[1]


async def test_an_engine_restarted_between_two_readings_is_a_restart(
    make_proxy: Any, registry: CollectorRegistry
) -> None:
    """No reading fell in the outage: the engine's process start time (vLLM's /metrics, and the
    emulator's like it) still tells the restart."""
    port = free_port()
    config = EmulatorConfig(version="0.23.0")
    async with EmulatorServer(config, port=port) as first:
        metrics = await get(H1Upstream(first.url), "/metrics", 5.0)
        assert b"\nprocess_start_time_seconds " in metrics.body
        client = await make_proxy(
            f"http://127.0.0.1:{port}", env={"DETPROXY_UPSTREAM__FINGERPRINT_INTERVAL_S": "1"}
        )
        await more_readings(client, await reach(client, "up"), n=1)
    async with EmulatorServer(config, port=port):
        state = await reach(client, "up", restarts=1)
        assert counts(registry) == (0, 1, 1), f"one restart, no change: {state}"


async def test_another_engine_after_an_outage_is_a_change(
    make_proxy: Any, registry: CollectorRegistry
) -> None:
    port = free_port()
    async with EmulatorServer(EmulatorConfig(models=("model-a",)), port=port):
        client = await make_proxy(f"http://127.0.0.1:{port}", env=FAST)
        await reach(client, "up")
    await reach(client, "down")
    async with EmulatorServer(EmulatorConfig(models=("model-b",)), port=port):

        async def changed() -> dict[str, Any] | None:
            state = await upstream_state(client)
            return state if state["changes"] else None

        state = await eventually(changed, what="a change")
        assert state["state"] == "up" and state["restarts"] == 0, state
        assert counts(registry) == (1, 0, 1)
        incidents = await (await client.get("/detproxy/incidents")).json()
        change = next(i for i in incidents if i["kind"] == "upstream_change")
        assert (change["before"]["models"], change["after"]["models"]) == (
            ["model-a"],
            ["model-b"],
        )


async def test_another_engine_between_two_readings_is_a_change() -> None:
    """No outage seen (the engine swapped between two readings): still one change."""
    port = free_port()
    bus = EventBus()
    seen: list[object] = []
    for kind in (UpstreamFingerprinted, UpstreamRestarted, UpstreamUnreachable):
        bus.subscribe(kind, seen.append)
    url = f"http://127.0.0.1:{port}"
    poller = FingerprintPoller(H1Upstream(url), url, bus, interval_s=0)
    async with EmulatorServer(EmulatorConfig(models=("model-a",)), port=port):
        first = await poller.poll()
    async with EmulatorServer(EmulatorConfig(models=("model-b",)), port=port):
        second = await poller.poll()
        again = await poller.poll()
    assert (first.models, second.models) == (("model-a",), ("model-b",))
    kinds = [(type(e).__name__, getattr(e, "changed", None)) for e in seen]
    fingerprinted = "UpstreamFingerprinted"
    assert kinds == [(fingerprinted, False), (fingerprinted, True), (fingerprinted, False)], kinds
    assert again.fingerprint == second.fingerprint
    assert (poller.changes, poller.restarts, poller.outages) == (1, 0, 0)


def _engine(state: dict[str, Any]) -> MockUpstream:
    """A vLLM-shaped upstream whose answers a test moves: ``status`` answers every path with
    that code (a gateway without its engine, a server loading), ``props`` the same for /props
    alone, ``started`` its process start time (vLLM's /metrics)."""
    answers = {
        "/version": Reply.json({"version": "0.23.0"}),
        "/v1/models": Reply.json(MODELS),
        "/props": Reply.json({}, 404),
    }

    def handle(request: Received) -> Reply:
        path = request.path
        if path not in (*answers, "/metrics"):
            return not_found(request)
        status = state.get("status") or (state.get("props") if path == "/props" else None)
        if status:
            return Reply.json({"error": "x"}, status)
        if path == "/metrics":
            return Reply.text(f"{PLAIN}process_start_time_seconds {state['started']}\n")
        return answers[path]

    return MockUpstream(handle)


async def test_the_process_start_time_tells_a_restart_from_a_blip() -> None:
    state: dict[str, Any] = {"started": time.time() - 3600}
    engine = _engine(state)
    bus = EventBus()
    restarts: list[UpstreamRestarted] = []
    bus.subscribe(UpstreamRestarted, restarts.append)
    poller = FingerprintPoller(engine, "http://engine", bus, interval_s=0)
    await poller.poll()
    state["status"] = 502  # the gateway lost its engine for a moment
    await poller.poll()
    assert poller.state()["state"] == "down"
    state["status"] = None  # the same process behind it
    await poller.poll()
    assert (poller.up, poller.restarts, restarts) == (True, 0, []), "a blip, no restart"
    state["started"] = time.time()  # restarted between two readings: no outage seen
    await poller.poll()
    await poller.poll()
    assert [(r.evidence, r.down_s) for r in restarts] == [("process_start_time", None)]
    assert (poller.changes, poller.restarts, poller.outages) == (0, 1, 1)


async def test_engines_behind_a_load_balancer_are_not_restarts() -> None:
    """One URL, several engines of one identity (a Service): the readings alternate between
    processes started long ago; none of them is a restart."""
    begun = time.time() - 3600
    state: dict[str, Any] = {"started": begun}
    engine = _engine(state)
    poller = FingerprintPoller(engine, "http://engine", EventBus(), interval_s=0)
    for i in range(6):
        state["started"] = begun + 100 * (i % 3)  # three pods in turn
        await poller.poll()
    assert (poller.changes, poller.restarts, poller.outages) == (0, 0, 0)


async def test_a_server_still_loading_is_not_an_identity() -> None:
    """llama-server answers 503 "Loading model" until its model is in; a server some of whose
    identity endpoints do not answer yet is read in part: neither is an identity."""
    state: dict[str, Any] = {"started": 1.0, "status": 503}
    engine = _engine(state)
    bus = EventBus()
    readings: list[UpstreamFingerprinted] = []
    bus.subscribe(UpstreamFingerprinted, readings.append)
    poller = FingerprintPoller(engine, "http://engine", bus, interval_s=0)
    await poller.poll()
    assert poller.state()["state"] == "waiting", poller.state()
    assert poller.state()["reason"] == "HTTP 503 on /version, /v1/models, /props"
    state.update(status=None, props=503)  # /version and /v1/models answer, /props not yet
    await poller.poll()
    assert (poller.state()["state"], readings) == ("waiting", []), "a part is no identity"
    state["props"] = None  # /props answers its 404: this server has none
    await poller.poll()
    state["props"] = 504  # and a later reading in part keeps the identity
    kept = await poller.poll()
    assert [r.changed for r in readings] == [False] and poller.up is True
    assert kept.fingerprint == readings[0].fingerprint.fingerprint
    assert (poller.changes, poller.restarts, poller.outages) == (0, 0, 0)


def test_what_a_reading_is_worth() -> None:
    version, models = Answer(200, {"version": "0.23.0"}), Answer(200, MODELS)
    refused = Answer(None, error="connection refused")
    absent, loading = Answer(404), Answer(503)

    def worth(v: Answer, m: Answer, p: Answer) -> str:
        return assess({"/version": v, "/v1/models": m, "/props": p})[0]

    assert worth(refused, refused, refused) == UNREACHABLE
    assert worth(loading, loading, loading) == NOT_READY
    assert worth(absent, absent, absent) == NOT_READY  # answers, none says what runs
    assert worth(Answer(200, "<html>"), absent, absent) == NOT_READY
    assert worth(version, models, absent) == COMPLETE  # vLLM
    assert worth(absent, models, Answer(200, {"build_info": "b1"})) == COMPLETE  # llama.cpp
    assert worth(version, refused, absent) == PARTIAL  # /v1/models timed out this time
    assert worth(absent, models, loading) == PARTIAL


# ------------------------------------------------------------------ a URL with /v1 in it


async def test_an_api_base_url_is_named_once(caplog: pytest.LogCaptureFixture) -> None:
    """The openai SDK's base URL given as the upstream: /v1/v1/models is 404, /v1/models
    answers; the poller says which URL to use, once."""
    caplog.set_level(logging.WARNING, "proxy.engine.fingerprint")
    async with EmulatorServer(EmulatorConfig()) as emu:
        url = emu.url + "/v1"
        poller = FingerprintPoller(H1Upstream(url), url, EventBus(), interval_s=0)
        for _ in range(3):
            await poller.poll()
    state = poller.state()
    assert state["state"] == "waiting", state  # nothing says what runs at that URL
    expected = (
        f"upstream URL {emu.url}/v1 looks like an API base URL: {emu.url}/v1/models answers"
        f" but {emu.url}/v1/v1/models is 404; detproxy adds /v1/... itself: use {emu.url}"
    )
    assert state["hint"] == expected
    assert [r.getMessage() for r in caplog.records] == [expected], "said once"


async def test_a_prefixed_url_is_named_in_the_status(
    make_proxy: Any, mock_upstream: MockUpstream
) -> None:
    """A gateway path that holds the API's prefix (here /api: /api/models answers; the mock
    is the client of that URL, so it is asked for /models)."""
    mock_upstream.on("/models", Reply.json(MODELS))
    client = await make_proxy(MOCK_URL + "/api", upstream=mock_upstream, env=FAST)

    async def hint() -> str | None:
        said: str | None = (await upstream_state(client))["hint"]
        return said

    said = await eventually(hint, what="a hint in the status")
    assert f"detproxy adds /v1/... itself: use {MOCK_URL}" in said, said
    assert not said.endswith("/api"), said


async def test_an_engine_that_answers_has_no_hint(emulator: EmulatorServer) -> None:
    poller = FingerprintPoller(H1Upstream(emulator.url), emulator.url, EventBus(), interval_s=0)
    await poller.poll()
    assert poller.state()["hint"] is None and poller.state()["state"] == "up"


async def test_an_upstream_not_up_yet_is_read_again_within_seconds() -> None:
    """The interval is for an upstream that is up; one that is not is read every few seconds,
    so that it is known up (and its restarts seen) soon after it answers."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    poller = FingerprintPoller(H1Upstream(url), url, EventBus(), 3600)
    task = asyncio.create_task(poller.run())
    try:

        async def read(state: str) -> bool:
            return bool(poller.state()["state"] == state)

        await eventually(lambda: read("waiting"), what="the first reading")
        async with EmulatorServer(EmulatorConfig(version="0.23.0"), port=port):
            up_within = DOWN_INTERVAL_S + 3
            await eventually(lambda: read("up"), timeout_s=up_within, what="up within seconds")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


# --------------------------------------------------------------------- the recipe


def test_server_info_is_told_apart_by_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    """One URL, two engines: vLLM's /server_info has ``vllm_config``; SGLang's is its server
    arguments."""
    from proxy.engine import sources
    from proxy.engine.facts import EngineFacts
    from proxy.engine.fingerprint import endpoint_facts

    def said(name: str) -> Callable[[Any], EngineFacts]:
        return lambda _: EngineFacts({name: True}, {name: name}, (), (), (), False)

    for name in ("vllm", "sglang", "llama"):
        attr = {"vllm": "vllm_server_info", "sglang": "sglang_server_info", "llama": "llama_props"}
        monkeypatch.setattr(sources, f"facts_from_{attr[name]}", said(name))
    monkeypatch.setattr(sources, "facts_from_cache_config_info", said("cache"))
    vllm = endpoint_facts({"vllm_config": {}, "vllm_env": {}}, None, "")
    sglang = endpoint_facts({"attention_backend": "fa3", "disable_radix_cache": False}, None, "")
    llama = endpoint_facts(None, {"build_info": "b1-x"}, None)
    assert {k for k, v in vllm.values.items() if v} == {"cache", "vllm"}, vllm
    assert {k for k, v in sglang.values.items() if v} == {"cache", "sglang"}, sglang
    assert {k for k, v in llama.values.items() if v} == {"cache", "llama"}, llama


# --------------------------------------------------------------------- through the seam


async def test_readings_go_through_the_upstream_seam_with_the_urls_credentials(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The poller asks its engine through the client it is given (the app's upstream), with the
    URL's credentials as an HTTP client sends them; logs and state show the URL masked."""
    caplog.set_level(logging.INFO, "proxy.engine.fingerprint")
    engine = MockUpstream(routes={"/version": Reply.json({"version": "0.23.0"})})
    engine.on("/v1/models", Reply.json(MODELS))
    poller = FingerprintPoller(engine, "http://user:s3cret@engine:8000", EventBus(), 0)
    fp = await poller.poll()
    assert (fp.kind, fp.version, poller.state()["state"]) == ("vllm", "0.23.0", "up")
    asked = {r.path: r.headers.get("Authorization") for r in engine.requests}
    assert set(asked) >= {"/version", "/v1/models", "/props", "/metrics"}, asked
    assert set(asked.values()) == {"Basic dXNlcjpzM2NyZXQ="}, asked
    assert "s3cret" not in caplog.text + str(poller.state())


async def test_faults_of_the_seam_are_said_in_a_few_words() -> None:
    """The seam's one error vocabulary, as the poller says why the engine is down."""
    refused = ConnectionRefusedError(111, "Connection refused")
    unreachable = OSError(113, "No route to host")

    def raising(exc: BaseException) -> Any:
        def handle(request: Received) -> Reply:
            raise exc

        return handle

    def failure(kind: str, cause: BaseException | None = None) -> UpstreamFailure:
        exc = UpstreamFailure(502, "upstream error", kind)
        exc.__cause__ = cause
        return exc

    said = {
        "connection refused": raising(failure("refused", refused)),
        "cannot connect (No route to host)": raising(failure("refused", unreachable)),
        "connection closed before an answer": raising(failure("reset")),
        "no answer within 0.05 s": lambda request: Reply(200, body=b"{}", delay_s=5),
    }
    for reason, answer in said.items():
        poller = FingerprintPoller(
            MockUpstream(answer), "http://engine", EventBus(), 0, timeout_s=0.05
        )
        await poller.poll()
        assert (poller.state()["state"], poller.state()["reason"]) == ("waiting", reason)
