"""An upstream that is detproxy itself, refused.

Pointed at its own port, detproxy would forward each request to itself, which forwards it
again, until a thousand connections hang. Two layers stop it:

- at start, where the addresses say so (``points_back``): the upstream's host is an address
  literal or ``localhost`` (a name is not resolved: that would wait on DNS) that reaches one
  of detproxy's listeners, on its port; one line, exit 2;
- at run time, for what addresses do not show (a host name, a chain through another proxy,
  ``--workers``): every request detproxy sends upstream carries ``X-Detproxy-Via: <id>``, the
  id of the server that sent it (its workers share it), and a request that comes back with
  that id is answered 508 Loop Detected at once (``came_back``), never forwarded.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Mapping, Sequence

from yarl import URL

from proxy.config import SERVER_ID_ENV, Settings
from proxy.http.clientside import ClientSide
from proxy.http.headers import VIA
from proxy.redact import mask_url

_VIA_LOWER = VIA.lower()
VIA_NAME = _VIA_LOWER.encode()
LOOP_STATUS = 508
LOOP_MESSAGE = (
    "the upstream points back at detproxy: this request came back to the detproxy that sent it"
    " (its upstream.url is its own address, or leads back to it through another proxy), so it"
    " was not forwarded again; point upstream.url at the engine"
)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
_LOOPBACK: tuple[IPAddress, IPAddress] = (
    ipaddress.IPv4Address("127.0.0.1"),
    ipaddress.IPv6Address("::1"),
)


# ---------------------------------------------------------------------------------------------
# The server's id


def new_server_id() -> str:
    return os.urandom(8).hex()


def server_id(worker: int | None, env: Mapping[str, str]) -> str:
    """A worker's id is its supervisor's (``SERVER_ID_ENV``): a request one worker sends that
    another receives is the server's own. Anyone else mints one (an inherited variable would
    make two servers one)."""
    given = env.get(SERVER_ID_ENV, "") if worker is not None else ""
    return given or new_server_id()


def came_back(client: ClientSide, own: str) -> bool:
    """Whether the request carries ``own`` among its ``X-Detproxy-Via`` ids: this server sent
    it. Ids of other detproxies (one in front of this one) are passed on with the request."""
    for name, value in client.headers.items():  # every field of the name, repeats included
        if name.lower() == _VIA_LOWER and own in _ids(value):
            return True
    return False


def _ids(value: str) -> list[str]:
    return [part.strip() for part in value.split(",")]


# ---------------------------------------------------------------------------------------------
# At start


def points_back(settings: Settings, listening: Sequence[tuple[str, int]]) -> str | None:
    """Why an upstream (``upstream.url``, ``audit.reference_url``) is one of detproxy's own
    listeners (``(address, port)`` as bound), in one line; None when none is."""
    targets = [("upstream.url", settings.upstream.url)]
    if settings.audit.reference_url:
        targets.append(("audit.reference_url", settings.audit.reference_url))
    for field, url in targets:
        for host, port in listening:
            if _reaches(URL(url), host, port):
                return (
                    f"{field} {mask_url(url)} is detproxy's own address (it listens on"
                    f" {_hostport(host, port)}): every request would come back to it; point"
                    f" {field} at the engine's own address and port"
                )
    return None


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _reaches(url: URL, host: str, port: int) -> bool:
    if url.port != port:
        return False
    try:
        listener = ipaddress.ip_address(host)
    except ValueError:  # a bound socket's address is always a literal; be safe
        return False
    return any(_lands_on(address, listener) for address in _known_addresses(url.host or ""))


def _known_addresses(host: str) -> list[IPAddress]:
    """What a host is known to be without asking DNS: an address literal, or localhost (which
    is always the loopback, RFC 6761)."""
    if host == "localhost" or host.endswith(".localhost"):
        return list(_LOOPBACK)
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return []
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return [address.ipv4_mapped]
    return [address]


def _lands_on(address: IPAddress, listener: IPAddress) -> bool:
    """Whether a connection to ``address`` reaches a socket bound to ``listener`` (the ports
    being equal)."""
    if address.is_unspecified:  # connecting to 0.0.0.0 (::) reaches this host's loopback
        address = _LOOPBACK[0 if address.version == 4 else 1]
    if not listener.is_unspecified:
        return address == listener
    if listener.version == 4 and address.version == 6:
        return False  # 0.0.0.0 takes IPv4 only; :: takes both (dual stack, Linux's default)
    return _is_own(address)


def _is_own(address: IPAddress) -> bool:
    """An address of this machine: the loopback, or one a socket can bind (no packet sent)."""
    if address.is_loopback:
        return True
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.bind((str(address), 0))
    except OSError:
        return False
    return True
