"""Settings the tests give detproxy through its DETPROXY_* environment."""

from __future__ import annotations

import orjson

# No shadow replays (detproxy audits 5% and one a minute per model by default): for tests that
# count upstream requests or audits and are about something else. Passive checks stay on.
NO_SHADOWS = {"DETPROXY_AUDIT__SAMPLE_RATE": "0", "DETPROXY_AUDIT__AT_LEAST_EVERY_S": "0"}


def rendering(mode: str) -> dict[str, str]:
    markers = [{"models": "*", "rendered_continuation": mode}]
    return {"DETPROXY_LOOPS__REASONING_MARKERS": orjson.dumps(markers).decode()}
