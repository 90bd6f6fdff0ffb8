"""Incident records to view models: rows, divergence points, the side-by-side split, loops."""

from __future__ import annotations

import math

import orjson

from proxy.observe.ui.incident import (
    AuditDetail,
    ChangeDetail,
    LoopDetail,
    common_prefix,
    detail_of,
    incident_id,
    parting_offset,
    row_of,
    side_by_side,
)
from tests.observe.ui.records import audit, change, loop


def roundtrip(record: dict) -> dict:  # type: ignore[type-arg]
    """What a log file gives back: tuples became lists."""
    return orjson.loads(orjson.dumps(record))  # type: ignore[no-any-return]


def test_ids_are_stable_across_the_ring_and_the_file_and_tell_incidents_apart() -> None:
    a, b = audit("r1"), audit("r1", mode="prefill")
    assert incident_id(a) == incident_id(roundtrip(a))
    assert incident_id(a) != incident_id(b)
    assert incident_id(change()) != incident_id(change(after="00"))
    assert len(incident_id(a)) == 16


def test_rows_summarise_each_kind() -> None:
    row = row_of(audit(index=5, tokens=(" yes", " no")))
    assert row is not None
    assert (row.kind, row.verdict, row.mode, row.fingerprint) == (
        "audit",
        "text_divergence",
        "full",
        "0123456789abcdef",
    )
    assert row.summary == 'token 5: " yes" vs " no"'
    looped = row_of(loop(period=12, repeats=30))
    assert looped is not None and looped.verdict == "loop"
    assert looped.summary == "proxy loop in content: 12 chars x 30"
    changed = row_of(change())
    assert changed is not None and changed.fingerprint == "fedcba9876543210"
    assert "0.17.1 → 0.17.2" in changed.summary
    assert row_of({"kind": "tally"}) is None
    assert row_of({"kind": "audit", "ts": "yesterday", "model": 3}) is not None  # tolerated


def test_the_divergence_point_reads_topk_margin_and_the_shift_of_the_primary_token() -> None:
    for record in (audit(), roundtrip(audit())):
        detail = detail_of(record)
        assert isinstance(detail, AuditDetail) and detail.divergence is not None
        point = detail.divergence
        assert [e.token for e in point.primary_top] == [" cat", " dog"]
        assert [e.chosen for e in point.primary_top] == [True, False]
        assert [e.chosen for e in point.shadow_top] == [True, False]
        assert point.near_tie is True
        assert point.token_shift is not None and math.isclose(point.token_shift, -0.80 + 0.69)


def test_minus_9999_is_minus_infinity_and_unknown_logprobs_stay_unknown() -> None:
    record = audit(primary_top=((" cat", -9999.0), (" dog", None)), margin=None)
    detail = detail_of(roundtrip(record))
    assert isinstance(detail, AuditDetail) and detail.divergence is not None
    top = detail.divergence.primary_top
    assert top[0].logprob == -math.inf and top[0].probability == 0.0
    assert top[1].logprob is None
    assert detail.divergence.near_tie is None
    assert detail.divergence.token_shift is None


def test_the_sides_part_where_each_goes_on_with_its_own_token() -> None:
    # " the" vs " then": the first differing character is inside the tokens, not at their start
    primary, shadow = "I see the cat", "I see then cat"
    assert common_prefix(primary, shadow) == len("I see the")
    assert parting_offset(primary, shadow, " the", " then") == len("I see")
    pair = side_by_side(primary, shadow, " the", " then")
    assert (pair.common, pair.primary_mark, pair.primary_rest) == ("I see", " the", " cat")
    assert (pair.shadow_mark, pair.shadow_rest) == (" then", " cat")


def test_without_matching_tokens_the_first_differing_character_is_marked() -> None:
    pair = side_by_side("abcXdef", "abcYdef", None, None)
    assert (pair.offset, pair.primary_mark, pair.shadow_mark) == (3, "X", "Y")
    ended = side_by_side("abc", "abcdef", None, "def")  # the primary ended there
    assert (ended.offset, ended.primary_mark, ended.shadow_mark) == (3, "", "def")


def test_long_texts_are_cut_around_the_divergence() -> None:
    common = "x" * 5000
    pair = side_by_side(common + "A" + "p" * 9000, common + "B" + "s" * 10, None, None)
    assert pair.common_hidden == 5000 - 400 and len(pair.common) == 400
    assert pair.primary_cut == 9000 - 4000 and pair.shadow_cut == 0
    assert common_prefix("a" * 3000, "a" * 3000) == 3000
    assert common_prefix("a" * 2048 + "b", "a" * 2048 + "c") == 2048


def test_an_audit_without_stored_text_has_numbers_only() -> None:
    detail = detail_of(audit(texts=None))
    assert isinstance(detail, AuditDetail)
    assert detail.text_stored is False and detail.side_by_side is None
    assert detail.primary_hash == "a" * 32 and detail.inflight_primary == 4
    assert detail.overlapped is True


def test_a_loop_and_an_upstream_change() -> None:
    looped = detail_of(loop(unit=None))
    assert isinstance(looped, LoopDetail)
    assert (looped.period, looped.repeats, looped.start_offset, looped.unit) == (35, 6, 20, None)
    changed = detail_of(change())
    assert isinstance(changed, ChangeDetail)
    assert changed.changed_fields == (("version", "0.17.1", "0.17.2"),)
