"""Paced streaming benchmark: one SSE event per token, tokens 20 ms apart, as an engine writes them.

Run: ``.venv/bin/python tests/bench/bench_paced.py [--seconds 5] [--rounds 1]
[--streams 100,400,1000] [--workers auto,1]``. Needs ``nginx`` with Debian's echo module
(``apt-get install -y nginx libnginx-mod-http-echo``) and ``wrk``. Prints figures only.

bench_proxy.py streams a pre-generated answer whole, so a 200-event stream arrives in one or
two reads. Here the upstream writes what vLLM writes, paced:

- nginx #1 with the echo module answers ``POST /v1/chat/completions`` with a role chunk and 64
  one-token ``chat.completion.chunk`` events (the last one carries ``finish_reason``, as vLLM
  sends it), then ``data: [DONE]``: 66 events, each ``echo_flush``-ed, ``echo_sleep 0.02``
  between tokens (nginx timers: the upstream costs almost nothing). A second listener answers
  the same text as one JSON chat completion: the reference the audited target's shadows go to;
- the targets, each in front of nginx #1: ``nginx`` (nginx #2, ``worker_processes 1``, a plain
  reverse proxy, ``proxy_buffering off``), ``dp-default`` (detproxy with its defaults: loop
  inspection on, passive checks on, audit off), ``dp-noloops`` (the defaults with
  ``[loops] enabled = false``), ``dp-audit`` (the defaults with every greedy request audited
  and the shadow budgets raised, as bench_proxy.py's dp-audit), each started as serve starts
  by default (one worker per core; ``dp-default`` is ``detproxy serve --upstream URL`` and
  nothing else), and with ``--workers auto,1,2`` also ``dp-default-w1`` and ``dp-default-w2``
  (the defaults, ``detproxy serve --workers N``); the listing says each one's workers and build
  (source, or compiled where ``--baseline`` names a ``tests/compiled_tree.py`` copy);
- wrk (one thread) holds ``--streams`` connections, each POSTing a streamed greedy chat request
  (a different prompt each time, so passive duplicate checks see no duplicates) and reading the
  stream to its end; per cell (streams, target) one wrk run of ``--seconds``, the targets in a
  rotated order each round, ``--rounds`` rounds;
- each target's CPU (user + system, the process and its children: nginx's master and worker,
  detproxy's supervisor and workers) is read from ``/proc/PID/stat`` before its run and once it
  is idle again after it (cleaning up the streams wrk cut at the end is the target's work too).

Per cell: events/s (bytes wrk read over the wire bytes of one whole stream through that target,
times 66: streams cut at the end of the run count for what they delivered), CPU per event in us,
its ratio to nginx's, p50 and p99 stream time (request sent to last byte: wrk's latency) and
errors (socket errors and non-2xx). With several rounds, each figure is the median.
"""

from __future__ import annotations

import argparse
import json
import pstats
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gc import TIMED_LAUNCHER, collections
from bench_proxy import (
    AUTO,
    DEFAULTS,
    HOST,
    LAUNCHER,
    MODEL,
    NGINX_COMMON,
    NGINX_PROXY,
    PATH,
    TICK,
    Bench,
    Target,
    build_of,
    cpu_s,
    detproxy_argv,
    detproxy_env,
    detproxy_runs,
    free_port,
    lua_string,
    machine,
    make_json_answer,
    metric_lines,
    nginx_said,
    nginx_workers,
    spy_profile,
    stream_words,
    tree,
    wait_port,
    wait_workers,
    worker_count,
    worker_settings,
    workers_said,
)

TOKENS = 64
PACE_S = 0.02
EVENTS = TOKENS + 2  # the role chunk, 64 token chunks, data: [DONE]
STREAMS = (100, 400, 1000)
ECHO_MODULE = ("/usr/lib/nginx/modules/ngx_http_echo_module.so",)
STREAM_ID = "chatcmpl-5d1e0c3a9b7f4e2a8c6d4b2a0f1e3d5c"
CREATED = 1718000000


