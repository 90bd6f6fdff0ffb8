"""EngineFacts: merge, JSON form, digest."""

from __future__ import annotations

import json

from proxy.engine.facts import FIELDS, EngineFacts

A = EngineFacts(
    {"engine": "vllm", "attention_backend": "FLASH_ATTN", "prefix_caching": True},
    {"engine": "log", "attention_backend": "log", "prefix_caching": "log"},
    unknown_env=("VLLM_A",),
    deprecated=("X is deprecated",),
)


def test_fields_are_the_documented_names_in_display_order() -> None:
    assert FIELDS[:3] == ("engine", "version", "model")
    assert "non_default_args" in FIELDS and len(set(FIELDS)) == len(FIELDS)


def test_merged_other_known_values_win_lists_are_united_in_order() -> None:
    b = EngineFacts(
        {"prefix_caching": False, "attention_backend": None, "kv_cache_dtype": "auto"},
        {"prefix_caching": "cache_config_info", "kv_cache_dtype": "cache_config_info"},
        unknown_env=("VLLM_B", "VLLM_A"),
        fallbacks=("Marlin",),
        start_failed=True,
    )
    m = A.merged(b)
    assert dict(m.values) == {
        "engine": "vllm",
        "attention_backend": "FLASH_ATTN",
        "prefix_caching": False,
        "kv_cache_dtype": "auto",
    }
    assert m.sources["prefix_caching"] == "cache_config_info"
    assert m.sources["attention_backend"] == "log", "an unknown value took the source"
    assert m.unknown_env == ("VLLM_A", "VLLM_B")
    assert m.deprecated == ("X is deprecated",) and m.fallbacks == ("Marlin",)
    assert m.start_failed is True
    assert A.merged(EngineFacts()) == A


def test_as_dict_is_json_ready_and_in_display_order() -> None:
    facts = A.merged(EngineFacts({"version": "0.23.0", "non_default_args": {"x": (1, 2)}}))
    d = facts.as_dict()
    assert json.loads(json.dumps(d)) == d
    assert list(d["facts"]) == [
        "engine",
        "version",
        "attention_backend",
        "prefix_caching",
        "non_default_args",
    ]
    assert d["facts"]["non_default_args"] == {"x": [1, 2]}
    assert d["unknown_env"] == ["VLLM_A"] and d["start_failed"] is False
    assert EngineFacts().as_dict() == {
        "facts": {},
        "sources": {},
        "unknown_env": [],
        "deprecated": [],
        "fallbacks": [],
        "start_failed": False,
    }


def test_digest_follows_the_recipe_not_the_order_or_the_source() -> None:
    same = EngineFacts(
        {"prefix_caching": True, "attention_backend": "FLASH_ATTN", "engine": "vllm"},
        {"prefix_caching": "server_info"},
        unknown_env=("VLLM_A",),
    )
    assert A.digest() == same.digest()
    assert len(A.digest()) == 16
    other = A.merged(EngineFacts({"attention_backend": "TRITON_ATTN"}))
    assert other.digest() != A.digest(), "another backend, same identity"
    assert A.merged(EngineFacts(start_failed=True)).digest() != A.digest()
    assert A.merged(EngineFacts(unknown_env=("VLLM_C",))).digest() != A.digest()
    # the operator's argument list is how, not what: it does not move the identity
    assert A.merged(EngineFacts({"non_default_args": {"port": 1}})).digest() == A.digest()
