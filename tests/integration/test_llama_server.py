"""Through detproxy, the openai SDK receives what it receives directly from llama-server."""

from __future__ import annotations

import urllib.request
from typing import Any

import httpx2
import openai
import pytest

from tests.helpers.llama_server import Engine, engine_busy, wait_engine_idle
from tests.helpers.waiting import eventually_sync

pytestmark = pytest.mark.integration

PROMPT = "Name three primary colours."
# cache_prompt false: llama-server otherwise reuses KV computed for an earlier request.
EXTRA = {"cache_prompt": False}
VOLATILE = {"id", "created", "timings"}


def clients(engine: Engine, detproxy_url: str) -> tuple[openai.OpenAI, openai.OpenAI]:
    direct = openai.OpenAI(base_url=engine.url + "/v1", api_key="none", max_retries=0)
    proxied = openai.OpenAI(base_url=detproxy_url + "/v1", api_key="none", max_retries=0)
    return direct, proxied


def stable(obj: Any) -> Any:
    return {k: v for k, v in obj.model_dump().items() if k not in VOLATILE}


def test_chat_non_streaming_with_logprobs(engine: Engine, detproxy_url: str) -> None:
    direct, proxied = clients(engine, detproxy_url)
    kwargs: dict[str, Any] = dict(
        model=engine.model,
        temperature=0,
        max_tokens=24,
        logprobs=True,
        top_logprobs=3,
        extra_body=EXTRA,
        messages=[{"role": "user", "content": PROMPT}],
    )
    a = direct.chat.completions.create(**kwargs)
    b = proxied.chat.completions.create(**kwargs)
    assert b.choices[0].message.content
    assert b.choices[0].logprobs is not None and b.choices[0].logprobs.content
    assert stable(a) == stable(b)


def collect_chat_stream(stream: Any) -> list[Any]:
    out = []
    for chunk in stream:
        for choice in chunk.choices:
            lp = choice.logprobs.model_dump() if choice.logprobs else None
            out.append((choice.delta.content, choice.finish_reason, lp))
        if chunk.usage:
            out.append(("usage", chunk.usage.model_dump()))
    return out


def test_chat_streaming_with_usage(engine: Engine, detproxy_url: str) -> None:
    direct, proxied = clients(engine, detproxy_url)
    kwargs: dict[str, Any] = dict(
        model=engine.model,
        temperature=0,
        max_tokens=24,
        stream=True,
        logprobs=True,
        top_logprobs=2,
        extra_body=EXTRA,
        stream_options={"include_usage": True},
        messages=[{"role": "user", "content": PROMPT}],
    )
    a = collect_chat_stream(direct.chat.completions.create(**kwargs))
    b = collect_chat_stream(proxied.chat.completions.create(**kwargs))
    assert len(b) > 5 and b[-1][0] == "usage"
    assert a == b


def test_completions_streaming_and_not(engine: Engine, detproxy_url: str) -> None:
    direct, proxied = clients(engine, detproxy_url)
    kwargs: dict[str, Any] = dict(
        model=engine.model,
        prompt="The capital of France is",
        temperature=0,
        max_tokens=16,
        logprobs=2,
        extra_body=EXTRA,
    )
    assert stable(direct.completions.create(**kwargs)) == stable(
        proxied.completions.create(**kwargs)
    )

    def texts(stream: Any) -> list[str]:
        return [c.choices[0].text for c in stream if c.choices]

    a = texts(direct.completions.create(stream=True, **kwargs))
    b = texts(proxied.completions.create(stream=True, **kwargs))
    assert "".join(b) and a == b


def test_models_and_other_paths(engine: Engine, detproxy_url: str) -> None:
    direct, proxied = clients(engine, detproxy_url)
    assert [m.id for m in proxied.models.list()] == [m.id for m in direct.models.list()]
    with urllib.request.urlopen(detproxy_url + "/health") as resp:
        assert resp.status == 200
    with urllib.request.urlopen(detproxy_url + "/metrics") as resp:
        assert b"llamacpp:" in resp.read()  # the engine's own metrics, passed through


def test_wrong_types_are_forwarded_and_the_engine_error_reaches_the_sdk(
    engine: Engine, detproxy_url: str
) -> None:
    errors = []
    for client in clients(engine, detproxy_url):
        with pytest.raises(openai.BadRequestError) as exc:
            client.chat.completions.create(
                model=engine.model,
                max_tokens="x",  # type: ignore[arg-type]
                messages=[{"role": "user", "content": "hi"}],
            )
        errors.append(exc.value.body)
    assert errors[0] == errors[1] and "max_tokens" in str(errors[1])


def test_client_disconnect_stops_generation(engine: Engine, detproxy_url: str) -> None:
    body = {
        "model": engine.model,
        "temperature": 0,
        "max_tokens": 2000,
        "stream": True,
        "messages": [{"role": "user", "content": "Write a very long story about the sea."}],
        "cache_prompt": False,
    }
    with (
        httpx2.Client(timeout=30) as http,
        http.stream("POST", detproxy_url + "/v1/chat/completions", json=body) as resp,
    ):
        lines = resp.iter_lines()
        assert next(lines).startswith("data: ")
        assert engine_busy(engine) == 1
    # The client has gone. detproxy must close its upstream connection, which makes
    # llama-server cancel the task. (metrics refresh when the server's loop turns over)
    wait_engine_idle(engine, timeout_s=3)


def test_fingerprint_of_llama_server(engine: Engine, detproxy_url: str) -> None:
    import orjson

    def fingerprint() -> dict[str, Any] | None:
        with urllib.request.urlopen(detproxy_url + "/detproxy/status") as resp:
            fp: dict[str, Any] | None = orjson.loads(resp.read())["upstream_fingerprint"]
        return fp

    fp = eventually_sync(fingerprint, interval_s=0.1, what="llama-server's fingerprint read")
    assert fp["kind"] == "llama.cpp" and fp["version"].startswith("b")  # build_info, e.g. b1-...
    assert fp["models"] == ["smollm2"]
    assert fp["identity"]["llama"]["total_slots"] == 2
    assert fp["identity"]["llama"]["model_file"].endswith(".gguf")
    with urllib.request.urlopen(detproxy_url + "/detproxy/metrics") as resp:
        assert b'detproxy_upstream_info{fingerprint="' in resp.read()