def _chunk(delta: dict[str, str], finish: str | None = None) -> bytes:
    choice: dict[str, object] = {"index": 0, "delta": delta, "logprobs": None}
    choice["finish_reason"] = finish
    if finish is not None:
        choice["stop_reason"] = None
    obj = {
        "id": STREAM_ID,
        "object": "chat.completion.chunk",
        "created": CREATED,
        "model": MODEL,
        "choices": [choice],
    }
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def paced_events() -> list[bytes]:
    """What vLLM streams for 64 tokens: the role chunk, one chunk per token, the last with
    ``finish_reason`` (vLLM sends no separate empty finish chunk), then ``[DONE]``."""
    words = stream_words(TOKENS)
    events = [_chunk({"role": "assistant", "content": ""})]
    for i, word in enumerate(words):
        last = i == TOKENS - 1
        events.append(_chunk({"content": word if i == 0 else " " + word}, "stop" if last else None))
    events.append(b"data: [DONE]\n\n")
    return events


def _echo(event: bytes) -> str:
    text = event.decode()
    assert "'" not in text and "$" not in text and "\\" not in text  # nginx quoting, echo vars
    return "echo -n '" + text.replace("\n", "\\n") + "';"


def paced_location(events: list[bytes]) -> str:
    """The echo directives: role chunk and first token at once, then a token every 20 ms."""
    lines = ["echo_read_request_body;", _echo(events[0]), _echo(events[1]), "echo_flush;"]
    for event in events[2:-1]:
        lines += [f"echo_sleep {PACE_S};", _echo(event), "echo_flush;"]
    lines += [_echo(events[-1]), "echo_flush;"]
    return "\n            ".join(lines)


NGINX_PACED = """\
    server {{
        listen {host}:{port};
        location = {path} {{
            default_type text/event-stream;
            add_header Cache-Control no-cache;
            {directives}
        }}
    }}
    # dp-audit's reference_url: a shadow is non-streamed; the same text as the stream, at once.
    server {{
        listen {host}:{shadow_port};
        root {dir}/www;
        location / {{
            rewrite ^ /answer.json last;
        }}
        location = /answer.json {{
            default_type application/json;
            error_page 405 =200 $uri;
        }}
    }}
"""

# --ht-relay: the floor of a relay in Python on the same event loop. A lean asyncio protocol
# with httptools' parsers that forwards the client's request bytes to the upstream (one
# upstream connection per client connection) and writes every upstream read to the client from
# the read's own callback: no task, no future, no await per event, nothing inspected. What a
# callback-driven relay of detproxy's own could reach at best (issue 16).
HTTPTOOLS_RELAY = """\
import asyncio, sys
import httptools
from proxy.http.eventloop import new_event_loop
UPSTREAM = ("127.0.0.1", int(sys.argv[1]))
TASK = sys.argv[3:] == ["task"]
COALESCE = sys.argv[3:] == ["coalesce"]
QUEUED = []  # COALESCE: the clients with writes queued in this loop iteration
def flush():
    queued = QUEUED[:]
    QUEUED.clear()
    for client in queued:
        data = b"".join(client.out)
        client.out.clear()
        client.transport.write(data)
class Upstream(asyncio.Protocol):
    def __init__(self, client):
        self.client = client
        self.parser = httptools.HttpResponseParser(self)
        self.chunks, self.waiter = [], None
    def connection_made(self, transport):
        self.transport = transport
        if TASK:
            self.pump = asyncio.ensure_future(self.relay())
    def data_received(self, data):
        if TASK:  # handed to a task, as an awaiting relay does
            self.chunks.append(data)
            if self.waiter is not None and not self.waiter.done():
                self.waiter.set_result(None)
        elif COALESCE:  # written at the iteration's end, as detproxy's front does
            client = self.client
            if not client.out:
                if not QUEUED:
                    asyncio.get_running_loop().call_soon(flush)
                QUEUED.append(client)
            client.out.append(data)
        else:
            self.client.transport.write(data)
        self.parser.feed_data(data)  # where the response ends: the connection is kept
    async def relay(self):
        while True:
            while not self.chunks:
                self.waiter = asyncio.get_running_loop().create_future()
                await self.waiter
            data = b"".join(self.chunks) if len(self.chunks) > 1 else self.chunks[0]
            self.chunks.clear()
            self.client.transport.write(data)
    def connection_lost(self, exc):
        if TASK:
            self.pump.cancel()
        self.client.upstream = None
        self.client.transport.close()
class Client(asyncio.Protocol):
    def connection_made(self, transport):
        self.transport = transport
        self.parser = httptools.HttpRequestParser(self)
        self.upstream, self.parts, self.out = None, [], []
    def data_received(self, data):
        self.parts.append(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()
    def on_message_complete(self):
        request, self.parts = b"".join(self.parts), []
        if self.upstream is None:
            asyncio.ensure_future(self.connect(request))
        else:
            self.upstream.transport.write(request)
    async def connect(self, request):
        loop = asyncio.get_running_loop()
        _, self.upstream = await loop.create_connection(lambda: Upstream(self), *UPSTREAM)
        self.upstream.transport.write(request)
    def connection_lost(self, exc):
        if self.upstream is not None:
            self.upstream.transport.close()
async def main():
    loop = asyncio.get_running_loop()
    server = await loop.create_server(Client, "127.0.0.1", int(sys.argv[2]), backlog=4096)
    await server.serve_forever()
new_event_loop("auto").run_until_complete(main())
"""

