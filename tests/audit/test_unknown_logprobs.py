"""Unknown logprobs: vLLM streams a NaN logprob as ``"logprob": null`` (its non-streamed answer
refuses to serialise it). A null, or a non-finite float, is unknown: never a crash, never a
false logprob_drift; comparisons over it are incomparable with a reason; tokens still compare."""

from __future__ import annotations

import json
import math
from typing import Any

import orjson
from prometheus_client import CollectorRegistry, generate_latest

from proxy.audit.compare import UNKNOWN_LOGPROBS, compare_choices, compare_outcomes
from proxy.audit.outcome import (
    ChoiceOutcome,
    Outcome,
    StreamAccumulator,
    TokenLogprob,
    outcome_from_response,
)
from proxy.events import AuditCompleted, EventBus
from proxy.observe.incidents import audit_incident
from proxy.observe.metrics import Metrics
from tests.helpers.answers import (
    CONTENT,
    Token,
    chat_body,
    chat_chunks,
    completion_body,
    completion_chunks,
)
from tests.helpers.metrics import metric

# What vLLM streams for a model whose logprobs come out NaN: every value null.
NAN_CONTENT: list[Token] = [(t, None, [(alt, None) for alt, _ in top]) for t, _, top in CONTENT]


def _stream(endpoint: str, chunks: list[dict[str, Any]]) -> Outcome:
    acc = StreamAccumulator(endpoint)
    for chunk in chunks:
        acc.on_chunk(orjson.loads(orjson.dumps(chunk)))  # as the wire carries it
    acc.on_end(True)
    return acc.outcome()


def _choice(tokens: list[TokenLogprob], finish: str = "stop") -> ChoiceOutcome:
    return ChoiceOutcome(0, "".join(t.token for t in tokens), "", tuple(tokens), finish)


def test_streamed_nulls_read_as_unknown_not_minus_infinity() -> None:
    out = _stream("chat", chat_chunks([], NAN_CONTENT))
    assert out.error is None
    (choice,) = out.choices
    assert choice.content == "Hi! ok"
    assert choice.tokens == tuple(
        TokenLogprob(t, None, tuple((alt, None) for alt, _ in top)) for t, _, top in CONTENT
    )


def test_streamed_null_in_top_logprobs_only() -> None:
    content = list(CONTENT)
    content[1] = ("!", -0.5, [("!", -0.5), (".", None)])
    out = _stream("chat", chat_chunks([], content))
    assert out.choices[0].tokens is not None
    assert out.choices[0].tokens[1] == TokenLogprob("!", -0.5, (("!", -0.5), (".", None)))


def test_streamed_completions_with_nulls() -> None:
    out = _stream("completions", completion_chunks(NAN_CONTENT))
    (choice,) = out.choices
    assert choice.tokens is not None
    assert [t.token for t in choice.tokens] == ["Hi", "!", " ok"]
    assert all(t.logprob is None for t in choice.tokens)
    assert all(v is None for t in choice.tokens for _, v in t.top)


