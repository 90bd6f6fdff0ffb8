"""Tests for the online repetition-loop detector (proxy/loops/detector.py)."""

from __future__ import annotations

import itertools
import random
import string
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.loops.detector import DetectorConfig, LoopDetector, LoopReport

CORPUS = Path(__file__).parent / "corpus"
CORPUS_FILES = sorted(p for p in CORPUS.iterdir() if p.is_file())
PROSE = (CORPUS / "prose.txt").read_text(encoding="utf-8")
DEFAULT = DetectorConfig()


def feed_split(
    det: LoopDetector, text: str, rng: random.Random, lo: int = 1, hi: int = 20
) -> tuple[LoopReport | None, int]:
    """Feed ``text`` in random-sized deltas; return the first report and how many fired."""
    first: LoopReport | None = None
    fired = 0
    i = 0
    while i < len(text):
        k = rng.randint(lo, hi)
        rep = det.feed(text[i : i + k])
        i += k
        if rep is not None:
            fired += 1
            first = first or rep
    return first, fired


def feed_until(det: LoopDetector, text: str, rng: random.Random) -> LoopReport | None:
    i = 0
    while i < len(text):
        k = rng.randint(1, 20)
        rep = det.feed(text[i : i + k])
        i += k
        if rep is not None:
            return rep
    return None


def make_unit(length: int, rng: random.Random) -> str:
    """A primitive unit of ``length`` chars that reads like text (letters, spaces, punctuation)."""
    if length <= 8:
        letters = rng.sample(string.ascii_lowercase, length)  # distinct: primitive
        return "".join(letters)
    words: list[str] = []
    size = 0
    while size < length:
        w = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 9)))
        words.append(w)
        size += len(w) + 1
    unit = (" ".join(words))[: length - 2] + ".\n"
    assert (unit + unit).find(unit, 1) == len(unit)
    return unit


def is_rotation(preview: str, unit: str) -> bool:
    doubled = unit + unit
    return any(doubled[i : i + len(preview)] == preview for i in range(len(unit)))


# --- detection of real loops ---------------------------------------------------------------


@pytest.mark.parametrize("period", [4, 5, 6, 7, 8, 14, 50, 180, 400, 2000])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_detects_exact_loop(period: int, seed: int) -> None:
    rng = random.Random(period * 100 + seed)
    unit = make_unit(period, rng)
    prefix = PROSE[: rng.randint(300, 3000)]
    need = DEFAULT.required_chars(period)
    assert need is not None
    copies = (need + DEFAULT.check_every_chars) // period + 2
    text = prefix + unit * copies
    det = LoopDetector()
    rep = feed_until(det, text, rng)
    assert rep is not None, f"period {period} not detected"
    onset = len(prefix)
    assert rep.period == period
    assert rep.trivial is False
    assert onset - period < rep.start_offset <= onset
    assert rep.repeats == rep.covered_chars // period
    assert rep.covered_chars >= need
    assert rep.unit_preview == text[rep.start_offset : rep.start_offset + min(period, 120)]
    assert is_rotation(rep.unit_preview, unit)
    if rep.start_offset == onset:
        assert rep.unit_preview == unit[:120]
    # Lag (documented bound): the loop is found by the first check (checks run at every
    # multiple of check_every_chars) after its run covers required_chars(period), i.e. at a
    # stream offset below onset + required_chars(period) + check_every_chars; `feed` returns it
    # with the delta that crosses that offset (detected_at - found_at < one delta). With the
    # defaults: 256 chars for units up to 64 chars, 4 units above (720 for 180, 1600 for 400).
    found_at = rep.start_offset + rep.covered_chars
    assert found_at % DEFAULT.check_every_chars == 0
    assert found_at < onset + need + DEFAULT.check_every_chars
    assert found_at <= rep.detected_at < found_at + 20