# --cprofile: detproxy under cProfile, its stats written when it stops (SIGTERM: it drains).
CPROFILE_LAUNCHER = """\
import cProfile, sys
from proxy.cli import main
profile = cProfile.Profile()
profile.enable()
try:
    main(sys.argv[2:])
finally:
    profile.disable()
    profile.dump_stats(sys.argv[1])
"""

CONFIGS = {  # each run as serve starts by default: one worker per core (bench_proxy.py)
    "dp-default": DEFAULTS,
    "dp-noloops": "[loops]\nenabled = false\n",
    # Nothing inspects a stream: its events take the raw relay (the I/O skeleton's cost).
    "dp-raw": "[loops]\nenabled = false\n[audit]\npassive_checks = false\n",
    # As bench_proxy.py's dp-audit: the shadow budgets raised so that every request is replayed
    # (the default rate limit of 100 shadows/s would audit a few percent of these streams).
    "dp-audit": """\
[audit]
sample_rate = 1.0
reference_url = "{shadow_url}"
max_shadows_per_s = 1000000.0
max_concurrent_shadows = 16
queue_size = 100000
""",
}
WHAT = {
    "direct": "nginx + echo module itself (the paced upstream)",
    "nginx": "nginx reverse proxy, proxy_buffering off",
    "dp-default": "detproxy, defaults (loop inspection on, passive checks on, audit 5%)",
    "dp-noloops": "detproxy, defaults with [loops] enabled = false",
    "dp-raw": "detproxy, loops off and passive checks off: no stream is inspected (raw relay)",
    "dp-audit": "detproxy, defaults with every greedy request audited, shadow budgets raised",
    "dp-gcoff": "detproxy, defaults with gc_freeze = false, gc_threshold = Python's (700, 10, 10)",
    "ht-relay": "asyncio + httptools, each read relayed from its callback: a Python relay's floor",
    "ht-relay-task": "ht-relay with each read handed to a task that awaits it and writes it",
    "ht-relay-coalesce": "ht-relay with the writes of a loop iteration made at its end",
}

# Each request a different prompt (a tag per run and a counter), read to the end; done()
# prints the figures this script reads (latency in us).
WRK_SCRIPT = """\
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer bench"
local head = {head}
local tail = {tail}
local tag = "run"
local n = 0
function init(args)
    tag = args[1] or tag
end
function request()
    n = n + 1
    return wrk.format(nil, nil, nil, head .. tag .. " " .. n .. tail)
end
function done(summary, latency, requests)
    local e = summary.errors
    io.write(string.format("PACED %d %d %d %d %d %d %d %d %d %d\\n", summary.requests,
        summary.bytes, summary.duration, e.connect, e.read, e.write, e.timeout, e.status,
        latency:percentile(50), latency:percentile(99)))
end
"""

MARK = "@@PROMPT@@"


def wrk_script() -> str:
    body = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": f"Explain how a reverse proxy relays a stream ({MARK})."},
        ],
        "temperature": 0,
        "max_tokens": 256,
        "stream": True,
    }
    head, tail = json.dumps(body, separators=(",", ":")).split(MARK)
    return WRK_SCRIPT.format(head=lua_string(head.encode()), tail=lua_string(tail.encode()))


