"""End-to-end proxy benchmark: detproxy next to nginx against a static upstream, in one run.

Run: ``.venv/bin/python tests/bench/bench_proxy.py [--duration 4] [--rounds 2] [--quick]``
Needs ``nginx`` and ``wrk`` on PATH (Debian: ``apt-get install nginx wrk``). Prints figures only.

What it does, all bound to 127.0.0.1, everything in a temp dir that is removed afterwards:

- writes a vLLM-shaped chat completion (~1 KB JSON) and a ~200-chunk SSE stream of the same
  kind (one content token per chunk, ``"logprobs": null``, ``data: [DONE]`` at the end);
- starts nginx #1 (``worker_processes 1``) serving them to ``POST /v1/chat/completions``: the
  stream when the query has ``bench=sse``, the JSON otherwise. This is the upstream ("direct");
- starts nginx #2 (``worker_processes 1``) as a plain reverse proxy in front of it
  (``proxy_buffering off``, HTTP/1.1, keepalive upstream pool): "nginx";
- starts four detproxy processes in front of nginx #1:
  ``dp-default`` (detproxy's defaults: loop inspection and passive checks on, audit off),
  ``dp-off`` (audit off, passive checks off, loops disabled: the bare relay),
  ``dp-audit`` (100% of greedy requests sampled, the shadow budgets raised so that each is
  replayed; shadows hit a second nginx listener; the run prints the share audited),
  ``dp-loops`` (audit off, passive checks off, loop inspection on);
- for each mode (non-streaming, streaming) and concurrency (1, 16, 64) runs wrk against every
  target back to back, ``--rounds`` times with a rotated order, and keeps the median round;
- prints, per mode, requests/s, p50 and p99 latency per target and concurrency, the throughput
  ratio against direct and against nginx, and the p50 added over direct.

Every request is greedy (``"temperature": 0``), so dp-audit really audits it, and each has its
own prompt (``wrk_script``), so that none is a passive duplicate of another.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import platform
import re
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.helpers.processes import free_port  # noqa: E402

Popen = subprocess.Popen[bytes]
HOST = "127.0.0.1"
PATH = "/v1/chat/completions"
MODEL = "Qwen/Qwen3-8B"
CREATED = 1718000000
REQ_ID = "chatcmpl-8f3c2a71d4e54b0b9a6f1c2d3e4f5a6b"
CONCURRENCY = (1, 16, 64)
MODES = ("json", "sse")
MODE_TITLE = {"json": "non-streaming (~1 KB JSON answer)", "sse": "streaming (~200 SSE chunks)"}

WORDS = [
    "the",
    "model",
    "returns",
    "a",
    "token",
    "for",
    "each",
    "step",
    "of",
    "the",
    "decoding",
    "loop",
    "and",
    "the",
    "proxy",
    "relays",
    "every",
    "chunk",
    "as",
    "it",
    "arrives",
    "while",
    "the",
    "detector",
    "keeps",
    "a",
    "bounded",
    "window",
    "of",
    "recent",
    "text",
    "so",
    "memory",
    "stays",
    "small",
    "even",
    "when",
    "answers",
    "run",
    "long",
    "engineers",
    "compare",
    "replay",
    "outputs",
    "bit",
    "for",
    "bit",
    "to",
    "find",
    "nondeterminism",
    "in",
    "batching",
    "kernels",
    "cache",
    "reuse",
    "or",
    "sampling",
    "parameters",
    "that",
    "differ",
]


# ---------------------------------------------------------------------------------------------
# Pre-generated bodies


def _words(n: int, seed: int) -> list[str]:
    # A deterministic, non-repeating word sequence (an LCG over the vocabulary).
    out, x = [], seed
    for _ in range(n):
        x = (x * 1103515245 + 12345) % (2**31)
        out.append(WORDS[(x >> 8) % len(WORDS)])
    return out


def make_json_answer(text: str | None = None) -> bytes:
    if text is None:
        text = " ".join(_words(95, 7)).capitalize() + "."
    answer = {
        "id": REQ_ID,
        "object": "chat.completion",
        "created": CREATED,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": text,
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "tool_calls": [],
                    "reasoning_content": None,
                },
                "logprobs": None,
                "finish_reason": "stop",
                "stop_reason": None,
            }
        ],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": {
            "prompt_tokens": 24,
            "total_tokens": 24 + 120,
            "completion_tokens": 120,
            "prompt_tokens_details": None,
        },
        "prompt_logprobs": None,
        "kv_transfer_params": None,
    }
    return json.dumps(answer, separators=(",", ":")).encode()


def _chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
    obj = {
        "id": REQ_ID,
        "object": "chat.completion.chunk",
        "created": CREATED,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "delta": delta,
                "logprobs": None,
                "finish_reason": finish,
                **({"stop_reason": None} if finish else {}),
            }
        ],
    }
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def stream_words(tokens: int = 200) -> list[str]:
    return _words(tokens, 11)


def make_sse_stream(tokens: int = 200) -> tuple[bytes, int]:
    parts = [_chunk({"role": "assistant", "content": ""})]
    words = stream_words(tokens)
    for i, w in enumerate(words):
        parts.append(_chunk({"content": (w if i == 0 else " " + w)}))
    parts.append(_chunk({"content": ""}, finish="stop"))
    parts.append(b"data: [DONE]\n\n")
    return b"".join(parts), len(parts)


PROMPT = b"a token stream."  # where wrk's requests differ (wrk_script)


def request_body(stream: bool) -> bytes:
    body = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Explain how a reverse proxy relays " + PROMPT.decode()},
        ],
        "temperature": 0,
        "max_tokens": 256,
        "stream": stream,
    }
    return json.dumps(body, separators=(",", ":")).encode()


# ---------------------------------------------------------------------------------------------
# Processes


def wait_port(port: int, proc: subprocess.Popen[bytes], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode} at start (see its log)")
        try:
            with socket.create_connection((HOST, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"{what} did not listen on {port} within {timeout}s")


NGINX_COMMON = """\
worker_processes 1;
daemon off;
pid {dir}/{name}.pid;
error_log {dir}/{name}.error.log warn;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    client_body_temp_path {dir}/tmp/{name}-body;
    proxy_temp_path {dir}/tmp/{name}-proxy;
    fastcgi_temp_path {dir}/tmp/{name}-fcgi;
    uwsgi_temp_path {dir}/tmp/{name}-uwsgi;
    scgi_temp_path {dir}/tmp/{name}-scgi;
    types {{ }}
    sendfile on;
    tcp_nodelay on;
    keepalive_requests 10000000;
    keepalive_timeout 300s;
{body}
}}
"""

# POST to a static file gets 405 from nginx's static module; error_page turns it into an
# internal redirect (as GET) to the same file with status 200.
NGINX_STATIC = """\
    server {{
        listen {host}:{port};
        root {dir}/www;
        location = {path} {{
            if ($arg_bench = "sse") {{ rewrite ^ /chat.sse last; }}
            rewrite ^ /chat.json last;
        }}
        location = /chat.json {{
            default_type application/json;
            error_page 405 =200 $uri;
        }}
        location = /chat.sse {{
            default_type text/event-stream;
            add_header Cache-Control no-cache;
            error_page 405 =200 $uri;
        }}
    }}
    # dp-audit's reference_url: shadows are non-streamed even when the primary streamed, but
    # keep its path (and so ?bench=sse); this listener of the same nginx always answers JSON,
    # for streams the non-streamed twin of the SSE file (same text), so audits agree.
    server {{
        listen {host}:{shadow_port};
        root {dir}/www;
        location / {{
            if ($arg_bench = "sse") {{ rewrite ^ /chat-sse.json last; }}
            rewrite ^ /chat.json last;
        }}
        location ~ ^/chat(-sse)?\\.json$ {{
            default_type application/json;
            error_page 405 =200 $uri;
        }}
    }}
