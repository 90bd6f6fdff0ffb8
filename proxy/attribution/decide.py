"""From evidence to a cause (pure): the one-switch-at-a-time reading of what triage saw.

In order, the first that the evidence shows:

- ``recipe_change``: the upstream's identity differed between the primary and the shadow, or
  the replays ran on another identity than the primary and agree with each other and with the
  shadow, not with the primary (the change was read only after the shadow);
- ``intrinsic``: two runs in the same condition (alone; the same cache state, or any once cold
  and warm runs agree) differ: serial batch-1 replays of one request disagree;
- ``prefix_cache``: cold runs agree with each other, warm runs agree with each other, cold
  differs from warm (at least two of each), and the primary and the shadow are one of each
  (a side of unknown cache state that ran beside others and matches warm may be a prefill
  chunked under load: ``unknown``, naming it);
- ``speculative``: the upstream says it runs speculative decoding, its runs alone agree, the
  reference's agree, and the two differ;
- ``batch``: a run beside other requests (the primary or the shadow with others in flight)
  differs from the runs alone in the same cache state (at least two, agreeing); where its
  cache state is not known, from the runs alone in each state it may have run in;
- ``unknown`` otherwise, naming the evidence that was missing.

The audit's two sides are the primary and the shadow, or, for a duplicate request, the
primary and the ``earlier`` client answer it repeated (known by its digests, in conditions the
store may not have recorded): each rule reads the other side the same way, whichever it is.

A rule names a cause only from runs that differ in that one switch; a run that is missing can
only take a rule's evidence away (fewer runs never turn ``unknown`` into a cause), and a
reference that disagrees with itself names no cause of the upstream's.
"""

from __future__ import annotations

from collections.abc import Iterable

from proxy.attribution.evidence import Attribution, Evidence, Run

# The run that stands against the primary: a shadow replay, or a duplicate's earlier answer.
OTHER_SIDES = ("shadow", "earlier")


def _other(ev: Evidence) -> Run | None:
    """The audit's other side (the shadow, or the earlier answer a duplicate repeated)."""
    for name in OTHER_SIDES:
        found = ev.run(name)
        if found is not None:
            return found
    return None


def _groups(runs: Iterable[Run]) -> set[int]:
    return {r.group for r in runs if r.group is not None}


def _answered(runs: Iterable[Run]) -> list[Run]:
    return [r for r in runs if r.group is not None]


def _names(runs: Iterable[Run]) -> str:
    return ", ".join(r.name for r in runs)


def _recipe_change(ev: Evidence) -> Attribution | None:
    primary, shadow = ev.run("primary"), _other(ev)
    if (
        primary is not None
        and shadow is not None
        and shadow.target == "same"
        and primary.identity is not None
        and shadow.identity is not None
        and primary.identity != shadow.identity
    ):
        return Attribution(
            "recipe_change",
            f"the upstream's identity changed between the primary ({primary.identity}) "
            f"and the {shadow.name} ({shadow.identity})",
        )
    if primary is None or primary.identity is None or primary.group is None:
        return None
    replays = [r for r in _alone_same(ev) if r.name not in ("primary", *OTHER_SIDES)]
    others = {r.identity for r in replays}
    groups = _groups(replays)
    if (
        len(replays) >= 2
        and len(others) == 1
        and None not in others
        and primary.identity not in others
        and len(groups) == 1
        and primary.group not in groups
        # a shadow on the reference is another engine: it says nothing of the upstream's recipe
        and (
            shadow is None
            or shadow.target != "same"
            or (shadow.group in groups and shadow.identity != primary.identity)
        )
    ):
        return Attribution(
            "recipe_change",
            f"the replays ran on identity {others.pop()} and agree with each other and with "
            f"the {shadow.name if shadow is not None else 'shadow'}, not with the primary, "
            f"which ran on {primary.identity}",
        )
    return None


def _alone_same(ev: Evidence) -> list[Run]:
    return [r for r in _answered(ev.runs) if r.target == "same" and r.alone is True]