# ---------------------------------------------------------------------------------------------
# CPU from /proc


def settled_cpu_s(pids: list[int], idle_s: float = 0.1, limit_s: float = 10.0) -> float:
    """``cpu_s`` once the processes are idle again: the streams wrk cut at the end of a run
    are cleaned up after it (their connections closed, upstream too), at the target's cost,
    and before the next target's run, whose stream times it would otherwise slow down."""
    last, deadline = cpu_s(pids), time.monotonic() + limit_s
    while time.monotonic() < deadline:
        time.sleep(idle_s)
        now = cpu_s(pids)
        if now - last <= 2 / TICK:  # at most two clock ticks in idle_s: idle
            return now
        last = now
    return last


# ---------------------------------------------------------------------------------------------
# Processes


def echo_module() -> str | None:
    return next((p for p in ECHO_MODULE if Path(p).exists()), None)


GC_OFF = "[server]\ngc_freeze = false\ngc_threshold = [700, 10, 10]\n"  # before issue 16


def start(
    bench: Bench,
    workers: list[str],
    names: list[str],
    log_level: str,
    gc_timed: bool,
    baseline: Path | None = None,
    nginx: str = "1",
) -> tuple[int, int]:
    """Starts the upstream and the targets; returns the bytes of one stream's events and the
    upstream's port. ``baseline``: each detproxy target has a twin, ``NAME@base``, running
    that checkout's code (``PYTHONPATH`` ahead of the installed package)."""
    tmp = bench.tmp
    (tmp / "www").mkdir()
    (tmp / "tmp").mkdir()
    events = paced_events()
    text = "".join(stream_words(TOKENS)[:1] + [" " + w for w in stream_words(TOKENS)[1:]])
    (tmp / "www" / "answer.json").write_bytes(make_json_answer(text))
    (tmp / "paced.lua").write_text(wrk_script())
    module = echo_module()
    up, shadow = free_port(), free_port()
    body = NGINX_PACED.format(
        host=HOST,
        port=up,
        shadow_port=shadow,
        dir=tmp,
        path=PATH,
        directives=paced_location(events),
    )
    conf = f"load_module {module};\n" + NGINX_COMMON.format(dir=tmp, name="paced", body=body)
    _nginx(bench, "paced", conf, up)
    if "direct" in names:
        bench.targets.append(Target("direct", up, WHAT["direct"]))
    if "nginx" in names:
        px = free_port()
        # bench_proxy.py's proxy with a keep-alive pool as large as detproxy's (1024): with 256,
        # most of 1000 streams would open a new upstream connection each.
        proxy = NGINX_PROXY.replace("keepalive 256;", "keepalive 1024;")
        conf = NGINX_COMMON.format(
            dir=tmp, name="proxy", body=proxy.format(host=HOST, port=px, upstream_port=up)
        )
        proc = _nginx(bench, "proxy", nginx_workers(conf, nginx), px)
        bench.targets.append(Target("nginx", px, WHAT["nginx"], proc, nginx_said(nginx)))
    relays = (("ht-relay", []), ("ht-relay-task", ["task"]), ("ht-relay-coalesce", ["coalesce"]))
    for name, mode in relays:
        if name in names:
            port = free_port()
            argv = [sys.executable, "-c", HTTPTOOLS_RELAY, str(up), str(port), *mode]
            proc = bench.spawn(argv, f"{name}.log", cwd=tmp)
            wait_port(port, proc, name)
            bench.targets.append(Target(name, port, WHAT[name], proc))
    configs = {name: c for name, c in {**CONFIGS, "dp-gcoff": GC_OFF}.items() if name in names}
    runs = detproxy_runs(configs, workers, names)
    # dp-gcoff is there for its collections, timed in one process only.
    runs = [(name, c, "1" if name == "dp-gcoff" else w) for name, c, w in runs]
    trees: list[tuple[str, dict[str, str]]] = [("", detproxy_env())]
    if baseline is not None:
        trees.append(("@base", detproxy_env(baseline)))
    builds = {suffix: build_of(env, tmp) for suffix, env in trees}
    for name, config, setting in runs:
        count = worker_count(setting)
        for suffix, env in trees:
            port = free_port()
            launcher = [sys.executable, "-c", LAUNCHER]
            if gc_timed and count == 1:  # every collection timed, written at exit (bench_gc.py)
                gc_out = str(tmp / f"{name}{suffix}.gc.json")
                launcher = [sys.executable, "-c", TIMED_LAUNCHER, gc_out]
            argv = detproxy_argv(
                launcher,
                config.format(shadow_url=f"http://{HOST}:{shadow}"),
                tmp / f"{name}{suffix}.toml",
                f"http://{HOST}:{up}",
                port,
                log_level,
                setting,
            )
            proc = bench.spawn(argv, f"{name}{suffix}.log", cwd=tmp, env=env)
            wait_port(port, proc, f"detproxy ({name}{suffix})")
            wait_workers(proc, count, f"detproxy ({name}{suffix})")
            what = WHAT.get(name, "detproxy, defaults")
            runs_as = f"{workers_said(setting)}, {builds[suffix]}"
            bench.targets.append(Target(name + suffix, port, what, proc, runs_as))
    return sum(len(e) for e in events), up


