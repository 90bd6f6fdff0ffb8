"""What the tests share: free ports and the processes started on them (detproxy, llama-server),
metric readers, SSE builders and parsers, engine-shaped answers, a client for the emulator,
scripted upstreams, and a harness that drives the stream relay without sockets.

Test modules import from here, never from one another; pytest fixtures stay in conftest.py.
Nothing here imports pytest, so the benchmarks can use it too.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, overload

import aiohttp
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import BaseTestServer
from aiohttp.typedefs import Handler
from aiohttp.web_runner import BaseRunner
from multidict import CIMultiDict
from prometheus_client import CollectorRegistry
from yarl import URL

from policies.base import Continue
from proxy.config import Settings
from proxy.events import EventBus, InspectionStopped, UpstreamFailed
from proxy.http.errors import UpstreamBodyError
from proxy.http.upstream import pump_chunks
from proxy.loops.detector import DetectorConfig, LoopDetector
from proxy.loops.rendered import SENTINEL
from proxy.loops.watch import LoopWatch
from proxy.relay.inspectors import InspectorSet
from proxy.relay.result import StreamResult
from proxy.relay.stream import StreamPlan, StreamRelay
from proxy.serving import serving

TESTS = Path(__file__).resolve().parents[1]

# No shadow replays (detproxy audits 5% and one a minute per model by default): for tests that
# count upstream requests or audits and are about something else. Passive checks stay on.
NO_SHADOWS = {"DETPROXY_AUDIT__SAMPLE_RATE": "0", "DETPROXY_AUDIT__AT_LEAST_EVERY_S": "0"}

# ---------------------------------------------------------------------------------------------
# Polling: until something is so, by a deadline (never a count of tries: a busy machine is slow)

T = TypeVar("T")


@dataclass(frozen=True)
class Unmet:
    """A check's answer for "not yet" that still shows what it saw in the failure message."""

    seen: Any

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return repr(self.seen)


def _not_within(what: str, timeout_s: float, last: object) -> AssertionError:
    seen = repr(last).replace("\n", "\\n")
    if len(seen) > 500:
        seen = seen[:500] + "..."
    return AssertionError(f"{what}: not within {timeout_s} s (last: {seen})")


@overload
async def eventually(
    check: Callable[[], Awaitable[T | Unmet | None]],
    *,
    timeout_s: float = ...,
    interval_s: float = ...,
    what: str,
) -> T: ...


@overload
async def eventually(
    check: Callable[[], T | Unmet | None],
    *,
    timeout_s: float = ...,
    interval_s: float = ...,
    what: str,
) -> T: ...


async def eventually(
    check: Callable[[], Any],
    *,
    timeout_s: float = 10.0,
    interval_s: float = 0.02,
    what: str,
) -> Any:
    """``check()``'s first truthy value (``check`` may be async), polled every ``interval_s``;
    past ``timeout_s`` an AssertionError that says ``what`` was awaited and the last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() >= deadline:
            raise _not_within(what, timeout_s, value)
        await asyncio.sleep(interval_s)


def eventually_sync(
    check: Callable[[], T | Unmet | None],
    *,
    timeout_s: float = 10.0,
    interval_s: float = 0.02,
    what: str,
) -> T:
    """``eventually()`` for code that blocks (processes polled with blocking HTTP)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value is not None and value and not isinstance(value, Unmet):  # (narrowed for mypy)
            return value
        if time.monotonic() >= deadline:
            raise _not_within(what, timeout_s, value)
        time.sleep(interval_s)


def _settled(status: dict[str, Any], audits: int) -> dict[str, Any] | Unmet:
    shadow, audit = status["shadow"], status["audit"]
    ended = audit["audits"] + sum(audit["shadows_dropped"].values())
    idle = shadow is None or shadow["queued"] == shadow["running"] == 0
    return status if idle and ended >= audits else Unmet({"shadow": shadow, "ended": ended})


def _settled_what(audits: int) -> str:
    return f"shadows settled and {audits} audits ended" if audits else "shadows settled"


