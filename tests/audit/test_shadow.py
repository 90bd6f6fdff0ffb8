"""Shadow replays: their shape on the wire, their budgets and drops, shutdown."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, cast

import orjson
import pytest
from multidict import CIMultiDict
from prometheus_client import CollectorRegistry

from proxy.audit.shadow import ShadowJob, ShadowScheduler, TokenBucket
from proxy.audit.turns import LocalTurns
from proxy.config import AuditConfig
from proxy.events import EventBus, ShadowDropped
from proxy.testing import MockUpstream, Received, Reply
from proxy.tools.emulator import EmulatorConfig, EmulatorServer
from tests.helpers.metrics import metric
from tests.helpers.upstreams import MOCK_URL
from tests.helpers.waiting import eventually, settle

MODEL = "emulator-model"
CHAT = "/v1/chat/completions"
AUDIT_ALL = {
    "DETPROXY_AUDIT__SAMPLE_RATE": "1",
    "DETPROXY_AUDIT__MAX_SHADOWS_PER_S": "1000",
    "DETPROXY_AUDIT__PASSIVE_CHECKS": "false",
}


def chat(prompt: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "temperature": 0,
        "max_tokens": 8,
        "messages": [{"role": "user", "content": prompt}],
        **extra,
    }


def dropped(registry: CollectorRegistry, reason: str) -> float:
    return metric(registry, "detproxy_shadow_dropped_total", reason=reason)


class Capture:
    """An upstream that answers like vLLM and keeps every request it gets (a handler of
    ``proxy.testing``'s: in process, or on a socket)."""

    def __init__(self) -> None:
        self.requests: list[tuple[CIMultiDict[str], dict[str, Any]]] = []

    def handle(self, request: Received) -> Reply:
        body = request.json()
        self.requests.append((CIMultiDict(request.headers), body))
        logprobs = {
            "content": [
                {
                    "token": "Hi",
                    "logprob": -0.5,
                    "bytes": [72, 105],
                    "top_logprobs": [{"token": "Hi", "logprob": -0.5}],
                }
            ]
        }
        answer = {
            "id": "chatcmpl-x",
            "object": "chat.completion",
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "length",
                    "message": {"role": "assistant", "content": "Hi"},
                    "logprobs": logprobs if body.get("logprobs") else None,
                }
            ],
            "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
        }
        return Reply.json(answer)


@pytest.fixture
def capture() -> Capture:
    return Capture()


async def test_shadow_request_shape(make_proxy: Any, fake_upstream: Any, capture: Capture) -> None:
    """On a socket: X-Detproxy-Via is written by the upstream client, on the wire."""
    upstream = await fake_upstream(routes={CHAT: capture.handle})
    client = await make_proxy(
        upstream.url,
        env=AUDIT_ALL
        | {
            "DETPROXY_AUDIT__SHADOW_MODE": "prefill",
            "DETPROXY_AUDIT__CACHE_SALT": "true",
            "DETPROXY_AUDIT__SHADOW_EXTRA_BODY": '{"cache_prompt": false}',
            "DETPROXY_AUDIT__INJECT_TOP_LOGPROBS": "50",
            "DETPROXY_UPSTREAM__MAX_LOGPROBS": "7",
            "DETPROXY_AUDIT__SERVICE_API_KEY": "svc-key",
        },
    )
    resp = await client.post(
        "/v1/chat/completions",
        headers={"X-Request-Id": "r1", "Authorization": "Bearer client"},
        json=chat(
            "shape", stream=True, request_id="body-id", stream_options={"include_usage": True}
        ),
    )
    assert resp.status == 200
    await resp.read()
    await settle(client)
    (ph, primary), (sh, shadow) = capture.requests
    assert primary["logprobs"] is True and primary["top_logprobs"] == 7  # bounded by max_logprobs
    assert ph["Authorization"] == "Bearer client"
    assert sh["X-Detproxy-Shadow"] == "1" and sh["X-Request-Id"] == "r1-shadow"
    # Marked as the primary is, by the same server (proxy/selfloop.py): a loop is caught.
    assert sh["X-Detproxy-Via"] == ph["X-Detproxy-Via"] and len(ph["X-Detproxy-Via"]) == 16
    assert sh["Authorization"] == "Bearer svc-key"  # not the client's credentials
    assert shadow["request_id"] == "body-id-shadow"
    assert "stream" not in shadow and "stream_options" not in shadow
    assert shadow["max_tokens"] == 1 and shadow["cache_prompt"] is False
    assert isinstance(shadow["cache_salt"], str) and len(shadow["cache_salt"]) >= 16
    assert (shadow["logprobs"], shadow["top_logprobs"]) == (True, 7)  # like for like


