"""What runs behind detproxy: read, exported, stamped on incidents, and changes counted."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import ClientSession, web
from prometheus_client import CollectorRegistry

from proxy.engine.fingerprint import FingerprintPoller, build, parse_metrics
from proxy.events import EventBus, UpstreamFingerprinted
from proxy.tools.emulator import EmulatorConfig, EmulatorServer
from tests.helpers import metric

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


async def test_a_fresh_speculative_vllm_reads_the_same_before_and_after_its_first_draft(
    aiohttp_server: Any,
) -> None:
    state = {"drafts": 0, "metrics_up": True}

    async def version(request: web.Request) -> web.Response:
        return web.json_response({"version": "0.23.0"})

    async def models(request: web.Request) -> web.Response:
        return web.json_response(MODELS)

    async def metrics(request: web.Request) -> web.Response:
        if not state["metrics_up"]:
            return web.Response(status=503)
        n = state["drafts"]
        text = FRESH_SPECULATIVE.replace(" 0.0\nvllm:spec", f" {n}.0\nvllm:spec")
        return web.Response(text=text, content_type="text/plain")

    app = web.Application()
    app.router.add_get("/version", version)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    server = await aiohttp_server(app)
    bus = EventBus()
    readings: list[UpstreamFingerprinted] = []
    bus.subscribe(UpstreamFingerprinted, readings.append)
    async with ClientSession() as session:
        poller = FingerprintPoller(session, str(server.make_url("")), bus, interval_s=0)
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
    make_proxy: Any, upstream: Any, upstream_app: web.Application, registry: CollectorRegistry
) -> None:
    state = {"version": "0.16.0"}

    async def version(request: web.Request) -> web.Response:
        return web.json_response({"version": state["version"]})

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "max_model_len": 8}]})

    async def answer(request: web.Request) -> web.Response:
        return web.json_response(
            {"choices": [{"index": 0, "finish_reason": "stop", "message": {"content": "x"}}]}
        )

    upstream_app.router.add_get("/version", version)
    upstream_app.router.add_get("/v1/models", models)
    upstream_app.router.add_post("/v1/chat/completions", answer)
    client = await make_proxy(
        await upstream(), env={"DETPROXY_UPSTREAM__FINGERPRINT_INTERVAL_S": "0.05"}
    )
    await asyncio.sleep(0.2)
    labels = {"kind": "vllm", "version": "0.16.0", "model": "m"}
    text = await (await client.get("/detproxy/metrics")).text()
    assert 'detproxy_upstream_info{fingerprint="' in text and 'version="0.16.0"' in text
    assert metric(registry, "detproxy_upstream_changes_total") == 0
    body = {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": "q"}]}
    await client.post("/v1/chat/completions", json=body)
    state["version"] = "0.17.1"  # a redeploy under traffic
    await asyncio.sleep(0.2)
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


async def test_the_emulator_reads_as_vllm(make_proxy: Any, registry: CollectorRegistry) -> None:
    async with EmulatorServer(EmulatorConfig(version="0.15.1")) as emu:
        client = await make_proxy(emu.url)
        for _ in range(50):
            status = await (await client.get("/detproxy/status")).json()
            if status["upstream_fingerprint"]:
                break
            await asyncio.sleep(0.02)
        fp = status["upstream_fingerprint"]
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
        await asyncio.sleep(0.05)
        incidents = await (await client.get("/detproxy/incidents")).json()
        assert incidents and all(i["upstream"]["version"] == "0.15.1" for i in incidents)