async def settle(
    client: Any, audits: int = 0, *, timeout_s: float = 10.0, headers: dict[str, str] | None = None
) -> dict[str, Any]:
    """Until no shadow is queued or running and ``audits`` audits ended (a dropped shadow
    ended too), read from ``client``'s (a TestClient's) /detproxy/status; the status then."""

    async def status() -> dict[str, Any] | Unmet:
        resp = await client.get("/detproxy/status", headers=headers)
        return _settled(await resp.json(), audits)

    return await eventually(status, timeout_s=timeout_s, what=_settled_what(audits))


def settle_sync(base: str, audits: int = 0, *, timeout_s: float = 60.0) -> dict[str, Any]:
    """``settle()`` for a detproxy process at ``base`` (its URL), polled with blocking HTTP."""

    def status() -> dict[str, Any] | Unmet:
        with urllib.request.urlopen(base + "/detproxy/status", timeout=10) as resp:
            return _settled(orjson.loads(resp.read()), audits)

    what = _settled_what(audits)
    return eventually_sync(status, timeout_s=timeout_s, interval_s=0.5, what=what)


# ---------------------------------------------------------------------------------------------
# Ports and processes

EXE = str(Path(sys.executable).with_name("detproxy"))  # the console script a user runs


def bare_env(**extra: str) -> dict[str, str]:
    """A child process's environment with nothing of the caller's but the session's state
    dir (tests/conftest.py): without it the child would keep incidents in the real home."""
    return {"PATH": "", "DETPROXY_STATE_DIR": os.environ["DETPROXY_STATE_DIR"], **extra}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


NEEDS_REDIS = pytest.mark.skipif(
    shutil.which("redis-server") is None, reason="redis-server (Debian package) is not installed"
)


@contextlib.contextmanager
def redis_server(folder: Path) -> Iterator[str]:
    """A real redis-server on 127.0.0.1 (no persistence), its URL while the block runs."""
    port = free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", str(folder)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip

    def listening() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        except OSError:
            return False
        return True

    try:
        eventually_sync(listening, timeout_s=10, interval_s=0.05, what="redis-server listening")
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


async def wait_healthy(url: str, timeout_s: float = 15.0) -> None:
    async with aiohttp.ClientSession() as http:

        async def answered() -> int | Unmet:
            try:
                async with http.get(url) as resp:
                    return resp.status if resp.status == 200 else Unmet(resp.status)
            except aiohttp.ClientError as err:
                return Unmet(err)

        await eventually(answered, timeout_s=timeout_s, interval_s=0.05, what=f"{url} answers 200")


@asynccontextmanager
async def detproxy_serve(
    upstream: str, *flags: str, env: dict[str, str] | None = None, port: int | None = None
) -> AsyncIterator[tuple[str, asyncio.subprocess.Process]]:
    """detproxy as a user starts it, the console script in a child process on a free port.
    Yield (base URL, process); terminate it on exit unless the test already stopped it."""
    port = port or free_port()
    proc = await asyncio.create_subprocess_exec(
        EXE,
        "serve",
        "--upstream",
        upstream,
        "--port",
        str(port),
        *flags,
        env={**bare_env(), **(env or {})},
        stderr=asyncio.subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        await wait_healthy(base + "/detproxy/health")
        yield base, proc
    finally:
        if proc.returncode is None:
            proc.terminate()
            await asyncio.wait_for(proc.wait(), 30)


class ServedApp(BaseTestServer):
    """A detproxy app served as ``detproxy serve`` serves it (``proxy.serving``: with the lean
    front unless ``server.http`` says aiohttp), for aiohttp's ``TestClient``."""

    def __init__(self, app: web.Application, settings: Settings) -> None:
        super().__init__()
        self.app = app
        self._settings = settings
        self._serving: contextlib.AbstractAsyncContextManager[object] | None = None

    async def _make_runner(self, **kwargs: Any) -> BaseRunner:
        raise TypeError("ServedApp serves through proxy.serving")

    @property
    def started(self) -> bool:
        return self._serving is not None

    async def start_server(self, loop: asyncio.AbstractEventLoop | None = None, **_: Any) -> None:
        if self._serving is not None:
            return
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self.host, self.port = sock.getsockname()[:2]
        self.scheme = "http"
        self._serving = serving(self.app, self._settings.server, sock)
        await self._serving.__aenter__()
        self._root = URL(f"http://127.0.0.1:{self.port}")

    async def close(self) -> None:
        if self._serving is not None and not self._closed:
            self._closed = True
            await self._serving.__aexit__(None, None, None)
            self._root = None


def own_tasks() -> int:
    """Tasks in this loop other than aiohttp's per-connection handlers: idle keep-alive
    connections keep theirs until the keep-alive timeout (pooled, not leaked)."""
    return sum(
        1
        for t in asyncio.all_tasks()
        if getattr(t.get_coro(), "__qualname__", "") != "RequestHandler.start"
    )


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float = 120.0) -> None:
    """Block until ``url`` answers 200; fail at once if ``proc`` exits first."""

    def answered() -> int | Unmet:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                return int(resp.status) if resp.status == 200 else Unmet(resp.status)
        except OSError as err:
            return Unmet(err)

    eventually_sync(answered, timeout_s=timeout, interval_s=0.2, what=f"{url} answers 200")


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# ---------------------------------------------------------------------------------------------
# The real engine of the integration tests: llama.cpp's llama-server with SmolLM2-135M


