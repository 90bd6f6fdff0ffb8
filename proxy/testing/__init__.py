"""A fake OpenAI-compatible upstream to test a detproxy configuration or policy against, that
answers each request as the test scripted it and records what it received; in two kinds:

- ``MockUpstream``: in process, no socket (as httpx ships ``MockTransport``): it implements
  detproxy's upstream seam (``proxy.http.upstream.Upstream``) and is given to the app,
  ``build_app(settings, upstream=MockUpstream(handler))``; every request detproxy makes to the
  engine (proxied, shadows, replays, its reads of /version, /metrics, ...) goes to it. A
  handler returns a ``Reply`` or a ``MockResponse`` (whose body may be any iterable or async
  iterable of byte pieces), or raises the ``UpstreamError`` a real client would;
- ``FakeUpstream``: an HTTP server on 127.0.0.1, in the test's own event loop, for what is
  about sockets or another process (``detproxy serve`` started with ``--upstream``).

Both answer alike (``script``, ``on``, a handler; ``received``, ``bodies``). Usage, in an async
test (pytest-asyncio or pytest-aiohttp)::

    from proxy.testing import FakeUpstream, Reply, chat_stream

    async def test_a_cut_stream_then_a_refusal() -> None:
        async with FakeUpstream() as upstream:  # answers "Hello!" where nothing is scripted
            upstream.script(
                "/v1/chat/completions",
                Reply.sse(chat_stream(["Hel", "lo"]), cut_after=2),  # 1st request: cut short
                Reply.error(503, "overloaded"),  # 2nd: refused; the 3rd gets "Hello!"
            )
            ...  # start detproxy with --upstream upstream.url, send requests through it
            first, *_ = upstream.received("/v1/chat/completions")
            assert first.json()["stream"] is True

The server runs in the test's event loop: wait on detproxy (a ``detproxy serve`` child
process, say) with async calls, never blocking ones. What no script answers, a handler does:
``FakeUpstream(handler)`` with a function of the ``Received`` request that returns a ``Reply``
(or an awaitable of one; ``answers()`` is the default), or ``FakeUpstream(forward=url)``, which
passes it on to a real server (an engine, the emulator) and records it on the way
(``MockUpstream(forward=H1Upstream(url))`` does the same with no socket of its own).
``on(path, reply)``, or ``routes``, answers every request to a path.
"""

from proxy.testing.mock import MockResponse, MockUpstream
from proxy.testing.replies import (
    Handler,
    Received,
    Reply,
    answers,
    chat_answer,
    chat_chunk,
    chat_stream,
    completion_answer,
    completion_stream,
    not_found,
)
from proxy.testing.server import FakeUpstream

__all__ = [
    "FakeUpstream",
    "Handler",
    "MockResponse",
    "MockUpstream",
    "Received",
    "Reply",
    "answers",
    "chat_answer",
    "chat_chunk",
    "chat_stream",
    "completion_answer",
    "completion_stream",
    "not_found",
]
