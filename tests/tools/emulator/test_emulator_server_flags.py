"""Server flags that change every answer: --api-key and --enable-request-id-headers (vLLM's)."""

from __future__ import annotations

import pytest

from proxy.tools.emulator.cli import build_parser, config_from_args
from tests.helpers.emulator import chat, completion

from .conftest import MakeClient

KEY = {"Authorization": "Bearer s3cret"}


async def test_request_id_headers_off_by_default(make_client: MakeClient) -> None:
    client, _ = await make_client()
    for reply in (
        await client.chat(chat(), headers={"X-Request-Id": "r1"}),
        await client.chat(chat(stream=True), headers={"X-Request-Id": "r1"}),
        await client.chat(chat(model="nope"), headers={"X-Request-Id": "r1"}),
        await client.get("/v1/models"),
    ):
        assert "X-Request-Id" not in reply.headers


async def test_request_id_headers_when_enabled(make_client: MakeClient) -> None:
    client, _ = await make_client(enable_request_id_headers=True)
    reply = await client.chat(chat(), headers={"X-Request-Id": "r1"})
    assert reply.headers["X-Request-Id"] == "r1"
    streamed = await client.chat(chat(stream=True), headers={"X-Request-Id": "r2"})
    assert streamed.headers["X-Request-Id"] == "r2"
    error = await client.chat(chat(model="nope"), headers={"X-Request-Id": "r3"})
    assert error.status == 404 and error.headers["X-Request-Id"] == "r3"
    # Without one in the request, a fresh uuid (vLLM's middleware does not read the body).
    minted = await client.chat(chat(request_id="body-id"))
    assert minted.json()["id"] == "chatcmpl-body-id"
    rid = minted.headers["X-Request-Id"]
    assert len(rid) == 32 and rid != "body-id"
    assert (await client.get("/health")).headers["X-Request-Id"]


async def test_api_key_guards_v1_only(make_client: MakeClient) -> None:
    client, server = await make_client(api_key="s3cret")
    for reply in (
        await client.chat(chat()),
        await client.chat(chat(), headers={"Authorization": "Bearer wrong"}),
        await client.chat(chat(), headers={"Authorization": "s3cret"}),
        await client.completion(completion(stream=True)),
        await client.get("/v1/models"),
    ):
        assert reply.status == 401
        assert reply.raw == b'{"error":"Unauthorized"}'
        assert reply.headers["Content-Type"].startswith("application/json")
    assert server.stats()["requests"] == 0
    assert (await client.chat(chat(), headers=KEY)).status == 200
    assert (await client.post("/v1/completions", completion(), headers=KEY)).status == 200
    for path in ("/health", "/version", "/metrics"):
        assert (await client.get(path)).status == 200
    assert (await client.post("/tokenize", {"prompt": "hi"})).status == 200
    assert server.stats()["requests"] == 2


async def test_no_api_key_accepts_anything(make_client: MakeClient) -> None:
    client, _ = await make_client()
    assert (await client.chat(chat(), headers={"Authorization": "Bearer x"})).status == 200
    assert (await client.chat(chat())).status == 200


@pytest.mark.parametrize(
    ("argv", "field", "value"),
    [
        (["--api-key", "k"], "api_key", "k"),
        ([], "api_key", None),
        (["--enable-request-id-headers"], "enable_request_id_headers", True),
        ([], "enable_request_id_headers", False),
    ],
)
def test_cli_flags(argv: list[str], field: str, value: object) -> None:
    assert getattr(config_from_args(build_parser().parse_args(argv)), field) == value


async def test_version_is_the_vllm_release_whose_api_is_emulated(make_client: MakeClient) -> None:
    client, _ = await make_client()
    assert (await client.get("/version")).json() == {"version": "0.23.0"}


@pytest.mark.parametrize("flag", ["--vllm-version", "--version"])
def test_the_version_is_a_flag(flag: str) -> None:
    assert config_from_args(build_parser().parse_args([flag, "0.24.1"])).version == "0.24.1"
    assert config_from_args(build_parser().parse_args([])).version == "0.23.0"
