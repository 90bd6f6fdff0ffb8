"""[upstream.expect] held against the loaded facts."""

from __future__ import annotations

from pathlib import Path

from proxy.engine.engine_log import EngineLogReader
from proxy.engine.expect import EXPECT_KEYS, Mismatch, check
from proxy.engine.facts import EngineFacts

FIXTURES = Path(__file__).parent / "fixtures"


def facts_of(name: str) -> EngineFacts:
    reader = EngineLogReader()
    for line in (FIXTURES / name).read_text(encoding="utf-8").splitlines():
        reader.feed(line)
    return reader.facts


def test_the_spec_keys_are_accepted() -> None:
    assert {
        "attention_backend",
        "moe_backend",
        "quantization",
        "dtype",
        "cudagraphs",
        "prefix_caching",
        "speculative",
        "batch_invariant",
        "unknown_env",
    } <= EXPECT_KEYS


def test_the_unknown_env_log_against_what_its_author_believed() -> None:
    facts = facts_of("vllm-0.23.0-eager-unknown-env.log")
    mismatches, unknown = check(
        {
            "attention_backend": "FLASHINFER",
            "moe_backend": "marlin",
            "dtype": "bf16",
            "cudagraphs": True,
            "prefix_caching": True,
            "speculative": False,
            "unknown_env": False,
        },
        facts,
    )
    assert mismatches == (
        Mismatch("attention_backend", "FLASHINFER", "FLASH_ATTN"),
        Mismatch("cudagraphs", True, False),
        Mismatch("unknown_env", (), ("VLLM_FP8_MOE_BACKEND", "VLLM_ATTENTION_BACKEND")),
    )
    assert unknown == ("moe_backend",), "a field the log did not say was guessed"


def test_a_recipe_that_is_met_raises_nothing() -> None:
    facts = facts_of("vllm-0.23.0-eager-triton-noprefix.log")
    assert check(
        {
            "attention_backend": "triton_attn",
            "dtype": "torch.bfloat16",
            "quantization": "none",
            "cudagraphs": False,
            "prefix_caching": False,
            "speculative": False,
            "unknown_env": False,
        },
        facts,
    ) == ((), ())


def test_dtype_aliases_and_case() -> None:
    for loaded in ("bfloat16", "torch.bfloat16", "BF16"):
        for expected in ("bf16", "bfloat16", "torch.bfloat16"):
            assert check({"dtype": expected}, EngineFacts({"dtype": loaded})) == ((), ())
    assert check({"dtype": "fp16"}, EngineFacts({"dtype": "bfloat16"}))[0] == (
        Mismatch("dtype", "fp16", "bfloat16"),
    )


def test_speculative_as_bool_or_method() -> None:
    eagle = EngineFacts({"speculative": "eagle3"})
    off = EngineFacts({"speculative": False})
    assert check({"speculative": True}, eagle) == ((), ())
    assert check({"speculative": "EAGLE3"}, eagle) == ((), ())
    assert check({"speculative": "ngram"}, eagle)[0] == (
        Mismatch("speculative", "ngram", "eagle3"),
    )
    assert check({"speculative": False}, eagle)[0] == (Mismatch("speculative", False, "eagle3"),)
    assert check({"speculative": "eagle3"}, off)[0] == (Mismatch("speculative", "eagle3", False),)
    assert check({"speculative": False}, off) == ((), ())


def test_what_the_engine_did_not_say_is_unknown_never_a_mismatch() -> None:
    assert check({"batch_invariant": True, "moe_backend": "triton"}, EngineFacts()) == (
        (),
        ("batch_invariant", "moe_backend"),
    )
    # unknown_env true allows them; none said is none
    assert check({"unknown_env": False}, EngineFacts()) == ((), ())
    assert check({"unknown_env": True}, EngineFacts(unknown_env=("VLLM_X",))) == ((), ())


def test_a_failed_start_checks_only_what_it_said() -> None:
    facts = facts_of("vllm-0.23.0-cudagraphs-oom.log")
    assert facts.start_failed
    assert check({"cudagraphs": True, "batch_invariant": False}, facts) == (
        (),
        ("batch_invariant",),
    )


def test_keys_outside_the_spec_are_ignored() -> None:
    assert check({"colour": "blue"}, EngineFacts({"colour": "red"})) == ((), ())


def test_every_checked_field_can_be_declared_in_the_config() -> None:
    from proxy.config import UpstreamExpectConfig

    declarable = set(UpstreamExpectConfig.model_fields)
    assert declarable == set(EXPECT_KEYS), (
        f"[upstream.expect] refuses {sorted(set(EXPECT_KEYS) - declarable)}, "
        f"checks nothing for {sorted(declarable - set(EXPECT_KEYS))}"
    )