def test_non_streamed_completions_with_nulls_against_its_stream() -> None:
    body = completion_body(NAN_CONTENT)
    lp = body["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == [None, None, None] and lp["top_logprobs"][0]["Hi"] is None
    (choice,) = outcome_from_response("completions", body).choices
    assert choice.tokens is not None and [t.logprob for t in choice.tokens] == [None] * 3
    streamed = _stream("completions", completion_chunks(NAN_CONTENT))
    (v,) = compare_outcomes(streamed, outcome_from_response("completions", body))
    assert (v.verdict, v.reason, v.max_abs_logprob_delta) == (
        "incomparable",
        UNKNOWN_LOGPROBS,
        None,
    )


def test_non_finite_floats_read_as_unknown() -> None:
    # Python's json (unlike orjson) yields NaN and infinities: they are unknown too.
    raw = json.dumps(chat_body([], CONTENT))
    raw = raw.replace("-0.125", "NaN").replace("-2.25", "Infinity").replace("-0.5", "-Infinity")
    (choice,) = outcome_from_response("chat", json.loads(raw)).choices
    assert choice.tokens is not None
    assert choice.tokens[0] == TokenLogprob("Hi", None, (("Hi", None), ("Hello", None)))
    assert choice.tokens[1] == TokenLogprob("!", None, (("!", None), (".", -1.0)))
    assert choice.tokens[2].logprob == -9999.0  # vLLM's own minus infinity: a known value


def test_all_unknown_same_tokens_is_incomparable_stream_against_non_stream() -> None:
    primary = _stream("chat", chat_chunks([], NAN_CONTENT))
    # the shadow (non-streamed) of the same model, parsed by a lenient parser
    raw = json.dumps(chat_body([], CONTENT))
    for value in ("-0.125", "-2.25", "-0.5", "-1.0", "-9999.0"):
        raw = raw.replace(value, "NaN")
    shadow = outcome_from_response("chat", json.loads(raw))
    (v,) = compare_outcomes(primary, shadow)
    assert (v.verdict, v.reason) == ("incomparable", UNKNOWN_LOGPROBS)
    assert v.divergence is None and v.max_abs_logprob_delta is None
    assert (v.primary_tokens, v.shadow_tokens) == (3, 3)


def test_unknown_against_known_is_not_drift() -> None:
    # A streamed primary with nulls, a shadow (say a reference engine) with values.
    primary = _stream("chat", chat_chunks([], NAN_CONTENT))
    shadow = outcome_from_response("chat", chat_body([], CONTENT))
    for a, b in ((primary, shadow), (shadow, primary)):
        (v,) = compare_outcomes(a, b)
        assert (v.verdict, v.reason, v.max_abs_logprob_delta) == (
            "incomparable",
            UNKNOWN_LOGPROBS,
            None,
        )


def test_one_null_among_known_values_is_not_drift_and_not_identical() -> None:
    base = [
        TokenLogprob("a", -0.5, (("a", -0.5), ("b", -1.0))),
        TokenLogprob("b", -0.25, (("b", -0.25), ("c", -2.0))),
    ]
    nulled = [base[0], TokenLogprob("b", -0.25, (("b", -0.25), ("c", None)))]
    for a, b in ((base, nulled), (nulled, base), (nulled, nulled)):
        v = compare_choices(_choice(a), _choice(b))
        assert (v.verdict, v.reason) == ("incomparable", UNKNOWN_LOGPROBS)
        assert v.max_abs_logprob_delta is None


def test_known_difference_is_drift_even_with_unknowns_elsewhere() -> None:
    primary = [
        TokenLogprob("a", None, (("a", None), ("b", None))),
        TokenLogprob("b", -0.25, (("b", -0.25), ("c", -2.0))),
    ]
    shadow = [primary[0], TokenLogprob("b", -0.75, (("b", -0.75), ("c", -2.0)))]
    v = compare_choices(_choice(primary), _choice(shadow))
    assert (v.verdict, v.reason) == ("logprob_drift", UNKNOWN_LOGPROBS)
    assert v.divergence is not None and v.divergence.index == 1
    assert v.divergence.margin == 1.75  # known at index 1
    assert v.max_abs_logprob_delta is None  # the prefix holds unknown values: max unknown


def test_tokens_still_compare_text_divergence_at_its_index() -> None:
    primary = _stream("chat", chat_chunks([], NAN_CONTENT))
    flipped = list(NAN_CONTENT)
    flipped[1] = (".", None, [(".", None), ("!", None)])
    shadow = _stream("chat", chat_chunks([], flipped))
    (v,) = compare_outcomes(primary, shadow)
    assert v.verdict == "text_divergence"
    assert v.reason == UNKNOWN_LOGPROBS
    assert v.divergence is not None
    assert (v.divergence.index, v.divergence.primary_token, v.divergence.shadow_token) == (
        1,
        "!",
        ".",
    )
    assert v.divergence.margin is None  # the top-k there is unknown: no margin, not 0 or NaN
    assert v.max_abs_logprob_delta is None  # the prefix (index 0) is unknown


def test_text_divergence_after_known_prefix_keeps_its_delta() -> None:
    primary = [
        TokenLogprob("a", -0.5, (("a", -0.5), ("b", -1.0))),
        TokenLogprob("b", None, (("b", None), ("c", -2.0))),
    ]
    shadow = [
        TokenLogprob("a", -0.75, (("a", -0.75), ("b", -1.0))),
        TokenLogprob("c", -0.5, (("c", -0.5), ("b", -0.75))),
    ]
    v = compare_choices(_choice(primary), _choice(shadow))
    assert (v.verdict, v.reason, v.max_abs_logprob_delta) == ("text_divergence", None, 0.25)
    assert v.divergence is not None and v.divergence.index == 1
    assert v.divergence.margin is None


def test_prefix_of_the_other_with_unknowns() -> None:
    long = [TokenLogprob(t, None, ()) for t in ("a", "b", "c")]
    v = compare_choices(_choice(long[:2], "stop"), _choice(long, "length"))
    assert v.verdict == "text_divergence"
    assert v.reason is not None and UNKNOWN_LOGPROBS in v.reason
    assert v.divergence is not None and v.divergence.index == 2
    assert v.max_abs_logprob_delta is None


def test_prefill_probe_with_unknowns() -> None:
    a = [TokenLogprob("a", None, (("a", None), ("b", None)))]
    b = [TokenLogprob("a", -0.5, (("a", -0.5), ("b", -1.0)))]
    for x, y in ((a, a), (a, b), (b, a)):
        v = compare_choices(_choice(x), _choice(y), first_token_only=True)
        assert (v.verdict, v.reason, v.max_abs_logprob_delta) == (
            "incomparable",
            UNKNOWN_LOGPROBS,
            None,
        )
    c = [TokenLogprob("a", None, (("a", -0.5), ("b", -1.25)))]  # a known top-k entry moved
    v = compare_choices(_choice(c), _choice(b), first_token_only=True)
    assert (v.verdict, v.reason, v.max_abs_logprob_delta) == (
        "logprob_drift",
        UNKNOWN_LOGPROBS,
        None,
    )
    flip = [TokenLogprob("b", None, (("b", None), ("a", None)))]
    v = compare_choices(_choice(a), _choice(flip), first_token_only=True)
    assert v.verdict == "text_divergence"
    assert v.divergence is not None and v.divergence.index == 0 and v.divergence.margin is None


def test_nan_floats_built_directly_are_unknown_too() -> None:
    nan = [TokenLogprob("a", math.nan, (("a", math.nan),))]
    v = compare_choices(_choice(nan), _choice(list(nan)))
    assert (v.verdict, v.reason) == ("incomparable", UNKNOWN_LOGPROBS)
    known = [TokenLogprob("a", -0.5, (("a", -0.5),))]
    assert compare_choices(_choice(nan), _choice(known)).verdict == "incomparable"


def test_incident_and_metrics_render_an_unknown_verdict() -> None:
    primary = _stream("chat", chat_chunks([], NAN_CONTENT))
    flipped = list(NAN_CONTENT)
    flipped[2] = (" no", None, [(" no", None)])
    verdicts = compare_outcomes(primary, _stream("chat", chat_chunks([], flipped)))
    verdicts += compare_outcomes(primary, primary)
    registry = CollectorRegistry()
    bus = EventBus()
    Metrics(registry).subscribe(bus)
    for v in verdicts:
        ev = AuditCompleted("r1", "m", "chat", "full", 0, v, "k", 1, 0, 0.1, 0.1, "same", 0.0)
        record = orjson.loads(orjson.dumps(audit_incident(ev)))
        assert record["reason"] == UNKNOWN_LOGPROBS
        assert record["max_abs_logprob_delta"] is None
        bus.publish(ev)
    text_record = audit_incident(
        AuditCompleted("r1", "m", "chat", "full", 0, verdicts[0], "k", 1, 0, 0.1, 0.1, "s", 0.0)
    )
    assert text_record["divergence"]["index"] == 2
    assert text_record["divergence"]["primary_top"] == ((" ok", None), (" no", None))
    audits = "detproxy_audits_total"
    assert metric(registry, audits, model="m", mode="full", verdict="text_divergence") == 1
    assert metric(registry, audits, model="m", mode="full", verdict="incomparable") == 1
    assert metric(registry, audits, model="m", mode="full", verdict="logprob_drift") == 0
    assert metric(registry, "detproxy_logprob_delta_nats_count", model="m", mode="full") == 0
    assert "NaN" not in generate_latest(registry).decode()


def test_a_duplicate_with_unknown_logprobs_is_incomparable_not_drift() -> None:
    from proxy.audit.auditor import compare_digests
    from proxy.audit.store import digest_choice

    known = _stream("chat", chat_chunks([], CONTENT)).choices[0]
    unknown = _stream("chat", chat_chunks([], NAN_CONTENT)).choices[0]
    assert digest_choice(unknown).logprob_hash is None
    assert digest_choice(unknown).token_hash == digest_choice(known).token_hash
    for before, now in ((known, unknown), (unknown, unknown), (unknown, known)):
        verdict = compare_digests(digest_choice(before), digest_choice(now))
        assert (verdict.verdict, verdict.reason) == ("incomparable", UNKNOWN_LOGPROBS)
    assert compare_digests(digest_choice(known), digest_choice(known)).verdict == "identical"
