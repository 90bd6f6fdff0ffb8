"""What the audit hands to triage: one shadow comparison, or one duplicate request's, whose
verdict was not identical."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from proxy.audit.outcome import Outcome
from proxy.audit.store import ChoiceDigest

# The verdicts triage looks into (incomparable is an error, not a divergence).
TRIAGED = ("logprob_drift", "text_divergence", "answer_divergence")


@dataclass(frozen=True, slots=True)
class Diverged:
    """One choice that diverged: its index, the audit's verdict, the incident's ``ts``."""

    choice: int
    verdict: str
    audit_ts: float


@dataclass(frozen=True, slots=True)
class Earlier:
    """The earlier client answer a duplicate request was compared with, known by its digests
    only (one per choice, in order: its text was never stored), and how it ran where the
    duplicate store recorded it (the in-memory store does; a shared one does not)."""

    digests: tuple[ChoiceDigest, ...]
    inflight: int | None = None  # detproxy's client requests in flight (itself included)
    cache: str = "unknown"  # cold | warm | unknown, as for a primary
    at: float | None = None  # wall clock, when it started


@dataclass(frozen=True, slots=True)
class TriageCase:
    """A shadow replay that diverged from its primary, with how each of the two ran.

    ``body`` is the replay's body as the shadow sent it (logprobs as the primary had them; one
    token long in prefill mode) less the shadow's own ``cache_salt`` (the client's, if any, is
    kept). ``shadow_cold``: the shadow ran with a fresh ``cache_salt`` (or cache_prompt off).
    ``shadow_alone``: None when other shadows could have shared its batch.

    A duplicate (``mode`` duplicate) has ``earlier``: the client answer it repeated, which
    stands where the shadow would; its ``shadow`` is an empty outcome and the ``shadow_*``
    fields are unused. ``body`` is then the client request as the primary sent it."""

    request_id: str
    model: str
    endpoint: str
    raw_path: str
    body: Mapping[str, Any]
    headers: Mapping[str, str]
    mode: str  # full | prefill | duplicate
    target: str  # same | the reference's URL: where the shadow went
    primary: Outcome
    shadow: Outcome
    primary_inflight: int  # detproxy's client requests in flight when the primary started
    primary_inflight_end: int  # and when it ended (both count the primary itself)
    shadow_inflight: int
    shadow_cold: bool
    shadow_alone: bool | None
    primary_at: float  # wall clock, when the primary started
    shadow_at: float  # wall clock, when the shadow's answer came
    estimated_tokens: int  # one run's prompt + completion tokens
    diverged: tuple[Diverged, ...]
    # The client's own cache_salt, never sent before by this process (its only worker): the
    # primary's prefill found nothing of its tenant cached and ran cold.
    primary_cold_salt: bool = False
    earlier: Earlier | None = None  # a duplicate's earlier answer (mode duplicate)
