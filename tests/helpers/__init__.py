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
# ``from tests.helpers import ...``: import from the modules above instead. Lazily, so that a
# name changed in one module breaks only the imports of that name. (Delete from this line on.)
import importlib
from typing import Any

_MOVED: dict[str, list[str]] = {
    "answers": [
        "CONTENT",
        "REASONING",
        "Token",
        "chat_body",
        "chat_chunks",
        "chat_entry",
        "completion_body",
        "completion_chunks",
        "grouped_chat_chunks",
        "legacy_logprobs",
        "no_loop_in",
        "tokens",
    ],
    "emulator": [
        "CHAT",
        "COMPLETIONS",
        "EmulatorClient",
        "EmulatorReply",
        "MESSAGES",
        "chat",
        "completion",
        "knobs",
    ],
    "llama_server": [
        "Engine",
        "TESTS",
        "engine_busy",
        "engine_paths",
        "reasoning_template",
        "run_engine",
        "wait_engine_idle",
    ],
    "metrics": ["metric", "metric_samples", "metric_total", "scrape"],
    "processes": [
        "EXE",
        "NEEDS_REDIS",
        "bare_env",
        "detproxy_serve",
        "free_port",
        "redis_server",
        "run_detproxy",
        "stop",
        "wait_healthy",
        "wait_http",
    ],
    "relay_run": ["ExplodingInspector", "RecordedWrites", "RelayRun", "ScriptedReads", "relay"],
    "served": ["ServedApp", "own_tasks"],
    "settings": ["NO_SHADOWS", "rendering"],
    "sse": [
        "chat_chunk",
        "chat_event",
        "chat_text",
        "chunks",
        "parse_sse",
        "sse_blocks",
        "sse_chunks",
        "sse_comments",
        "sse_event",
        "stream_text",
        "without_ids",
    ],
    "upstreams": [
        "JSON_REPLY",
        "ScriptedReply",
        "ScriptedRequest",
        "ScriptedServer",
        "UpstreamScript",
        "replies_with",
        "scripted_routes",
    ],
    "waiting": ["Unmet", "eventually", "eventually_sync", "settle", "settle_sync"],
}
_MODULE_OF = {name: module for module, names in _MOVED.items() for name in names}


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'tests.helpers' has no attribute {name!r}")
    return getattr(importlib.import_module(f"tests.helpers.{_MODULE_OF[name]}"), name)