async def test_shadow_reuses_client_auth_only_when_configured(
    make_proxy: Any, mock_upstream: MockUpstream, capture: Capture
) -> None:
    mock_upstream.on(CHAT, capture.handle)
    env = AUDIT_ALL | {"DETPROXY_AUDIT__REUSE_CLIENT_AUTH": "true"}
    client = await make_proxy(MOCK_URL, upstream=mock_upstream, env=env)
    await client.post(
        "/v1/chat/completions", json=chat("auth"), headers={"Authorization": "Bearer client"}
    )
    await settle(client)
    assert capture.requests[1][0]["Authorization"] == "Bearer client"

    capture.requests.clear()
    client = await make_proxy(MOCK_URL, upstream=mock_upstream, env=AUDIT_ALL)
    await client.post(
        "/v1/chat/completions", json=chat("auth"), headers={"Authorization": "Bearer client"}
    )
    await settle(client)
    assert "Authorization" not in capture.requests[1][0]


async def test_reference_upstream_gets_the_shadow(make_proxy: Any) -> None:
    async with EmulatorServer() as primary, EmulatorServer() as reference:
        client = await make_proxy(
            primary.url, env=AUDIT_ALL | {"DETPROXY_AUDIT__REFERENCE_URL": reference.url}
        )
        await client.post("/v1/chat/completions", json=chat("to the control engine"))
        status = await settle(client)
        assert primary.stats()["requests"] == 1 and reference.stats()["requests"] == 1
        assert status["audit"]["verdicts"] == {"identical": 1}


@pytest.fixture
async def slow_emulator() -> AsyncIterator[EmulatorServer]:
    async with EmulatorServer(EmulatorConfig(token_latency_s=0.02)) as srv:
        yield srv


async def test_budgets_drop_and_count(
    make_proxy: Any, slow_emulator: EmulatorServer, registry: CollectorRegistry
) -> None:
    client = await make_proxy(
        slow_emulator.url,
        env=AUDIT_ALL
        | {"DETPROXY_AUDIT__QUEUE_SIZE": "1", "DETPROXY_AUDIT__MAX_CONCURRENT_SHADOWS": "1"},
    )
    # Six primaries at once: one shadow runs, one waits, the rest find the queue full.
    await asyncio.gather(
        *(client.post("/v1/chat/completions", json=chat(f"q{i}")) for i in range(6))
    )
    status = await settle(client)
    assert dropped(registry, "queue_full") >= 1
    assert status["audit"]["audits"] + dropped(registry, "queue_full") == 6

    other = CollectorRegistry()
    no_budget = {"DETPROXY_AUDIT__MAX_TOKEN_SHARE": "0", "DETPROXY_AUDIT__TOKEN_ALLOWANCE": "0"}
    client = await make_proxy(slow_emulator.url, registry=other, env=AUDIT_ALL | no_budget)
    resp = await client.post("/v1/chat/completions", json=chat("no budget"))
    assert resp.status == 200
    assert dropped(other, "token_budget") == 1


def scheduler(**config: Any) -> tuple[ShadowScheduler, list[str]]:
    """A scheduler whose workers never start: admit and submit only."""
    bus = EventBus()
    drops: list[str] = []
    bus.subscribe(ShadowDropped, lambda ev: drops.append(ev.reason))
    sched = ShadowScheduler(AuditConfig(**config), cast(Any, None), bus, cast(Any, None))
    return sched, drops


