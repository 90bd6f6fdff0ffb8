"""Answer extractors end to end: a changed extracted field is an answer divergence."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from prometheus_client import CollectorRegistry

from proxy.config import ConfigError, load_settings
from proxy.testing import MockUpstream, Received, Reply
from tests.helpers.metrics import metric
from tests.helpers.upstreams import MOCK_URL
from tests.helpers.waiting import settle

ANSWERS = {
    # primary content, shadow content, expected verdict
    "same": (
        '{"date": "2024-03-01", "amount": 12}',
        '{"date": "2024-03-01", "amount": 12}',
        "identical",
    ),
    "wording": (
        '{"date": "2024-03-01", "note": "paid"}',
        '{"date": "2024-03-01", "note": "ok"}',
        "text_divergence",
    ),
    "answer": (
        '{"date": "2024-03-01", "amount": 12}',
        '{"date": "2024-03-02", "amount": 12}',
        "answer_divergence",
    ),
}


async def test_json_path_extractor(
    make_proxy: Any, mock_upstream: MockUpstream, registry: CollectorRegistry
) -> None:
    def answer(request: Received) -> Reply:
        primary, shadow, _ = ANSWERS[request.json()["messages"][0]["content"]]
        content = shadow if request.headers.get("X-Detproxy-Shadow") else primary
        return Reply.json(
            {"choices": [{"index": 0, "finish_reason": "stop", "message": {"content": content}}]}
        )

    mock_upstream.on("/v1/chat/completions", answer)
    client = await make_proxy(
        MOCK_URL,
        upstream=mock_upstream,
        env={
            "DETPROXY_AUDIT__SAMPLE_RATE": "1",
            "DETPROXY_AUDIT__PASSIVE_CHECKS": "false",
            "DETPROXY_AUDIT__ANSWER_EXTRACTOR": "json:$.date",
        },
    )
    for name in ANSWERS:
        resp = await client.post(
            "/v1/chat/completions",
            json={"model": "m", "temperature": 0, "messages": [{"role": "user", "content": name}]},
        )
        assert resp.status == 200
    await settle(client, audits=3)
    for _, _, verdict in ANSWERS.values():
        assert (
            metric(registry, "detproxy_audits_total", model="m", mode="full", verdict=verdict) == 1
        )
    incidents = await (await client.get("/detproxy/incidents")).json()
    by_verdict = {i["verdict"]: i for i in incidents}
    assert by_verdict["answer_divergence"]["primary_answer"] == orjson.dumps("2024-03-01").decode()
    assert by_verdict["answer_divergence"]["shadow_answer"] == orjson.dumps("2024-03-02").decode()


def test_bad_extractor_fails_at_start() -> None:
    with pytest.raises(ConfigError, match=r"audit\.answer_extractor"):
        load_settings(env={"DETPROXY_AUDIT__ANSWER_EXTRACTOR": "xpath://nope"})
