"""Which event loop ``server.event_loop`` gives, with and without uvloop importable."""

from __future__ import annotations

import asyncio
import sys

import pytest
import uvloop

from proxy.config import ConfigError
from proxy.http.eventloop import loop_name, new_event_loop


def made(choice: str) -> type[asyncio.AbstractEventLoop]:
    loop = new_event_loop(choice)
    loop.close()
    return type(loop)


def test_each_choice_gives_its_loop() -> None:
    assert made("auto") is uvloop.Loop
    assert made("uvloop") is uvloop.Loop
    assert issubclass(made("asyncio"), asyncio.BaseEventLoop)  # uvloop's loop is not one


def test_without_uvloop_auto_falls_back_and_uvloop_is_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop now raises ImportError
    assert issubclass(made("auto"), asyncio.BaseEventLoop)
    with pytest.raises(ConfigError, match=r'server\.event_loop is "uvloop".*pip install uvloop'):
        new_event_loop("uvloop")


def test_loop_names() -> None:
    for choice, name in (("uvloop", "uvloop"), ("asyncio", "asyncio")):
        loop = new_event_loop(choice)
        try:
            assert loop_name(loop) == name
        finally:
            loop.close()


def test_asyncio_is_asyncio_even_under_a_uvloop_policy() -> None:
    policy = asyncio.get_event_loop_policy()
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    try:
        assert made("asyncio") is asyncio.SelectorEventLoop
    finally:
        asyncio.set_event_loop_policy(policy)
