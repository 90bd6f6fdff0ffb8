"""No secret leaves the process (SPEC 1.20): ``detproxy serve`` configured with distinctive
secrets (the admin token, the shadows' API key, passwords in the upstream, reference and Redis
URLs; the engine's API key in the log it follows), its every admin endpoint read, its failure
paths provoked (Redis unreachable, the upstream gone), and not one secret in a response's body
or headers, a log line, the incident log or ``detproxy config``."""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
from collections.abc import AsyncIterator
from html import unescape
from pathlib import Path

import aiohttp
from prometheus_client import CollectorRegistry

from proxy.app import ADMIN, build_app
from proxy.config import load_settings
from proxy.tools.emulator import EmulatorServer
from tests.helpers.emulator import CHAT, chat, knobs
from tests.helpers.processes import EXE, bare_env, free_port, wait_healthy
from tests.helpers.waiting import Unmet, eventually

ADMIN_TOKEN = "ADMINTOKENxq7Zp3Lw9"
SERVICE_KEY = "SERVICEKEYm4Rt8Vn2"
UPSTREAM_PASS = "UPSTREAMPASSk9Hs1Qd"
REFERENCE_PASS = "REFERENCEPASSb6Wy5Jc"
DUPLICATE_REDIS_PASS = "DUPREDISPASSe2Nf7Tu"
BUDGET_REDIS_PASS = "BUDGETREDISPASSg8Lc4Xa"
ENGINE_KEY = "ENGINEKEYr3Dv6Hm1"  # vLLM's --api-key, as its log lists it
SECRETS = (
    ADMIN_TOKEN,
    SERVICE_KEY,
    UPSTREAM_PASS,
    REFERENCE_PASS,
    DUPLICATE_REDIS_PASS,
    BUDGET_REDIS_PASS,
    ENGINE_KEY,
)
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
INCIDENT_LINK = re.compile(r"/detproxy/ui/incident/[0-9a-f]{16}")


def _env(upstream: str, state: Path) -> dict[str, str]:
    """Every secret where an operator would put it: in DETPROXY_* variables."""
    host = upstream.removeprefix("http://")
    nobody = f"127.0.0.1:{free_port()}"  # no Redis there: every call to it fails
    engine_log = state / "vllm.log"
    engine_log.write_text(
        "(APIServer pid=1) INFO 12-04 04:41:38 [api_utils.py:273] non-default args:"
        f" {{'model': 'emulator-model', 'api_key': ['{ENGINE_KEY}'], 'port': 8001}}\n"
    )
    return bare_env(
        DETPROXY_STATE_DIR=str(state),
        DETPROXY_UPSTREAM=f"http://detproxy:{UPSTREAM_PASS}@{host}",
        DETPROXY_SERVER__ADMIN_TOKEN=ADMIN_TOKEN,
        DETPROXY_AUDIT__SERVICE_API_KEY=SERVICE_KEY,
        DETPROXY_AUDIT__REFERENCE_URL=f"http://reference:{REFERENCE_PASS}@{host}",
        DETPROXY_AUDIT__SAMPLE_RATE="1",
        DETPROXY_AUDIT__MAX_SHADOWS_PER_S="1000",
        DETPROXY_AUDIT__DUPLICATE_STORE="redis",
        DETPROXY_AUDIT__REDIS_URL=f"redis://:{DUPLICATE_REDIS_PASS}@{nobody}/0",
        DETPROXY_LOOPS__POLICY="retry",
        DETPROXY_LOOPS__RECOVERY_BUDGET_STORE="redis",
        DETPROXY_LOOPS__RECOVERY_BUDGET_REDIS_URL=f"redis://budget:{BUDGET_REDIS_PASS}@{nobody}/1",
        DETPROXY_UPSTREAM__FINGERPRINT_INTERVAL_S="1",
        DETPROXY_UPSTREAM__ENGINE_LOG=str(engine_log),
        DETPROXY_LOG_LEVEL="debug",
        DETPROXY_LOG_FORMAT="json",
        DETPROXY_ACCESS_LOG="true",
    )


class Seen:
    """Everything that came out of the process: responses (as text) and log lines."""

    def __init__(self) -> None:
        self.texts: list[tuple[str, str]] = []  # (where, what)
        self.lines: list[str] = []

    async def get(
        self, http: aiohttp.ClientSession, url: str, headers: dict[str, str] | None = None
    ) -> str:
        async with http.get(url, headers=headers, allow_redirects=False) as resp:
            body = await resp.text()
            self.keep(f"GET {url} -> {resp.status}", resp, body)
            return body

    def keep(self, where: str, resp: aiohttp.ClientResponse, body: str) -> None:
        headers = "\n".join(f"{k}: {v}" for k, v in resp.headers.items())
        self.texts.append((where, headers + "\n\n" + body))

    def logged(self, words: str) -> bool:
        return any(words in line for line in self.lines)

    def leaks(self) -> list[str]:
        found = [
            f"{secret} in {where}"
            for where, text in self.texts
            for secret in SECRETS
            if secret in text
        ]
        found += [f"{s} in a log line: {line}" for line in self.lines for s in SECRETS if s in line]
        return found


async def _collect(stream: asyncio.StreamReader, lines: list[str]) -> None:
    while line := await stream.readline():
        lines.append(line.decode(errors="replace").rstrip("\n"))


