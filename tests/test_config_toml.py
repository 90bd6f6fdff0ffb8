"""The configuration written as TOML: tomllib reads it back into the same Settings."""

from __future__ import annotations

import tomllib

import pytest

from proxy.config import Settings
from proxy.config_toml import MASK, dumps, effective_toml, mask_secrets, string


def test_a_rich_configuration_round_trips() -> None:
    settings = Settings.model_validate(
        {
            "server": {"port": 0, "admin_port": 9090, "gc_threshold": [1000, 20, 30]},
            "upstream": {"url": "https://engine.example:8443"},
            "audit": {
                "sample_rate": 0.125,
                "model_rates": {"qwen3-*": 0.5, "a model with spaces": 1.0},
                "shadow_extra_body": {"cache_prompt": False, "nested": {"list": [1, 2.5, "x"]}},
                "answer_extractor": 'regex:answer: "(\\d+)"\\n',
                "quiet_max_upstream_running": 2,
            },
            "loops": {
                "ladders": [
                    {
                        "models": "llama*",
                        "action": "retry",
                        "attempts": [{"temperature": 0.6, "strategy": "continue"}, {"seed": 3}],
                    },
                    {"models": "*", "action": "observe"},
                ],
                "engine_detection": {"min_count": 9},
                "reasoning_markers": [{"models": "x*", "start": "<r>", "end": "</r>"}],
                "detector": {"min_covered_chars": 300},
            },
            "incidents": {"path": "/var/lib/detproxy/incidents \u00e9\t.jsonl"},
            "log": {"level": "debug", "format": "json", "access_log": True},
        }
    )
    text = effective_toml(settings, masked=False)
    assert Settings.model_validate(tomllib.loads(text)) == settings, text


def test_defaults_round_trip_and_unset_values_are_comments() -> None:
    settings = Settings()
    text = effective_toml(settings, masked=False)
    assert Settings.model_validate(tomllib.loads(text)) == settings
    assert "# admin_token = (none)" in text
    assert "retry_budget" not in text  # replaced settings are not offered


@pytest.mark.parametrize(
    "value", ['quo"te', "back\\slash", "new\nline", "tab\t", "\x00\x1f\x7f", "é ü 漢", ""]
)
def test_strings_survive(value: str) -> None:
    assert tomllib.loads("x = " + string(value))["x"] == value


def test_tables_keep_their_own_keys_before_their_sub_tables() -> None:
    tree = {"a": {"sub": {"k": 1}, "z": 2, "arr": [{"i": 1}, {"i": 2}]}, "top": {"empty": {}}}
    assert tomllib.loads(dumps(tree)) == tree


def test_secrets_are_masked() -> None:
    tree = {
        "server": {"admin_token": "abc", "host": "h"},
        "audit": {"service_api_key": "k", "redis_url": "redis://:pw@r:6379/0"},
        "x": {"url": "http://user:pw@h/", "plain": "http://h/"},
    }
    masked = mask_secrets(tree)
    assert masked["server"] == {"admin_token": MASK, "host": "h"}
    assert masked["audit"]["service_api_key"] == MASK
    assert "pw" not in masked["audit"]["redis_url"] and "pw" not in masked["x"]["url"]
    assert masked["x"]["plain"] == "http://h/"
