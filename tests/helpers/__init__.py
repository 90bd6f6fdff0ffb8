"""What the tests share, one module by what it helps (test modules import from these, never
from one another; pytest fixtures stay in tests/conftest.py; the benchmarks use them too):

- ``waiting``: ``eventually()``, ``eventually_sync()``, ``Unmet``, ``settle()``, ``settle_sync()``
- ``processes``: free ports; detproxy and redis-server as child processes
- ``llama_server``: the integration tests' real engine
- ``served``: detproxy served in the test's own process (``ServedApp``), ``own_tasks()``
- ``settings``: DETPROXY_* environments (``NO_SHADOWS``, ``rendering()``)
- ``metrics``: metric readers
- ``sse``: SSE events and chunks, built and read back
- ``answers``: engine-shaped answers with logprobs, whole and streamed
- ``emulator``: requests to the emulator and a client that reads whole replies
- ``upstreams``: scripted and recording upstreams
- ``relay_run``: the stream relay driven without sockets
"""

# Re-exported only while test modules written before the split still import
# ``from tests.helpers import ...``: import from the modules above instead. (The split's
# report gives the one command that deletes everything from this line on.)
from tests.helpers.answers import (
    CONTENT,
    REASONING,
    Token,
    chat_body,
    chat_chunks,
    chat_entry,
    completion_body,
    completion_chunks,
    grouped_chat_chunks,
    legacy_logprobs,
    no_loop_in,
    tokens,
)
from tests.helpers.emulator import (
    CHAT,
    COMPLETIONS,
    MESSAGES,
    EmulatorClient,
    EmulatorReply,
    chat,
    completion,
    knobs,
)
from tests.helpers.llama_server import (
    TESTS,
    Engine,
    engine_busy,
    engine_paths,
    reasoning_template,
    run_engine,
    wait_engine_idle,
)
from tests.helpers.metrics import metric, metric_samples, metric_total, scrape
from tests.helpers.processes import (
    EXE,
    NEEDS_REDIS,
    bare_env,
    detproxy_serve,
    free_port,
    redis_server,
    run_detproxy,
    stop,
    wait_healthy,
    wait_http,
)
from tests.helpers.relay_run import (
    ExplodingInspector,
    RecordedWrites,
    RelayRun,
    ScriptedReads,
    relay,
)
from tests.helpers.served import ServedApp, own_tasks
from tests.helpers.settings import NO_SHADOWS, rendering
from tests.helpers.sse import (
    chat_chunk,
    chat_event,
    chat_text,
    chunks,
    parse_sse,
    sse_blocks,
    sse_chunks,
    sse_comments,
    sse_event,
    stream_text,
    without_ids,
)
from tests.helpers.upstreams import (
    JSON_REPLY,
    ScriptedReply,
    ScriptedRequest,
    ScriptedServer,
    Seen,
    UpstreamScript,
    refused,
    replies_with,
    scripted_upstream,
)
from tests.helpers.waiting import Unmet, eventually, eventually_sync, settle, settle_sync

__all__ = [
    "CHAT",
    "COMPLETIONS",
    "CONTENT",
    "EXE",
    "JSON_REPLY",
    "MESSAGES",
    "NEEDS_REDIS",
    "NO_SHADOWS",
    "REASONING",
    "TESTS",
    "EmulatorClient",
    "EmulatorReply",
    "Engine",
    "ExplodingInspector",
    "RecordedWrites",
    "RelayRun",
    "ScriptedReads",
    "ScriptedReply",
    "ScriptedRequest",
    "ScriptedServer",
    "Seen",
    "ServedApp",
    "Token",
    "Unmet",
    "UpstreamScript",
    "bare_env",
    "chat",
    "chat_body",
    "chat_chunk",
    "chat_chunks",
    "chat_entry",
    "chat_event",
    "chat_text",
    "chunks",
    "completion",
    "completion_body",
    "completion_chunks",
    "detproxy_serve",
    "engine_busy",
    "engine_paths",
    "eventually",
    "eventually_sync",
    "free_port",
    "grouped_chat_chunks",
    "knobs",
    "legacy_logprobs",
    "metric",
    "metric_samples",
    "metric_total",
    "no_loop_in",
    "own_tasks",
    "parse_sse",
    "reasoning_template",
    "redis_server",
    "refused",
    "relay",
    "rendering",
    "replies_with",
    "run_detproxy",
    "run_engine",
    "scrape",
    "scripted_upstream",
    "settle",
    "settle_sync",
    "sse_blocks",
    "sse_chunks",
    "sse_comments",
    "sse_event",
    "stop",
    "stream_text",
    "tokens",
    "wait_engine_idle",
    "wait_healthy",
    "wait_http",
    "without_ids",
]