def _nginx(bench: Bench, name: str, conf: str, port: int) -> subprocess.Popen[bytes]:
    path = bench.tmp / f"{name}.conf"
    path.write_text(conf)
    argv = ["nginx", "-p", str(bench.tmp), "-c", str(path), "-e", str(bench.tmp / f"{name}.err")]
    proc = bench.spawn(argv, f"{name}.log")
    wait_port(port, proc, f"nginx ({name})")
    return proc


def request_bytes(port: int) -> bytes:
    payload = json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "check"}],
            "temperature": 0,
            "stream": True,
        }
    ).encode()
    return (
        f"POST {PATH} HTTP/1.1\r\nHost: {HOST}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode() + payload


def wire_stream(target: Target) -> tuple[int, bytes]:
    """One whole stream through ``target``, as the bytes on the wire (headers, chunked framing):
    what wrk counts for it."""
    with socket.create_connection((HOST, target.port), timeout=10) as sock:
        sock.sendall(request_bytes(target.port))
        data = b""
        while not data.endswith(b"\r\n0\r\n\r\n"):
            part = sock.recv(65536)
            if not part:
                break
            data += part
    return len(data), data


def check(bench: Bench) -> dict[str, int]:
    """Every target streams the 66 events in order; returns each one's wire bytes per stream."""
    expected = paced_events()
    wire = {}
    for target in bench.targets:
        size, data = wire_stream(target)
        head, _, rest = data.partition(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200") or b"chunked" not in head.lower():
            raise SystemExit(f"{target.name}: {head[:200]!r}")
        body, pos = b"", 0
        while True:  # de-chunk
            line_end = rest.index(b"\r\n", pos)
            n = int(rest[pos:line_end], 16)
            if n == 0:
                break
            body += rest[line_end + 2 : line_end + 2 + n]
            pos = line_end + 2 + n + 2
        events = [e + b"\n\n" for e in body.split(b"\n\n") if e]
        strip = [e.replace(STREAM_ID.encode(), b"") for e in events]
        if len(events) != EVENTS or [e.count(b'"content"') for e in strip] != [
            e.count(b'"content"') for e in expected
        ]:
            raise SystemExit(f"{target.name}: {len(events)} events, expected {EVENTS}")
        wire[target.name] = size
    return wire


# ---------------------------------------------------------------------------------------------
# Measurement


@dataclass(frozen=True)
class Cell:
    events_s: float
    cpu_us: float  # CPU per relayed event, us
    p50_s: float
    p99_s: float
    streams: int  # whole streams
    errors: int
    events: float = 0.0
    window: tuple[float, float] = (0.0, 0.0)  # wall clock


def run_cell(
    bench: Bench, wire: dict[str, int], target: Target, streams: int, seconds: float, tag: str
) -> Cell:
    pids = tree(target.proc.pid) if target.proc is not None else []
    argv = ["wrk", "-t", "1", "-c", str(streams), "-d", f"{seconds:g}s", "--timeout", "60s"]
    argv += ["-s", str(bench.tmp / "paced.lua"), f"http://{HOST}:{target.port}{PATH}", "--", tag]
    before, began = cpu_s(pids), time.time()
    out = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 120)
    pids += [p for p in tree(pids[0]) if p not in pids] if pids else []
    after = settled_cpu_s(pids)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("PACED ")), None)
    if out.returncode != 0 or line is None:
        raise SystemExit(f"wrk failed on {target.name}: {out.stderr or out.stdout}")
    requests, nbytes, duration_us, *errs, p50_us, p99_us = (int(x) for x in line.split()[1:])
    events = nbytes / wire[target.name] * EVENTS
    cpu = after - before
    return Cell(
        events_s=events / (duration_us / 1e6),
        cpu_us=cpu / events * 1e6 if events else float("nan"),
        p50_s=p50_us / 1e6,
        p99_s=p99_us / 1e6,
        streams=requests,
        errors=sum(errs),
        events=events,
        window=(began, time.time()),
    )


