"""The login page and the explorer's log-out button, as HTML."""

from __future__ import annotations

from proxy.observe.ui.login import LOGIN_CSP, login_page
from proxy.observe.ui.page import Links, document


def test_the_login_page_is_a_form_with_nothing_to_run() -> None:
    evil = '/detproxy/ui?model="><script>window.__pwned=1</script>'
    page = login_page(evil, "CSRF-TOKEN", error="<b>Wrong</b> token.")
    assert '<form class="login" id="login" method="post" action="/detproxy/login">' in page
    assert '<input type="password" id="token" name="token"' in page
    assert '<input type="hidden" name="csrf" value="CSRF-TOKEN">' in page
    assert "<script" not in page, "markup in next= became a script"
    assert "&quot;&gt;&lt;script&gt;" in page  # shown as text in the field's value
    assert "&lt;b&gt;Wrong&lt;/b&gt; token." in page
    assert "script-src" not in LOGIN_CSP and "frame-ancestors 'none'" in LOGIN_CSP
    assert 'id="error"' not in login_page("/detproxy/ui", "t"), "an error shown without one"


def test_a_logged_in_browser_gets_a_log_out_button_and_a_report_file_none() -> None:
    page = document("t", "<p>body</p>", "N", "live", Links(logout_csrf='a"b'))
    assert '<form class="logout" id="logout" method="post" action="/detproxy/logout">' in page
    assert '<input type="hidden" name="csrf" value="a&quot;b">' in page
    for links in (Links(), Links(base=None)):
        assert 'id="logout"' not in document("t", "<p>body</p>", "N", "live", links)
