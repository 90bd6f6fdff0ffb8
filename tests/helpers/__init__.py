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
