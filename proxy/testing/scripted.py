"""What both fake upstreams share: the replies scripted per path, the routes, the handler of
the rest; what they received."""

from __future__ import annotations

import inspect
from collections import deque
from collections.abc import Mapping
from typing import Any

from proxy.http.errors import UpstreamError
from proxy.testing.replies import Answer, Handler, Received, Reply, answers, not_found


class Answering:
    def __init__(
        self, handler: Handler | None, routes: Mapping[str, Reply | Handler] | None, model: str
    ) -> None:
        self.requests: list[Received] = []
        self.errors: list[Exception] = []  # what handlers raised (answered 500)
        # With routes alone, the paths they name are all it answers (404 elsewhere).
        self._handler = handler or (not_found if routes is not None else answers(model=model))
        self._scripts: dict[str, deque[Reply | Handler]] = {}
        self._routes: dict[str, Reply | Handler] = dict(routes or {})

    def script(self, path: str, *replies: Reply | Handler) -> None:
        """The next requests to ``path`` get these, one each, in order (after the replies
        already queued)."""
        self._scripts.setdefault(path, deque()).extend(replies)

    def on(self, path: str, reply: Reply | Handler | None) -> None:
        """Every request to ``path`` that no script answers gets ``reply`` (None: no more)."""
        if reply is None:
            self._routes.pop(path, None)
        else:
            self._routes[path] = reply

    def received(self, path: str | None = None) -> list[Received]:
        """The requests received (to ``path`` only, if given), oldest first."""
        return [r for r in self.requests if path is None or r.path == path]

    def bodies(self, path: str) -> list[Any]:
        """The JSON bodies of the requests to ``path``, oldest first."""
        return [r.json() for r in self.received(path)]

    def _next(self, path: str) -> Reply | Handler | None:
        queued = self._scripts.get(path)
        if queued:
            return queued.popleft()
        return self._routes.get(path)

    async def _answer(self, got: Reply | Handler, request: Received) -> Answer:
        """What the handler answers; 500 where it raised (raised again at the block's end).
        An ``UpstreamError`` is the upstream's fault the test asked for: it goes on."""
        if isinstance(got, Reply):
            return got
        try:
            answered = got(request)
            return await answered if inspect.isawaitable(answered) else answered
        except UpstreamError:
            raise
        except Exception as exc:  # a bug of the test's: raised again at the block's end
            self.errors.append(exc)
            name = type(self).__name__
            return Reply.text(f"{name} handler raised {exc!r}", 500)

    def _raise_errors(self) -> None:
        if self.errors:
            raise self.errors[0]