@contextlib.asynccontextmanager
async def _detproxy(env: dict[str, str], seen: Seen) -> AsyncIterator[str]:
    """``detproxy serve`` as an operator runs it, its stderr read line by line into ``seen``;
    stopped with SIGTERM (its last lines read too)."""
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        EXE, "serve", "--port", str(port), env=env, stderr=asyncio.subprocess.PIPE
    )
    assert proc.stderr is not None
    reader = asyncio.create_task(_collect(proc.stderr, seen.lines))
    try:
        await wait_healthy(f"http://127.0.0.1:{port}/detproxy/health")
        yield f"http://127.0.0.1:{port}"
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), 60)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            await asyncio.wait_for(reader, 10)


async def _make_incidents(http: aiohttp.ClientSession, base: str, seen: Seen) -> None:
    """A clean audit, a divergent one (the emulator flips the primary's third token), a
    recovered loop."""
    for headers, body in [
        ({}, chat(max_tokens=12)),
        (knobs(flip_probability=1.0, flip_position=2), chat(max_tokens=12)),
        (
            knobs(loop_channel="content", loop_after_tokens=3, loop_escape_probability=1.0),
            chat(max_tokens=200),
        ),
    ]:
        async with http.post(base + CHAT, json=body, headers=headers) as resp:
            text = await resp.text()
            seen.keep(f"POST {CHAT} -> {resp.status}", resp, text)
            assert resp.status == 200, text


async def _read_every_admin_endpoint(http: aiohttp.ClientSession, base: str, seen: Seen) -> int:
    """Every admin path (``Admin.paths``), the incidents' explorer pages, a browser's log-in
    (its form, the token for a cookie), a wrong token and a path that is not there; how many
    incident pages were read."""
    paths = build_app(load_settings(), registry=CollectorRegistry())[ADMIN].paths
    for path in sorted(paths):
        await seen.get(http, base + path, headers=AUTH)
    await seen.get(http, base + "/detproxy/incidents?limit=1000", headers=AUTH)
    await seen.get(http, base + "/detproxy/ui?verdict=text_divergence", headers=AUTH)
    form = await seen.get(http, base + "/detproxy/login")
    (csrf,) = re.findall(r'name="csrf" value="([^"]*)"', form)
    login = {"token": ADMIN_TOKEN, "csrf": unescape(csrf), "next": "/detproxy/ui"}
    async with http.post(base + "/detproxy/login", data=login, allow_redirects=False) as resp:
        seen.keep(f"POST /detproxy/login -> {resp.status}", resp, await resp.text())
        assert resp.status == 303, "the log-in was refused"
    await seen.get(http, base + "/detproxy/status", headers={"Authorization": "Bearer wrong"})
    await seen.get(http, base + "/detproxy/nothing-here", headers=AUTH)
    overview = await seen.get(http, base + "/detproxy/ui", headers=AUTH)
    links = sorted(set(INCIDENT_LINK.findall(overview)))
    for link in links:
        await seen.get(http, base + link, headers=AUTH)
    return len(links)


async def test_no_secret_in_any_response_log_line_or_incident(tmp_path: Path) -> None:
    seen = Seen()
    emulator = EmulatorServer()
    upstream = await emulator.start()
    env = _env(upstream, tmp_path)
    try:
        async with (
            _detproxy(env, seen) as base,
            aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as http,
        ):
            await _make_incidents(http, base, seen)

            async def audited() -> dict[str, object] | Unmet:
                async with http.get(base + "/detproxy/status", headers=AUTH) as resp:
                    status = await resp.json()
                tally, engine = status["audit"], status["engine"]["loaded"]
                done = (
                    tally["audits"] >= 2
                    and tally["loops"]
                    and "non_default_args" in engine["facts"]
                )
                return status if done else Unmet((tally, engine))

            await eventually(audited, timeout_s=30, what="two audits, a loop, the engine log")
            await eventually(
                lambda: (
                    seen.logged("duplicate store unavailable")
                    and seen.logged("recovery budget store unavailable")
                ),
                timeout_s=30,
                what="both Redis stores failing, logged",
            )
            assert await _read_every_admin_endpoint(http, base, seen) >= 2, "no incident pages"
            # The upstream goes away: a 502 for the client, the outage logged.
            await emulator.stop()
            async with http.post(base + CHAT, json=chat(max_tokens=4)) as resp:
                seen.keep(f"POST {CHAT} (upstream gone) -> {resp.status}", resp, await resp.text())
                assert resp.status == 502
            await eventually(
                lambda: seen.logged("down:") or seen.logged("waiting for upstream"),
                timeout_s=30,
                what="the upstream's outage logged",
            )
            await seen.get(http, base + "/detproxy/status", headers=AUTH)
    finally:
        await emulator.stop()
    assert seen.logged('"event":"listening"'), seen.lines[:5]
    incident_log = (tmp_path / "incidents.jsonl").read_text()
    assert '"kind":"audit"' in incident_log and '"kind":"loop"' in incident_log
    seen.texts.append(("the incident log", incident_log))
    config = await asyncio.create_subprocess_exec(
        EXE, "config", env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    printed, _ = await asyncio.wait_for(config.communicate(), 60)
    assert config.returncode == 0, printed.decode()
    seen.texts.append(("detproxy config", printed.decode()))
    leaks = seen.leaks()
    assert not leaks, "\n".join(leaks[:20])
