"""Micro-benchmarks of detproxy's per-chunk path, and memory per open stream.

Run: ``.venv/bin/python tests/bench/bench_chunks.py [--tokens 2000] [--streams 1000] [--micro]``
Prints figures only (no assertions). Uses detproxy's own modules on vLLM-shaped chat chunks
(``data: {...chat.completion.chunk...}\\n\\n``, one content token each):

- microseconds per token (= per chunk of one token), best of several repetitions, for each
  stage the relay runs: SSE decode (one event per ``feed``, and the whole stream in 64 KB reads),
  orjson parse, ``LoopWatch.on_delta``, ``StreamAccumulator.on_delta`` (with and without top-5
  logprobs), ``strip_logprobs`` and the re-serialisation of a stripped chunk, xxh3 of the text;
  next to baselines measured in the same run (an empty loop, ``bytes.split``, a no-op call);
- microseconds per event of the relay itself (``StreamRelay.run`` over an in-memory upstream
  and client): nothing inspects (the raw path), loops on (the simple path), in 64 KB reads and
  one event per read, reasoning then content with and without ``hold_reasoning``, CRLF framing
  (the general path), loops with an audit accumulator (``--micro`` stops after these);
- tracemalloc of one open stream's state (decoder + loop watch + accumulator) after N tokens;
- VmRSS of a detproxy process (a subprocess, loops on) before and while it holds 1,000 open
  streams: a tiny aiohttp upstream in this process sends the first chunk of each stream and
  holds it open, 1,000 aiohttp clients wait on them; then they are released and finish.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

import orjson  # noqa: E402
import xxhash  # noqa: E402
from bench_proxy import LAUNCHER, MODEL, REQ_ID, _words, machine  # noqa: E402

from proxy.audit.outcome import StreamAccumulator  # noqa: E402
from proxy.http.sse import SSEDecoder, encode_event  # noqa: E402
from proxy.loops.detector import DetectorConfig  # noqa: E402
from proxy.loops.watch import LoopWatch  # noqa: E402
from proxy.openai import strip_logprobs  # noqa: E402
from proxy.relay.inspectors import Delta  # noqa: E402
from tests.helpers.processes import free_port  # noqa: E402

HOST = "127.0.0.1"
REPEAT = 5


# ---------------------------------------------------------------------------------------------
# Chunks


def _logprobs(token: str, top: int) -> dict[str, Any]:
    def entry(tok: str, lp: float) -> dict[str, Any]:
        return {"token": tok, "logprob": lp, "bytes": list(tok.encode())}

    alts = [entry(token, -0.0123)] + [entry(f"{token}{i}", -2.5 - i) for i in range(top - 1)]
    return {"content": [{**entry(token, -0.0123), "top_logprobs": alts[:top]}]}


def make_chunks(tokens: int, top: int = 0) -> list[bytes]:
    """SSE events of one chat stream: a role chunk, one content token each, a finish chunk."""
    words = _words(tokens, 11)
    out = []

    def event(delta: dict[str, Any], finish: str | None, lp: dict[str, Any] | None) -> bytes:
        choice: dict[str, Any] = {
            "index": 0,
            "delta": delta,
            "logprobs": lp,
            "finish_reason": finish,
        }
        if finish:
            choice["stop_reason"] = None
        obj = {
            "id": REQ_ID,
            "object": "chat.completion.chunk",
            "created": 1718000000,
            "model": MODEL,
            "choices": [choice],
        }
        return encode_event(orjson.dumps(obj))

    out.append(event({"role": "assistant", "content": ""}, None, None))
    for i, w in enumerate(words):
        tok = w if i == 0 else " " + w
        out.append(event({"content": tok}, None, _logprobs(tok, top) if top else None))
    out.append(event({"content": ""}, "stop", None))
    return out


# ---------------------------------------------------------------------------------------------
# Timing


def per_item_us(fn: Callable[[], int], repeat: int = REPEAT) -> float:
    """``fn`` runs a loop and returns how many items it processed; best run, µs per item."""
    best = float("inf")
    for _ in range(repeat):
        gc.collect()
        t0 = time.perf_counter_ns()
        n = fn()
        dt = time.perf_counter_ns() - t0
        best = min(best, dt / 1000 / max(n, 1))
    return best


class Noop:
    __slots__ = ()

    def on_chunk(self, chunk: Any) -> None:
        return None


def micro(tokens: int) -> None:
    events = make_chunks(tokens)
    events_lp = make_chunks(tokens, top=5)
    stream = b"".join(events)
    datas = [e[6:-2] for e in events]  # the JSON of each event
    parsed = [orjson.loads(d) for d in datas]
    deltas = [Delta(0, "content", c["choices"][0]["delta"]["content"]) for c in parsed]
    parsed_lp_json = [e[6:-2] for e in events_lp]
    texts = [(c["choices"][0]["delta"].get("content") or "").encode() for c in parsed]
    n = len(events)
    noop = Noop()
    config = DetectorConfig()

    def empty_loop() -> int:
        for _ in events:
            pass
        return n

    def noop_call() -> int:
        f = noop.on_chunk
        for c in parsed:
            f(c)
        return n

    def split_lines() -> int:
        for e in events:
            e.split(b"\n")
        return n

    def sse_per_event() -> int:
        dec = SSEDecoder()
        feed = dec.feed
        for e in events:
            feed(e)
        return n

    def sse_64k() -> int:
        dec = SSEDecoder()
        for i in range(0, len(stream), 65536):
            dec.feed(stream[i : i + 65536])
        return n

    def sse_split_across() -> int:
        # Reads that cut every event in two: the decoder's buffer is used each time.
        dec = SSEDecoder()
        for e in events:
            h = len(e) // 2
            dec.feed(e[:h])
            dec.feed(e[h:])
        return n

    def parse() -> int:
        loads = orjson.loads
        for d in datas:
            loads(d)
        return n

    def loop_watch() -> int:
        watch = LoopWatch("chat", config)
        for c in parsed:
            watch.on_delta(c)
        return n

    def loop_watch_deltas() -> int:
        watch = LoopWatch("chat", config)
        for d in deltas:
            watch.on_delta(d)
        return n

    def accumulate() -> int:
        acc = StreamAccumulator("chat")
        for c in parsed:
            acc.on_delta(c)
        acc.on_end(True)
        return n

    lp_sets: list[list[dict[str, Any]]] = []

    def fresh_lp() -> None:
        lp_sets.clear()
        lp_sets.extend([orjson.loads(d) for d in parsed_lp_json] for _ in range(REPEAT))

    def accumulate_lp() -> int:
        acc = StreamAccumulator("chat")
        for c in lp_sets.pop():
            acc.on_delta(c)
        acc.on_end(True)
        return n

    def strip() -> int:
        for c in lp_sets.pop():
            strip_logprobs(c)
        return n

    stripped = [orjson.loads(d) for d in parsed_lp_json]
    for c in stripped:
        strip_logprobs(c)

    def reserialise() -> int:
        dumps = orjson.dumps
        for c in stripped:
            encode_event(dumps(c))
        return n

    def parse_lp() -> int:
        loads = orjson.loads
        for d in parsed_lp_json:
            loads(d)
        return n

    def xxh3_incremental() -> int:
        h = xxhash.xxh3_64()
        for t in texts:
            h.update(t)
        h.intdigest()
        return n

    def xxh3_128_incremental() -> int:
        h = xxhash.xxh3_128()
        for t in texts:
            h.update(t)
        h.hexdigest()
        return n

    def full_inspection() -> int:
        # What the relay does per chunk with loops on and an audit accumulating, hashing too.
        dec = SSEDecoder()
        watch = LoopWatch("chat", config)
        acc = StreamAccumulator("chat")
        h = xxhash.xxh3_64()
        loads = orjson.loads
        for e in events:
            for ev in dec.feed(e):
                data = ev.data
                if data is None or data == b"[DONE]":
                    continue
                c = loads(data)
                watch.on_delta(c)
                acc.on_delta(c)
                text = c["choices"][0]["delta"].get("content")
                if text:
                    h.update(text.encode())
        acc.on_end(True)
        return n

    def decode_parse_only() -> int:
        dec = SSEDecoder()
        loads = orjson.loads
        for e in events:
            for ev in dec.feed(e):
                if ev.data is not None and ev.data != b"[DONE]":
                    loads(ev.data)
        return n

    size = sum(map(len, events)) / n
    size_lp = sum(map(len, events_lp)) / n
    print(
        f"\n== per token (one chunk of one token; {n} chunks of ~{size:.0f} B, "
        f"~{size_lp:.0f} B with top-5 logprobs; best of {REPEAT}) =="
    )
    rows: list[tuple[str, float]] = [
        ("baseline: empty for loop", per_item_us(empty_loop)),
        ("baseline: no-op method call", per_item_us(noop_call)),
        ("baseline: bytes.split(b'\\n') of the event", per_item_us(split_lines)),
        ("SSE decode, one event per feed()", per_item_us(sse_per_event)),
        ("SSE decode, each event split over 2 feeds", per_item_us(sse_split_across)),
        ("SSE decode, whole stream in 64 KB feeds", per_item_us(sse_64k)),
        ("orjson.loads of the event's JSON", per_item_us(parse)),
        ("orjson.loads, chunk with top-5 logprobs", per_item_us(parse_lp)),
        ("LoopWatch.on_delta, a parsed chunk", per_item_us(loop_watch)),
        ("LoopWatch.on_delta, a Delta (the chunk's text)", per_item_us(loop_watch_deltas)),
        ("StreamAccumulator.on_delta, logprobs null", per_item_us(accumulate)),
    ]
    fresh_lp()
    rows.append(("StreamAccumulator.on_delta, top-5 logprobs", per_item_us(accumulate_lp)))
    fresh_lp()
    rows.append(("strip_logprobs (top-5 -> null)", per_item_us(strip)))
    rows += [
        ("re-serialise stripped chunk (dumps+frame)", per_item_us(reserialise)),
        ("xxh3_64 update with the token's text", per_item_us(xxh3_incremental)),
        ("xxh3_128 update with the token's text", per_item_us(xxh3_128_incremental)),
        ("decode + parse (what dp with loops off does)", per_item_us(decode_parse_only)),
        ("full: decode+parse+loops+accumulate+xxh3", per_item_us(full_inspection)),
    ]
    for name, us in rows:
        print(f"  {name:48} {us:7.3f} µs")
    relay_rows(events)


# ---------------------------------------------------------------------------------------------
# The relay itself (StreamRelay.run over a fake upstream and a fake client)


class _Upstream:
    def __init__(self, reads: list[bytes]) -> None:
        self._reads = reads
        self._left = iter(reads)  # pump's: it goes on where the last call stopped

    async def chunks(self) -> AsyncIterator[bytes]:
        for read in self._reads:
            yield read

    async def pump(self, sink: Callable[[bytes], bool]) -> bool:
        # As the native client pumps: each read handed over synchronously, no await per read.
        return all(sink(read) for read in self._left)


class _Client:
    async def write(self, data: bytes) -> None:
        return None

    def write_nowait(self, data: bytes) -> bool:
        return True

    async def drain(self) -> None:
        return None


def _reads(stream: bytes, size: int) -> list[bytes]:
    return [stream[i : i + size] for i in range(0, len(stream), size)]


def _reasoning_events(events: list[bytes]) -> list[bytes]:
    """The stream as a reasoning model sends it: the first half of the tokens as reasoning."""
    half = len(events) // 2
    return [e.replace(b'"content"', b'"reasoning"') for e in events[:half]] + events[half:]


def relay_rows(events: list[bytes]) -> None:
    """µs per event of ``StreamRelay.run`` on the whole stream: what detproxy does per event."""
    from proxy.events import EventBus
    from proxy.relay.inspectors import InspectorSet
    from proxy.relay.stream import StreamPlan, StreamRelay

    config = DetectorConfig()
    stream = b"".join(events) + b"data: [DONE]\n\n"
    n = len(events) + 1
    by_64k = _reads(stream, 65536)
    by_event = [*events, b"data: [DONE]\n\n"]
    crlf = _reads(stream.replace(b"\n", b"\r\n"), 65536)
    reasoning = _reads(b"".join(_reasoning_events(events)) + b"data: [DONE]\n\n", 65536)

    def relay(reads: list[bytes], loops: bool, audit: bool = False, hold: bool = False) -> float:
        loop = asyncio.new_event_loop()

        async def once() -> None:
            found: list[Any] = [StreamAccumulator("chat")] if audit else []
            watchers = [LoopWatch("chat", config)] if loops else []
            plan = StreamPlan(hold_reasoning=hold)
            inspectors = InspectorSet(found, lambda name: None, watchers)
            relay = StreamRelay("chat", inspectors, EventBus(), 8 << 20, 0.0, plan)
            await relay.run(_Upstream(reads), _Client())  # type: ignore[arg-type]

        def run() -> int:
            loop.run_until_complete(once())
            return n

        try:
            return per_item_us(run)
        finally:
            loop.close()

    print(f"\n== the relay, StreamRelay.run per event ({n} events; best of {REPEAT}) ==")
    rows = [
        ("nothing inspects, 64 KB reads", relay(by_64k, False)),
        ("nothing inspects, one event per read", relay(by_event, False)),
        ("loops on, 64 KB reads", relay(by_64k, True)),
        ("loops on, one event per read", relay(by_event, True)),
        ("loops on, reasoning then content, 64 KB reads", relay(reasoning, True)),
        ("loops + hold_reasoning, reasoning then content", relay(reasoning, True, hold=True)),
        ("loops on, CRLF framing (general path), 64 KB", relay(crlf, True)),
        ("loops + audit accumulator, 64 KB reads", relay(by_64k, True, audit=True)),
    ]
    for name, us in rows:
        print(f"  {name:48} {us:7.3f} µs")


# ---------------------------------------------------------------------------------------------
# Memory of one stream (tracemalloc)


def stream_state_kb(tokens: int, top: int, audited: bool) -> tuple[float, float]:
    """(KB held by decoder + loop watch [+ accumulator] after ``tokens`` tokens, peak KB).

    The relay keeps a StreamAccumulator only for an audited request."""
    events = make_chunks(tokens, top)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    tracemalloc.reset_peak()
    dec = SSEDecoder()
    watch = LoopWatch("chat", DetectorConfig())
    acc = StreamAccumulator("chat") if audited else None
    for e in events:
        for ev in dec.feed(e):
            if ev.data is None or ev.data == b"[DONE]":
                continue
            c = orjson.loads(ev.data)
            watch.on_delta(c)
            if acc is not None:
                acc.on_delta(c)
            del c
    del ev
    gc.collect()
    cur, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    keep = (dec, watch, acc)  # noqa: F841  (alive until measured)
    return (cur - base) / 1024, (peak - base) / 1024


def memory(tokens: int) -> None:
    print(f"\n== one open stream's state after {tokens} tokens (tracemalloc) ==")
    for top, audited, what in (
        (0, False, "not audited: decoder + loop watch"),
        (0, True, "audited, chunks without logprobs"),
        (5, True, "audited, top-5 logprobs kept"),
    ):
        cur, peak = stream_state_kb(tokens, top, audited)
        print(f"  {what:36} {cur:8.1f} KB held, {peak:8.1f} KB peak")
    print(
        "  (audited = + StreamAccumulator; detproxy injects top-5 logprobs into audited"
        " requests, so the last row is the usual audited case)"
    )
    # The loop detector alone: bounded by its window whatever the length.
    for n in (tokens, 10 * tokens):
        gc.collect()
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        watch = LoopWatch("chat", DetectorConfig())
        for w in _words(n, 3):
            watch.on_delta({"choices": [{"index": 0, "delta": {"content": " " + w}}]})
        gc.collect()
        cur = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
        print(f"  LoopWatch alone after {n:>6} tokens     {cur / 1024:8.1f} KB held")


# ---------------------------------------------------------------------------------------------
# RSS of detproxy with many open streams


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


async def held_streams(
    proc: subprocess.Popen[bytes], port: int, up_port: int, streams: int, audit: bool
) -> None:
    """The upstream (in this process) and the clients; detproxy is already starting."""
    from aiohttp import ClientSession, ClientTimeout, TCPConnector, web

    events = make_chunks(40)
    release = asyncio.Event()
    opened = 0

    async def handler(request: web.Request) -> web.StreamResponse:
        nonlocal opened
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(events[0] + events[1])
        opened += 1
        await release.wait()
        await resp.write(b"".join(events[2:]) + b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, HOST, up_port, backlog=4096).start()

    body = orjson.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hold the line"}],
            "temperature": 0,
            "stream": True,
        }
    )
    url = f"http://{HOST}:{port}/v1/chat/completions"
    try:
        async with ClientSession(
            connector=TCPConnector(limit=streams + 16), timeout=ClientTimeout(total=120)
        ) as session:
            for _ in range(100):
                try:
                    async with session.get(f"http://{HOST}:{port}/detproxy/health") as r:
                        await r.read()
                    break
                except OSError:
                    if proc.poll() is not None:
                        raise SystemExit("detproxy exited at start") from None
                    await asyncio.sleep(0.1)

            release.set()  # warm-up: a few complete streams
            for _ in range(20):
                async with session.post(url, data=body) as r:
                    await r.read()
            release.clear()
            opened = 0
            await asyncio.sleep(0.5)
            before = rss_kb(proc.pid)

            got_first = 0
            done = asyncio.Event()

            async def client() -> int:
                nonlocal got_first
                async with session.post(url, data=body) as r:
                    first = await r.content.readuntil(b"\n\n")
                    got_first += 1
                    if got_first == streams:
                        done.set()
                    rest = await r.read()
                    return len(first) + len(rest)

            t0 = time.monotonic()
            tasks = [asyncio.create_task(client()) for _ in range(streams)]
            try:
                await asyncio.wait_for(done.wait(), timeout=60)
            except TimeoutError:
                print(f"  only {got_first} of {streams} streams opened in 60 s")
            opened_s = time.monotonic() - t0
            await asyncio.sleep(0.5)
            gc.collect()
            during = rss_kb(proc.pid)
            release.set()
            sizes = await asyncio.gather(*tasks, return_exceptions=True)
            failed = sum(1 for s in sizes if isinstance(s, BaseException))
            await asyncio.sleep(0.5)
            after = rss_kb(proc.pid)
            kind = "audit 100% + loops on" if audit else "audit off, loops on"
            print(
                f"  detproxy ({kind}): VmRSS {before / 1024:.1f} MB idle -> "
                f"{during / 1024:.1f} MB with {got_first} open streams ({opened_s:.1f} s to "
                f"open) -> {after / 1024:.1f} MB after they ended; "
                f"{(during - before) / max(got_first, 1):.1f} KB per open stream; "
                f"{failed} failed"
            )
    finally:
        await runner.cleanup()


def rss_with_streams(streams: int, audit: bool) -> None:
    up_port = free_port()
    tmp = Path(tempfile.mkdtemp(prefix="detproxy-chunks-"))
    cfg = tmp / "detproxy.toml"
    cfg.write_text(
        f"[server]\nshutdown_grace_s = 1\n[upstream]\nmax_connections = {streams + 64}\n"
        f"[audit]\nsample_rate = {1.0 if audit else 0.0}\npassive_checks = false\n"
        "[loops]\nenabled = true\n"
    )
    port = free_port()
    log = open(tmp / "detproxy.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            LAUNCHER,
            "serve",
            "--config",
            str(cfg),
            "--upstream",
            f"http://{HOST}:{up_port}",
            "--host",
            HOST,
            "--port",
            str(port),
            "--log-level",
            "WARNING",
            "--workers",
            "1",  # the RSS of one process: memory per stream is one worker's
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        cwd=tmp,
    )
    try:
        asyncio.run(held_streams(proc, port, up_port, streams, audit))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2000, help="tokens per stream (default 2000)")
    ap.add_argument("--streams", type=int, default=1000, help="open streams for the RSS figure")
    ap.add_argument("--micro", action="store_true", help="per-event figures only")
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, max(soft, 4 * args.streams + 1024))
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    print("\n".join(machine(tools=False)))
    micro(args.tokens)
    if args.micro:
        return 0
    memory(args.tokens)
    print(f"\n== detproxy process RSS with {args.streams} concurrent open streams ==")
    for audit in (False, True):
        rss_with_streams(args.streams, audit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