@dataclass(frozen=True)
class Engine:
    url: str  # base URL of llama-server, e.g. http://127.0.0.1:PORT
    model: str


def engine_paths() -> tuple[str, str]:
    """(llama-server binary, GGUF): from LLAMA_SERVER and SMOLLM2_GGUF, else built."""
    server, gguf = os.environ.get("LLAMA_SERVER"), os.environ.get("SMOLLM2_GGUF")
    if server and gguf:
        return server, gguf
    out = subprocess.run(
        ["bash", str(TESTS / "integration" / "build_llama_server.sh")],
        check=True,
        capture_output=True,
        text=True,
        timeout=3600,
    ).stdout
    found = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    return found["LLAMA_SERVER"], found["SMOLLM2_GGUF"]


def reasoning_template() -> str:
    """QwQ's chat template from the vendored llama.cpp: it opens a <think> block."""
    server, _ = engine_paths()
    src = os.environ.get("LLAMA_SRC") or str(Path(server).parents[2] / "src/vendor/llama.cpp")
    return str(Path(src) / "models/templates/Qwen-QwQ-32B.jinja")


def engine_busy(engine: Engine) -> float:
    """The requests llama-server is processing now (``llamacpp:requests_processing``)."""
    for value in scrape(engine.url + "/metrics", "llamacpp:requests_processing").values():
        return value
    raise AssertionError("llama-server exported no llamacpp:requests_processing")


def wait_engine_idle(engine: Engine, timeout_s: float = 120.0) -> None:
    """Until llama-server processes nothing: a request its client left may still generate."""

    def idle() -> bool | Unmet:
        busy = engine_busy(engine)
        return busy == 0 or Unmet(busy)

    eventually_sync(idle, timeout_s=timeout_s, interval_s=0.1, what="llama-server idle")


@contextlib.contextmanager
def run_engine(logdir: Path, *args: str) -> Iterator[Engine]:
    """llama-server on a free loopback port with these extra arguments."""
    server, gguf = engine_paths()
    port = free_port()
    log = open(logdir / f"llama-server-{port}.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [
            server,
            "-m",
            gguf,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "-t",
            "2",
            "-a",
            "smollm2",
            "--no-webui",
            "--metrics",
            *args,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc)
        yield Engine(url=f"http://127.0.0.1:{port}", model="smollm2")
    finally:
        stop(proc)
        log.close()


