"""The one way secrets are masked: credentials in URLs, values of keys named like secrets."""

from __future__ import annotations

import pytest

from proxy.config import Settings
from proxy.redact import MASK, mask_secrets, mask_url


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("http://a:b@h:1/x", f"http://a:{MASK}@h:1/x"),  # the password, not the user
        ("redis://:pw@127.0.0.1:6379/0", f"redis://:{MASK}@127.0.0.1:6379/0"),
        ("https://sk-live-123@api.example/v", f"https://{MASK}@api.example/v"),  # a key as user
        ("redis://h:6379/0?password=pw&db=1", f"redis://h:6379/0?password={MASK}&db=1"),
        ("http://h/?API_KEY=k", f"http://h/?API_KEY={MASK}"),
        ("redis://:pw@h:notaport/0", f"redis://{MASK}@h:notaport/0"),  # yarl cannot read it
        ("http://h:1", "http://h:1"),  # nothing to mask: as it came, not re-written
        ("http://h:1/?q=a%20b", "http://h:1/?q=a%20b"),
        ("not a url", "not a url"),
        ("", ""),
    ],
)
def test_mask_url(url: str, shown: str) -> None:
    assert mask_url(url) == shown


def test_mask_secrets_masks_secret_keys_and_urls_at_any_depth() -> None:
    tree = {
        "server": {"admin_token": "t" * 16, "host": "0.0.0.0"},
        "audit": {"service_api_key": "k", "redis_url": "redis://:p@h/0", "max_tokens": 5},
        "list": [{"password": "p"}, "http://u:p@h"],
        "unset": {"admin_token": None},
        "engine": {"api_key": ["sk-1", "sk-2"], "port": 8000},  # vLLM's non-default args
    }
    assert mask_secrets(tree) == {
        "server": {"admin_token": MASK, "host": "0.0.0.0"},
        "audit": {"service_api_key": MASK, "redis_url": f"redis://:{MASK}@h/0", "max_tokens": 5},
        "list": [{"password": MASK}, f"http://u:{MASK}@h"],
        "unset": {"admin_token": None},  # not set: nothing to hide, and it says so
        "engine": {"api_key": [MASK, MASK], "port": 8000},
    }


def test_every_secret_of_the_settings_is_masked() -> None:
    settings = Settings.model_validate(
        {
            "server": {"admin_token": "admin-token-0123456789"},
            "upstream": {"url": "http://u:upstream-pw@engine:8000"},
            "audit": {
                "service_api_key": "service-key",
                "reference_url": "http://r:reference-pw@ref:8000",
                "redis_url": "redis://:redis-pw@redis:6379/0",
            },
            "loops": {"recovery_budget_redis_url": "redis://u:budget-pw@redis:6379/1"},
        }
    )
    shown = repr(mask_secrets(settings.model_dump(mode="json")))
    for secret in ("admin-token", "upstream-pw", "service-key", "reference-pw", "redis-pw"):
        assert secret not in shown
    assert "budget-pw" not in shown and "engine:8000" in shown
