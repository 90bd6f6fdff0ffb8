"""decide(): each cause from the evidence that names it; unknown says what was missing."""

from __future__ import annotations

from proxy.attribution.decide import decide
from proxy.attribution.evidence import Evidence, Run


def run(
    name: str,
    group: int | None,
    *,
    cache: str = "cold",
    alone: bool | None = True,
    target: str = "same",
    inflight: int | None = 0,
    identity: str | None = "fp1",
) -> Run:
    return Run(name, target, cache, alone, group, inflight, identity)


def evidence(
    *runs: Run,
    cold: str | None = "cache_salt",
    spec: bool | None = False,
    missing: tuple[str, ...] = (),
) -> Evidence:
    return Evidence("text_divergence", "text", runs, cold, spec, missing)


PRIMARY_CROWDED = run("primary", 1, cache="unknown", alone=False, inflight=8)
SHADOW = run("shadow", 0)


def test_identity_moved_between_primary_and_shadow_is_a_recipe_change_without_replays() -> None:
    got = decide(evidence(run("primary", 0, identity="a"), run("shadow", 1, identity="b")))
    assert got.cause == "recipe_change", got
    assert "a" in got.reason and "b" in got.reason


def test_replays_on_a_new_identity_agreeing_with_each_other_not_the_primary() -> None:
    got = decide(
        evidence(
            run("primary", 0, cache="unknown", alone=None, identity="a"),
            run("shadow", 1, identity=None),
            run("cold-1", 1, identity="b"),
            run("cold-2", 1, identity="b"),
        )
    )
    assert got.cause == "recipe_change", got


def test_cold_replays_alone_that_disagree_are_intrinsic() -> None:
    got = decide(evidence(PRIMARY_CROWDED, SHADOW, run("cold-1", 0), run("cold-2", 1)))
    assert got.cause == "intrinsic", got


def test_a_cold_shadow_alone_disagreeing_with_cold_replays_is_intrinsic() -> None:
    got = decide(
        evidence(
            run("primary", 0, cache="unknown", alone=None),
            run("shadow", 1),
            run("cold-1", 0),
            run("cold-2", 0),
        )
    )
    assert got.cause == "intrinsic", got


def test_warm_runs_that_disagree_are_intrinsic() -> None:
    got = decide(evidence(SHADOW, run("warm-1", 0, cache="warm"), run("warm-2", 1, cache="warm")))
    assert got.cause == "intrinsic", got


def test_cold_agrees_with_cold_warm_with_warm_cold_differs_from_warm_is_prefix_cache() -> None:
    got = decide(
        evidence(
            run("primary", 1, cache="unknown", alone=None),
            SHADOW,
            run("cold-1", 0),
            run("cold-2", 0),
            run("prime", 1, cache="unknown"),
            run("warm-1", 1, cache="warm"),
            run("warm-2", 1, cache="warm"),
        )
    )
    assert got.cause == "prefix_cache", got


def test_one_warm_run_is_not_enough_to_call_prefix_cache() -> None:
    got = decide(evidence(SHADOW, run("cold-1", 0), run("warm-1", 1, cache="warm")))
    assert got.cause != "prefix_cache", got


def test_speculative_needs_the_engine_to_say_so_and_both_sides_self_consistent() -> None:
    runs = (
        run("primary", 0, cache="unknown", alone=None),
        run("shadow", 1, target="reference"),
        run("cold-1", 0),
        run("cold-2", 0),
        run("reference-1", 1, target="reference"),
    )
    assert decide(evidence(*runs, spec=True)).cause == "speculative"
    off = decide(evidence(*runs, spec=False))
    assert off.cause == "unknown", off
    assert any("speculative" in m for m in off.missing), off.missing
    # The reference disagreeing with itself is intrinsic (on the reference), not speculation.
    flaky = (*runs, run("reference-2", 2, target="reference"))
    assert decide(evidence(*flaky, spec=True)).cause == "intrinsic"


