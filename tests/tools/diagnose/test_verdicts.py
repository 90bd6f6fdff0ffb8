"""The verdicts from made-up evidence: each switch alone, and what cannot be decided."""

from __future__ import annotations

from proxy.attribution.evidence import CAUSES
from proxy.audit.outcome import ChoiceOutcome, TokenLogprob
from proxy.tools.diagnose.engine import identify
from proxy.tools.diagnose.experiments import PromptEvidence
from proxy.tools.diagnose.verdicts import decide, self_spread, spread, switch

VLLM = identify({"version": "0.23.0"}, None, None)
UNKNOWN = identify(None, {"data": [{"id": "m", "owned_by": "x"}]}, None)


def answer(*tokens: str, second: float = -2.0, drift: float = 0.0) -> ChoiceOutcome:
    entries = tuple(
        TokenLogprob(t, -0.1 - drift, ((t, -0.1 - drift), ("alt", second))) for t in tokens
    )
    return ChoiceOutcome(0, "".join(tokens), "", entries, "length")


A = answer("a", "b", "c")
B = answer("a", "x", "c")  # parts at token 1
A_DRIFT = answer("a", "b", "c", drift=0.25)


def evidence(**groups: object) -> PromptEvidence:
    ev = PromptEvidence("p", prefill=[("a", (("a", -0.1), ("alt", -2.0)))] * 3, serial=[A] * 3)
    for name, value in groups.items():
        setattr(ev, name, value)
    return ev


def by_cause(ev: list[PromptEvidence], **kw: object) -> dict[str, str]:
    engine = kw.pop("engine", VLLM)
    d = decide(ev, engine, kw.pop("levels", (1, 4)), **kw)  # type: ignore[arg-type]
    return {v.cause: v.status for v in d.verdicts}


def test_spread_counts_outputs_and_finds_the_first_divergence() -> None:
    s = spread(A, [A, B, A_DRIFT])
    assert (s.runs, s.distinct, s.distinct_texts, s.first_position) == (4, 3, 2, 0)
    assert abs((s.margin or 0) - 1.9) < 1e-9
    assert abs((s.max_delta or 0) - 0.25) < 1e-9
    assert self_spread([A, A, A]).agrees


def test_serial_replays_that_differ_are_intrinsic_and_block_the_rest() -> None:
    ev = evidence(serial=[A, B, A], concurrent={4: [B]}, warm=[B])
    got = by_cause([ev])
    assert (got["intrinsic"], got["batch"], got["prefix_cache"]) == ("found", "unknown", "unknown")


def test_a_prefill_vector_that_moves_is_intrinsic() -> None:
    ev = evidence(prefill=[("a", (("a", -0.1),)), ("a", (("a", -0.3),))])
    d = decide([ev], VLLM, (1,))
    (cause,) = d.causes
    assert (cause.cause, cause.evidence[0].split(":")[1].strip()) == ("intrinsic", "prefill probe")
    assert abs((cause.max_delta or 0) - 0.2) < 1e-9


def test_concurrent_only_is_batch_warm_only_is_prefix_cache() -> None:
    assert by_cause([evidence(concurrent={4: [A, B]}, warm=[A])])["batch"] == "found"
    got = by_cause([evidence(concurrent={4: [A]}, warm=[A_DRIFT, A_DRIFT])])
    assert (got["batch"], got["prefix_cache"]) == ("not_found", "found")


def test_reference_that_differs_while_both_agree_is_speculative() -> None:
    got = by_cause([evidence(reference=[B, B, B])], reference_given=True)
    assert got["speculative"] == "found"
    got = by_cause([evidence(reference=[B, A, B])], reference_given=True)
    assert (got["speculative"], got["unknown"]) == ("unknown", "found")


def test_without_a_reference_or_levels_they_are_not_tested() -> None:
    got = by_cause([evidence()], levels=(1,))
    assert (got["batch"], got["speculative"]) == ("not_tested", "not_tested")


def test_an_unknown_engine_tells_a_first_cold_replay_from_a_race() -> None:
    d = decide([evidence(serial=[B, A, A, A])], UNKNOWN, (1,))
    (cause,) = d.causes
    assert cause.cause == "unknown" and "intrinsic or prefix_cache" in (cause.missing or "")
    got = by_cause([evidence(serial=[A, A, B, A])], engine=UNKNOWN)
    assert (got["intrinsic"], got["prefix_cache"]) == ("found", "not_tested")


def test_an_identity_that_moved_is_a_recipe_change() -> None:
    after = identify({"version": "0.24.0"}, None, None)
    assert by_cause([evidence()], identity_after=after)["recipe_change"] == "found"
    assert by_cause([evidence()], identity_after=VLLM)["recipe_change"] == "not_found"


def test_each_switch_is_decided_by_triages_decider() -> None:
    alone = [(f"cold-{k}", "same", "cold", True, None, A) for k in range(3)]
    crowded = [("crowded-4-1", "same", "cold", False, 4, B)]
    found = switch([*alone, *crowded], "cache_salt")
    assert found.cause == "batch" and "crowded-4-1 with 4 in flight" in found.reason
    assert switch([*alone, ("crowded-4-1", "same", "cold", False, 4, A)], "cache_salt").cause == (
        "unknown"
    )


def test_warm_replays_that_disagree_among_themselves_are_no_prefix_cache() -> None:
    d = decide([evidence(warm=[A_DRIFT, B])], VLLM, (1,))
    got = {v.cause: v for v in d.verdicts}
    assert (got["prefix_cache"].status, got["unknown"].status) == ("not_found", "found")
    assert "warm replays against cold" in (got["unknown"].missing or "")


def test_a_prime_that_differs_from_the_cold_replays_is_no_prefix_cache() -> None:
    got = by_cause([evidence(prime=B, warm=[A_DRIFT, A_DRIFT])])
    assert (got["prefix_cache"], got["unknown"]) == ("not_found", "found")
    assert by_cause([evidence(prime=A, warm=[A_DRIFT, A_DRIFT])])["prefix_cache"] == "found"


def test_verdicts_follow_triages_list_of_causes() -> None:
    assert tuple(v.cause for v in decide([evidence()], VLLM, (1,)).verdicts) == CAUSES
