"""The event loop ``detproxy serve`` runs on (``server.event_loop``).

``auto`` takes uvloop where it can be imported (a faster loop in C, on libuv), else asyncio's
own; ``uvloop`` insists on it; ``asyncio`` never uses it.
"""

from __future__ import annotations

import asyncio
import sys

from proxy.config import ConfigError


def new_event_loop(choice: str) -> asyncio.AbstractEventLoop:
    """A fresh loop of the configured kind; a ``ConfigError`` if uvloop is asked for and absent."""
    if choice != "asyncio":
        try:
            import uvloop
        except ImportError as exc:
            if choice == "uvloop":
                raise ConfigError(
                    f'server.event_loop is "uvloop" but uvloop cannot be imported ({exc}); '
                    'install it (pip install uvloop) or choose "auto" or "asyncio"'
                ) from None
        else:
            return uvloop.new_event_loop()
    # asyncio's own loop, whatever event loop policy someone installed (uvloop.install()).
    if sys.platform == "win32":
        return asyncio.ProactorEventLoop()
    return asyncio.SelectorEventLoop()


def loop_name(loop: asyncio.AbstractEventLoop) -> str:
    """``uvloop`` or ``asyncio`` (the package the loop's class comes from)."""
    return type(loop).__module__.partition(".")[0]
