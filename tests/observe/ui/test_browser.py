"""The explorer in a real headless Chromium, against a live detproxy whose incidents come from
the emulator: the DOM after the page's script ran, real clicks, a screenshot's pixels."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from proxy.tools.emulator import EmulatorConfig, EmulatorServer
from proxy.tools.report.cli import main as report_main
from tests.observe.ui.browser import CHROMIUM, chromium
from tests.observe.ui.live import AUTH, EVIL_PROMPT, TOKEN, env, make_incidents
from tests.observe.ui.png import read_png

pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="chromium (Debian package) is not installed"
)
DIVERGENCE_RGB = (0xD9, 0x48, 0x0F)  # --text_divergence: the chosen top-k bar, the mark's outline


@pytest.fixture
async def emulator() -> AsyncIterator[EmulatorServer]:
    async with EmulatorServer(EmulatorConfig()) as srv:
        yield srv


async def test_from_the_alert_to_the_divergent_token_in_two_clicks(
    make_proxy: Any, emulator: EmulatorServer, tmp_path: Path
) -> None:
    client = await make_proxy(emulator.url, env=env(store_text=True))
    await make_incidents(client)
    incidents = await (await client.get("/detproxy/incidents", headers=AUTH)).json()
    flip = next(i for i in incidents if i["request_id"] == "flip")
    div = flip["divergence"]
    ui = str(client.make_url("/detproxy/ui"))
    started = time.monotonic()
    async with chromium(tmp_path / "profile", headers=AUTH) as page:
        # click 1 is the alert's link: the list of this model's incidents, newest first
        await page.goto(f"{ui}?model=emulator-model")
        assert await page.js("document.body.dataset.ready") == "1"  # the page's script ran
        rows = await page.js(
            "[...document.querySelectorAll('#incidents tbody tr')].map(r => r.dataset.verdict)"
        )
        assert rows == [i["verdict"] if i["kind"] == "audit" else i["kind"] for i in incidents]
        assert {"text_divergence", "logprob_drift", "loop"} <= set(rows)
        assert await page.js("document.querySelectorAll('svg.timeline').length") == 1
        assert await page.js("document.querySelector('time[data-ts]').dataset.ago") is not None
        # click 2: the flipped request's row
        await page.click("tr[data-request='flip'] a.incident-link")
        assert "/detproxy/ui/incident/" in await page.js("location.pathname")
        marks = await page.js("[...document.querySelectorAll('mark.div')].map(m => m.textContent)")
        assert marks == [div["primary_token"], div["shadow_token"]]
        bars = await page.js("document.querySelectorAll('svg.topk rect.topk-bar').length")
        assert bars == len(div["primary_top"]) + len(div["shadow_top"])
        # the prompt's markup is text on the page, never run
        prompt = await page.js("document.querySelector('#prompt pre').textContent")
        assert prompt == f'[{{"role":"user","content":"{EVIL_PROMPT}"}}]'
        assert await page.js("typeof window.__pwned") == "undefined"
        assert await page.js("document.scripts.length") == 1
        width, height, colours = read_png(await page.screenshot("svg.topk[data-side=primary]"))
        assert width > 100 and height > 20
        assert colours[DIVERGENCE_RGB] > 50  # the emitted token's bar is drawn, in its colour
        assert len(colours) > 5  # not blank
        # a filter chosen in the page reloads the list with it
        await page.goto(ui)
        await page.js(
            "(() => { const s = document.querySelector('select[name=verdict]'); s.value = 'loop';"
            " s.dispatchEvent(new Event('change')); })()"
        )
        await page.wait_event("Page.loadEventFired")
        assert await page.js("location.search") == "?verdict=loop&limit=100"
        shown = await page.js(
            "[...document.querySelectorAll('#incidents tbody tr')].map(r => r.dataset.verdict)"
        )
        assert shown == ["loop"]
        await page.click("a.incident-link")
        assert await page.js("document.querySelectorAll('mark.unit').length") >= 1
        # a bad parameter: a 400 page saying what is wrong
        await page.goto(f"{ui}?verdict=nope")
        error = await page.js("document.getElementById('error').textContent")
        assert "verdict must be one of" in error and "'nope'" in error
    print(f"\nbrowser steps: {time.monotonic() - started:.2f} s")


async def test_the_html_report_opens_offline_without_stored_text(
    make_proxy: Any, emulator: EmulatorServer, tmp_path: Path
) -> None:
    log = tmp_path / "incidents.jsonl"
    client = await make_proxy(
        emulator.url,
        env=env(store_text=False, DETPROXY_INCIDENTS__PATH=str(log)),
    )
    await make_incidents(client)
    await client.close()  # the last tally line is written at shutdown
    out = tmp_path / "report.html"
    assert report_main(["--html", str(out), str(log)]) == 0
    started = time.monotonic()
    async with chromium(tmp_path / "profile") as page:
        await page.goto(out.as_uri())
        assert await page.js("document.body.dataset.ready") == "1"
        verdicts = await page.js(
            "[...document.querySelectorAll('#incidents tbody tr')].map(r => r.dataset.verdict)"
        )
        assert {"text_divergence", "logprob_drift", "loop"} <= set(verdicts)
        # the filter runs in the page (there is no server to ask)
        await page.js(
            "(() => { const s = document.querySelector('select[name=verdict]'); s.value = 'loop';"
            " s.dispatchEvent(new Event('change', {bubbles: true})); })()"
        )
        visible = await page.js(
            "[...document.querySelectorAll('#incidents tbody tr')].filter(r => !r.hidden)"
            ".map(r => r.dataset.verdict)"
        )
        assert visible == ["loop"]
        await page.js(
            "(() => { const s = document.querySelector('select[name=verdict]'); s.value = '';"
            " s.dispatchEvent(new Event('change', {bubbles: true})); })()"
        )
        await page.click("tr[data-request='flip'] a.incident-link", navigates=False)
        # The page follows the hash in its hashchange handler, which runs after the click.
        target = await page.wait_for(
            "location.hash.startsWith('#i-') && document.body.classList.contains('viewing')"
            " && location.hash"
        )
        assert (
            await page.js("getComputedStyle(document.getElementById('overview')).display") == "none"
        )
        shown = await page.js(f"document.getElementById({target[1:]!r}).offsetHeight")
        assert shown > 0
        note = await page.js(f"document.querySelector('#{target[1:]} #no-text').textContent")
        assert "Text not stored" in note
        assert await page.js(f"document.querySelectorAll('#{target[1:]} mark').length") == 0
        bars = await page.js(f"document.querySelectorAll('#{target[1:]} rect.topk-bar').length")
        assert bars > 2
    print(f"\nbrowser steps: {time.monotonic() - started:.2f} s")


async def test_a_browser_logs_in_with_the_admin_token_and_out(
    make_proxy: Any, emulator: EmulatorServer, tmp_path: Path
) -> None:
    """No bearer header this time: the browser gets the login page, the token pasted into it
    buys a session cookie, the explorer opens and stays open on reload, log-out ends it."""
    client = await make_proxy(emulator.url, env=env(store_text=True))
    await make_incidents(client)
    ui = str(client.make_url("/detproxy/ui"))
    async with chromium(tmp_path / "profile") as page:
        await page.goto(f"{ui}?model=emulator-model")
        assert await page.js("location.pathname") == "/detproxy/login", "no login page"
        assert await page.js("document.querySelector('#login input[name=next]').value") == (
            "/detproxy/ui?model=emulator-model"
        )
        # a wrong token: the page again, saying so
        await page.type_into("#token", "not-the-token-0123456789")
        await page.click("#login button")
        error = await page.js("document.getElementById('error')?.textContent")
        assert error == "Wrong token.", f"after a wrong token the page said {error!r}"
        await page.type_into("#token", TOKEN)
        await page.click("#login button")
        assert await page.js("location.pathname + location.search") == (
            "/detproxy/ui?model=emulator-model"
        ), "login did not go back to where the browser was going"
        rows = await page.js("document.querySelectorAll('#incidents tbody tr').length")
        assert rows >= 3, f"the incident list has {rows} rows after login"
        cookies = (await page.send("Network.getCookies"))["cookies"]
        session = next(c for c in cookies if c["name"] == "detproxy_session")
        assert session["httpOnly"] and session["sameSite"] == "Strict"
        assert session["path"] == "/detproxy/" and TOKEN not in session["value"]
        assert "detproxy_session" not in await page.js("document.cookie")  # HttpOnly
        # a reload: still logged in
        await page.reload()
        assert await page.js("location.pathname") == "/detproxy/ui"
        assert await page.js("document.querySelectorAll('#incidents tbody tr').length") == rows
        # the JSON and the metrics open in the browser too (the page itself fetches nothing)
        await page.goto(str(client.make_url("/detproxy/incidents")))
        listed = json.loads(await page.js("document.body.innerText"))
        assert len(listed) == rows, f"the incidents JSON in the browser: {listed!r:.200}"
        await page.goto(str(client.make_url("/detproxy/metrics")))
        assert "detproxy_requests_total" in await page.js("document.body.innerText")
        await page.goto(ui)
        # log out: back to the login page, and the explorer asks again
        await page.click("#logout button")
        assert await page.js("location.pathname") == "/detproxy/login", "log-out went elsewhere"
        await page.goto(ui)
        assert await page.js("location.pathname") == "/detproxy/login", "still logged in"


async def test_no_chart_label_is_cut_off_at_the_left(tmp_path: Path) -> None:
    """A rate of 100% by requests in flight: its label ``100.00%`` is drawn inside the chart."""
    log = tmp_path / "incidents.jsonl"
    line = {
        "kind": "tally",
        "process": "p1",
        "started": 1_700_000_000.0,
        "ts": 1_700_000_060.0,
        "audits": {"m": {"full": {"text_divergence": 3}}},
        "audits_by_inflight": {"m": {"1": {"text_divergence": 3}}},
        "loops": {},
        "policy_actions": {},
        "shadows_dropped": {},
    }
    log.write_text(json.dumps(line) + "\n")
    out = tmp_path / "report.html"
    assert report_main(["--html", str(out), str(log)]) == 0
    async with chromium(tmp_path / "profile") as page:
        await page.goto(out.as_uri())
        boxes = await page.js(
            "[...document.querySelectorAll('svg.chart text.tick')]"
            ".map(t => [t.textContent, t.getBBox().x])"
        )
        assert ["100.00%"] in [[text] for text, _ in boxes], boxes
        cut = [(text, x) for text, x in boxes if x < 0]
        assert cut == [], f"labels drawn left of their chart: {cut}"
