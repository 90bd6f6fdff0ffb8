"""A live detproxy in front of the emulator, with real incidents: a flip (text divergence)
whose prompt holds markup, a logprob drift, a content loop that a retry recovers."""

from __future__ import annotations

from typing import Any

import orjson

from tests.helpers.waiting import settle

MODEL = "emulator-model"
TOKEN = "t" * 24
EVIL_PROMPT = "<script>window.__pwned = 1</script><b>bold?</b>"


def knobs(**fields: Any) -> dict[str, str]:
    return {"X-Emulator-Knobs": orjson.dumps(fields).decode()}


def env(store_text: bool, **extra: str) -> dict[str, str]:
    return {
        "DETPROXY_AUDIT__SAMPLE_RATE": "1",
        "DETPROXY_AUDIT__MAX_SHADOWS_PER_S": "1000",
        "DETPROXY_AUDIT__PASSIVE_CHECKS": "false",
        "DETPROXY_INCIDENTS__STORE_TEXT": "true" if store_text else "false",
        "DETPROXY_SERVER__ADMIN_TOKEN": TOKEN,
        **extra,
    }


AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def make_incidents(client: Any) -> None:
    """Four requests: clean, flipped at token 2, drifting logprobs, looping (recovered)."""

    def chat(prompt: str) -> dict[str, Any]:
        return {
            "model": MODEL,
            "temperature": 0,
            "max_tokens": 12,
            "messages": [{"role": "user", "content": prompt}],
        }

    cases = [
        ("clean", {}),
        ("flip", knobs(flip_probability=1.0, flip_position=2)),
        ("drift", knobs(logprob_jitter_probability=1.0)),
        ("loop", knobs(loop_channel="content", loop_after_tokens=3, loop_escape_probability=1.0)),
    ]
    for rid, headers in cases:
        prompt = EVIL_PROMPT if rid == "flip" else f"prompt {rid}"
        body = chat(prompt) | ({"max_tokens": 200} if rid == "loop" else {})
        resp = await client.post(
            "/v1/chat/completions", json=body, headers={"X-Request-Id": rid, **headers}
        )
        assert resp.status == 200, await resp.text()
        await resp.read()
    await settle(client, headers=AUTH)