def test_serial_replays_agree_and_the_crowded_primary_differs_is_batch() -> None:
    got = decide(
        evidence(
            PRIMARY_CROWDED,
            SHADOW,
            run("cold-1", 0),
            run("cold-2", 0),
            run("warm-1", 0, cache="warm"),
            run("warm-2", 0, cache="warm"),
        )
    )
    assert got.cause == "batch", got
    assert "primary with 8 in flight" in got.reason


def test_replays_agreeing_with_both_sides_is_unknown_and_says_so() -> None:
    got = decide(
        evidence(
            run("primary", 0, cache="unknown", alone=None),
            run("shadow", 1, alone=None),
            run("cold-1", 0),
            run("cold-2", 0),
        )
    )
    assert got.cause == "unknown", got
    assert any("shared its batch is not known" in m for m in got.missing), got.missing


def test_no_replays_and_no_cold_names_what_is_missing() -> None:
    got = decide(
        evidence(
            run("primary", 0, alone=None),
            run("shadow", 1, alone=None),
            cold=None,
            missing=("budget: rate_limit",),
        )
    )
    assert got.cause == "unknown"
    assert got.missing[0] == "budget: rate_limit"
    assert "no way to run cold on this engine" in got.missing
    assert any(m.startswith("serial replays alone") for m in got.missing), got.missing


def test_failed_runs_prove_nothing() -> None:
    got = decide(evidence(PRIMARY_CROWDED, SHADOW, run("cold-1", None), run("cold-2", None)))
    assert got.cause == "unknown", got


def test_a_crowded_primary_matching_neither_cold_nor_warm_is_batch_not_prefix_cache() -> None:
    """Real vLLM 0.23 on the H200 (2026-12-04): a cold primary beside 17 others differed from
    the cold shadow; cold replays agreed with the shadow, warm ones with each other but not with
    cold. The cache effect is real, but it is not what parted this audit's two sides."""
    got = decide(
        evidence(
            run("primary", 0, cache="unknown", alone=False, inflight=17),
            run("shadow", 1),
            run("cold-1", 1),
            run("cold-2", 1),
            run("cold-3", 1),
            run("prime", 2, cache="unknown"),
            run("warm-1", 2, cache="warm"),
            run("warm-2", 2, cache="warm"),
        )
    )
    assert got.cause == "batch", got
    assert "17 in flight" in got.reason, got.reason


def test_a_primary_matching_the_warm_runs_is_still_prefix_cache() -> None:
    got = decide(
        evidence(
            run("primary", 2, cache="unknown", alone=None),
            run("shadow", 1),
            run("cold-1", 1),
            run("cold-2", 1),
            run("warm-1", 2, cache="warm"),
            run("warm-2", 2, cache="warm"),
        )
    )
    assert got.cause == "prefix_cache", got


def test_a_crowded_primary_matching_the_warm_runs_is_unknown_naming_its_cache_state() -> None:
    """Real vLLM 0.23 with VLLM_BATCH_INVARIANT=1 on the H200 (2026-12-04): cold primaries (a
    fresh cache_salt each) beside 12-24 others matched the warm replays bit for bit, cold
    replays and the cold shadow agreed: a prefill chunked under load computes as a warm one.
    Cache or batch cannot be told apart there; it was called prefix_cache before."""
    got = decide(
        evidence(
            run("primary", 2, cache="unknown", alone=False, inflight=14),
            run("shadow", 1),
            run("cold-1", 1),
            run("cold-2", 1),
            run("cold-3", 1),
            run("prime", 2, cache="unknown"),
            run("warm-1", 2, cache="warm"),
            run("warm-2", 2, cache="warm"),
        )
    )
    assert got.cause == "unknown", got
    assert any("prefix cache" in m and "14 others" in m for m in got.missing), got.missing


def test_a_crowded_primary_known_cold_matching_warm_is_batch() -> None:
    """The same shape, but the primary's cache state known (cold): the batch parted it."""
    got = decide(
        evidence(
            run("primary", 2, cache="cold", alone=False, inflight=14),
            run("shadow", 1),
            run("cold-1", 1),
            run("cold-2", 1),
            run("warm-1", 2, cache="warm"),
            run("warm-2", 2, cache="warm"),
        )
    )
    assert got.cause == "batch", got
