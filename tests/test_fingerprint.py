"""What runs behind detproxy: read, exported, stamped on incidents, and changes counted."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry

from proxy.emulator import EmulatorConfig, EmulatorServer
from proxy.fingerprint import build, parse_metrics
from tests.conftest import metric

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