def profiled(
    bench: Bench, wire: dict[str, int], target: Target, streams: int, seconds: float
) -> None:
    cells: list[Cell] = []
    spy_profile(
        bench,
        target,
        seconds,
        lambda: cells.append(run_cell(bench, wire, target, streams, seconds, f"spy-{target.name}")),
        lambda: (
            f"{target.name}, {streams} paced streams, {seconds:g}s:"
            f" {cells[0].events_s:.0f} events/s, {cells[0].cpu_us:.1f} us CPU per event"
        ),
        24,
    )


def cprofiled(bench: Bench, wire: dict[str, int], up: int, streams: int, seconds: float) -> None:
    """detproxy's defaults under cProfile for one wrk run: each function's time per relayed
    event (profiled times: cProfile slows Python calls several times; compare shares)."""
    port, stats = free_port(), bench.tmp / "dp-cprofile.prof"
    cfg = bench.tmp / "dp-cprofile.toml"
    cfg.write_text(DEFAULTS)
    argv = [sys.executable, "-c", CPROFILE_LAUNCHER, str(stats), "serve", "--config", str(cfg)]
    argv += ["--upstream", f"http://{HOST}:{up}", "--host", HOST, "--port", str(port)]
    argv += ["--workers", "1"]  # cProfile sees this process only
    proc = bench.spawn(argv, "dp-cprofile.log", cwd=bench.tmp, env=detproxy_env())
    wait_port(port, proc, "detproxy (dp-cprofile)")
    target = Target("dp-cprofile", port, "detproxy, defaults, under cProfile", proc)
    wire[target.name] = wire_stream(target)[0]
    cell = run_cell(bench, wire, target, streams, seconds, "cprofile")
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    table = pstats.Stats(str(stats))
    rows = []
    for (path, line, name), (_, calls, own, total, _) in table.stats.items():  # type: ignore[attr-defined]
        where = path.split("/proxy/", 1)[-1] if "/proxy/" in path else Path(path).name
        rows.append((own, total, calls, f"{where}:{line}({name})"))
    rows.sort(reverse=True)
    events = cell.events
    print(
        f"\n== cProfile: dp-default, {streams} paced streams, {seconds:g}s: {events:.0f} events;"
        " profiled us per event (the loop's own row includes its idle wait) =="
    )
    print(f"{'self':>8} {'total':>8} {'calls':>7}  function")
    for own, total, calls, where in rows[:30]:
        print(
            f"{own / events * 1e6:8.2f} {total / events * 1e6:8.2f} {calls / events:7.2f}  {where}"
        )


def median_cell(cells: list[Cell]) -> Cell:
    return Cell(
        statistics.median(c.events_s for c in cells),
        statistics.median(c.cpu_us for c in cells),
        statistics.median(c.p50_s for c in cells),
        statistics.median(c.p99_s for c in cells),
        sum(c.streams for c in cells),
        sum(c.errors for c in cells),
    )


