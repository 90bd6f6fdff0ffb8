"""The auditor's passive checks: an in-process duplicate store is checked inline."""

from __future__ import annotations

import asyncio
from typing import Any

from proxy.audit.auditor import Auditor
from proxy.audit.outcome import outcome_from_response
from proxy.audit.store import ChoiceDigest, DuplicateStore, MemoryDuplicateStore
from proxy.classify import classify
from proxy.config import load_settings
from proxy.events import AuditCompleted, EventBus
from tests.helpers.answers import chat_body
from tests.helpers.waiting import eventually

BODY: dict[str, Any] = {
    "model": "m",
    "temperature": 0,
    "messages": [{"role": "user", "content": "hi"}],
}


class SlowStore:
    """A store that has to be awaited, as a shared one is (checked off the request path)."""

    def __init__(self) -> None:
        self._memory = MemoryDuplicateStore(60, 100)

    async def check_and_put(
        self, key: str, digests: tuple[ChoiceDigest, ...]
    ) -> tuple[ChoiceDigest, ...] | None:
        await asyncio.sleep(0)
        return self._memory.swap(key, digests)

    async def close(self) -> None:
        pass


def auditor_with(store: DuplicateStore) -> tuple[Auditor, list[AuditCompleted]]:
    settings = load_settings(env={}, flags={"upstream": "http://127.0.0.1:8000"})
    bus = EventBus()
    seen: list[AuditCompleted] = []
    bus.subscribe(AuditCompleted, seen.append)
    return Auditor(settings, bus, None, store, lambda: 1), seen


def answered(auditor: Auditor, text: str) -> None:
    view = classify("chat", BODY)
    ticket = auditor.plan(view, BODY, "r", "/v1/chat/completions", None)
    assert ticket is not None  # passive checks are on by default
    auditor.primary_done(ticket, outcome_from_response("chat", chat_body([], [(text, -0.5, [])])))


async def test_an_in_process_store_is_checked_before_primary_done_returns() -> None:
    auditor, seen = auditor_with(MemoryDuplicateStore(60, 100))
    answered(auditor, "same")
    assert seen == []
    answered(auditor, "other")  # the same request, another answer: no await in between
    duplicates = [e for e in seen if e.mode == "duplicate"]
    assert len(duplicates) == 1 and duplicates[0].verdict.verdict == "text_divergence"
    await auditor.close()


async def test_a_store_that_must_be_awaited_is_checked_off_the_request_path() -> None:
    auditor, seen = auditor_with(SlowStore())
    answered(auditor, "same")
    answered(auditor, "same")
    assert [e for e in seen if e.mode == "duplicate"] == []  # not yet: the checks are tasks
    duplicates = await eventually(
        lambda: [e for e in seen if e.mode == "duplicate"], what="the duplicate check's verdict"
    )
    assert len(duplicates) == 1 and duplicates[0].verdict.verdict == "identical"
    await auditor.close()


def salted(salt: str | None, temperature: float = 0) -> dict[str, Any]:
    body: dict[str, Any] = {**BODY, "temperature": temperature}
    if salt is not None:
        body["cache_salt"] = salt
    return body


def plan_of(auditor: Auditor, body: dict[str, Any]) -> Any:
    return auditor.plan(classify("chat", body), body, "r", "/v1/chat/completions", None)


async def test_a_clients_salt_never_sent_before_says_the_primary_ran_cold() -> None:
    auditor, _ = auditor_with(MemoryDuplicateStore(60, 100))
    assert plan_of(auditor, salted("tenant-1")).cold_salt is True
    assert plan_of(auditor, salted("tenant-1")).cold_salt is False  # its tenant is warm now
    assert plan_of(auditor, salted(None)).cold_salt is False  # no salt: not known
    # A sampled request (not audited) warms its tenant too.
    assert plan_of(auditor, salted("tenant-2", temperature=0.7)) is None
    assert plan_of(auditor, salted("tenant-2")).cold_salt is False
    await auditor.close()


async def test_with_several_workers_a_salt_says_nothing_of_the_cache() -> None:
    settings = load_settings(env={}, flags={"upstream": "http://127.0.0.1:8000", "workers": 2})
    auditor = Auditor(settings, EventBus(), None, MemoryDuplicateStore(60, 100), lambda: 1)
    assert (
        plan_of(auditor, salted("tenant-1")).cold_salt is False
    )  # another worker may have sent it
    await auditor.close()