def job(tokens: int) -> ShadowJob:
    return ShadowJob(MODEL, "chat", "/v1/chat/completions", {}, {}, tokens, lambda r: None)


def test_the_token_budget_is_an_allowance_plus_a_share_of_primary_tokens() -> None:
    sched, drops = scheduler(max_token_share=0.1, token_allowance=1000)
    assert sched.admit(MODEL) and sched.submit(job(600)), "the first audit fits the allowance"
    assert sched.admit(MODEL) and not sched.submit(job(600)), "1200 tokens > the 1000 allowed"
    assert drops == ["token_budget"]
    sched.count_primary_tokens(10_000)  # 1000 + 0.1 x 10000 = 2000 allowed
    assert sched.submit(job(600)) and sched.shadow_tokens == 1200
    assert not sched.submit(job(900)), "2100 tokens > the 2000 allowed"
    sched.shadow_tokens = 2000
    assert not sched.admit(MODEL), "a spent budget refuses before the primary goes out"
    assert drops == ["token_budget"] * 3


def test_no_share_and_no_allowance_admit_no_shadow() -> None:
    sched, drops = scheduler(max_token_share=0, token_allowance=0)
    sched.count_primary_tokens(10**6)
    assert not sched.admit(MODEL) and drops == ["token_budget"]


def test_token_bucket() -> None:
    now = [0.0]
    bucket = TokenBucket(2.0, clock=lambda: now[0])
    assert [bucket.take() for _ in range(3)] == [True, True, False]
    now[0] = 0.5
    assert [bucket.take(), bucket.take()] == [True, False]


async def test_rate_limit(
    make_proxy: Any, slow_emulator: EmulatorServer, registry: CollectorRegistry
) -> None:
    client = await make_proxy(
        slow_emulator.url, env=AUDIT_ALL | {"DETPROXY_AUDIT__MAX_SHADOWS_PER_S": "1"}
    )
    for i in range(3):
        await client.post("/v1/chat/completions", json=chat(f"r{i}"))
    await settle(client)
    assert dropped(registry, "rate_limit") == 2


async def test_quiet_waits_for_own_inflight_then_drops_at_deadline(
    make_proxy: Any, slow_emulator: EmulatorServer, registry: CollectorRegistry
) -> None:
    client = await make_proxy(
        slow_emulator.url,
        env=AUDIT_ALL
        | {
            "DETPROXY_AUDIT__SCHEDULE": "quiet",
            "DETPROXY_AUDIT__QUIET_DEADLINE_S": "0.3",
            "DETPROXY_AUDIT__QUIET_POLL_S": "0.02",
        },
    )
    long = asyncio.create_task(
        client.post("/v1/chat/completions", json=chat("long", max_tokens=100))
    )  # ~2 s

    async def inflight() -> int:
        return int((await (await client.get("/detproxy/status")).json())["inflight"])

    await eventually(inflight, what="the long request in flight")
    await client.post("/v1/chat/completions", json=chat("short", max_tokens=2))
    await eventually(lambda: dropped(registry, "quiet_deadline"), what="a quiet_deadline drop")
    assert dropped(registry, "quiet_deadline") == 1
    await long
    await settle(client)  # with nothing else in flight, the long one's shadow runs
    assert (
        metric(registry, "detproxy_audits_total", model=MODEL, mode="full", verdict="identical")
        == 1
    )


