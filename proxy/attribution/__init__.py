"""Cause attribution: why an audit diverged (SPEC 1.14).

``evidence`` holds what was observed and ``decide`` the pure rule from it to a cause;
``experiments`` runs the follow-up replays of one audit; ``triage`` picks which audits get
them, under budgets, at quiet times, and publishes ``CauseAttributed``.
"""