def test_thinking_paragraph_repeated_22_times() -> None:
    paragraph = (
        "Wait, let me re-check the date in the second paragraph. The invoice says the payment "
        "is due on the 14th, but the reminder mentions the 15th, so I should verify it again.\n"
    )
    assert 170 <= len(paragraph) <= 190
    text = "Okay, the user wants the due date and the amount from this email. " + paragraph * 22
    det = LoopDetector()
    rep, fired = feed_split(det, text, random.Random(5), 1, 8)
    assert rep is not None and fired == 1
    assert rep.period == len(paragraph)
    assert rep.unit_preview == paragraph[:120]
    assert rep.repeats >= 4
    assert rep.start_offset + rep.covered_chars <= text.index(paragraph) + 5 * len(paragraph)


@pytest.mark.parametrize(
    "unit",
    [
        "The little robot looked at the stars and said, I will find my way home.\n",
        "  - Step: open the file, read the header, and check the checksum again.\n",
        "Roses are red, the sky is blue, I wrote this poem just for you. ",
        "人工智能正在改变世界。",
        '{"role": "assistant", "content": "I am sorry, I cannot help with that."},\n',
    ],
)
def test_detects_smollm2_style_loops(unit: str) -> None:
    text = PROSE[:700] + unit * 40
    rep = feed_until(LoopDetector(), text, random.Random(3))
    assert rep is not None
    assert rep.period == len(unit)
    assert is_rotation(rep.unit_preview, unit)


def test_loop_from_offset_zero_single_delta() -> None:
    unit = "all work and no play makes jack a dull boy. "
    det = LoopDetector()
    rep = det.feed(unit * 30)
    assert rep is not None
    assert (rep.period, rep.start_offset, rep.unit_preview) == (len(unit), 0, unit)
    assert rep.covered_chars == 256  # the first check at which the run covers 256 chars
    assert rep.detected_at == len(unit) * 30


def test_reports_primitive_unit_not_multiple() -> None:
    # A multiple of the unit (20 chars) would qualify earlier than the unit (10 chars) itself
    # under these thresholds; the detector must still report 10, and only once 10 qualifies.
    cfg = DetectorConfig(
        short_period=16,
        min_short_repeats=40,
        min_covered_chars=128,
        max_period=64,
        window_chars=1100,
        check_every_chars=8,
    )
    unit = "abcdefghi "
    det = LoopDetector(cfg)
    prefix = "Some text before the loop begins. "
    rep = det.feed(prefix + unit * 39)
    assert rep is None
    text = unit * 10
    rep = feed_until(det, text, random.Random(0))
    assert rep is not None
    assert rep.period == 10
    assert rep.covered_chars >= 400
    assert rep.start_offset == len(prefix) - 1  # the prefix ends with the unit's last char


