"""A headless Chromium driven over the DevTools protocol (aiohttp's websocket client): open a
page, read the DOM after its scripts ran, click like a person, take a screenshot."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import re
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp

from tests.helpers.waiting import eventually

CHROMIUM = shutil.which("chromium")
_LISTENING = re.compile(rb"DevTools listening on (ws://\S+)")
START_S = 30.0
STEP_S = 15.0


class Page:
    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self._ws = ws
        self._ids = itertools.count(1)
        self._events: list[dict[str, Any]] = []

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        msg_id = next(self._ids)
        await self._ws.send_json({"id": msg_id, "method": method, "params": params})
        async with asyncio.timeout(STEP_S):
            while True:
                msg = await self._ws.receive_json()
                if msg.get("id") == msg_id:
                    if "error" in msg:
                        raise RuntimeError(f"{method}: {msg['error']}")
                    result: dict[str, Any] = msg.get("result", {})
                    return result
                self._events.append(msg)

    async def wait_event(self, method: str) -> dict[str, Any]:
        async with asyncio.timeout(STEP_S):
            while True:
                for i, ev in enumerate(self._events):
                    if ev.get("method") == method:
                        del self._events[: i + 1]
                        return ev
                self._events.clear()
                self._events.append(await self._ws.receive_json())

    async def goto(self, url: str) -> None:
        self._events.clear()
        await self.send("Page.navigate", url=url)
        await self.wait_event("Page.loadEventFired")

    async def reload(self) -> None:
        self._events.clear()
        await self.send("Page.reload")
        await self.wait_event("Page.loadEventFired")

    async def type_into(self, selector: str, text: str) -> None:
        """Focus the field and type ``text`` as a keyboard would."""
        await self.js(f"document.querySelector({selector!r}).focus()")
        await self.send("Input.insertText", text=text)

    async def js(self, expression: str) -> Any:
        result = await self.send("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str) -> Any:
        """Until ``expression`` is truthy in the page, for what a handler changes after an event
        (a ``hashchange`` runs after the click that caused it); its value."""
        # The page's handlers run between evaluations.
        return await eventually(lambda: self.js(expression), timeout_s=STEP_S, what=expression)

    async def click(self, selector: str, navigates: bool = True) -> None:
        """A real mouse click at the middle of the first element ``selector`` matches."""
        box = await self.js(
            f"(() => {{ const e = document.querySelector({selector!r}); e.scrollIntoView();"
            " const r = e.getBoundingClientRect();"
            " return [r.left + r.width / 2, r.top + r.height / 2]; })()"
        )
        self._events.clear()
        for kind in ("mousePressed", "mouseReleased"):
            await self.send(
                "Input.dispatchMouseEvent",
                type=kind,
                x=box[0],
                y=box[1],
                button="left",
                clickCount=1,
            )
        if navigates:
            await self.wait_event("Page.loadEventFired")

    async def screenshot(self, selector: str | None = None) -> bytes:
        params: dict[str, Any] = {"format": "png"}
        if selector is not None:
            r = await self.js(
                f"(() => {{ const r = document.querySelector({selector!r}).getBoundingClientRect();"
                " return [r.left + scrollX, r.top + scrollY, r.width, r.height]; })()"
            )
            params["clip"] = {"x": r[0], "y": r[1], "width": r[2], "height": r[3], "scale": 1}
            params["captureBeyondViewport"] = True
        shot = await self.send("Page.captureScreenshot", **params)
        return base64.b64decode(shot["data"])


@contextlib.asynccontextmanager
async def chromium(tmp: Path, headers: dict[str, str] | None = None) -> AsyncIterator[Page]:
    assert CHROMIUM is not None
    proc = await asyncio.create_subprocess_exec(
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--hide-scrollbars",
        "--window-size=1200,900",
        "--remote-debugging-port=0",
        "--remote-allow-origins=*",
        f"--user-data-dir={tmp}",
        "about:blank",
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stderr is not None
        async with asyncio.timeout(START_S):
            while not (found := _LISTENING.search(await proc.stderr.readline())):
                pass
        browser_ws = found.group(1).decode()
        base = browser_ws.split("/devtools/")[0].replace("ws://", "http://")
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{base}/json/list") as resp:
                targets = await resp.json()
            page_ws = next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")
            drain = asyncio.create_task(_drain(proc.stderr), name="chromium-stderr")
            try:
                async with session.ws_connect(page_ws, max_msg_size=0) as ws:
                    page = Page(ws)
                    await page.send("Page.enable")
                    if headers:
                        await page.send("Network.enable")
                        await page.send("Network.setExtraHTTPHeaders", headers=headers)
                    yield page
            finally:
                drain.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await drain
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                async with asyncio.timeout(10):
                    await proc.wait()
            except TimeoutError:
                proc.kill()
                await proc.wait()


async def _drain(stream: asyncio.StreamReader) -> None:
    """Chromium logs to stderr: read it so that a full pipe never blocks it."""
    while await stream.readline():
        pass