@contextlib.contextmanager
def run_detproxy(logdir: Path, upstream: str, config: str = "") -> Iterator[str]:
    """detproxy in front of ``upstream``, started the way a user starts it, with this TOML
    config; its log in ``logdir``."""
    port = free_port()
    cfg = logdir / f"detproxy-{port}.toml"
    cfg.write_text(config)
    log = open(logdir / f"detproxy-{port}.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [
            EXE,
            "serve",
            "--upstream",
            upstream,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--config",
            str(cfg),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/detproxy/health", proc, timeout=30)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)
        log.close()


# ---------------------------------------------------------------------------------------------
# Metrics


def metric(registry: CollectorRegistry, sample: str, **labels: str) -> float:
    """One sample of an in-process registry; 0 where it was never set."""
    return registry.get_sample_value(sample, labels) or 0.0


def metric_total(registry: CollectorRegistry, sample: str) -> float:
    """One sample of an in-process registry summed over all its label sets."""
    return sum(s.value for family in registry.collect() for s in family.samples if s.name == sample)


def metric_samples(text: str, prefix: str | tuple[str, ...] = "") -> dict[str, float]:
    """The samples of a Prometheus text page whose names start with ``prefix``, keyed by
    ``name{labels}`` as written."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and line.startswith(prefix):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def scrape(url: str, prefix: str | tuple[str, ...] = "") -> dict[str, float]:
    """``metric_samples`` of the page at ``url`` (a blocking GET, for the integration tests)."""
    with urllib.request.urlopen(url) as resp:
        return metric_samples(resp.read().decode(), prefix)


# ---------------------------------------------------------------------------------------------
# SSE: building streams


def sse_event(obj: Any) -> bytes:
    """One vLLM-framed SSE event: ``data: <json>`` and a blank line."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def chat_chunk(
    delta: dict[str, Any] | None = None,
    finish: str | None = None,
    *,
    chunk_id: str = "chatcmpl-1",
    **extra: Any,
) -> dict[str, Any]:
    """A vLLM ``chat.completion.chunk`` with one choice (no logprobs); ``extra`` adds top-level
    fields (``usage``, ...)."""
    choice = {"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish}
    return {"id": chunk_id, "object": "chat.completion.chunk", "choices": [choice], **extra}


def chat_event(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
    """``chat_chunk`` as an SSE event."""
    return sse_event(chat_chunk(delta, finish, **extra))


# ---------------------------------------------------------------------------------------------
# SSE: reading streams


def sse_blocks(raw: bytes) -> list[bytes]:
    """A stream's events as framed, without the blank line that ends each: b'data: {...}',
    b': comment', b'data: [DONE]'."""
    return [block for block in raw.split(b"\n\n") if block]


def sse_chunks(raw: bytes) -> list[dict[str, Any]]:
    """The JSON of a stream's data events; [DONE] and comments left out."""
    return [
        orjson.loads(block[len(b"data: ") :])
        for block in sse_blocks(raw)
        if block.startswith(b"data: ") and block != b"data: [DONE]"
    ]


def sse_comments(raw: bytes) -> list[bytes]:
    """A stream's comment lines (``: ...``), as detproxy writes them between attempts."""
    return [block for block in sse_blocks(raw) if block.startswith(b":")]


def parse_sse(raw: bytes) -> list[Any]:
    """Strictly parse vLLM SSE framing: every event is ``data: <json>\\n\\n``, last is [DONE]."""
    assert raw.endswith(b"\n\n"), raw[-50:]
    out: list[Any] = []
    for block in raw[:-2].split(b"\n\n"):
        assert block.startswith(b"data: "), block
        payload = block[len(b"data: ") :]
        out.append("[DONE]" if payload == b"[DONE]" else orjson.loads(payload))
    return out


def chunks(events: list[Any]) -> list[dict[str, Any]]:
    """The chunks of ``parse_sse``'s events, which must end with [DONE]."""
    assert events[-1] == "[DONE]"
    assert all(isinstance(e, dict) for e in events[:-1])
    return list(events[:-1])


def without_ids(raw: bytes) -> bytes:
    """Remove id/created from a JSON body or every SSE chunk (for determinism comparisons)."""

    def scrub(obj: dict[str, Any]) -> bytes:
        return orjson.dumps({k: v for k, v in obj.items() if k not in {"id", "created"}})

    if raw.startswith(b"data: "):
        return b"|".join(b"[DONE]" if e == "[DONE]" else scrub(e) for e in parse_sse(raw))
    return scrub(orjson.loads(raw))


def chat_text(body: dict[str, Any], field: str = "content") -> str:
    return "".join(c["message"][field] or "" for c in body["choices"][:1])


def stream_text(events: list[Any], field: str = "content", index: int = 0) -> str:
    out = []
    for ch in chunks(events):
        for choice in ch["choices"]:
            if choice["index"] == index and choice.get("delta", {}).get(field):
                out.append(choice["delta"][field])
    return "".join(out)


# ---------------------------------------------------------------------------------------------
# Engine-shaped answers with logprobs: one non-streamed body and its equivalent stream

Token = tuple[str, float | None, list[tuple[str, float | None]]]  # (token, logprob, top-k)


def chat_entry(
    token: str, logprob: float | None, top: list[tuple[str, float | None]]
) -> dict[str, Any]:
    return {
        "token": token,
        "logprob": logprob,
        "bytes": list(token.encode()),
        "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in top],
    }


def legacy_logprobs(tokens: list[Token]) -> dict[str, Any]:
    offsets, pos = [], 0
    for tok, _, _ in tokens:
        offsets.append(pos)
        pos += len(tok)
    return {
        "tokens": [t for t, _, _ in tokens],
        "token_logprobs": [v for _, v, _ in tokens],
        "top_logprobs": [dict(top) for _, _, top in tokens],
        "text_offset": offsets,
    }


def chat_body(
    reasoning: list[Token], content: list[Token], finish: str = "stop", index: int = 0
) -> dict[str, Any]:
    """A non-streamed chat answer whose texts are the concatenated tokens."""
    message: dict[str, Any] = {"role": "assistant", "content": "".join(t for t, _, _ in content)}
    if reasoning:
        message["reasoning"] = "".join(t for t, _, _ in reasoning)
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "choices": [
            {
                "index": index,
                "message": message,
                "logprobs": {"content": [chat_entry(*t) for t in reasoning + content]},
                "finish_reason": finish,
                "stop_reason": None,
            }
        ],
        "usage": {"prompt_tokens": 7, "completion_tokens": len(reasoning) + len(content)},
    }


def chat_chunks(
    reasoning: list[Token],
    content: list[Token],
    finish: str = "stop",
    index: int = 0,
    reasoning_field: str = "reasoning",
) -> list[dict[str, Any]]:
    """The same answer streamed one token per chunk, vLLM style, with a usage chunk."""

    def chunk(choice: dict[str, Any]) -> dict[str, Any]:
        return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": [choice]}

    out = [
        chunk(
            {
                "index": index,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        )
    ]
    for field_name, tokens in ((reasoning_field, reasoning), ("content", content)):
        for tok in tokens:
            out.append(
                chunk(
                    {
                        "index": index,
                        "delta": {field_name: tok[0]},
                        "logprobs": {"content": [chat_entry(*tok)]},
                        "finish_reason": None,
                    }
                )
            )
    out.append(chunk({"index": index, "delta": {}, "finish_reason": finish, "stop_reason": None}))
    out.append(
        {
            "id": "chatcmpl-1",
            "choices": [],
            "usage": {"prompt_tokens": 7, "completion_tokens": len(reasoning) + len(content)},
        }
    )
    return out


def completion_body(tokens: list[Token], finish: str = "length") -> dict[str, Any]:
    return {
        "id": "cmpl-1",
        "object": "text_completion",
        "choices": [
            {
                "index": 0,
                "text": "".join(t for t, _, _ in tokens),
                "logprobs": legacy_logprobs(tokens),
                "finish_reason": finish,
                "stop_reason": None,
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": len(tokens)},
    }


def completion_chunks(tokens: list[Token], finish: str = "length") -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [
        {
            "id": "cmpl-1",
            "object": "text_completion",
            "choices": [
                {
                    "index": 0,
                    "text": tok[0],
                    "logprobs": legacy_logprobs([tok]),
                    "finish_reason": None,
                }
            ],
        }
        for tok in tokens
    ]
    out.append(
        {
            "id": "cmpl-1",
            "object": "text_completion",
            "choices": [{"index": 0, "text": "", "finish_reason": finish, "stop_reason": None}],
        }
    )
    out.append(
        {
            "id": "cmpl-1",
            "choices": [],
            "usage": {"prompt_tokens": 3, "completion_tokens": len(tokens)},
        }
    )
    return out


REASONING: list[Token] = [
    ("Let", -0.25, [("Let", -0.25), ("Okay", -1.5)]),
    (" me", -0.01, [(" me", -0.01), (" us", -4.75)]),
]
CONTENT: list[Token] = [
    ("Hi", -0.125, [("Hi", -0.125), ("Hello", -2.25)]),
    ("!", -0.5, [("!", -0.5), (".", -1.0)]),
    (" ok", -9999.0, [(" ok", -9999.0), (" no", -9999.0)]),
]


def grouped_chat_chunks(
    content: list[Token],
    per_chunk: int,
    logprobs: bool = True,
    continuous_usage: bool = False,
    final_usage: bool = True,
) -> list[dict[str, Any]]:
    """A chat answer streamed ``per_chunk`` tokens a chunk, as vLLM's stream interval and
    speculative decoding send it: the role chunk, then the tokens (their logprobs entries in
    ``logprobs.content``, ``usage`` growing by the chunk's tokens with ``continuous_usage``),
    the last of them in the chunk that carries ``finish_reason``, then the usage chunk."""

    def chunk(choice: dict[str, Any], done: int) -> dict[str, Any]:
        out: dict[str, Any] = {"id": "chatcmpl-1", "object": "chat.completion.chunk"}
        out["choices"] = [choice]
        if continuous_usage:
            out["usage"] = {"prompt_tokens": 7, "completion_tokens": done}
        return out

    role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
    out = [chunk({**role, "finish_reason": None}, 0)]
    for start in range(0, len(content), per_chunk):
        group = content[start : start + per_chunk]
        last = start + per_chunk >= len(content)
        choice: dict[str, Any] = {
            "index": 0,
            "delta": {"content": "".join(t for t, _, _ in group)},
            "logprobs": {"content": [chat_entry(*t) for t in group]} if logprobs else None,
            "finish_reason": "stop" if last else None,
        }
        out.append(chunk(choice, start + len(group)))
    if final_usage:
        usage = {"prompt_tokens": 7, "completion_tokens": len(content)}
        out.append({"id": "chatcmpl-1", "choices": [], "usage": usage})
    return out


def tokens(n: int) -> list[Token]:
    """``n`` distinct content tokens."""
    return [(f" t{i}", -0.5, [(f" t{i}", -0.5), (" x", -2.0)]) for i in range(n)]


# ---------------------------------------------------------------------------------------------
# A client for the emulator

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "Tell me about determinism in batched inference."}]


def knobs(**fields: Any) -> dict[str, str]:
    """The header that sets emulator knobs for one request."""
    return {"X-Emulator-Knobs": orjson.dumps(fields).decode()}


def chat(**extra: Any) -> dict[str, Any]:
    """A greedy chat request to the emulator's model."""
    body: dict[str, Any] = {"model": "emulator-model", "messages": MESSAGES, "temperature": 0}
    body.update(extra)
    return body


def completion(**extra: Any) -> dict[str, Any]:
    """A greedy completions request to the emulator's model."""
    body: dict[str, Any] = {
        "model": "emulator-model",
        "prompt": "Once upon a time",
        "temperature": 0,
    }
    body.update(extra)
    return body


@dataclass
class EmulatorReply:
    status: int
    headers: CIMultiDict[str]
    raw: bytes

    def json(self) -> Any:
        return orjson.loads(self.raw)

    def events(self) -> list[Any]:
        return parse_sse(self.raw)


class EmulatorClient:
    """A tiny HTTP client that reads whole replies."""

    def __init__(self, session: aiohttp.ClientSession, base: str) -> None:
        self.session = session
        self.base = base

    async def post(
        self, path: str, body: Any, headers: dict[str, str] | None = None
    ) -> EmulatorReply:
        data = body if isinstance(body, bytes) else orjson.dumps(body)
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        async with self.session.post(self.base + path, data=data, headers=hdrs) as resp:
            raw = await resp.read()
            return EmulatorReply(resp.status, resp.headers.copy(), raw)

    async def get(self, path: str) -> EmulatorReply:
        async with self.session.get(self.base + path) as resp:
            return EmulatorReply(resp.status, resp.headers.copy(), await resp.read())

    async def chat(
        self, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> EmulatorReply:
        return await self.post(CHAT, body, headers)

    async def completion(
        self, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> EmulatorReply:
        return await self.post(COMPLETIONS, body, headers)


# ---------------------------------------------------------------------------------------------
# A scripted HTTP/1.1 server for the upstream client's tests: it records each request and the
# connection it came on, and answers with whatever bytes a test's ``ScriptedReply`` writes.

JSON_REPLY = (
    b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 7\r\n\r\n{"a":1}'
)


@dataclass
class ScriptedRequest:
    conn: int  # which server-side connection it came on (0, 1, ...)
    head: bytes
    body: bytes

    @property
    def lines(self) -> list[bytes]:
        return self.head.split(b"\r\n")

    def header(self, name: bytes) -> bytes | None:
        for line in self.lines[1:]:
            key, _, value = line.partition(b":")
            if key.strip().lower() == name.lower():
                return value.strip()
        return None


# Gets the request and the writer; returns True to keep reading requests on the connection.
ScriptedReply = Callable[[ScriptedRequest, asyncio.StreamWriter], Awaitable[bool]]


@dataclass
class ScriptedServer:
    reply: ScriptedReply
    requests: list[ScriptedRequest] = field(default_factory=list)
    connections: int = 0
    eofs: int = 0  # connections the client closed
    server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = self.connections
        self.connections += 1
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    self.eofs += 1
                    return
                req = ScriptedRequest(conn, head, b"")
                length = req.header(b"content-length")
                if length is not None:
                    req.body = await reader.readexactly(int(length))
                elif req.header(b"transfer-encoding") == b"chunked":
                    req.body = await _read_chunked(reader)
                self.requests.append(req)
                if not await self.reply(req, writer):
                    writer.close()
                    return
                await writer.drain()
        finally:
            writer.close()


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    out = b""
    while True:
        size = int((await reader.readuntil(b"\r\n")).strip(), 16)
        data = await reader.readexactly(size + 2)
        if size == 0:
            return out
        out += data[:-2]


def replies_with(raw: bytes) -> ScriptedReply:
    """A ``ScriptedReply`` that writes ``raw`` to every request and keeps the connection."""

    async def reply(req: ScriptedRequest, writer: asyncio.StreamWriter) -> bool:
        writer.write(raw)
        return True

    return reply


# ---------------------------------------------------------------------------------------------
# A scripted OpenAI-compatible upstream (aiohttp): a minimal SSE stream and a /version that
# can change


@dataclass
class UpstreamScript:
    tokens: int = 20
    delay_s: float = 0.002
    change_version: bool = False  # /version says 0.1.0 once, then 0.2.0
    fail_every: int = 0  # every n-th chat request (not the first) answers HTTP 500
    # /metrics of a vLLM with speculative decoding: its spec-decode counters start at 0 and
    # rise with the chat requests after the first (drafts of 3 tokens, 2 accepted); the first
    # drafts nothing, as vLLM's n-gram proposer when the prompt has no match.
    speculative: bool = False
    version_calls: int = 0
    chat_calls: int = 0
    bodies: list[dict[str, Any]] = field(default_factory=list)


def scripted_upstream(script: UpstreamScript) -> web.Application:
    async def version(request: web.Request) -> web.Response:
        script.version_calls += 1
        changed = script.change_version and script.version_calls > 1
        return web.json_response({"version": "0.2.0" if changed else "0.1.0"})

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

    async def chat(request: web.Request) -> web.StreamResponse:
        script.chat_calls += 1
        script.bodies.append(await request.json())
        if (
            script.fail_every
            and script.chat_calls > 1
            and script.chat_calls % script.fail_every == 0
        ):
            return web.json_response({"error": {"message": "scripted failure"}}, status=500)
        delay = script.delay_s
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(chat_event({"role": "assistant", "content": ""}))
        for _ in range(script.tokens):
            await asyncio.sleep(delay)
            await resp.write(chat_event({"content": "x"}))
        await resp.write(chat_event({}, "length"))
        usage = {"prompt_tokens": 5, "completion_tokens": script.tokens, "total_tokens": 25}
        await resp.write(sse_event({"choices": [], "usage": usage}))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def metrics(request: web.Request) -> web.Response:
        n = max(0, script.chat_calls - 1)
        lines = [
            'vllm:num_requests_running{engine="0",model_name="m"} 0.0',
            f'vllm:spec_decode_num_drafts_total{{engine="0",model_name="m"}} {n}.0',
            f'vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="m"}} {3 * n}.0',
            f'vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="m"}} {2 * n}.0',
        ]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    app = web.Application()
    if script.speculative:
        app.router.add_get("/metrics", metrics)
    app.router.add_get("/version", version)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat)
    return app


# ---------------------------------------------------------------------------------------------
# The stream relay driven without sockets: upstream reads in, client writes out


class ExplodingInspector:
    """An inspector with a bug: it raises on its first chunk (it must be dropped, in isolation)."""

    name = "explode"

    def on_chunk(self, chunk: dict[str, Any]) -> None:
        raise ValueError("inspector bug")

    def on_end(self, complete: bool) -> None:
        raise AssertionError("a dropped inspector is not called again")


class ScriptedReads:
    """The upstream body: these reads, then the end or (``fail``) a lost connection."""

    def __init__(self, reads: list[bytes], fail: bool = False) -> None:
        self.reads = reads
        self.fail = fail
        self._body = self.chunks()  # pump's: it goes on where the last call stopped

    async def chunks(self) -> AsyncIterator[bytes]:
        for read in self.reads:
            yield read
        if self.fail:
            raise UpstreamBodyError("connection lost")

    async def pump(self, sink: Callable[[bytes], bool]) -> bool:
        return await pump_chunks(self._body, sink)


class RecordedWrites:
    """The client: every write it was given."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    async def write(self, data: bytes) -> None:
        self.writes.append(data)

    def write_nowait(self, data: bytes) -> bool:
        self.writes.append(data)
        return True

    async def drain(self) -> None:
        pass

    @property
    def body(self) -> bytes:
        return b"".join(self.writes)


class RelayRun:
    def __init__(self, relay: StreamRelay, client: RecordedWrites, result: StreamResult) -> None:
        self.relay, self.client, self.result = relay, client, result
        self.stopped: list[str] = []
        self.failed: list[str] = []
        self.decided: list[Any] = []


def relay(
    reads: list[bytes],
    *,
    loops: bool = False,
    decision: Any = None,
    hold: bool = False,
    inspectors: list[Any] | None = None,
    fail: bool = False,
    general: bool = False,
    max_event_bytes: int = 1 << 20,
    endpoint: str = "chat",
    **plan: Any,
) -> RelayRun:
    """Relay these upstream reads through a ``StreamRelay`` (``general``: its general path
    only); ``decision`` answers every trigger of the loop watch (``loops``)."""
    bus = EventBus()
    decided: list[Any] = []

    def on_trigger(trigger: Any) -> Any:
        decided.append(trigger)
        return decision or Continue()

    stream_plan = StreamPlan(
        on_trigger=on_trigger if loops else None,
        hold_reasoning=hold,
        **plan,
    )
    dropped: list[str] = []
    watch = [LoopWatch(endpoint, DetectorConfig())] if loops else []
    r = StreamRelay(
        endpoint,
        InspectorSet([*watch, *(inspectors or [])], dropped.append),
        bus,
        max_event_bytes,
        0.0,
        stream_plan,
        fast_paths=not general,
    )
    stopped: list[str] = []
    failed: list[str] = []
    bus.subscribe(InspectionStopped, lambda ev: stopped.append(ev.reason))
    bus.subscribe(UpstreamFailed, lambda ev: failed.append(ev.kind))
    client = RecordedWrites()
    result = asyncio.run(r.run(ScriptedReads(reads, fail), client))  # type: ignore[arg-type]
    run = RelayRun(r, client, result)
    run.stopped, run.failed, run.decided = stopped + dropped, failed, decided
    return run


# ---------------------------------------------------------------------------------------------
# A recording upstream: the rendered continuations' tests


def rendering(mode: str) -> dict[str, str]:
    markers = [{"models": "*", "rendered_continuation": mode}]
    return {"DETPROXY_LOOPS__REASONING_MARKERS": orjson.dumps(markers).decode()}


class Seen:
    """The requests the emulator got (path, body), and the paths it answers otherwise (a
    status and body)."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.refuse: dict[str, tuple[int, dict[str, Any]]] = {}

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        body = orjson.loads(await request.read() or b"{}")
        self.requests.append((request.path, body))
        answer = self.refuse.get(request.path)
        if answer is not None:
            return web.json_response(answer[1], status=answer[0])
        return await handler(request)

    def bodies(self, path: str) -> list[dict[str, Any]]:
        return [body for p, body in self.requests if p == path]

    def probes(self) -> int:
        """Probes of a template (the /tokenize render whose reasoning is SENTINEL)."""
        return sum(
            1
            for body in self.bodies("/tokenize")
            if SENTINEL in orjson.dumps(body.get("messages") or []).decode()
        )


def no_loop_in(text: str) -> bool:
    detector = LoopDetector()
    return detector.feed(text) is None and detector.report is None


def refused(status: int) -> tuple[int, dict[str, Any]]:
    return status, {"error": {"message": "refused", "type": "BadRequestError", "code": status}}