"""

NGINX_PROXY = """\
    upstream static_upstream {{
        server {host}:{upstream_port};
        keepalive 256;
    }}
    server {{
        listen {host}:{port};
        location / {{
            proxy_pass http://static_upstream;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
        }}
    }}
"""

DETPROXY_CONFIGS = {
    "dp-default": "",  # detproxy's defaults: loops on, passive checks on, audit 5%
    "dp-off": """\
[audit]
sample_rate = 0.0
passive_checks = false
[loops]
enabled = false
""",
    "dp-audit": """\
[audit]
sample_rate = 1.0
reference_url = "{shadow_url}"
passive_checks = false
# Every request audited: the shadow budgets raised so that the row measures auditing, not the
# default rate limit of 100 shadows/s (the run prints the share actually audited).
max_shadows_per_s = 1000000.0
max_concurrent_shadows = 16
queue_size = 100000
[loops]
enabled = false
""",
    "dp-loops": """\
[audit]
sample_rate = 0.0
passive_checks = false
[loops]
enabled = true
""",
}


# --ceiling: aiohttp's HTTP server alone, answering the same bytes from memory (no upstream),
# on the event loop detproxy picks (uvloop where installed). No proxy built on aiohttp's
# server can be faster than this.
AIOHTTP_STATIC = """\
import sys
from pathlib import Path
from aiohttp import web
from proxy.http.eventloop import new_event_loop
www = Path(sys.argv[1])
answer = (www / "chat.json").read_bytes()
stream = (www / "chat.sse").read_bytes()
async def handle(request):
    await request.read()
    if request.query.get("bench") == "sse":
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(stream)
        await resp.write_eof()
        return resp
    return web.Response(body=answer, content_type="application/json")
app = web.Application()
app.router.add_post("/v1/chat/completions", handle)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[2]), access_log=None, print=None,
            loop=new_event_loop("auto"))
"""

# --ceiling, the other candidate: a lean asyncio protocol with httptools' parser (what uvicorn's
# httptools implementation and detproxy's upstream client are built on), answering the same
# bytes: what a server of detproxy's own could reach before any proxy work (issue 16).
HTTPTOOLS_STATIC = """\
import asyncio, sys
from pathlib import Path
import httptools
from proxy.http.eventloop import new_event_loop
www = Path(sys.argv[1])
answer = (www / "chat.json").read_bytes()
stream = (www / "chat.sse").read_bytes()
JSON = (b"HTTP/1.1 200 OK\\r\\nContent-Type: application/json\\r\\nContent-Length: "
        + str(len(answer)).encode() + b"\\r\\n\\r\\n" + answer)
SSE = (b"HTTP/1.1 200 OK\\r\\nContent-Type: text/event-stream\\r\\nTransfer-Encoding: chunked"
       b"\\r\\n\\r\\n" + b"%x\\r\\n" % len(stream) + stream + b"\\r\\n0\\r\\n\\r\\n")
class Server(asyncio.Protocol):
    def connection_made(self, transport):
        self.transport = transport
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
    def data_received(self, data):
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()
    def on_url(self, url):
        self.url = url
    def on_message_complete(self):
        self.transport.write(SSE if b"bench=sse" in self.url else JSON)
        if not self.parser.should_keep_alive():
            self.transport.close()
async def main():
    loop = asyncio.get_running_loop()
    server = await loop.create_server(Server, "127.0.0.1", int(sys.argv[2]), backlog=4096)
    await server.serve_forever()
