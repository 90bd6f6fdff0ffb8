"""An upstream that is detproxy itself (proxy/selfloop.py): what the start-up check sees in the
addresses, and what the run-time guard does with a request that comes back (508, logged once,
never forwarded again), in one process, through a chain of two, and across workers."""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from proxy.app import BUS, build_app
from proxy.config import SERVER_ID_ENV, Settings, load_settings
from proxy.observe.log import EventLog
from proxy.selfloop import LOOP_STATUS, points_back, server_id
from proxy.serving import serving
from proxy.testing import Reply
from tests.helpers.metrics import metric, metric_samples, metric_total
from tests.helpers.processes import detproxy_serve, free_port

CHAT = {
    "model": "m",
    "temperature": 0.7,
    "max_tokens": 4,
    "messages": [{"role": "user", "content": "hello"}],
}
# Nothing of detproxy's own that would also go upstream: no audits, no fingerprint reads.
QUIET = {
    "DETPROXY_AUDIT__SAMPLE_RATE": "0",
    "DETPROXY_AUDIT__AT_LEAST_EVERY_S": "0",
    "DETPROXY_UPSTREAM__FINGERPRINT_INTERVAL_S": "0",
}


def settings_for(upstream: str, **env: str) -> Settings:
    return load_settings(env=env, flags={"upstream": upstream})


# ---------------------------------------------------------------------------------------------
# At start: what the addresses say


@pytest.mark.parametrize(
    ("upstream", "listening", "loops"),
    [
        ("http://127.0.0.1:8080", [("127.0.0.1", 8080)], True),
        ("http://localhost:8080", [("127.0.0.1", 8080)], True),
        ("http://app.localhost:8080", [("::1", 8080)], True),
        ("http://[::1]:8080", [("::1", 8080)], True),
        ("http://127.0.0.1", [("127.0.0.1", 80)], True),  # the scheme's port
        ("http://127.0.0.1:9090", [("127.0.0.1", 8080), ("127.0.0.1", 9090)], True),  # admin
        ("http://127.0.0.1:8080", [("0.0.0.0", 8080)], True),  # every local address
        ("http://0.0.0.0:8080", [("127.0.0.1", 8080)], True),  # connecting there: loopback
        ("http://127.0.0.1:8080", [("::", 8080)], True),  # dual stack
        ("http://[::ffff:127.0.0.1]:8080", [("127.0.0.1", 8080)], True),
        ("http://127.0.0.1:8081", [("127.0.0.1", 8080)], False),  # the engine beside it
        ("http://127.0.0.2:8080", [("127.0.0.1", 8080)], False),  # another listener's
        ("http://[::1]:8080", [("0.0.0.0", 8080)], False),  # 0.0.0.0 takes no IPv6
        ("http://192.0.2.1:8080", [("0.0.0.0", 8080)], False),  # not this machine's
        ("http://vllm:8080", [("0.0.0.0", 8080)], False),  # a name: left to the run-time guard
    ],
)
def test_an_upstream_on_an_own_listener_is_refused(
    upstream: str, listening: list[tuple[str, int]], loops: bool
) -> None:
    settings = settings_for(upstream)
    why = points_back(settings, listening)
    assert (why is not None) == loops, why
    if loops:
        said = f"upstream.url {settings.upstream.url} is detproxy's own"
        assert why is not None and why.startswith(said), why


def test_a_non_loopback_address_of_this_machine_is_its_own() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # no packet: the kernel only picks a route
        except OSError:
            pytest.skip("no route off the loopback here")
        own = probe.getsockname()[0]
    if own.startswith("127."):
        pytest.skip("no address but the loopback here")
    assert points_back(settings_for(f"http://{own}:8080"), [("0.0.0.0", 8080)])
    assert points_back(settings_for(f"http://{own}:8080"), [("127.0.0.1", 8080)]) is None


def test_the_reference_upstream_is_checked_too_and_a_password_is_masked() -> None:
    settings = settings_for(
        "http://127.0.0.1:8000",
        DETPROXY_AUDIT__REFERENCE_URL="http://user:hunter2@127.0.0.1:8080",
    )
    why = points_back(settings, [("127.0.0.1", 8080)])
    assert why is not None and why.startswith("audit.reference_url http://user:")
    assert "hunter2" not in why


def test_workers_share_their_supervisors_id_and_nobody_else_inherits_it() -> None:
    env = {SERVER_ID_ENV: "00ff00ff00ff00ff"}
    assert server_id(1, env) == server_id(0, env) == "00ff00ff00ff00ff"
    assert server_id(None, env) != "00ff00ff00ff00ff"  # a serve started from a worker's env
    assert server_id(None, {}) != server_id(None, {})


# ---------------------------------------------------------------------------------------------
# At run time: a request that comes back


