"""Determinism audit: normalise responses, extract answers, compare primary and shadow."""