new_event_loop("auto").run_until_complete(main())
"""

# ``detproxy serve`` exactly as a user runs it, with the venv's interpreter.
LAUNCHER = "import sys; from proxy.cli import main; sys.exit(main(sys.argv[1:]))"

# ``--workers``: serve's default (no flag: one worker per core it may use), or N.
AUTO = "auto"
DEFAULTS = ""  # dp-default's configuration: none at all, as `detproxy serve --upstream URL`


def worker_settings(text: str) -> list[str]:
    """``--workers auto,1,2`` -> ["auto", "1", "2"]: each "auto" or a positive count."""
    out = [w.strip() for w in text.split(",") if w.strip()]
    bad = [w for w in out if w != AUTO and not (w.isdigit() and int(w) > 0)]
    if bad:
        raise SystemExit(f"--workers: {bad[0]!r} is neither auto nor a positive count")
    return out


def nginx_workers(conf: str, setting: str) -> str:
    """``conf`` (NGINX_COMMON's) with ``worker_processes setting``: 1, N or auto."""
    if setting != AUTO and not (setting.isdigit() and int(setting) > 0):
        raise SystemExit(f"--nginx-workers: {setting!r} is neither auto nor a positive count")
    return conf.replace("worker_processes 1;", f"worker_processes {setting};", 1)


def nginx_said(setting: str) -> str:
    if setting == AUTO:
        return f"worker_processes auto ({os.cpu_count()} workers: one per core)"
    return f"worker_processes {setting}"


def detproxy_runs(
    configs: dict[str, str], workers: list[str], named: list[str]
) -> list[tuple[str, str, str]]:
    """(name, configuration, workers setting) of each detproxy target: every one of
    ``configs`` as serve starts by default (no --workers flag: one worker per core), then
    ``dp-default-wN``, the defaults under ``--workers N``, for each N of ``workers`` and each
    ``dp-default-wN`` in ``named``."""
    runs = [(name, config, AUTO) for name, config in configs.items()]
    counts = [w for w in workers if w != AUTO]
    counts += [m.group(1) for n in named if (m := re.fullmatch(r"dp-default-w(\d+)", n))]
    runs += [(f"dp-default-w{n}", DEFAULTS, n) for n in dict.fromkeys(counts)]
    return runs


def worker_count(setting: str) -> int:
    """The workers serve runs for ``setting``: "auto" resolved as serve resolves it."""
    from proxy.cores import usable_cores

    return usable_cores() if setting == AUTO else int(setting)


def workers_said(setting: str) -> str:
    n = worker_count(setting)
    plural = "worker" if n == 1 else "workers"
    if setting == AUTO:
        return f"{n} {plural} (serve's default: one per core)"
    return f"{n} {plural} (--workers {setting})"


def detproxy_argv(
    launcher: list[str],
    config: str,
    cfg: Path,
    upstream: str,
    port: int,
    log_level: str,
    setting: str,
) -> list[str]:
    """``launcher`` + serve's arguments. The defaults (``DEFAULTS``) get nothing but the
    upstream, the address and the worker count: `detproxy serve --upstream URL` as a user runs
    it; every other configuration its file (``cfg``) and ``--log-level``."""
    argv = [*launcher, "serve", "--upstream", upstream, "--host", HOST, "--port", str(port)]
    if config != DEFAULTS:
        cfg.write_text(config)
        argv += ["--config", str(cfg), "--log-level", log_level]
    if setting != AUTO:
        argv += ["--workers", setting]
    return argv


def detproxy_env(code: Path | None = None) -> dict[str, str]:
    """A detproxy target's environment: the caller's without its DETPROXY_* variables (a shell
    with DETPROXY_WORKERS=1 or a config in DETPROXY_CONFIG would change the defaults), and
    ``code`` (another checkout, a compiled tree) ahead of the installed package."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DETPROXY_")}
    if code is not None:
        env["PYTHONPATH"] = str(code)
    return env


# Which build a target's interpreter imports: how many of the modules the compiled build
# compiles (pyproject.toml's [tool.detproxy] compiled) are extensions, and from where.
BUILD_PROBE = """\
import importlib, json, sys
import proxy
compiled = [m for m in sys.argv[1:] if importlib.import_module(m).__file__.endswith(".so")]
print(json.dumps([len(compiled), proxy.__file__]))
"""


def build_of(env: dict[str, str], cwd: Path) -> str:
    """Source or compiled build (and where its code is): what ``env`` imports as detproxy."""
    listed = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["detproxy"]["compiled"]
    modules = [path.removesuffix(".py").replace("/", ".") for path in listed]
    out = subprocess.run(
        [sys.executable, "-c", BUILD_PROBE, *modules],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        check=False,
    )
    if out.returncode != 0:
        return f"build unknown ({out.stderr.strip().splitlines()[-1:]})"
    compiled, where = json.loads(out.stdout)
    code = Path(where).parent.parent
    if compiled == 0:
        return f"source build ({code})"
    if compiled == len(modules):
        return f"compiled build ({compiled} modules mypyc-compiled, {code})"
    return f"partly compiled build ({compiled} of {len(modules)} modules, {code})"


def wait_workers(proc: Popen, count: int, what: str, timeout: float = 60.0) -> None:
    """Until ``count`` workers run (a supervisor and its workers; one: the process alone)."""
    want = 1 if count == 1 else count + 1
    deadline = time.monotonic() + timeout
    while len(tree(proc.pid)) < want:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode} at start (see its log)")
        if time.monotonic() > deadline:
            raise SystemExit(f"{what}: {len(tree(proc.pid))} processes, {want} expected")
        time.sleep(0.1)


@dataclass
class Target:
    name: str
    port: int
    what: str
    proc: subprocess.Popen[bytes] | None = None
    runs: str = ""  # a detproxy's workers and build

    def said(self) -> str:
        return f"{self.what}; {self.runs}" if self.runs else self.what


@dataclass
class Bench:
    tmp: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)

    def spawn(
        self,
        argv: list[str],
        log_name: str,
        cwd: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> Popen:
        log = open(self.tmp / log_name, "wb")  # noqa: SIM115
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=cwd, env=env
        )
        self.procs.append(proc)
        return proc

    def nginx(self, name: str, body: str, port: int, workers: str = "1") -> Popen:
        conf = nginx_workers(NGINX_COMMON.format(dir=self.tmp, name=name, body=body), workers)
        path = self.tmp / f"{name}.conf"
        path.write_text(conf)
        proc = self.spawn(
            ["nginx", "-p", str(self.tmp), "-c", str(path), "-e", str(self.tmp / f"{name}.err")],
            f"{name}.log",
        )
        wait_port(port, proc, f"nginx ({name})")
        return proc

    def start(
        self,
        log_level: str,
        ceiling: bool = False,
        only: tuple[str, ...] = (),
        baseline: Path | None = None,
        workers: tuple[str, ...] = (AUTO,),
        nginx_workers: str = "1",
    ) -> None:
        """``only``: these detproxy targets alone (all when empty); ``baseline``: each detproxy
        target has a twin, ``NAME@base``, running that checkout's code (``PYTHONPATH``);
        ``workers``: each N adds ``dp-default-wN`` (``--workers N``) to ``dp-default``;
        ``nginx_workers``: the proxy nginx's ``worker_processes`` (1 or auto)."""
        tmp = self.tmp
        (tmp / "www").mkdir()
        (tmp / "tmp").mkdir()
        answer = make_json_answer()
        stream, events = make_sse_stream()
        (tmp / "www" / "chat.json").write_bytes(answer)
        (tmp / "www" / "chat.sse").write_bytes(stream)
        # What a shadow of a streamed request gets (see NGINX_STATIC): the same text, whole.
        (tmp / "www" / "chat-sse.json").write_bytes(make_json_answer(" ".join(stream_words())))
        self.answer, self.stream, self.events = answer, stream, events
        (tmp / "json.lua").write_text(wrk_script(request_body(False)))
        (tmp / "sse.lua").write_text(wrk_script(request_body(True)))

        up, shadow = free_port(), free_port()
        static = self.nginx(
            "static",
            NGINX_STATIC.format(host=HOST, port=up, shadow_port=shadow, dir=tmp, path=PATH),
            up,
        )
        self.targets.append(Target("direct", up, "nginx static files (the upstream)", static))
        px = free_port()
        body = NGINX_PROXY.format(host=HOST, port=px, upstream_port=up)
        proxy = self.nginx("proxy", body, px, nginx_workers)
        what = "nginx reverse proxy, proxy_buffering off"
        self.targets.append(Target("nginx", px, what, proxy, nginx_said(nginx_workers)))
        if ceiling:
            for name, script, what in (
                ("aio-static", AIOHTTP_STATIC,
                 "aiohttp's server alone, same bytes from memory: the ceiling"),
                ("ht-static", HTTPTOOLS_STATIC,
                 "asyncio + httptools alone, same bytes from memory: a lean server's ceiling"),
            ):  # fmt: skip
                port = free_port()
                argv = [sys.executable, "-c", script, str(tmp / "www"), str(port)]
                proc = self.spawn(argv, f"{name}.log")
                wait_port(port, proc, name)
                self.targets.append(Target(name, port, what, proc))
        configs = dict(DETPROXY_CONFIGS)
        if only:
            configs = {name: conf for name, conf in configs.items() if name in only}
        trees: list[tuple[str, dict[str, str]]] = [("", detproxy_env())]
        if baseline is not None:
            trees.append(("@base", detproxy_env(baseline)))
        builds = {suffix: build_of(env, tmp) for suffix, env in trees}
        runs = detproxy_runs(configs, list(workers), list(only))
        for (name, conf, setting), (suffix, env) in itertools.product(runs, trees):
            port = free_port()
            argv = detproxy_argv(
                [sys.executable, "-c", LAUNCHER],
                conf.format(shadow_url=f"http://{HOST}:{shadow}"),
                tmp / f"{name}.toml",
                f"http://{HOST}:{up}",
                port,
                log_level,
                setting,
            )
            proc = self.spawn(argv, f"{name}{suffix}.log", cwd=tmp, env=env)
            wait_port(port, proc, f"detproxy ({name}{suffix})")
            wait_workers(proc, worker_count(setting), f"detproxy ({name}{suffix})")
            what = {
                "dp-default": "detproxy, defaults (loops on, passive checks on, audit 5%)",
                "dp-off": "detproxy, audit off, passive checks off, loops disabled",
                "dp-audit": "detproxy, 100% of greedy requests audited, loops disabled",
                "dp-loops": "detproxy, audit off, passive checks off, loop inspection on",
            }.get(name, "detproxy, defaults")
            runs_as = f"{workers_said(setting)}, {builds[suffix]}"
            self.targets.append(Target(name + suffix, port, what, proc, runs_as))

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                nginx = isinstance(proc.args, list) and proc.args[0] == "nginx"
                proc.send_signal(signal.SIGQUIT if nginx else signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def wrk_script(body: bytes) -> str:
    """Every request its own prompt (a tag per wrk run and a counter): with passive checks on
    (detproxy's defaults), a request repeated would be a duplicate, each one compared."""
    head, tail = body.split(PROMPT)
    return (
        'wrk.method = "POST"\n'
        'wrk.headers["Content-Type"] = "application/json"\n'
        'wrk.headers["Authorization"] = "Bearer bench"\n'
        f"local head = {lua_string(head + PROMPT[:-1])}\n"
        f"local tail = {lua_string(b'.' + tail)}\n"
        'local tag = tostring(os.time()) .. "-" .. tostring(math.random(1000000))\n'
        "local n = 0\n"
        "request = function()\n"
        "    n = n + 1\n"
        '    return wrk.format(nil, nil, nil, head .. " " .. tag .. " " .. n .. tail)\n'
        "end\n"
    )


def lua_string(data: bytes) -> str:
    # A long bracket string cannot hold "]==]": pick a level that does not occur.
    text = data.decode()
    level = 0
    while f"]{'=' * level}]" in text:
        level += 1
    eq = "=" * level
    return f"[{eq}[{text}]{eq}]"


# ---------------------------------------------------------------------------------------------
# Checks and measurement


def url(target: Target, mode: str) -> str:
    return f"http://{HOST}:{target.port}{PATH}" + ("?bench=sse" if mode == "sse" else "")


def fetch(target: Target, mode: str) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(
        url(target, mode),
        data=request_body(mode == "sse"),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        return resp.status, dict(resp.headers), resp.read()


def check(bench: Bench) -> None:
    """Every target answers both modes with the expected body, before anything is measured."""
    for target in bench.targets:
        for mode in MODES:
            status, headers, body = fetch(target, mode)
            problems = []
            if status != 200:
                problems.append(f"status {status}")
            if mode == "sse":
                if not headers.get("Content-Type", "").startswith("text/event-stream"):
                    problems.append(f"content-type {headers.get('Content-Type')}")
                if body.count(b"\n\n") != bench.events or not body.endswith(b"data: [DONE]\n\n"):
                    problems.append(f"{body.count(chr(10).encode() * 2)} events")
            elif json.loads(body) != json.loads(bench.answer):
                problems.append("JSON answer differs")
            if problems:
                raise SystemExit(f"{target.name} {mode}: " + ", ".join(problems))


_UNIT = {"us": 1e-3, "ms": 1.0, "s": 1000.0, "m": 60000.0}


def _ms(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text)
    if not m:
        raise ValueError(f"cannot parse wrk latency {text!r}")
    return float(m.group(1)) * _UNIT[m.group(2)]


@dataclass
class Sample:
    rps: float
    p50: float  # ms
    p99: float  # ms
    requests: int
    errors: int  # non-2xx responses plus socket errors
    cpu_us: float | None = None  # the target's CPU (its processes, from /proc) per request


def _find(pattern: str, out: str) -> str:
    m = re.search(pattern, out, re.M)
    if m is None:
        raise SystemExit(f"unexpected wrk output (no {pattern!r}):\n{out}")
    return m.group(1)


def parse_wrk(out: str) -> Sample:
    rps = float(_find(r"Requests/sec:\s+([\d.]+)", out))
    p50 = _ms(_find(r"^\s+50%\s+(\S+)", out))
    p99 = _ms(_find(r"^\s+99%\s+(\S+)", out))
    requests = int(_find(r"(\d+) requests in", out))
    errors = 0
    m = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    if m:
        errors += int(m.group(1))
    m = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    if m:
        errors += sum(int(x) for x in m.groups())
    return Sample(rps, p50, p99, requests, errors)


# ---------------------------------------------------------------------------------------------
# CPU from /proc (bench_paced.py's too)


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()  # after "pid (comm) "


def tree(root: int) -> list[int]:
    """``root`` and its descendants (nginx's workers, detproxy's workers)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat_fields(int(entry))
            if fields is not None:
                parents.setdefault(int(fields[1]), []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(parents.get(pid, []))
    return out


TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of these processes (fields 14 and 15 of /proc/PID/stat)."""
    total = 0
    for pid in pids:
        fields = _stat_fields(pid)
        if fields is not None:
            total += int(fields[11]) + int(fields[12])
    return total / TICK


def run_wrk(bench: Bench, target: Target, mode: str, conns: int, duration: float) -> Sample:
    argv = [
        "wrk",
        "-t",
        "1",
        "-c",
        str(conns),
        "-d",
        f"{duration:g}s",
        "--timeout",
        "10s",
        "--latency",
        "-s",
        str(bench.tmp / f"{mode}.lua"),
        url(target, mode),
    ]
    pids = tree(target.proc.pid) if target.proc is not None else []
    before = cpu_s(pids)
    out = subprocess.run(argv, capture_output=True, text=True, timeout=duration + 30)
    cpu = cpu_s(pids) - before
    if out.returncode != 0:
        raise SystemExit(f"wrk failed on {target.name}: {out.stderr or out.stdout}")
    sample = parse_wrk(out.stdout)
    if pids and sample.requests:
        sample.cpu_us = cpu / sample.requests * 1e6
    return sample


def metric_lines(target: Target, prefixes: tuple[str, ...]) -> list[str]:
    try:
        with urllib.request.urlopen(
            f"http://{HOST}:{target.port}/detproxy/metrics", timeout=5
        ) as resp:
            text = resp.read().decode()
    except (urllib.error.URLError, OSError) as exc:
        return [f"(metrics unavailable: {exc})"]
    return [
        ln
        for ln in text.splitlines()
        if ln.startswith(prefixes)
        and not ln.startswith("#")
        and not ln.endswith(" 0.0")
        and "_created" not in ln
        and "_bucket" not in ln
    ]


def rss_kb(pid: int) -> int:
    """VmRSS of ``pid`` and its descendants (a supervisor's workers)."""
    total = 0
    for each in tree(pid):
        try:
            lines = Path(f"/proc/{each}/status").read_text().splitlines()
        except OSError:
            continue
        total += next((int(ln.split()[1]) for ln in lines if ln.startswith("VmRSS:")), 0)
    return total


# ---------------------------------------------------------------------------------------------
# --ttft: time to first token at one connection, a fresh connection per request


def ttft_request(port: int, n: int) -> bytes:
    """A streamed request with a prompt of its own (passive checks see no duplicate)."""
    head, tail = request_body(True).split(PROMPT)
    body = head + f"a token stream, ttft {n}.".encode() + tail
    return (
        f"POST {PATH}?bench=sse HTTP/1.1\r\nHost: {HOST}:{port}\r\n"
        "Content-Type: application/json\r\nAuthorization: Bearer bench\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


def _complete(data: bytes) -> bool:
    """The whole response is in ``data`` (Content-Length or chunked framing)."""
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        return False
    m = re.search(rb"(?im)^content-length:\s*(\d+)", head)
    if m is not None:
        return len(body) >= int(m.group(1))
    return body.endswith(b"\r\n0\r\n\r\n") or body == b"0\r\n\r\n"


def ttft_once(port: int, request: bytes, marker: bytes) -> float:
    """Seconds from opening a connection to the first token's bytes; the response is then read
    to its end and the connection closed (the next request opens a new one)."""
    began = time.perf_counter()
    first = 0.0
    with socket.create_connection((HOST, port), timeout=10) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(request)
        data = b""
        while not _complete(data):
            part = sock.recv(262144)
            if not part:
                raise SystemExit(f"--ttft: :{port} closed after {len(data)} bytes")
            data += part
            if not first and marker in data:
                first = time.perf_counter() - began
    if not first or not data.startswith(b"HTTP/1.1 200"):
        raise SystemExit(f"--ttft: :{port} answered {data[:120]!r}")
    return first


def _pct(values: list[float], p: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[p - 1]


def measure_ttft(targets: list[Target], count: int, warmup: int = 50) -> None:
    """``count`` streamed requests per target, each on a fresh connection, one at a time, the
    targets interleaved (a rotated order per request); p50, p90, p99 of the time to the first
    token, and what each target adds over direct: the difference of the percentiles (+p50,
    +p99) and the percentiles of the per-request differences (the same turn's direct request)."""
    marker = b'"content":"' + stream_words()[0].encode() + b'"'
    times: dict[str, list[float]] = {t.name: [] for t in targets}
    gc_was = gc.isenabled()
    gc.collect()
    gc.disable()  # the client's own collections out of the figures
    try:
        for i in range(-warmup, count):
            k = i % len(targets)
            for t in targets[k:] + targets[:k]:
                took = ttft_once(t.port, ttft_request(t.port, i), marker)
                if i >= 0:
                    times[t.name].append(took * 1000)
    finally:
        if gc_was:
            gc.enable()
    direct = times["direct"]
    print(
        f"\n== time to first token, streamed (~200 SSE chunks), one connection, a fresh one per"
        f" request ==  ({count} requests per target, interleaved; ms from connect to the first"
        " token's bytes; +p50, +p99: over direct's percentile; d50, d99: percentiles of each"
        " request's time minus the same turn's direct one)"
    )
    print(
        f"{'target':18} {'p50':>7} {'p90':>7} {'p99':>7} {'+p50':>7} {'+p99':>7} {'d50':>7}"
        f" {'d99':>7}"
    )
    for t in targets:
        mine = times[t.name]
        diffs = [a - b for a, b in zip(mine, direct, strict=True)]
        print(
            f"{t.name:18} {_pct(mine, 50):7.3f} {_pct(mine, 90):7.3f} {_pct(mine, 99):7.3f}"
            f" {_pct(mine, 50) - _pct(direct, 50):+7.3f} {_pct(mine, 99) - _pct(direct, 99):+7.3f}"
            f" {_pct(diffs, 50):+7.3f} {_pct(diffs, 99):+7.3f}"
        )


# ---------------------------------------------------------------------------------------------
# Report


def machine(tools: bool = True) -> list[str]:
    cpu = "unknown"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    try:
        from importlib.metadata import version

        dp = (
            f"detproxy {version('detproxy')}, aiohttp {version('aiohttp')}, "
            f"orjson {version('orjson')}, xxhash {version('xxhash')}"
        )
    except Exception:
        dp = "detproxy (version unknown)"
    versions = f"Python {platform.python_version()}; {dp}"
    if tools:
        nginx_v = subprocess.run(["nginx", "-v"], capture_output=True, text=True).stderr.strip()
        wrk_run = subprocess.run(["wrk", "-v"], capture_output=True, text=True)
        wrk_v = (wrk_run.stdout or wrk_run.stderr).splitlines()[0].split(" Copyright")[0].strip()
        versions = f"{nginx_v.replace('nginx version: ', '')}; {wrk_v}; {versions}"
    return [
        f"machine : {cpu}, {os.cpu_count()} cores, {platform.platform()}",
        f"versions: {versions}",
    ]


def fmt_ms(v: float) -> str:
    return f"{v:.3f}" if v < 10 else f"{v:.1f}" if v < 1000 else f"{v:.0f}"


def print_table(
    mode: str,
    results: dict[tuple[str, int, str], Sample],
    targets: list[Target],
    concs: tuple[int, ...],
) -> None:
    print(
        f"\n== {MODE_TITLE[mode]} ==  (req/s; latency in ms; xD, xN: req/s against direct"
        f" and nginx; +p50: p50 added over direct, ms)"
    )
    cell = f"{'req/s':>8} {'p50':>7} {'p99':>7} {'xD':>5} {'xN':>5} {'+p50':>6}"
    width = len(cell)
    print(f"{'':18}" + " | ".join(f"{'c=' + str(c):^{width}}" for c in concs))
    print(f"{'target':18}" + " | ".join(cell for _ in concs))
    for target in targets:
        cells = []
        for c in concs:
            s = results[(mode, c, target.name)]
            d = results[(mode, c, "direct")]
            n = results[(mode, c, "nginx")]
            cells.append(
                f"{s.rps:8.0f} {fmt_ms(s.p50):>7} {fmt_ms(s.p99):>7} "
                f"{s.rps / d.rps:5.2f} {s.rps / n.rps:5.2f} {s.p50 - d.p50:+6.2f}"
            )
        print(f"{target.name:18}" + " | ".join(cells))
    print("CPU per request, us (user + system of the target's processes, from /proc):")
    for target in targets:
        cpus = [results[(mode, c, target.name)].cpu_us for c in concs]
        if any(cpus):
            print(
                f"  {target.name:18}"
                + "  ".join(f"c={c} {x:6.1f}" for c, x in zip(concs, cpus, strict=True) if x)
            )


def median_sample(samples: list[Sample]) -> Sample:
    """Per-figure median over the rounds (with two rounds: their mean)."""
    return Sample(
        statistics.median(s.rps for s in samples),
        statistics.median(s.p50 for s in samples),
        statistics.median(s.p99 for s in samples),
        sum(s.requests for s in samples),
        sum(s.errors for s in samples),
        statistics.median(cpus) if (cpus := [s.cpu_us for s in samples if s.cpu_us]) else None,
    )


def _frame(frame: str) -> str:
    # "func (path/to/file.py:123)" -> "func (file.py)": lines vary within one function.
    m = re.match(r"(.*?) \((.*?)(?::\d+)?\)$", frame)
    if not m:
        return frame
    path = m.group(2)
    for marker in ("site-packages/", "/work/main/", "lib/python3"):
        if marker in path:
            path = path.split(marker, 1)[1]
    return f"{m.group(1)} ({path})"


def profile(bench: Bench, target: Target, mode: str, conns: int, seconds: float, top: int) -> None:
    """py-spy (sampling) on one detproxy process while wrk loads it with ``mode``."""
    sampled: list[Sample] = []
    title = f"{target.name}, {MODE_TITLE[mode]}, c={conns}, {seconds:g}s"
    spy_profile(
        bench,
        target,
        seconds,
        lambda: sampled.append(run_wrk(bench, target, mode, conns, seconds)),
        lambda: f"{title}: {sampled[0].rps:.0f} req/s",
        top,
    )


def spy_profile(
    bench: Bench,
    target: Target,
    seconds: float,
    load: Callable[[], object],
    title: Callable[[], str],
    top: int,
) -> None:
    """py-spy (sampling) on one detproxy process while ``load`` runs; top frames by self and
    total time, as shares of the samples taken while the process was busy."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        print("\n(--profile: py-spy not found; pip install py-spy into the venv)")
        return
    assert target.proc is not None
    out = bench.tmp / f"profile-{target.name}.txt"
    rec = subprocess.Popen(
        [
            spy,
            "record",
            "--pid",
            str(target.proc.pid),
            "--duration",
            str(int(seconds) + 1),
            "--rate",
            "200",
            "--format",
            "raw",
            "--output",
            str(out),
            "--nonblocking",
            "--subprocesses",  # a supervisor's workers
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(0.5)
    load()
    rec.wait(timeout=seconds + 30)
    selfs: dict[str, int] = {}
    totals: dict[str, int] = {}
    n = 0
    idle = 0
    for line in out.read_text().splitlines() if out.exists() else []:
        stack, _, count = line.rpartition(" ")
        frames = [_frame(f) for f in stack.split(";") if f]
        k = int(count)
        n += k
        if frames and frames[-1].startswith(("select (", "poll (", "_run_once (")):
            idle += k
            continue
        if frames:
            selfs[frames[-1]] = selfs.get(frames[-1], 0) + k
        for f in set(frames):
            totals[f] = totals.get(f, 0) + k
    busy = n - idle
    print(f"\n== py-spy: {title()}; {n} samples, {100 * busy / max(n, 1):.0f}% busy ==")
    if busy <= 0:
        print("  (no busy samples: is ptrace allowed?)")
        return
    print("  self %  function (file)")
    for f, k in sorted(selfs.items(), key=lambda x: -x[1])[:top]:
        print(f"  {100 * k / busy:6.1f}  {f}")
    print("  total %  function (file), detproxy's own frames")
    own = {f: k for f, k in totals.items() if "(proxy/" in f or "(policies/" in f}
    for f, k in sorted(own.items(), key=lambda x: -x[1])[:top]:
        print(f"  {100 * k / busy:6.1f}  {f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=4.0, help="seconds per wrk run (default 4)")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds (default 2)")
    ap.add_argument("--quick", action="store_true", help="1 round of 2 s: a smoke run")
    ap.add_argument(
        "--concurrency",
        default=",".join(map(str, CONCURRENCY)),
        help="comma-separated wrk connection counts (default 1,16,64)",
    )
    ap.add_argument("--modes", default="json,sse", help="json, sse or both (default)")
    ap.add_argument("--log-level", default="WARNING", help="detproxy --log-level (default WARNING)")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (configs, logs)")
    ap.add_argument(
        "--profile",
        type=float,
        default=0,
        metavar="SECONDS",
        help="after the tables, py-spy dp-off and dp-loops on streams at c=16",
    )
    ap.add_argument(
        "--profile-targets",
        default="",
        metavar="NAMES",
        help="with --profile: these targets (comma-separated) in every mode instead",
    )
    ap.add_argument(
        "--ceiling",
        action="store_true",
        help="add aio-static: aiohttp's server alone answering from memory (no upstream)",
    )
    ap.add_argument(
        "--targets",
        default="",
        metavar="NAMES",
        help="these detproxy targets only, comma-separated (default: all)",
    )
    ap.add_argument(
        "--baseline",
        type=Path,
        metavar="DIR",
        help="a checkout of another commit (git worktree add DIR COMMIT): each detproxy target"
        " gets a twin, NAME@base, running DIR's code, in the same interleaved rounds",
    )
    ap.add_argument(
        "--workers",
        default=AUTO,
        metavar="LIST",
        help="auto (default): every detproxy target as serve starts it, one worker per core;"
        " each N (e.g. auto,1) adds dp-default-wN, the defaults under serve --workers N",
    )
    ap.add_argument(
        "--ttft",
        type=int,
        default=0,
        metavar="N",
        help="after the tables, N streamed requests per target, each on a fresh connection,"
        " one at a time, interleaved: time to first token and what each adds over direct",
    )
    ap.add_argument("--ttft-only", action="store_true", help="--ttft alone, no wrk tables")
    ap.add_argument(
        "--nginx-workers",
        default="1",
        metavar="N|auto",
        help="the nginx target's worker_processes (default 1; auto: one per core, as nginx's"
        " packaged configuration has it); the upstream nginx keeps 1",
    )
    args = ap.parse_args()
    if args.quick:
        args.duration, args.rounds = 2.0, 1
    if args.ttft_only:
        args.modes, args.ttft = "", args.ttft or 2000
    concs = tuple(int(c) for c in args.concurrency.split(","))
    modes = tuple(m for m in args.modes.split(",") if m)
    workers = tuple(worker_settings(args.workers))
    for tool in ("nginx", "wrk"):
        if shutil.which(tool) is None:
            print(f"{tool} not found on PATH: apt-get install -y nginx wrk", file=sys.stderr)
            return 2
    try:
        import proxy.cli  # noqa: F401  (detproxy installed in this interpreter)
    except ImportError:
        print("run with the venv's python: detproxy (proxy.cli) is not importable", file=sys.stderr)
        return 2

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < min(hard, 16384):
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 16384), hard))

    tmp = Path(tempfile.mkdtemp(prefix="detproxy-bench-"))
    tmp.chmod(0o755)  # nginx workers (www-data when started as root) read the bodies
    bench = Bench(tmp)
    only = tuple(t for t in args.targets.split(",") if t)
    extra = 2 * args.ceiling
    dp_runs = detproxy_runs(
        {n: c for n, c in DETPROXY_CONFIGS.items() if not only or n in only}, list(workers), []
    )
    detproxies = (len(dp_runs) + extra) * (2 if args.baseline else 1)
    runs = len(modes) * len(concs) * (2 + 2 * args.ceiling + detproxies) * args.rounds
    print("\n".join(machine()))
    print(
        f"plan    : {runs} wrk runs of {args.duration:g}s (wrk -t 1), modes {','.join(modes)},"
        f" concurrency {','.join(map(str, concs))}, {args.rounds} interleaved round(s);"
        f" about {runs * (args.duration + 0.3) + 15:.0f}s"
        + (f"; --ttft {args.ttft} requests per target" if args.ttft else "")
    )
    t_start = time.monotonic()
    try:
        bench.start(args.log_level, args.ceiling, only, args.baseline, workers, args.nginx_workers)
        check(bench)
        print(
            f"bodies  : JSON answer {len(bench.answer)} B; SSE stream {len(bench.stream)} B in"
            f" {bench.events} events (~{len(bench.stream) // bench.events} B each)"
        )
        for t in bench.targets:
            print(f"  {t.name:18} :{t.port:<5}  {t.said()}")
        # Warm-up: every target, both modes, so first-connection costs are not measured.
        for t in bench.targets:
            for mode in modes:
                run_wrk(bench, t, mode, 16, 1)
        detproxies = [t for t in bench.targets if t.name.startswith("dp-")]
        rss_before = {t.name: rss_kb(t.proc.pid) for t in detproxies if t.proc}
        raw: dict[tuple[str, int, str], list[Sample]] = {}
        order = list(bench.targets)
        for mode in modes:
            for c in concs:
                for r in range(args.rounds):
                    k = r % len(order)
                    for t in order[k:] + order[:k]:  # rotate who goes first each round
                        raw.setdefault((mode, c, t.name), []).append(
                            run_wrk(bench, t, mode, c, args.duration)
                        )
                print(
                    f"  ... {mode} c={c} done ({time.monotonic() - t_start:.0f}s)",
                    file=sys.stderr,
                    flush=True,
                )
        results = {k: median_sample(v) for k, v in raw.items()}
        for mode in modes:
            print_table(mode, results, bench.targets, concs)
        if args.ttft:
            measure_ttft(bench.targets, args.ttft)
        errors = {k: v.errors for k, v in results.items() if v.errors}
        print(f"\nerrors (non-2xx + socket errors, all rounds): {errors or 'none'}")
        print(
            "detproxy RSS (MB, its processes together), after warm-up -> after the run: "
            + ", ".join(
                f"{t.name} {rss_before[t.name] / 1024:.0f} -> {rss_kb(t.proc.pid) / 1024:.0f}"
                for t in detproxies
                if t.proc
            )
        )
        audit = next((t for t in bench.targets if t.name == "dp-audit"), None)
        if audit is not None:
            print("dp-audit metrics (non-zero):")
            lines = metric_lines(audit, ("detproxy_audits", "detproxy_shadow", "detproxy_requests"))
            for line in lines:
                print(f"  {line}")
            audited = sum(
                float(ln.rsplit(" ", 1)[1])
                for ln in lines
                if ln.startswith("detproxy_audits_total")
            )
            requests = sum(
                float(ln.rsplit(" ", 1)[1])
                for ln in lines
                if ln.startswith("detproxy_requests_total")
            )
            if requests:
                share = f"{audited:.0f} of {requests:.0f} requests ({audited / requests:.1%})"
                print(f"dp-audit: audited {share}")
        if args.profile > 0:
            for mode in modes:
                for t in bench.targets:
                    chosen = (
                        t.name in args.profile_targets.split(",")
                        if args.profile_targets
                        else t.name == "dp-off" or (t.name == "dp-loops" and mode == "sse")
                    )
                    if chosen:
                        profile(bench, t, mode, 16, args.profile, 18)
        print(f"total {time.monotonic() - t_start:.0f}s")
    finally:
        bench.stop()
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
