"""Policies decide what happens to a response: let it through, or retry with overrides."""
