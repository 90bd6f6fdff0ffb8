"""How diagnose tells the engine, and how it asks it for a cold or a warm prefill."""

from __future__ import annotations

from proxy.tools.diagnose.engine import identify

MODELS = {"data": [{"id": "m", "owned_by": "vllm"}]}


def test_vllm_runs_cold_with_a_fresh_salt_each_request() -> None:
    engine = identify({"version": "0.23.0"}, MODELS, None)
    assert (engine.kind, engine.version, engine.can_run_cold) == ("vllm", "0.23.0", True)
    first, second = engine.cold()["cache_salt"], engine.cold()["cache_salt"]
    assert first != second, "two cold requests shared a salt"
    assert engine.warm() == {}


def test_llama_server_runs_cold_without_its_prompt_cache() -> None:
    props = {"build_info": "b1-abc", "total_slots": 2}
    engine = identify(None, {"data": [{"id": "m", "owned_by": "llamacpp"}]}, props)
    assert engine.kind == "llama.cpp"
    assert (engine.cold(), engine.warm()) == ({"cache_prompt": False}, {"cache_prompt": True})


def test_owned_by_alone_names_the_engine() -> None:
    assert identify(None, MODELS, None).kind == "vllm"
    assert identify(None, {"data": [{"id": "m", "owned_by": "llamacpp"}]}, None).kind == (
        "llama.cpp"
    )


def test_an_unknown_engine_cannot_run_cold_and_says_so() -> None:
    engine = identify(None, {"data": [{"id": "m", "owned_by": "someone"}]}, None)
    assert (engine.kind, engine.can_run_cold, engine.cold()) == ("unknown", False, {})
    assert "no way known" in engine.how_cold


def test_identity_changes_with_the_version() -> None:
    a = identify({"version": "0.23.0"}, MODELS, None)
    b = identify({"version": "0.24.0"}, MODELS, None)
    assert (
        a.fingerprint != b.fingerprint
        and a.fingerprint == identify({"version": "0.23.0"}, MODELS, None).fingerprint
    )
