"""detproxy in front of the emulator, following an engine log the test writes: what loaded is
shown in /detproxy/status, held against [upstream.expect] (incident, gauge, log line), and part
of the upstream's identity without facts learnt later counting as a change."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp.test_utils import TestClient
from prometheus_client import CollectorRegistry

from proxy.tools.emulator import EmulatorConfig, EmulatorServer
from tests.engine.test_follow import engine_log
from tests.helpers.processes import EXE, bare_env, free_port, wait_http
from tests.helpers.waiting import Unmet, eventually, eventually_sync

FAST = {"DETPROXY_UPSTREAM__FINGERPRINT_INTERVAL_S": "0.05"}
UNKNOWN_ENV_LOG = "vllm-0.23.0-eager-unknown-env.log"
TRITON_LOG = "vllm-0.23.0-eager-triton-noprefix.log"


async def more_readings(client: TestClient[Any, Any], n: int) -> None:
    """Until the fingerprint poller has read the upstream ``n`` more times."""

    async def read_at() -> float:
        return float((await status(client))["upstream_state"]["last_reading_at"])

    seen = await read_at()
    for _ in range(n):

        async def later(after: float = seen) -> float | None:
            at = await read_at()
            return at if at > after else None

        seen = await eventually(later, what="another reading")


async def status(client: TestClient[Any, Any]) -> dict[str, Any]:
    body: dict[str, Any] = await (await client.get("/detproxy/status")).json()
    return body


async def engine_once(client: TestClient[Any, Any], what: str, test: Callable[[Any], bool]) -> Any:
    async def check() -> Any:
        engine = (await status(client))["engine"]
        return engine if test(engine) else None

    return await eventually(check, what=what)


async def incidents(client: TestClient[Any, Any], kind: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = await (await client.get("/detproxy/incidents")).json()
    return [i for i in found if i["kind"] == kind]


def gauge(registry: CollectorRegistry, field: str) -> float | None:
    return registry.get_sample_value("detproxy_engine_expectation_mismatch", {"field": field})


def written(path: Path, source: Path) -> None:
    """The log as the engine writes it: line by line."""
    with path.open("a") as out:
        for line in source.read_text().splitlines(keepends=True):
            out.write(line)


async def test_a_fallback_and_an_unknown_variable_raise_within_one_reading(
    make_proxy: Any,
    registry: CollectorRegistry,
    tmp_path: Path,
) -> None:
    path = tmp_path / "vllm.log"
    written(path, engine_log(UNKNOWN_ENV_LOG))
    env = FAST | {
        "DETPROXY_UPSTREAM__ENGINE_LOG": str(path),
        "DETPROXY_UPSTREAM__EXPECT__ATTENTION_BACKEND": "FLASHINFER",
        "DETPROXY_UPSTREAM__EXPECT__UNKNOWN_ENV": "false",
    }
    async with EmulatorServer(EmulatorConfig(version="0.23.0")) as emu:
        client = await make_proxy(emu.url, env=env)
        engine = await engine_once(client, "the mismatches shown", lambda e: e["mismatches"])
        fields = {m["field"]: m for m in engine["mismatches"]}
        assert set(fields) == {"attention_backend", "unknown_env"}, engine
        assert fields["attention_backend"]["loaded"] == "FLASH_ATTN", fields
        assert engine["engine_log"]["path"] == str(path)
        assert engine["engine_log"]["read_lines"] > 0, engine["engine_log"]
        assert gauge(registry, "attention_backend") == 1.0
        assert gauge(registry, "unknown_env") == 1.0
        assert gauge(registry, "cudagraphs") is None, "only declared fields are exported"

        async def recorded() -> list[dict[str, Any]]:
            return await incidents(client, "engine_mismatch")

        (incident,) = await eventually(recorded, what="an engine_mismatch incident")
        assert {m["field"] for m in incident["mismatches"]} == set(fields)
        await more_readings(client, 3)  # no second incident
        assert len(await recorded()) == 1, "one incident per new mismatch set"


async def test_an_expectation_met_raises_nothing(
    make_proxy: Any, registry: CollectorRegistry, tmp_path: Path
) -> None:
    path = tmp_path / "vllm.log"
    written(path, engine_log(UNKNOWN_ENV_LOG))
    env = FAST | {
        "DETPROXY_UPSTREAM__ENGINE_LOG": str(path),
        "DETPROXY_UPSTREAM__EXPECT__ATTENTION_BACKEND": "FLASH_ATTN",
    }
    async with EmulatorServer(EmulatorConfig(version="0.23.0")) as emu:
        client = await make_proxy(emu.url, env=env)
        engine = await engine_once(
            client,
            "the backend read",
            lambda e: e["engine_log"]["read_lines"] and "attention_backend" not in e["unknown"],
        )
        assert engine["mismatches"] == [], engine
        assert gauge(registry, "attention_backend") == 0.0
        assert await incidents(client, "engine_mismatch") == []


async def test_a_sidecar_start_learns_the_recipe_over_time_without_a_change(
    make_proxy: Any, registry: CollectorRegistry, tmp_path: Path
) -> None:
    """detproxy first, then the engine answering, then its log: facts arrive, nothing moves."""
    path = tmp_path / "vllm.log"  # not there yet
    env = FAST | {"DETPROXY_UPSTREAM__ENGINE_LOG": str(path)}
    async with EmulatorServer(EmulatorConfig(version="0.23.0")) as emu:
        client = await make_proxy(emu.url, env=env)

        async def identified() -> Any:
            return (await status(client))["upstream_fingerprint"]

        first = await eventually(identified, what="an identity")
        written(path, engine_log(UNKNOWN_ENV_LOG))

        async def with_recipe() -> Any:
            now = await status(client)
            fp, engine = now["upstream_fingerprint"], now["engine"]
            read = engine["loaded"]["facts"].get("attention_backend") == "FLASH_ATTN"
            return fp if read and fp["identity"]["recipe"] == engine["recipe"] else None

        later = await eventually(with_recipe, what="the recipe in the identity")
        state = (await status(client))["upstream_state"]
        assert state["changes"] == 0, f"facts learnt later are no change: {state}"
        assert later["fingerprint"] == first["fingerprint"], (first, later)
        assert registry.get_sample_value("detproxy_upstream_changes_total") == 0.0
        assert await incidents(client, "upstream_change") == []

        # A new engine start in the same file with another backend: a change.
        written(path, engine_log(TRITON_LOG))

        async def changed() -> Any:
            state = (await status(client))["upstream_state"]
            return state if state["changes"] else None

        state = await eventually(changed, what="the new backend is a change")
        assert state["changes"] == 1, state
        (change,) = await incidents(client, "upstream_change")
        assert change["before"]["identity"]["recipe"] != change["after"]["identity"]["recipe"]


def test_the_engine_piped_into_detproxy_is_read_and_detproxy_stops_while_it_writes(
    tmp_path: Path,
) -> None:
    """`vllm serve ... 2>&1 | detproxy serve ...` with ``engine_log = "-"``: the engine's lines
    come on stdin; a stop does not wait for the engine to close the pipe."""
    port = free_port()
    env = bare_env(
        DETPROXY_UPSTREAM__ENGINE_LOG="-",
        DETPROXY_UPSTREAM__EXPECT__UNKNOWN_ENV="false",
        DETPROXY_UPSTREAM__FINGERPRINT_INTERVAL_S="0",
    )
    args = [EXE, "serve", "--upstream", f"http://127.0.0.1:{free_port()}"]
    args += ["--host", "127.0.0.1", "--port", str(port)]
    with (tmp_path / "detproxy.log").open("wb") as out:
        proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=out, stderr=out, env=env)
        assert proc.stdin is not None
        try:
            url = f"http://127.0.0.1:{port}"
            wait_http(url + "/detproxy/health", proc, timeout=30)
            proc.stdin.write(engine_log(UNKNOWN_ENV_LOG).read_bytes())
            proc.stdin.flush()  # and left open: the engine still runs

            def mismatched() -> dict[str, Any] | Unmet:
                with urllib.request.urlopen(url + "/detproxy/status", timeout=5) as resp:
                    engine: dict[str, Any] = json.load(resp)["engine"]
                return engine if engine.get("mismatches") else Unmet(engine)

            engine = eventually_sync(mismatched, interval_s=0.05, what="a mismatch from stdin")
            assert [m["field"] for m in engine["mismatches"]] == ["unknown_env"], engine
            started = time.monotonic()
            proc.terminate()
            assert proc.wait(timeout=15) == 0
            assert time.monotonic() - started < 10, "the stop waited for the pipe"
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stdin.close()


async def test_an_audit_incident_carries_the_recipe_it_was_measured_on(
    make_proxy: Any, tmp_path: Path
) -> None:
    from tests.helpers.emulator import chat, knobs

    path = tmp_path / "vllm.log"
    written(path, engine_log(UNKNOWN_ENV_LOG))
    env = FAST | {
        "DETPROXY_UPSTREAM__ENGINE_LOG": str(path),
        "DETPROXY_AUDIT__SAMPLE_RATE": "1",
        "DETPROXY_AUDIT__PASSIVE_CHECKS": "false",
    }
    async with EmulatorServer(EmulatorConfig(version="0.23.0")) as emu:
        client = await make_proxy(emu.url, env=env)

        async def recipe_in_identity() -> Any:
            now = await status(client)
            recipe = now["engine"]["recipe"]
            fp = now["upstream_fingerprint"] or {}
            return recipe if recipe and fp.get("identity", {}).get("recipe") == recipe else None

        recipe = await eventually(recipe_in_identity, what="the recipe in the upstream's identity")
        resp = await client.post(
            "/v1/chat/completions",
            json=chat(),
            headers=knobs(flip_probability=1.0, flip_position=1),  # the primary only
        )
        assert resp.status == 200, await resp.text()

        async def audited() -> list[dict[str, Any]]:
            return await incidents(client, "audit")

        (incident,) = await eventually(audited, what="an audit incident")
        assert incident["upstream"]["recipe"] == recipe, incident.get("upstream")