def _cache_split(alone: list[Run]) -> tuple[set[int], set[int], int, int]:
    cold = [r for r in alone if r.cache == "cold"]
    warm = [r for r in alone if r.cache == "warm"]
    return _groups(cold), _groups(warm), len(cold), len(warm)


def _intrinsic(ev: Evidence) -> Attribution | None:
    alone = _alone_same(ev)
    cold, warm, n_cold, n_warm = _cache_split(alone)
    for state, groups in (("cold", cold), ("warm", warm)):
        if len(groups) > 1:
            runs = [r for r in alone if r.cache == state]
            return Attribution(
                "intrinsic",
                f"{state} runs alone, one at a time, disagree with each other ({_names(runs)}: "
                f"{len(groups)} distinct outputs)",
            )
    indifferent = n_cold >= 1 and n_warm >= 1 and cold == warm
    if indifferent and len(_groups(alone)) > 1:
        return Attribution(
            "intrinsic",
            f"runs alone disagree ({_names(alone)}: {len(_groups(alone))} distinct outputs) "
            "while cold and warm runs agree",
        )
    # The reference disagreeing with itself is the reference's noise: it names no cause of the
    # upstream's (``_unknown`` says so).
    return None


def _audited(ev: Evidence) -> list[Run]:
    """The audit's two sides that answered (the primary, and the shadow or the earlier answer
    a duplicate repeated): the divergence being explained."""
    return [r for r in (ev.run("primary"), _other(ev)) if r is not None and r.group is not None]


def _prefix_cache(ev: Evidence) -> Attribution | None:
    cold, warm, n_cold, n_warm = _cache_split(_alone_same(ev))
    if n_cold >= 2 and n_warm >= 2 and len(cold) == 1 and len(warm) == 1 and cold != warm:
        # Cold differing from warm explains this audit only when its two sides are one cold
        # and one warm output: a primary that matches neither (e.g. cold, beside a batch: real
        # vLLM on the H200, 2026-12-04) diverged for another reason.
        if any(r.group not in cold | warm for r in _audited(ev)):
            return None
        if _crowded_as_warm(ev, warm):
            return None  # a prefill chunked under load: not told from a cache hit (below)
        sides = _audited(ev)
        if any(r.cache == "cold" and r.group in warm for r in sides) or any(
            r.cache == "warm" and r.group in cold for r in sides
        ):
            return None  # a side known cold output as warm runs do: something else parted it
        return Attribution(
            "prefix_cache",
            f"{n_cold} cold runs agree, {n_warm} warm runs agree, and cold differs from warm",
        )
    return None


def _crowded_as_warm(ev: Evidence, warm: set[int]) -> list[Run]:
    """The audit's sides whose cache state is not known, that ran beside other requests and
    match the warm runs. On real vLLM 0.23 (H200, 2026-12-04) cold primaries (a fresh
    ``cache_salt`` each) beside 12-24 others matched the warm replays bit for bit: a prefill
    chunked under load computes as a warm one does on its cached prefix. Such a side is
    explained by the cache or by the batch, and the evidence does not say which."""
    return [
        r for r in _audited(ev) if r.cache == "unknown" and r.alone is False and r.group in warm
    ]


def _speculative(ev: Evidence) -> Attribution | None:
    recipe = _alone_same(ev)
    reference = [r for r in _answered(ev.runs) if r.target == "reference" and r.alone is not False]
    if len(recipe) < 2 or len(reference) < 2:
        return None
    mine, theirs = _groups(recipe), _groups(reference)
    if len(mine) != 1 or len(theirs) != 1 or mine == theirs:
        return None
    if ev.speculative is True:
        return Attribution(
            "speculative",
            f"the upstream runs speculative decoding; its {len(recipe)} runs agree, the "
            f"reference's {len(reference)} agree, and the two differ",
        )
    return None


def _states(r: Run) -> tuple[str, ...]:
    """The cache states ``r`` may have run in."""
    return (r.cache,) if r.cache in ("cold", "warm") else ("cold", "warm")


def _peers(alone: list[Run], state: str) -> set[int] | None:
    """The one output of the runs alone in cache ``state``, where at least two agree on it;
    None where they do not say (fewer than two, or they disagree)."""
    runs = [r for r in alone if r.cache == state]
    groups = _groups(runs)
    return groups if len(runs) >= 2 and len(groups) == 1 else None


