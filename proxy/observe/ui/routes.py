"""``/detproxy/ui``: the explorer served live from the incident ring, the tally and the live
history (every worker's under ``serve --workers N``: ``proxy.observe.view``). Under
``/detproxy/``, so the admin guard applies to it as to every admin endpoint (the admin listener
only, the bearer token, or a browser's session cookie: proxy/http/admin.py, which redirects a
browser without either to its login page)."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping
from typing import cast

from proxy.http.admin import Admin, AdminRequest, Reply, html_reply
from proxy.observe.ui.filters import FilterError, parse_filter
from proxy.observe.ui.incident import detail_of, incident_id
from proxy.observe.ui.overview import Inputs, Key3, build_overview
from proxy.observe.ui.page import UI_PATH, Links, csp, new_nonce
from proxy.observe.ui.render import error_page, incident_page, overview_page
from proxy.observe.view import ServerView

_ID = re.compile(r"[0-9a-f]{16}")


def _html(body: str, nonce: str, status: int = 200) -> Reply:
    return html_reply(
        body,
        status,
        {
            "Content-Security-Policy": csp(nonce),
            "Cache-Control": "no-store",
            "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer",
        },
    )


class Explorer:
    def __init__(
        self,
        view: ServerView,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._view = view
        self._history = view.history
        self._clock = clock
        self._links = Links(UI_PATH)

    def inputs(self) -> Inputs:
        counters = self._view.counters()
        return Inputs(
            records=self._view.records(),
            audits=cast(Mapping[Key3, int], counters["audits"]),
            loops=cast(Mapping[Key3, int], counters["loops"]),
            recoveries=cast(Mapping[Key3, int], counters["recoveries"]),
            by_inflight=cast(Mapping[Key3, int], counters["by_inflight"]),
            points=self._view.points(),
            readings=self._history.readings(),
            now=self._clock(),
            source="live",
            upstream=self._history.upstream_notes(),
            engine=self._history.engine(),
        )

    def _links_for(self, request: AdminRequest) -> Links:
        """A browser logged in with a session cookie gets a log-out button."""
        csrf = request.session_csrf
        return self._links if csrf is None else Links(UI_PATH, logout_csrf=csrf)

    def _error(self, request: AdminRequest, status: int, message: str) -> Reply:
        nonce = new_nonce()
        page = error_page(status, message, self._links_for(request), nonce)
        return _html(page, nonce, status)

    async def overview(self, request: AdminRequest) -> Reply:
        try:
            wanted = parse_filter(request.query.items())
        except FilterError as exc:
            return self._error(request, 400, f"bad query parameter {exc.param}: {exc}")
        nonce = new_nonce()
        links = self._links_for(request)
        return _html(overview_page(build_overview(self.inputs(), wanted), links, nonce), nonce)

    async def incident(self, request: AdminRequest) -> Reply:
        wanted = request.match
        if not _ID.fullmatch(wanted):
            return self._error(request, 400, "an incident id is 16 lowercase hex digits")
        for record in self._view.records():
            if incident_id(record) == wanted:
                detail = detail_of(record)
                if detail is not None:
                    nonce = new_nonce()
                    page = incident_page(detail, self._links_for(request), nonce, "live")
                    return _html(page, nonce)
        return self._error(
            request,
            404,
            f"no incident {wanted} in the ring (it keeps the newest; older ones are in the"
            " incident log file: detproxy report --html)",
        )


def register_ui(admin: Admin, view: ServerView) -> None:
    """Add the explorer's routes, over ``view`` (every worker's figures under --workers)."""
    explorer = Explorer(view)
    admin.add(UI_PATH, explorer.overview)
    admin.add(UI_PATH + "/", explorer.overview)
    admin.add_under(UI_PATH + "/incident/", explorer.incident)
