"""The login page a browser gets for the explorer when ``server.admin_token`` is set: one form
where the operator pastes the admin token (proxy/http/admin.py checks it and answers with a
session cookie). The explorer's look, no script at all."""

from __future__ import annotations

from proxy.observe.ui.page import CSS, LOGIN_PATH, esc

LOGIN_CSS = """
form.login{max-width:30em;display:flex;flex-direction:column;gap:8px;background:var(--panel);
padding:14px 16px;border-radius:6px;margin-top:12px}
form.login label{font-weight:600}
form.login input[type=password]{font:13px ui-monospace,monospace;padding:6px 8px;
border:1px solid var(--line);border-radius:4px}
form.login button{align-self:flex-start;padding:5px 14px;font-weight:600}
"""

# No script and nothing fetched: the page needs neither.
LOGIN_CSP = (
    "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; base-uri 'none';"
    " frame-ancestors 'none'"
)


def login_page(next_path: str, csrf: str, error: str | None = None) -> str:
    """``next_path``: where the browser goes once logged in (already checked to be local);
    ``csrf``: the form's token, bound to the login cookie that comes with the page."""
    note = f'<p class="note" id="error" role="alert">{esc(error)}</p>' if error else ""
    return (
        "<!doctype html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width,initial-scale=1">'
        f"<title>detproxy: log in</title><style>{CSS}{LOGIN_CSS}</style></head>"
        '<body class="live"><header class="top"><span>detproxy incidents</span>'
        '<span class="src">log in</span></header><main>'
        "<h1>Log in</h1>"
        f"{note}"
        f'<form class="login" id="login" method="post" action="{LOGIN_PATH}">'
        '<label for="token">Admin token</label>'
        '<input type="password" id="token" name="token" autocomplete="current-password"'
        " required autofocus>"
        f'<input type="hidden" name="next" value="{esc(next_path)}">'
        f'<input type="hidden" name="csrf" value="{esc(csrf)}">'
        '<button type="submit">Log in</button>'
        '<p class="small muted">The token is <code>server.admin_token</code> in detproxy\'s'
        " configuration (<code>DETPROXY_SERVER__ADMIN_TOKEN</code>). Scripts and Prometheus"
        " send it as <code>Authorization: Bearer</code> instead.</p>"
        "</form></main></body></html>\n"
    )