async def serve_on(port: int, settings: Settings, registry: CollectorRegistry) -> Any:
    """The app as ``serve`` runs it (its events logged) on ``port``."""
    app = build_app(settings, registry=registry)
    EventLog(settings.log, settings.upstream.url).subscribe(app[BUS])
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", port))
    return serving(app, settings.server, sock)


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [("POST", "/v1/chat/completions", CHAT), ("GET", "/v1/models", None)],
)
async def test_a_request_that_comes_back_is_answered_508_at_once_and_logged_once(
    method: str, path: str, body: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """detproxy's upstream is detproxy itself (here in one process, as a host name or a
    --workers port would make it past the start-up check): the request comes back once, is
    answered 508 there, and that answer reaches the client; nothing is forwarded again."""
    port = free_port()
    registry = CollectorRegistry()
    settings = settings_for(f"http://user:hunter2@127.0.0.1:{port}", **QUIET)
    caplog.set_level(logging.INFO, logger="detproxy.events")
    quickly = aiohttp.ClientTimeout(total=10)  # the loop it replaces hung until this
    async with await serve_on(port, settings, registry), aiohttp.ClientSession() as http:
        for _ in range(3):
            url = f"http://127.0.0.1:{port}{path}"
            async with http.request(method, url, json=body, timeout=quickly) as resp:
                assert resp.status == LOOP_STATUS
                error = (await resp.json())["error"]
    assert error["code"] == LOOP_STATUS and "points back at detproxy" in error["message"]
    endpoint = "chat" if path.endswith("completions") else "other"
    labels = {"endpoint": endpoint, "kind": "loop", "stage": "headers"}
    assert metric(registry, "detproxy_upstream_errors_total", **labels) == 3  # one return each
    # Each client request, and its one return: one upstream attempt per request.
    assert metric_total(registry, "detproxy_requests_total") == 6
    lines = [r for r in caplog.records if "points back" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.ERROR, [r.getMessage() for r in lines]
    said = lines[0].getMessage()
    assert f"@127.0.0.1:{port}" in said and "hunter2" not in said, said


async def test_a_client_that_came_through_another_detproxy_is_forwarded_with_both_ids(
    make_proxy: Any, fake_upstream: Any
) -> None:
    """A client's X-Detproxy-Via (a detproxy in front of this one) is no loop: passed on, this
    server's own beside it."""
    # On a socket: detproxy's own id is written by its HTTP client, on the wire (proxy/http/h1.py).
    upstream = await fake_upstream(routes={"/v1/models": Reply.json({"data": []})})
    client = await make_proxy(upstream.url, env=QUIET)
    resp = await client.get("/v1/models", headers={"X-Detproxy-Via": "f00dfeedf00dfeed"})
    assert resp.status == 200
    seen = [
        [v for k, v in r.headers.items() if k.lower() == "x-detproxy-via"]
        for r in upstream.received("/v1/models")
    ]
    assert len(seen) == 1 and len(seen[0]) == 2 and "f00dfeedf00dfeed" in seen[0], seen


async def test_a_chain_of_two_detproxies_that_leads_back_is_stopped_on_its_first_return() -> None:
    """A's upstream is B and B's is A: nothing in either's addresses says so. The request goes
    A -> B -> A, where A finds its own id: 508, relayed back through B to the client."""
    port_a, port_b = free_port(), free_port()
    async with (
        detproxy_serve(f"http://127.0.0.1:{port_b}", port=port_a, env=QUIET) as (a, _),
        detproxy_serve(f"http://127.0.0.1:{port_a}", port=port_b, env=QUIET) as (b, _),
        aiohttp.ClientSession() as http,
    ):
        async with http.post(
            a + "/v1/chat/completions", json=CHAT, timeout=aiohttp.ClientTimeout(10)
        ) as resp:
            assert resp.status == LOOP_STATUS
            assert "points back at detproxy" in (await resp.json())["error"]["message"]
        seen = {}
        for name, base in (("a", a), ("b", b)):
            async with http.get(base + "/detproxy/metrics") as page:
                seen[name] = metric_samples(await page.text(), "detproxy_")
    loops = 'detproxy_upstream_errors_total{endpoint="chat",kind="loop",stage="headers"}'
    assert seen["a"].get(loops) == 1 and loops not in seen["b"], seen
    assert requests(seen["a"]) == 2 and requests(seen["b"]) == 1  # A: the client's, its return


def requests(samples: dict[str, float]) -> float:
    return sum(v for k, v in samples.items() if k.startswith("detproxy_requests_total{"))


async def test_workers_know_each_others_requests() -> None:
    """--workers 2 in front of a proxy that leads back: the request may come back to the other
    worker, which knows the id it carries (the supervisor's, passed to both)."""
    port_a, port_b = free_port(), free_port()
    async with (
        detproxy_serve(f"http://127.0.0.1:{port_b}", "--workers", "2", port=port_a, env=QUIET) as (
            a,
            _,
        ),
        detproxy_serve(f"http://127.0.0.1:{port_a}", port=port_b, env=QUIET) as (b, _),
        aiohttp.ClientSession() as http,
    ):
        for _ in range(4):
            async with http.post(
                a + "/v1/chat/completions", json=CHAT, timeout=aiohttp.ClientTimeout(10)
            ) as resp:
                assert resp.status == LOOP_STATUS
        async with http.get(b + "/detproxy/metrics") as page:
            at_b = metric_samples(await page.text(), "detproxy_")
    assert requests(at_b) == 4, at_b  # each went through B once: never sent round again


async def test_many_at_once_are_all_answered() -> None:
    """What the report saw (over a thousand requests in flight, the client hanging): now each
    request comes back once and is answered."""
    port = free_port()
    registry = CollectorRegistry()
    async with (
        await serve_on(port, settings_for(f"http://127.0.0.1:{port}", **QUIET), registry),
        aiohttp.ClientSession() as http,
    ):

        async def one() -> int:
            async with http.get(f"http://127.0.0.1:{port}/v1/models") as resp:
                return resp.status

        statuses = await asyncio.wait_for(asyncio.gather(*(one() for _ in range(50))), 10)
    assert statuses == [LOOP_STATUS] * 50