def print_collections(results: dict[tuple[int, str], list[Cell]], bench: Bench) -> None:
    """What the collector did in each detproxy during its measured runs (--gc-timings)."""
    print(
        "\n== garbage collections during the measured runs ==  (count by generation, the"
        " longest in CPU ms, the collector's CPU time per relayed event in us)"
    )
    print(
        f"{'target':14} {'streams':>7} {'gen0':>6} {'gen1':>5} {'gen2':>5} {'longest':>8}"
        f" {'us/ev':>6}"
    )
    for (n, name), cells in results.items():
        path = bench.tmp / f"{name}.gc.json"
        if not path.exists():
            continue
        found = collections(path, [c.window for c in cells])
        count = [sum(1 for g, _ in found if g == gen) for gen in range(3)]
        longest = max((d for _, d in found), default=0.0)
        per_event = sum(d for _, d in found) / sum(c.events for c in cells) * 1e6
        print(
            f"{name:14} {n:7d} {count[0]:6d} {count[1]:5d} {count[2]:5d}"
            f" {longest * 1e3:8.2f} {per_event:6.2f}"
        )


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def print_table(results: dict[tuple[int, str], list[Cell]], bench: Bench, streams: int) -> None:
    print(
        f"\n== {streams} concurrent streams ==  (CPU/ev: CPU per relayed event, us; xN: that"
        " against nginx's; xN/r: the median of each round's ratio to nginx's run of the same"
        " round, which this machine's drift between rounds moves less; stream times in s)"
    )
    print(
        f"{'target':18} {'events/s':>9} {'CPU/ev':>7} {'xN':>5} {'xN/r':>5} {'p50':>6} {'p99':>6}"
        f" {'streams':>8} {'errors':>6}  per round (CPU/ev)"
    )
    nginx = results.get((streams, "nginx"))
    base = median_cell(nginx) if nginx else None
    for target in bench.targets:
        cells = results[(streams, target.name)]
        c = median_cell(cells)
        ratio = f"{c.cpu_us / base.cpu_us:5.2f}" if base and target.proc else "    -"
        per_round = "    -"
        if nginx and target.proc and len(nginx) == len(cells):
            ratios = [x.cpu_us / b.cpu_us for x, b in zip(cells, nginx, strict=True)]
            per_round = f"{statistics.median_high(ratios):5.2f}"
        cpu = f"{c.cpu_us:7.1f}" if target.proc else "      -"
        rounds = " ".join(f"{x.cpu_us:.1f}" for x in cells) if target.proc else ""
        print(
            f"{target.name:18} {c.events_s:9.0f} {cpu} {ratio} {per_round} {c.p50_s:6.2f}"
            f" {c.p99_s:6.2f} {c.streams:8d} {c.errors:6d}  {rounds}"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=5.0, help="seconds per wrk run (default 5)")
    ap.add_argument("--rounds", type=int, default=1, help="interleaved rounds (default 1)")
    ap.add_argument("--streams", default=",".join(map(str, STREAMS)), help="default 100,400,1000")
    ap.add_argument(
        "--workers",
        default=AUTO,
        metavar="LIST",
        help="auto (default): every detproxy target as serve starts it, one worker per core;"
        " each N (e.g. auto,1) adds dp-default-wN, the defaults under serve --workers N",
    )
    ap.add_argument(
        "--targets",
        default="",
        help="comma-separated subset of nginx,dp-default,dp-noloops,dp-raw,dp-audit,dp-default-wN,"
        "direct,ht-relay,ht-relay-task,ht-relay-coalesce (default: all but direct and the "
        "ht- relays)",
    )
    ap.add_argument(
        "--gc-timings",
        action="store_true",
        help="add dp-gcoff (the collector as before issue 16) and time every collection",
    )
    ap.add_argument(
        "--profile",
        type=float,
        default=0,
        help="after the tables, py-spy each Python target for this many seconds at the"
        " largest --streams",
    )
    ap.add_argument(
        "--cprofile",
        type=float,
        default=0,
        help="after the tables, run detproxy's defaults under cProfile for this many seconds"
        " at the largest --streams and print its functions' time per event",
    )
    ap.add_argument(
        "--nginx-workers",
        default="1",
        metavar="N|auto",
        help="the nginx target's worker_processes (default 1; auto: one per core, as nginx's"
        " packaged configuration has it); the paced upstream keeps 1",
    )
    ap.add_argument("--log-level", default="WARNING", help="detproxy --log-level")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (configs, logs)")
    ap.add_argument(
        "--baseline",
        metavar="DIR",
        type=lambda v: Path(v).resolve(),
        help="another checkout (git worktree add DIR COMMIT): each detproxy target gets a twin,"
        " NAME@base, running DIR's code in the same interleaved rounds",
    )
    args = ap.parse_args()
    streams = [int(s) for s in args.streams.split(",") if s]
    workers = worker_settings(args.workers)
    names = [n for n in args.targets.split(",") if n] or ["nginx", *CONFIGS]
    if args.gc_timings and "dp-gcoff" not in names:
        names.append("dp-gcoff")
    for tool in ("nginx", "wrk"):
        if shutil.which(tool) is None:
            print(f"{tool} not found on PATH: apt-get install -y nginx wrk", file=sys.stderr)
            return 2
    if echo_module() is None:
        print("nginx's echo module not found: apt-get install -y libnginx-mod-http-echo")
        return 2
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < min(hard, 65536):
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 65536), hard))

    tmp = Path(tempfile.mkdtemp(prefix="detproxy-paced-"))
    tmp.chmod(0o755)
    bench = Bench(tmp)
    results: dict[tuple[int, str], list[Cell]] = {}
    print("\n".join(machine()))
    try:
        events_bytes, upstream_port = start(
            bench,
            workers,
            names,
            args.log_level,
            args.gc_timings,
            args.baseline,
            args.nginx_workers,
        )
        wire = check(bench)
        cells = len(streams) * len(bench.targets) * args.rounds
        print(
            f"plan    : {cells} wrk runs of {args.seconds:g}s (wrk -t 1), streams"
            f" {','.join(map(str, streams))}, {args.rounds} interleaved round(s); about"
            f" {cells * (args.seconds + 1.5):.0f}s"
        )
        print(
            f"stream  : {EVENTS} events ({TOKENS} one-token chunks {PACE_S * 1000:.0f} ms apart),"
            f" {events_bytes} B of events; wire bytes per stream: "
            + ", ".join(f"{k} {v}" for k, v in wire.items())
        )
        for t in bench.targets:
            print(f"  {t.name:18} :{t.port:<5}  {t.said()}")
        print(f"load    : {loadavg()} (1, 5, 15 min) before the run")
        for t in bench.targets:  # warm-up: connections, templates, first-request costs
            run_cell(bench, wire, t, 50, 2, f"warm-{t.name}")
        order = list(bench.targets)
        t0 = time.monotonic()
        for r in range(args.rounds):
            for n in streams:
                k = (r + streams.index(n)) % len(order)
                for t in order[k:] + order[:k]:
                    cell = run_cell(bench, wire, t, n, args.seconds, f"{t.name}-{n}-{r}")
                    results.setdefault((n, t.name), []).append(cell)
                    time.sleep(0.5)  # the streams wrk cut are cancelled upstream
                print(
                    f"  ... round {r + 1} {n} streams done ({time.monotonic() - t0:.0f}s,"
                    f" load {loadavg()})",
                    file=sys.stderr,
                    flush=True,
                )
        for n in streams:
            print_table(results, bench, n)
        if args.profile > 0:
            for t in bench.targets:
                if t.name not in ("nginx", "direct"):
                    profiled(bench, wire, t, max(streams), args.profile)
        if args.cprofile > 0:
            cprofiled(bench, wire, upstream_port, max(streams), args.cprofile)
        audit = next((t for t in bench.targets if t.name == "dp-audit"), None)
        if audit is not None:
            lines = metric_lines(audit, ("detproxy_audits_total", "detproxy_requests_total"))
            audited = sum(float(ln.rsplit(" ", 1)[1]) for ln in lines if "audits_total" in ln)
            requests = sum(float(ln.rsplit(" ", 1)[1]) for ln in lines if "requests_total" in ln)
            verdicts = [ln for ln in lines if ln.startswith("detproxy_audits_total")]
            print(
                f"\ndp-audit: {audited:.0f} of {requests:.0f} streams audited; "
                + "; ".join(verdicts)
            )
        print(f"\nload    : {loadavg()} (1, 5, 15 min) after the run")
    finally:
        bench.stop()  # the timed detproxies write their collections at exit
        if args.gc_timings:
            print_collections(results, bench)
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