@pytest.mark.parametrize("every", [1, 32])
@pytest.mark.parametrize("inner", [20, 31, 64])
def test_unit_with_internal_repetition(inner: int, every: int) -> None:
    # The unit is itself periodic over its whole length (period `inner`, which never qualifies
    # on its own because the unit is not a multiple of it). When the tail sits at a unit
    # boundary the short run covers exactly one unit: the search must not skip the real period
    # while discarding the short one.
    cfg = DetectorConfig(check_every_chars=every)
    block = make_unit(inner, random.Random(inner))
    unit = block * ((200 - inner // 2) // inner) + block[: inner // 2]  # inner run < 256
    need = cfg.required_chars(len(unit))
    assert need is not None
    prefix = PROSE[:333]
    for seed in range(5):
        rep = feed_until(LoopDetector(cfg), prefix + unit * 8, random.Random(seed))
        assert rep is not None and rep.period == len(unit)
        assert rep.start_offset + rep.covered_chars < len(prefix) + need + every
        if every == 1:
            assert rep.covered_chars == need


@pytest.mark.parametrize("period", [4095, 4096, 4097])
def test_longest_period(period: int) -> None:
    unit = make_unit(period, random.Random(period))
    det = LoopDetector()
    rep = det.feed(PROSE[:100] + unit * 5)
    if period > DEFAULT.max_period:
        assert rep is None  # beyond max_period; its multiples are longer still
    else:
        assert rep is not None and rep.period == period and rep.start_offset == 100
        assert rep.covered_chars < 4 * period + DEFAULT.check_every_chars


def test_unit_made_of_a_repeated_word_reports_the_word() -> None:
    rep = LoopDetector().feed(PROSE[:500] + "spam eggs " * 100)
    assert rep is not None
    assert rep.period == len("spam eggs ")


# --- fires once, bounded memory ------------------------------------------------------------


def test_fires_only_once_and_drops_its_buffer() -> None:
    unit = "I think the answer is 42, but let me double check that once more. "
    det = LoopDetector()
    rep, fired = feed_split(det, PROSE[:1000] + unit * 300, random.Random(1))
    assert fired == 1
    assert rep is not None and det.report == rep
    assert det.buffered_chars == 0
    assert det.feed(unit * 10) is None


def test_empty_deltas_are_ignored() -> None:
    det = LoopDetector()
    for _ in range(100):
        assert det.feed("") is None
    assert det.buffered_chars == 0
    text = PROSE[:400] + "tick tock goes the clock. " * 40
    reps = [det.feed(ch) or det.feed("") for ch in text]
    assert sum(r is not None for r in reps) == 1


def test_memory_bounded_over_one_megabyte() -> None:
    rng = random.Random(9)
    corpus = [p.read_text(encoding="utf-8") for p in CORPUS_FILES]
    det = LoopDetector()
    # Deltas wait for the next probe, 5 checks apart with the defaults (the "Probes" of the
    # detector's docstring).
    cap = DEFAULT.window_chars + 5 * DEFAULT.check_every_chars + 64
    peak = 0
    fed = 0
    docs = 0
    while fed < 1_000_000:
        docs += 1
        text = f"\n\n--- document {docs} ---\n\n" + rng.choice(corpus)
        pos = 0
        while pos < len(text):
            k = rng.randint(1, 64)
            assert det.feed(text[pos : pos + k]) is None
            pos += k
            peak = max(peak, det.buffered_chars)
            assert det.buffered_chars <= cap
        fed += len(text)
    assert peak >= DEFAULT.window_chars - DEFAULT.check_every_chars  # the window was used


def test_memory_bounded_with_one_huge_delta() -> None:
    det = LoopDetector()
    text = (PROSE + "\n") * 200  # ~1 MB, a 5 KB "unit": longer than max_period, never a loop
    assert det.feed(text) is None
    assert det.buffered_chars <= DEFAULT.window_chars + DEFAULT.check_every_chars


# --- no detection on normal text -----------------------------------------------------------


@pytest.mark.parametrize("path", CORPUS_FILES, ids=lambda p: p.name)
@pytest.mark.parametrize("seed", range(4))
def test_corpus_has_no_loop(path: Path, seed: int) -> None:
    text = path.read_text(encoding="utf-8")
    assert len(text) >= 3000
    rep, _ = feed_split(LoopDetector(), text, random.Random(seed))
    assert rep is None, rep


def test_corpus_concatenated_has_no_loop() -> None:
    text = "\n\n".join(p.read_text(encoding="utf-8") for p in CORPUS_FILES)
    assert LoopDetector().feed(text) is None


@pytest.mark.parametrize(
    "text",
    [
        "".join(
            f"Step {i}: think about the problem again and check the answer.\n" for i in range(300)
        ),
        "".join(
            f"- item {i % 7}{i % 11}: same text for every bullet in the list\n" for i in range(200)
        ),
        " ".join(str(i) for i in range(5000)),
        "".join(f"[{i:05d}] retrying connection to 10.0.0.1:5432 ...\n" for i in range(300)),
    ],
    ids=["numbered-steps", "bullets-two-counters", "counting", "retry-log"],
)
def test_near_loops_that_differ_in_digits(text: str) -> None:
    assert feed_split(LoopDetector(), text, random.Random(0))[0] is None


@pytest.mark.parametrize(
    "text",
    [
        "ha " * 60,
        "-" * 1000,
        "=" * 1000,
        "\n" * 1000,
        "|---" * 250,
        "| --- " * 160,
        "No. " * 60,
        "very, " * 40,
    ],
)
def test_legit_short_repetition_of_moderate_length(text: str) -> None:
    assert LoopDetector().feed("Intro. " + text + " Outro.") is None


# --- trivial units -------------------------------------------------------------------------


@pytest.mark.parametrize(("unit", "period"), [("-", 1), ("\n", 1), ("ha ", 3), ("| --- ", 6)])
def test_trivial_units_fire_only_when_very_long(unit: str, period: int) -> None:
    det = LoopDetector()
    assert det.feed("Intro. " + unit * (1000 // len(unit))) is None
    rep = det.feed(unit * (200 // len(unit) + 1))
    assert rep is not None
    assert rep.trivial is True
    assert rep.period == period
    assert rep.covered_chars >= 1024


def test_trivial_units_can_be_disabled() -> None:
    det = LoopDetector(DetectorConfig(min_trivial_covered_chars=None))
    assert det.feed("=" * 20000) is None
    assert det.feed("\n\n" * 5000) is None
    assert det.buffered_chars <= DEFAULT.window_chars + DEFAULT.check_every_chars


# --- config --------------------------------------------------------------------------------


def test_required_chars_is_stricter_for_short_units() -> None:
    need = {p: DEFAULT.required_chars(p) for p in (4, 5, 8, 14, 64, 180, 400, 4096)}
    assert need == {4: 256, 5: 256, 8: 256, 14: 256, 64: 256, 180: 720, 400: 1600, 4096: 16384}
    reps = {p: n // p for p, n in need.items() if n is not None}
    assert reps[5] > 10 * reps[400]
    assert DEFAULT.required_chars(3) == 1024
    assert DEFAULT.required_chars(40, trivial=True) == 1024


@pytest.mark.parametrize(
    "kwargs",
    [
        {"window_chars": 1000},
        {"min_repeats": 1},
        {"min_covered_chars": 10},
        {"max_period": 2, "min_period": 4},
        {"check_every_chars": 0},
        {"min_trivial_covered_chars": 0},
    ],
)
def test_bad_config_is_rejected(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        DetectorConfig(**kwargs)


# --- split independence, and an exhaustive oracle ------------------------------------------

SMALL = DetectorConfig(
    max_period=100,
    min_covered_chars=128,
    min_trivial_covered_chars=300,
    window_chars=500,
    check_every_chars=16,
)


def oracle(text: str, cfg: DetectorConfig) -> tuple[int, int] | None:
    """Brute force: at each check offset, the smallest primitive unit whose tail run qualifies."""
    every = cfg.check_every_chars
    for end in range(every, len(text) + 1, every):
        win = text[max(0, end - cfg.window_chars) : end]
        n = len(win)
        for p in range(1, min(cfg.max_period, n) + 1):
            i = n - p - 1
            while i >= 0 and win[i] == win[i + p]:
                i -= 1
            run = n - i - 1
            if run < 2 * p:
                continue
            unit = win[n - run : n - run + p]
            if (unit + unit).find(unit, 1) != p:
                continue  # not primitive: a smaller p has the same run
            trivial = p < cfg.min_period or not any(c.isalnum() for c in unit)
            need = cfg.required_chars(p, trivial)
            if need is not None and run >= need:
                return p, end - run
    return None


def summary(rep: LoopReport | None) -> tuple[int, int, int, str, int, bool] | None:
    if rep is None:
        return None
    return (
        rep.period,
        rep.start_offset,
        rep.repeats,
        rep.unit_preview,
        rep.covered_chars,
        rep.trivial,
    )


def run_split(text: str, cuts: list[int], cfg: DetectorConfig) -> LoopReport | None:
    det = LoopDetector(cfg)
    bounds = [0, *sorted(c % (len(text) + 1) for c in cuts), len(text)]
    for a, b in itertools.pairwise(bounds):
        rep = det.feed(text[a:b])
        if rep is not None:
            return rep
    return None


@st.composite
def loopy_text(draw: st.DrawFn) -> str:
    """Noise over a tiny alphabet (many accidental repeats) mixed with real and near loops."""
    alphabet = draw(st.sampled_from(["ab", "abc ", "ab1\n", "xyz-. ", string.ascii_lowercase]))
    parts: list[str] = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["noise", "loop", "near"]))
        if kind == "noise":
            parts.append(draw(st.text(alphabet=alphabet, max_size=200)))
            continue
        unit = draw(
            st.text(alphabet=alphabet, min_size=1, max_size=draw(st.sampled_from([8, 110])))
        )
        reps = draw(st.integers(2, 450 // len(unit) + 2))
        if kind == "loop":
            parts.append(unit * reps)
        else:
            parts.append("".join(f"{unit}{i}" for i in range(reps)))
    return "".join(parts)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=loopy_text(), cuts=st.lists(st.integers(0, 10_000), max_size=40))
def test_matches_brute_force_oracle_for_any_split(text: str, cuts: list[int]) -> None:
    whole = LoopDetector(SMALL).feed(text)
    split = run_split(text, cuts, SMALL)
    assert summary(split) == summary(whole)
    expected = oracle(text, SMALL)
    got = None if whole is None else (whole.period, whole.start_offset)
    assert got == expected


@settings(max_examples=60, deadline=None)
@given(
    period=st.integers(4, 600),
    prefix_len=st.integers(0, 3000),
    cuts=st.lists(st.integers(0, 100_000), max_size=200),
    seed=st.integers(0, 2**16),
)
def test_any_split_gives_the_same_report(
    period: int, prefix_len: int, cuts: list[int], seed: int
) -> None:
    rng = random.Random(seed)
    unit = make_unit(period, rng)
    need = DEFAULT.required_chars(period)
    assert need is not None
    copies = (need + DEFAULT.check_every_chars) // period + 2
    text = PROSE[:prefix_len] + unit * copies + PROSE[:200]
    whole = LoopDetector().feed(text)
    assert whole is not None and whole.period == period
    assert summary(run_split(text, cuts, DEFAULT)) == summary(whole)


@pytest.mark.parametrize("cfg", [SMALL, DEFAULT], ids=["small", "defaults"])
@pytest.mark.parametrize("period", [5, 37, 64, 100])
def test_a_loop_starting_at_any_offset_fires_at_the_oracles_check(
    cfg: DetectorConfig, period: int
) -> None:
    # Only every few checks are searched outside a loop (the detector's "Probes"): a loop
    # whose run begins at each offset across several probe intervals, fed whole and token by
    # token, is still reported at the first check where it qualifies.
    unit = make_unit(period, random.Random(period))
    need = cfg.required_chars(period)
    assert need is not None
    span = 6 * 5 * cfg.check_every_chars  # several probe intervals at every stride used here
    for onset in range(0, span, 3):
        text = PROSE[:onset] + unit * ((need + 2 * cfg.check_every_chars) // period + 2)
        expected = oracle(text, cfg)
        assert expected is not None
        whole = LoopDetector(cfg).feed(text)
        assert whole is not None and (whole.period, whole.start_offset) == expected
        # ... at the first check (a multiple of check_every_chars) its run covers ``need``.
        every = cfg.check_every_chars
        first_check = -(-(whole.start_offset + need) // every) * every
        assert whole.start_offset + whole.covered_chars == first_check
        tokens = run_split(text, list(range(0, len(text), 4)), cfg)
        assert summary(tokens) == summary(whole)
