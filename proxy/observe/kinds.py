"""The kinds of line the incident log holds, named once.

``proxy.observe.incidents`` writes them; the ``/detproxy/incidents`` filter, the explorer and
``detproxy report`` read them from here, so that a kind the writer adds is one they accept
(a filter that answered 400 to a kind the log holds is how this module came to be).
"""

from __future__ import annotations

AUDIT = "audit"  # a non-identical audit
LOOP = "loop"  # a repetition loop, with what the policy did about it
UPSTREAM_CHANGE = "upstream_change"  # the upstream's identity changed
ENGINE_MISMATCH = "engine_mismatch"  # the engine does not run what [upstream.expect] declares
UPSTREAM_RESTART = "upstream_restart"  # the same identity back after an outage or a restart

# Incidents: each is one line of the log and one record of the ring.
INCIDENT_KINDS = (AUDIT, LOOP, UPSTREAM_CHANGE, ENGINE_MISMATCH, UPSTREAM_RESTART)
# Incidents of the upstream, not of a model's requests.
UPSTREAM_KINDS = (UPSTREAM_CHANGE, ENGINE_MISMATCH, UPSTREAM_RESTART)

# Lines of the file that are not incidents: triage's verdict on an audit incident written
# earlier, and a process's counts (the denominators).
CAUSE = "cause"
TALLY = "tally"
LINE_KINDS = (*INCIDENT_KINDS, CAUSE, TALLY)