async def test_quiet_reads_the_upstream_running_gauge(
    make_proxy: Any, slow_emulator: EmulatorServer, registry: CollectorRegistry
) -> None:
    import aiohttp

    client = await make_proxy(
        slow_emulator.url,
        env=AUDIT_ALL
        | {
            "DETPROXY_AUDIT__SCHEDULE": "quiet",
            "DETPROXY_AUDIT__QUIET_MAX_INFLIGHT": "5",
            "DETPROXY_AUDIT__QUIET_MAX_UPSTREAM_RUNNING": "0",
            "DETPROXY_AUDIT__QUIET_DEADLINE_S": "0.3",
            "DETPROXY_AUDIT__QUIET_POLL_S": "0.02",
        },
    )
    async with aiohttp.ClientSession() as other:  # traffic that bypasses detproxy
        busy = asyncio.create_task(
            other.post(
                slow_emulator.url + "/v1/chat/completions", json=chat("elsewhere", max_tokens=60)
            )
        )
        running = lambda: slow_emulator.stats()["running"]  # noqa: E731
        await eventually(running, what="the other request running on the engine")
        await client.post("/v1/chat/completions", json=chat("mine", max_tokens=2))
        await eventually(lambda: dropped(registry, "quiet_deadline"), what="a quiet_deadline drop")
        assert dropped(registry, "quiet_deadline") == 1
        (await busy).release()


async def test_failed_shadows_are_counted_and_primaries_unaffected(
    make_proxy: Any, mock_upstream: MockUpstream, registry: CollectorRegistry
) -> None:
    async def primary_ok_shadow_fails(request: Received) -> Reply:
        if request.headers.get("X-Detproxy-Shadow"):
            slow = request.query == "mode=slow"
            # a shadow past its timeout (0.2 s): the wait is the behaviour under test
            return Reply.json({"error": {"message": "boom", "code": 500}}, 500, delay_s=5 * slow)
        return Reply.json(
            {"choices": [{"index": 0, "finish_reason": "stop", "message": {"content": "ok"}}]}
        )

    mock_upstream.on(CHAT, primary_ok_shadow_fails)
    env = AUDIT_ALL | {"DETPROXY_AUDIT__SHADOW_TIMEOUT_S": "0.2"}
    client = await make_proxy(MOCK_URL, upstream=mock_upstream, env=env)
    resp = await client.post("/v1/chat/completions", json=chat("x"))
    assert resp.status == 200 and (await resp.json())["choices"][0]["message"]["content"] == "ok"
    resp = await client.post("/v1/chat/completions?mode=slow", json=chat("y"))
    assert resp.status == 200
    await settle(client)
    assert dropped(registry, "upstream_error") == 1 and dropped(registry, "timeout") == 1


async def test_shutdown_cancels_shadow_workers(
    make_proxy: Any, slow_emulator: EmulatorServer
) -> None:
    client = await make_proxy(slow_emulator.url, env=AUDIT_ALL)
    await client.post("/v1/chat/completions", json=chat("in flight at shutdown", max_tokens=50))
    before = {t.get_name() for t in asyncio.all_tasks()}
    assert any(name.startswith("shadow:worker") for name in before)
    await client.close()  # the workers are gone once it returns: no wait after it
    after = {t.get_name() for t in asyncio.all_tasks()}
    assert not any(name.startswith("shadow:") for name in after)
    assert orjson.dumps(sorted(after))  # nothing else of detproxy's is left either


async def test_a_primary_beyond_the_rate_limit_goes_out_untouched(
    make_proxy: Any, mock_upstream: MockUpstream, registry: CollectorRegistry
) -> None:
    """The rate limit is taken when the primary starts: a primary that will not be replayed is
    forwarded as the client sent it (no logprobs injected) and is not accumulated."""
    mock_upstream.on(
        CHAT,
        Reply.json(
            {
                "id": "chatcmpl-1",
                "object": "chat.completion",
                "model": "m",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "same"},
                        "logprobs": None,
                        "finish_reason": "stop",
                    }
                ],
            }
        ),
    )
    env = AUDIT_ALL | {"DETPROXY_AUDIT__MAX_SHADOWS_PER_S": "1"}
    client = await make_proxy(MOCK_URL, upstream=mock_upstream, env=env)
    for i in range(3):
        resp = await client.post("/v1/chat/completions", json=chat(f"r{i}"))
        assert resp.status == 200
    await settle(client)
    bodies = mock_upstream.bodies(CHAT)
    assert dropped(registry, "rate_limit") == 2
    asked = [b for b in bodies if b.get("logprobs")]
    assert len(bodies) == 4 and len(asked) == 2  # the audited primary and its shadow
    untouched = [b for b in bodies if "logprobs" not in b]
    assert sorted(b["messages"][0]["content"] for b in untouched) == ["r1", "r2"]


