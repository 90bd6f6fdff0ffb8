"""The diagnosis as text (one block per cause, numbers first) and as JSON."""

from __future__ import annotations

from typing import Any

import orjson

from proxy.tools.diagnose.engine import Engine
from proxy.tools.diagnose.verdicts import FOUND, CauseVerdict, Diagnosis
from proxy.tools.sweep.recipe import describe_recipe

_STATUS = {
    "found": "FOUND",
    "not_found": "not found",
    "not_tested": "not tested",
    "unknown": "undecided",
}


def _numbers(v: CauseVerdict) -> str:
    parts = [f"{v.prompts_affected} of {v.prompts_tested} prompt(s)"]
    if v.distinct_outputs:
        parts.append(f"up to {v.distinct_outputs} distinct outputs")
    if v.text_changed:
        parts.append(f"text changed on {v.text_changed}")
    if v.first_position is not None:
        parts.append(f"first divergent token {v.first_position}")
    if v.margins:
        parts.append(f"margins {min(v.margins):.3g}..{max(v.margins):.3g}")
    if v.max_delta is not None:
        parts.append(f"max delta {v.max_delta:.3g} nats")
    return ", ".join(parts)


def text(
    diagnosis: Diagnosis,
    engine: Engine,
    settings: dict[str, Any],
    recipe: dict[str, Any] | None = None,
) -> str:
    lines = [
        f"upstream: {engine.kind} {engine.version or ''}".rstrip()
        + f", cold prefills by {engine.how_cold}",
        f"what loaded: {describe_recipe(recipe)}",
        f"{diagnosis.prompts} prompt(s), {settings['runs']} runs each, max_tokens"
        f" {settings['max_tokens']}, top-{settings['top_logprobs']} logprobs, concurrency"
        f" {','.join(map(str, settings['concurrency']))}",
        "",
    ]
    for v in diagnosis.verdicts:
        head = f"{v.cause:<14} {_STATUS[v.status]}"
        if v.status == FOUND:
            head += f": {_numbers(v)}"
        elif v.status == "not_found" and v.prompts_tested:
            head += f" ({v.prompts_tested} prompt(s) tested)"
        if v.missing and v.status != FOUND:
            head += f" (missing: {v.missing})"
        lines.append(head)
        if v.status == FOUND:
            lines += [f"    {e}" for e in v.evidence]
            if v.missing:
                lines.append(f"    missing: {v.missing}")
            lines.append(f"    what to do: {v.recommendation}")
    prefill = diagnosis.verdicts[0].detail.get("prefill", [])
    if prefill:
        worst = max(prefill, key=lambda p: p["distinct_vectors"])
        lines.append(
            f"prefill probe: up to {worst['distinct_vectors']} distinct top-k vector(s) of"
            f" {settings['runs']} (prompt {worst['prompt']}), max delta"
            f" {max((p['max_delta_nats'] or 0.0) for p in prefill):.3g} nats"
        )
    lines.append("")
    if diagnosis.stable:
        lines.append("stable: no cause found")
    else:
        lines.append("UNSTABLE: " + ", ".join(v.cause for v in diagnosis.causes))
    return "\n".join(lines)


def as_json(
    diagnosis: Diagnosis,
    engine: Engine,
    settings: dict[str, Any],
    recipe: dict[str, Any] | None = None,
) -> str:
    doc = {
        "recipe": recipe,  # what the engine says it loaded; None where it says nothing
        "stable": diagnosis.stable,
        "causes": [v.to_dict() for v in diagnosis.causes],
        "checks": [v.to_dict() for v in diagnosis.verdicts],
        "prompts": diagnosis.prompts,
        "engine": {"kind": engine.kind, "version": engine.version, "cold": engine.how_cold},
        "settings": settings,
    }
    return orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode()
