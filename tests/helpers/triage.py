"""Driving detproxy's triage in front of the emulator: the settings that make it fast, waiting
for it to settle, the incidents it attributed, and the confusion table of the causes it gave
against what the emulator injected into each audited request."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from aiohttp.test_utils import TestClient

from proxy.tools.emulator import EmulatorServer
from tests.helpers.waiting import Unmet, eventually

# Every request audited, shadows and triage as fast as the test machine allows.
FAST = {
    "DETPROXY_AUDIT__SAMPLE_RATE": "1",
    "DETPROXY_AUDIT__MAX_SHADOWS_PER_S": "1000",
    "DETPROXY_AUDIT__PASSIVE_CHECKS": "false",
    "DETPROXY_AUDIT__MAX_CONCURRENT_SHADOWS": "1",
    "DETPROXY_AUDIT__CACHE_SALT": "true",
    "DETPROXY_AUDIT__QUIET_SETTLE_S": "0.01",
    "DETPROXY_AUDIT__QUIET_POLL_S": "0.005",
    "DETPROXY_AUDIT__TOKEN_ALLOWANCE": "100000000",
    "DETPROXY_ATTRIBUTION__MAX_PER_MINUTE": "100000",
    "DETPROXY_ATTRIBUTION__TOKEN_ALLOWANCE": "100000000",
    "DETPROXY_ATTRIBUTION__QUEUE_SIZE": "1000",
    "DETPROXY_UPSTREAM__FINGERPRINT_INTERVAL_S": "0.5",
}


async def idle(client: TestClient[Any, Any], timeout_s: float = 60.0) -> dict[str, Any]:
    """Wait until no shadow and no triage is queued or running; the status then."""

    async def status() -> dict[str, Any] | Unmet:
        status = await (await client.get("/detproxy/status")).json()
        shadow, triage = status["shadow"], status["triage"]
        done = (
            shadow["queued"] == 0
            and shadow["running"] == 0
            and triage["queued"] == 0
            and not triage["running"]
        )
        return dict(status) if done else Unmet({"shadow": shadow, "triage": triage})

    return await eventually(status, timeout_s=timeout_s, what="shadows and triage settled")


async def causes_of(client: TestClient[Any, Any]) -> list[dict[str, Any]]:
    """The audit incidents, each with its ``cause`` and ``cause_evidence`` once triaged."""
    incidents = await (await client.get("/detproxy/incidents?limit=1000&kind=audit")).json()
    return list(incidents)


async def fingerprint_of(client: TestClient[Any, Any]) -> str | None:
    status = await (await client.get("/detproxy/status")).json()
    fp = status["upstream_fingerprint"]
    return None if fp is None else str(fp["fingerprint"])


# The emulator's injection record kinds that change an answer, and the cause each is.
CAUSE_OF_KIND = {
    "flip": "intrinsic",
    "batch_drift": "batch",
    "batch_divergence": "batch",
    "prefix_cache": "prefix_cache",
    "speculative": "speculative",
}
# The truth of a divergence that the reference engine's own noise made (a flip there): no cause
# of the upstream's, so any cause named for it is wrong.
REFERENCE_NOISE = "reference"
CAUSE_COLUMNS = ("intrinsic", "batch", "prefix_cache", "speculative", "recipe_change", "unknown")


def replay_flipped(incident: dict[str, Any], upstream: EmulatorServer) -> bool:
    """A run of the incident's experiment alone on the upstream (sent as ``<experiment>
    -triage-<run>``) got a flip: serial runs at batch 1 differ, which is what SPEC 1.14 calls
    intrinsic, whatever else parted the audited pair."""
    evidence = incident.get("cause_evidence") or {}
    experiment = evidence.get("experiment") or incident["request_id"]
    for run in evidence.get("runs") or []:
        if run.get("target") != "same" or run.get("alone") is not True:
            continue
        name = str(run.get("name"))
        if name in ("primary", "shadow", "earlier"):
            continue
        if any(r["kind"] == "flip" for r in upstream.injections(f"{experiment}-triage-{name}")):
            return True
    return False


def truth_of(
    request_id: str, upstream: EmulatorServer, reference: EmulatorServer | None = None
) -> frozenset[str]:
    """What the emulator injected into the audited pair of ``request_id``: the primary (sent
    with that X-Request-Id) on the upstream, its shadow (``-shadow``) on the reference where
    one is configured, else on the upstream. Empty: nothing was injected."""
    primary = upstream.injections(request_id)
    shadow = (reference or upstream).injections(f"{request_id}-shadow")
    truth = {CAUSE_OF_KIND[r["kind"]] for r in primary if r["kind"] in CAUSE_OF_KIND}
    if any(r["kind"] in CAUSE_OF_KIND for r in shadow):
        if reference is None:
            truth |= {CAUSE_OF_KIND[r["kind"]] for r in shadow if r["kind"] in CAUSE_OF_KIND}
        else:
            truth.add(REFERENCE_NOISE)
    return frozenset(truth)


def label(truth: frozenset[str]) -> str:
    return "+".join(sorted(truth)) if truth else "none"


@dataclass
class Confusion:
    """Truth (what was injected into the audited pair) x the cause detproxy gave.

    A cause given is right when it is one of the effects injected into that pair (with two, the
    divergence has both causes and either is an explanation); ``unknown`` is never wrong, only
    undecided."""

    cells: Counter[tuple[str, str]] = field(default_factory=Counter)
    wrong: list[dict[str, Any]] = field(default_factory=list)

    def add(self, truth: frozenset[str], cause: str, incident: dict[str, Any]) -> None:
        self.cells[(label(truth), cause)] += 1
        if cause != "unknown" and cause not in truth:
            self.wrong.append({"truth": label(truth), "cause": cause, "incident": incident})

    def merge(self, other: Confusion) -> None:
        self.cells.update(other.cells)
        self.wrong.extend(other.wrong)

    @property
    def total(self) -> int:
        return sum(self.cells.values())

    @property
    def unknown(self) -> int:
        return sum(n for (_, cause), n in self.cells.items() if cause == "unknown")

    def rows(self) -> list[str]:
        return sorted({t for t, _ in self.cells})

    def decided_right(self) -> dict[str, tuple[int, int]]:
        """Per cause given (``unknown`` aside): (right, decided)."""
        out: dict[str, tuple[int, int]] = {}
        for (truth, cause), n in self.cells.items():
            if cause == "unknown":
                continue
            right, decided = out.get(cause, (0, 0))
            ok = cause in truth.split("+")
            out[cause] = (right + (n if ok else 0), decided + n)
        return out

    def recall_decided(self) -> dict[str, tuple[int, int]]:
        """Per injected cause: of the incidents with it in their truth that were decided,
        (right, decided)."""
        out: dict[str, tuple[int, int]] = {}
        for (truth, cause), n in self.cells.items():
            if cause == "unknown":
                continue
            for part in truth.split("+"):
                right, decided = out.get(part, (0, 0))
                out[part] = (right + (n if cause in truth.split("+") else 0), decided + n)
        return out

    def markdown(self) -> str:
        cols = [c for c in CAUSE_COLUMNS if any(k[1] == c for k in self.cells)] or ["unknown"]
        lines = [
            "| truth (injected) \\ cause given | " + " | ".join(f"`{c}`" for c in cols) + " |",
            "|---|" + "---:|" * len(cols),
        ]
        for row in self.rows():
            cells = [str(self.cells[(row, c)]) for c in cols]
            lines.append(f"| {row} | " + " | ".join(cells) + " |")
        total = self.total
        share = self.unknown / total if total else 0.0
        decided = {c: f"{r}/{d}" for c, (r, d) in sorted(self.decided_right().items())}
        lines.append("")
        lines.append(
            f"{total} incidents; right of the decided per cause given: {decided or '-'}; "
            f"unknown: {self.unknown} ({share:.0%})"
        )
        return "\n".join(lines)


def confusion(
    incidents: Iterable[dict[str, Any]],
    upstream: EmulatorServer,
    reference: EmulatorServer | None = None,
) -> Confusion:
    table = Confusion()
    for incident in incidents:
        truth = truth_of(str(incident["request_id"]), upstream, reference)
        if truth and replay_flipped(incident, upstream):
            truth |= {"intrinsic"}  # the engine's own race, seen by the replays
        table.add(truth, str(incident.get("cause")), incident)
    return table