@pytest.mark.parametrize(
    ("status", "message", "blamed"),
    [
        (404, "The model `emulator-model` does not exist.", False),
        (401, "Unauthorized", False),
        (400, "Out of range float values are not JSON compliant: nan", True),
    ],
    ids=["model_gone", "key_revoked", "nan_logprobs"],
)
async def test_a_refused_shadow_blames_the_logprobs_only_where_the_engine_names_them(
    make_proxy: Any,
    mock_upstream: MockUpstream,
    status: int,
    message: str,
    blamed: bool,
) -> None:
    """The primary was answered; its shadow refused: only a refusal about the logprobs counts
    against their injection (three in a row suspend it for the model)."""

    def handle(request: Received) -> Reply:
        body = request.json()
        if request.headers.get("X-Detproxy-Shadow") == "1":
            error = {"object": "error", "message": message, "type": "BadRequestError"}
            return Reply.json({"error": error | {"code": status}}, status)
        answer = {
            "id": "x",
            "object": "chat.completion",
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "stop",
                    "message": {"role": "assistant", "content": "Hi"},
                    "logprobs": {"content": []} if body.get("logprobs") else None,
                }
            ],
        }
        return Reply.json(answer)

    mock_upstream.on(CHAT, handle)
    client = await make_proxy(MOCK_URL, upstream=mock_upstream, env=AUDIT_ALL)
    for i in range(3):
        resp = await client.post("/v1/chat/completions", json=chat(f"refused {i}"))
        assert resp.status == 200
        await resp.read()
        await settle(client)
    registry_status = await (await client.get("/detproxy/status")).json()
    suspended = bool(registry_status["injection"])
    assert suspended is blamed, registry_status["injection"]


class _Answered:
    """An upstream answer as a replay reads it."""

    status = 200
    raw_fields = None
    headers: dict[str, str] = {}

    async def read(self) -> bytes:
        return orjson.dumps({"choices": [{"index": 0, "finish_reason": "stop", "text": "x"}]})

    def close(self) -> None:
        pass


class _Counting:
    """An upstream that counts what reaches it and answers at once."""

    def __init__(self) -> None:
        self.sent = 0

    async def send(self, method: str, raw_path: str, headers: Any, body: Any) -> _Answered:
        self.sent += 1
        return _Answered()

    async def close(self) -> None:
        pass


class _Idle:
    inflight = 0
    started = 0


async def test_no_shadow_is_sent_while_an_experiment_holds_the_engine() -> None:
    """A triage experiment takes the engine whole: no shadow is sent until it is done, and
    one held longer than its quiet deadline still goes once released (not dropped)."""
    bus = EventBus()
    drops: list[str] = []
    bus.subscribe(ShadowDropped, lambda ev: drops.append(ev.reason))
    upstream = _Counting()
    config = AuditConfig(
        schedule="quiet", quiet_deadline_s=0.05, quiet_settle_s=0.0, quiet_poll_s=0.005
    )
    turns = LocalTurns(config.max_concurrent_shadows)
    sched = ShadowScheduler(config, cast(Any, upstream), bus, _Idle(), turns=turns)
    results: list[Any] = []
    sched.start()
    try:
        experiment = await turns.experiment(0.005)
        sched.submit(ShadowJob(MODEL, "chat", "/v1/completions", {}, {}, 1, results.append))
        await eventually(lambda: sched.running == 1, what="the shadow taken off the queue")
        waited = asyncio.get_running_loop().time()
        while asyncio.get_running_loop().time() - waited < 0.2:  # 4 quiet deadlines held
            assert upstream.sent == 0 and sched.sending == 0, "a shadow was sent while held"
            await asyncio.sleep(0.01)
        experiment.release()
        await eventually(lambda: results, what="the shadow sent once released")
        assert upstream.sent == 1 and drops == [], drops
    finally:
        await sched.close()
