"""The page shell: one HTML document with its own CSS and script inline (nothing fetched), a
nonce-bound Content-Security-Policy so that nothing but that script may run, and the links
between pages (a live server's paths, or anchors within one report file)."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from html import escape
from urllib.parse import quote, urlencode

UI_PATH = "/detproxy/ui"
LOGIN_PATH = "/detproxy/login"  # with server.admin_token: a browser's login (proxy/http/admin.py)
LOGOUT_PATH = "/detproxy/logout"

CSS = """
:root{--fg:#1d2125;--muted:#5c6670;--bg:#fff;--panel:#f5f6f8;--line:#d8dce0;--link:#0b5cad;
--identical:#4c9a2a;--logprob_drift:#d99a00;--text_divergence:#d9480f;
--answer_divergence:#a61e4d;--incomparable:#868e96;--loop:#6741d9;--upstream_change:#1c7ed6}
*{box-sizing:border-box}
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:var(--fg);
background:var(--bg);margin:0}
header.top{background:#22282e;color:#fff;padding:8px 18px;display:flex;gap:18px;align-items:center}
header.top a{color:#fff;text-decoration:none;font-weight:600}
header.top .src{color:#aab3bc;font-size:12px}
header.top form.logout{margin:0 0 0 auto}
header.top form.logout button{background:none;color:#fff;border:1px solid #6c7680;
border-radius:4px;padding:2px 10px;font:inherit;font-size:12px;cursor:pointer}
main{padding:12px 18px;max-width:1400px}
a{color:var(--link)}
h1{font-size:20px;margin:8px 0}h2{font-size:16px;margin:18px 0 6px}
h3{font-size:14px;margin:12px 0 4px}
.muted{color:var(--muted)}.small{font-size:12px}
.badge{display:inline-block;padding:1px 7px;border-radius:9px;color:#fff;font-size:12px;
font-weight:600;background:var(--incomparable)}
.b-identical{background:var(--identical)}.b-logprob_drift{background:var(--logprob_drift)}
.b-text_divergence{background:var(--text_divergence)}
.b-answer_divergence{background:var(--answer_divergence)}
.b-loop{background:var(--loop)}.b-upstream_change{background:var(--upstream_change)}
.b-engine_mismatch{background:#c92a2a}.b-upstream_restart{background:#4dabf7}
.cause{background:#495057}.c-intrinsic{background:#c92a2a}.c-batch{background:#d99a00}
.c-prefix_cache{background:#1098ad}.c-speculative{background:#7048e8}
.c-recipe_change{background:#1c7ed6}.c-untriaged{background:#adb5bd}
.model{border:1px solid var(--line);border-radius:6px;padding:6px 12px 10px;margin:12px 0}
.grid{display:grid;grid-template-columns:repeat(auto-fit,minmax(340px,1fr));gap:12px}
table{border-collapse:collapse;margin:4px 0}
th,td{border-bottom:1px solid var(--line);padding:3px 8px;text-align:left;vertical-align:top}
th{background:var(--panel);font-weight:600}
td.n{text-align:right;font-variant-numeric:tabular-nums}
table.facts th{width:15em;background:none;color:var(--muted);font-weight:normal}
#incidents td.sum{font-family:ui-monospace,monospace;font-size:12px;max-width:48em;
overflow-wrap:anywhere}
form.filters{display:flex;flex-wrap:wrap;gap:8px;align-items:end;background:var(--panel);
padding:8px;border-radius:6px}
form.filters label{display:flex;flex-direction:column;font-size:12px;color:var(--muted)}
.chart{width:100%;max-width:760px;height:auto;display:block}
.chart .axis{stroke:#888}.chart .tick{font-size:10px;fill:var(--muted)}
.chart .bar{fill:#8aa}.chart .rate{fill:none;stroke:#1d2125;stroke-width:1.5}
.chart .rate-dot{fill:#1d2125}
.v-logprob_drift{fill:var(--logprob_drift)!important}
.v-text_divergence{fill:var(--text_divergence)!important}
.v-answer_divergence{fill:var(--answer_divergence)!important}
.v-incomparable{fill:var(--incomparable)!important}
.chart .fp{stroke:#fff}.fp-0{fill:#d0ebff}.fp-1{fill:#ffe8cc}.fp-2{fill:#d3f9d8}.fp-3{fill:#f3d9fa}
.chart .fp-label{font:10px ui-monospace,monospace;fill:#333}
.chart .fp-change{stroke:var(--upstream_change);stroke-dasharray:4 3;stroke-width:1.5}
.chart .inflight-bar{fill:var(--text_divergence)}
.chart .topk-bar{fill:#9fb3c8}.chart .topk-bar.chosen{fill:var(--text_divergence)}
.chart .tok{font:12px ui-monospace,monospace;fill:var(--fg)}
.chart .before{fill:#e9ecef}.chart .u-0{fill:var(--loop)}.chart .u-1{fill:#9775fa}
.sides{display:grid;grid-template-columns:1fr 1fr;gap:10px}
pre.text{white-space:pre-wrap;overflow-wrap:anywhere;background:var(--panel);padding:8px;
border-radius:4px;margin:4px 0;font:12px/1.5 ui-monospace,monospace;max-height:32em;overflow:auto}
pre.common{color:var(--muted)}
mark.div{background:#ffd8a8;outline:2px solid var(--text_divergence);color:#000}
mark.unit{background:#e5dbff;border-right:2px solid var(--loop);color:#000}
.note{background:#fff9db;border-left:4px solid #fab005;padding:6px 10px;margin:8px 0}
.incident-page{display:block}
.report .incident-page{display:none;border-top:3px solid var(--line);margin-top:24px}
.report .incident-page:target{display:block}
body.viewing #overview{display:none}
"""

SCRIPT = """
(function(){
var d=document,now=Date.now()/1000;
function ago(s){s=Math.max(0,s);if(s<90)return Math.round(s)+' s ago';
if(s<5400)return Math.round(s/60)+' min ago';
if(s<172800)return Math.round(s/3600)+' h ago';return Math.round(s/86400)+' d ago';}
d.querySelectorAll('time[data-ts]').forEach(function(t){var a=ago(now-parseFloat(t.dataset.ts));
t.dataset.ago=a;t.title=a;});
var f=d.getElementById('filters');
function apply(){var want={};
f.querySelectorAll('select').forEach(function(s){if(s.value)want[s.name]=s.value;});
var lim=parseInt(f.elements.limit.value,10)||100,shown=0,match=0;
d.querySelectorAll('#incidents tbody tr').forEach(function(tr){
var ok=Object.keys(want).every(function(k){
var v=tr.dataset[k]||'';return k==='fingerprint'?v.indexOf(want[k])===0:v===want[k];});
if(ok)match++;var show=ok&&shown<lim;if(show)shown++;tr.hidden=!show;});
var c=d.getElementById('shown');if(c)c.textContent=shown+' shown of '+match+' matching';}
if(f){if(f.dataset.mode==='client'){f.addEventListener('change',apply);
f.addEventListener('submit',function(e){e.preventDefault();apply();});apply();}
else{var tidy=function(){f.querySelectorAll('select,input').forEach(function(e){
if(!e.value)e.disabled=true;});};f.addEventListener('submit',tidy);
f.querySelectorAll('select').forEach(function(s){s.addEventListener('change',function(){
tidy();f.submit();});});}}
function view(){d.body.classList.toggle('viewing',location.hash.indexOf('#i-')===0);}
if(d.body.classList.contains('report')){window.addEventListener('hashchange',view);view();}
var panes=d.querySelectorAll('.sides pre.text');
panes.forEach(function(p){p.addEventListener('scroll',function(){panes.forEach(function(q){
if(q!==p)q.scrollTop=p.scrollTop;});});});
d.body.dataset.ready='1';
})();
"""


def esc(value: object) -> str:
    """Text from clients and upstreams goes through here: it is never markup."""
    return escape(str(value), quote=True)


@dataclass(frozen=True, slots=True)
class Links:
    """Where the pages point: a live server's paths (``base``), or ``None``: anchors in one
    report file (the list filters in the page itself then). ``logout_csrf``: a browser logged
    in with a session cookie gets a log-out button, whose form carries this token."""

    base: str | None = UI_PATH
    logout_csrf: str | None = None

    @property
    def in_file(self) -> bool:
        return self.base is None

    def incident(self, incident_id: str) -> str:
        if self.base is None:
            return f"#i-{quote(incident_id)}"
        return f"{self.base}/incident/{quote(incident_id)}"

    def overview(self, query: dict[str, str] | None = None) -> str:
        if self.base is None:
            return "#"
        return self.base + ("?" + urlencode(query) if query else "")


def csp(nonce: str) -> str:
    return (
        "default-src 'none'; img-src data:; style-src 'unsafe-inline';"
        f" script-src 'nonce-{nonce}'; form-action 'self'; base-uri 'none'"
    )


def new_nonce() -> str:
    return secrets.token_urlsafe(16)


def document(title: str, body: str, nonce: str, source: str, links: Links) -> str:
    cls = "report" if links.in_file else "live"
    home = "#" if links.in_file else links.overview()
    logout = ""
    if links.logout_csrf is not None:
        logout = (
            f'<form class="logout" id="logout" method="post" action="{LOGOUT_PATH}">'
            f'<input type="hidden" name="csrf" value="{esc(links.logout_csrf)}">'
            '<button type="submit">Log out</button></form>'
        )
    return (
        "<!doctype html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{esc(csp(nonce))}">'
        '<meta name="viewport" content="width=device-width,initial-scale=1">'
        f"<title>{esc(title)}</title><style>{CSS}</style></head>"
        f'<body class="{cls}"><header class="top"><a href="{esc(home)}">detproxy incidents</a>'
        f'<span class="src">{esc(source)}</span>{logout}</header><main>{body}</main>'
        f'<script nonce="{esc(nonce)}">{SCRIPT}</script></body></html>\n'
    )