def _odd_in_company(alone: list[Run], r: Run) -> bool:
    """``r`` ran beside other requests and differs from the runs alone in every cache state it
    may have run in: the company is the one switch left. A run of unknown cache state needs
    both cold and warm runs alone (each self-consistent), so a missing warm run can never
    turn ``unknown`` into ``batch``."""
    for state in _states(r):
        peers = _peers(alone, state)
        if peers is None or r.group in peers:
            return False
    return True


def _batch(ev: Evidence) -> Attribution | None:
    alone = _alone_same(ev)
    crowded = [r for r in _answered(ev.runs) if r.target == "same" and r.alone is False]
    odd = [r for r in crowded if _odd_in_company(alone, r)]
    if not odd:
        return None
    states = {state for r in odd for state in _states(r)}
    n_alone = len([r for r in alone if r.cache in states])
    company = ", ".join(f"{r.name} with {r.inflight} in flight" for r in odd)
    return Attribution(
        "batch",
        f"{n_alone} runs alone agree ({' and '.join(sorted(states))}); the runs beside other "
        f"requests differ ({company})",
    )


def _unknown(ev: Evidence) -> Attribution:
    missing = list(ev.missing)
    if ev.cold_method is None:
        missing.append("no way to run cold on this engine")
    alone = _alone_same(ev)
    if len(alone) < 2:
        missing.append(f"serial replays alone: {len(alone)} answered, 2 needed")
    groups = _groups(alone)
    if len(alone) >= 2 and len(groups) == 1:
        primary, shadow = ev.run("primary"), _other(ev)
        odd = [r for r in (primary, shadow) if r is not None and r.group not in groups]
        if not odd:
            other = shadow.name if shadow is not None else "shadow"
            missing.append(f"replays agreed with both primary and {other}")
        else:
            for r in odd:
                if r.alone is None:
                    missing.append(
                        f"replays agree with each other, not with the {r.name}, and whether "
                        f"the {r.name} shared its batch is not known"
                    )
                elif r.target == "reference":
                    missing.append(
                        "the recipe differs from the reference, but the upstream does not say "
                        "it runs speculative decoding"
                        if ev.speculative is not True
                        else "replays to the reference (2 needed to call it self-consistent)"
                    )
                else:
                    missing.append(f"the {r.name} differs from the replays in the same condition")
    for r in _answered(ev.runs):
        if r.target == "same" and r.alone is False and r.cache not in ("cold", "warm"):
            short = [s for s in ("cold", "warm") if _peers(alone, s) is None]
            if short and r.group not in _groups(alone):
                missing.append(
                    f"the {r.name}'s cache state is not known (no cached-token count from the "
                    f"engine, no new cache_salt of the client's), and the {' and '.join(short)} "
                    "runs alone that would rule the cache out (2 agreeing each) are missing"
                )
    reference = [r for r in _answered(ev.runs) if r.target == "reference" and r.alone is not False]
    if len(_groups(reference)) > 1:
        missing.append(
            f"the reference disagrees with itself ({_names(reference)}): its noise names no "
            "cause of the upstream's"
        )
    _, warm, _, n_warm = _cache_split(alone)
    for r in _crowded_as_warm(ev, warm) if n_warm >= 2 else ():
        missing.append(
            f"whether the {r.name} hit the prefix cache: it matches the warm runs and ran beside "
            f"{r.inflight} others, and a prefill chunked under load computes as a warm one "
            "(an engine that reports cached prompt tokens, vLLM's "
            "--enable-prompt-tokens-details, tells it)"
        )
    if not missing:
        missing.append("the runs fit no single cause")
    return Attribution("unknown", "the evidence does not decide", tuple(dict.fromkeys(missing)))


def decide(ev: Evidence) -> Attribution:
    for rule in (_recipe_change, _intrinsic, _prefix_cache, _speculative, _batch):
        found = rule(ev)
        if found is not None:
            return found
    return _unknown(ev)
