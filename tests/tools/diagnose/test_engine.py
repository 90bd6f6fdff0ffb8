"""How diagnose tells the engine, and how it asks it for a cold or a warm prefill (the
triage's one chooser and request fields)."""

from __future__ import annotations

from proxy.attribution.experiments import cold_body, warm_body
from proxy.tools.diagnose.engine import identify

MODELS = {"data": [{"id": "m", "owned_by": "vllm"}]}


def test_vllm_runs_cold_with_a_fresh_salt_each_request() -> None:
    engine = identify({"version": "0.23.0"}, MODELS, None)
    assert (engine.kind, engine.version, engine.can_run_cold) == ("vllm", "0.23.0", True)
    assert engine.cold_method == "cache_salt"
    first, second = (cold_body({}, engine.cold_method)["cache_salt"] for _ in range(2))
    assert first != second, "two cold requests shared a salt"
    assert warm_body({}, engine.cold_method, "s") == {"cache_salt": "s"}


def test_llama_server_runs_cold_without_its_prompt_cache() -> None:
    props = {"build_info": "b1-abc", "total_slots": 2}
    engine = identify(None, {"data": [{"id": "m", "owned_by": "llamacpp"}]}, props)
    assert engine.kind == "llama.cpp"
    method = engine.cold_method
    assert (cold_body({}, method), warm_body({}, method, "s")) == (
        {"cache_prompt": False},
        {"cache_prompt": True},
    )


def test_owned_by_alone_names_the_engine() -> None:
    assert identify(None, MODELS, None).kind == "vllm"
    assert identify(None, {"data": [{"id": "m", "owned_by": "llamacpp"}]}, None).kind == (
        "llama.cpp"
    )


def test_an_unknown_engine_cannot_run_cold_and_says_so() -> None:
    engine = identify(None, {"data": [{"id": "m", "owned_by": "someone"}]}, None)
    assert (engine.kind, engine.can_run_cold, engine.cold_method) == ("unknown", False, None)
    assert cold_body({}, engine.cold_method) == {}
    assert "no way known" in engine.how_cold


def test_identity_changes_with_the_version() -> None:
    a = identify({"version": "0.23.0"}, MODELS, None)
    b = identify({"version": "0.24.0"}, MODELS, None)
    assert (
        a.fingerprint != b.fingerprint
        and a.fingerprint == identify({"version": "0.23.0"}, MODELS, None).fingerprint
    )
