"""``/detproxy/ui`` served live: the admin token rules, clear 400s, 404s, real incidents."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest

from proxy.tools.emulator import EmulatorConfig, EmulatorServer
from proxy.tools.report.cli import main as report_main
from tests.observe.ui.live import AUTH, env, make_incidents


@pytest.fixture
async def emulator() -> AsyncIterator[EmulatorServer]:
    async with EmulatorServer(EmulatorConfig()) as srv:
        yield srv


async def test_the_explorer_follows_the_admin_token_rules(
    make_proxy: Any, emulator: EmulatorServer
) -> None:
    client = await make_proxy(emulator.url, env=env(store_text=True))
    for path in ("/detproxy/ui", "/detproxy/ui/", "/detproxy/ui/incident/0123456789abcdef"):
        # a browser (nothing to show) is sent to the login page, saying where it was going
        resp = await client.get(path, allow_redirects=False)
        assert resp.status == 303, f"{path} without credentials answered {resp.status}"
        assert resp.headers["Location"] == "/detproxy/login?" + urlencode({"next": path})
        wrong = {"Authorization": "Bearer " + "x" * 24}
        assert (await client.get(path, headers=wrong)).status == 401
    resp = await client.get("/detproxy/ui", headers=AUTH)
    assert resp.status == 200 and resp.content_type == "text/html"
    nonce = re.search(r"'nonce-([^']+)'", resp.headers["Content-Security-Policy"])
    assert nonce is not None and f'<script nonce="{nonce.group(1)}">' in await resp.text()


@pytest.mark.parametrize(
    ("query", "says"),
    [
        ("verdict=nope", "bad query parameter verdict: verdict must be one of"),
        ("mode=x", "mode must be one of full, prefill, n_choices, duplicate"),
        ("limit=-1", "limit must be an integer from 1 to 10000"),
        ("fingerprint=zz", "fingerprint must be 1 to 64 lowercase hex digits"),
        ("color=red", "unknown query parameter &#x27;color&#x27;"),
        ("model=a&model=b", "model given more than once"),
    ],
)
async def test_bad_query_parameters_get_a_400_that_says_what_is_wrong(
    make_proxy: Any, emulator: EmulatorServer, query: str, says: str
) -> None:
    client = await make_proxy(emulator.url, env=env(store_text=False))
    resp = await client.get(f"/detproxy/ui?{query}", headers=AUTH)
    assert resp.status == 400 and resp.content_type == "text/html"
    assert says in await resp.text()


async def test_incident_pages_of_real_incidents_and_unknown_ids(
    make_proxy: Any, emulator: EmulatorServer
) -> None:
    client = await make_proxy(emulator.url, env=env(store_text=False))
    await make_incidents(client)
    page = await (await client.get("/detproxy/ui?verdict=logprob_drift", headers=AUTH)).text()
    links = re.findall(r'href="(/detproxy/ui/incident/[0-9a-f]{16})"', page)
    assert len(links) == 1
    drift = await (await client.get(links[0], headers=AUTH)).text()
    assert "logprob drift" in drift and 'id="no-text"' in drift and "<mark" not in drift
    missing = await client.get("/detproxy/ui/incident/0123456789abcdef", headers=AUTH)
    assert (
        missing.status == 404 and "no incident 0123456789abcdef in the ring" in await missing.text()
    )
    bad = await client.get("/detproxy/ui/incident/NOT-AN-ID", headers=AUTH)
    assert bad.status == 400 and "16 lowercase hex digits" in await bad.text()


async def test_report_html_is_one_file_that_needs_no_network(
    make_proxy: Any, emulator: EmulatorServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "incidents.jsonl"
    client = await make_proxy(
        emulator.url, env=env(store_text=True, DETPROXY_INCIDENTS__PATH=str(log))
    )
    await make_incidents(client)
    await client.close()
    out = tmp_path / "report.html"
    assert report_main(["--html", str(out), str(log)]) == 0
    assert "detproxy report" in capsys.readouterr().out  # the text report is still printed
    page = out.read_text()
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page)  # nothing fetched
    assert "<link" not in page and "@import" not in page
    assert page.count('<article class="incident-page"') == page.count('<tr data-id="')
    assert page.count('<mark class="div">') >= 2  # text stored: both sides marked
    assert 'class="chart timeline"' in page and 'class="chart inflight"' in page
    assert report_main(["--html", str(tmp_path / "no" / "such" / "dir.html"), str(log)]) == 2
    assert "cannot write" in capsys.readouterr().err
