"""Triage's budget account: one process's in memory, a server's workers' in one ledger."""

from __future__ import annotations

from pathlib import Path

from proxy.attribution.account import LocalAccount, SharedAccount, triage_account
from proxy.config import AttributionConfig

CONFIG = AttributionConfig(max_per_minute=6.0, token_allowance=1000, max_token_share=0.1)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def workers(tmp_path: Path, n: int = 2) -> tuple[list[SharedAccount], Clock]:
    clock = Clock()
    path = str(tmp_path / "triage" / "ledger.json")
    return [SharedAccount(CONFIG, path, clock, worker=str(i)) for i in range(n)], clock


def test_one_process_paces_starts_and_holds_to_the_budget() -> None:
    account = LocalAccount(CONFIG)
    assert account.start(600, primary_tokens=0) is None
    assert account.start(100, primary_tokens=0) == "rate_limit", "6 a minute: one now"
    assert account.start(600, primary_tokens=0) == "token_budget", "1200 > 1000 allowed"
    assert account.budget(primary_tokens=5000) == 1500
    account.settle(-500)  # the replays cost 100 of the 600 reserved
    assert account.tokens() == 100


def test_the_workers_share_one_allowance(tmp_path: Path) -> None:
    (a, b), clock = workers(tmp_path)
    assert a.start(800, primary_tokens=0) is None
    clock.now += 60
    assert b.start(800, primary_tokens=0) == "token_budget", "1600 of one 1000-token allowance"
    a.settle(-700)  # a's replays cost 100
    assert b.tokens() == 100 and b.start(800, primary_tokens=0) is None
    assert a.tokens() == 900


def test_the_workers_share_one_pace(tmp_path: Path) -> None:
    (a, b), clock = workers(tmp_path)
    assert a.start(10, primary_tokens=0) is None
    assert b.start(10, primary_tokens=0) == "rate_limit", "6 a minute for the server"
    assert 9.9 < b.wait_s() <= 10.0
    clock.now += 10
    assert b.wait_s() == 0.0 and b.start(10, primary_tokens=0) is None
    assert a.start(10, primary_tokens=0) == "rate_limit"


def test_the_share_is_of_every_workers_primaries(tmp_path: Path) -> None:
    (a, b), clock = workers(tmp_path)
    assert a.start(10, primary_tokens=3000) is None
    clock.now += 60
    assert b.start(10, primary_tokens=2000) is None
    # 1000 + 0.1 x (3000 + 2000): each worker's own count, the latest it gave
    assert a.budget(primary_tokens=0) == 1500 and b.budget(primary_tokens=0) == 1500
    clock.now += 60
    assert a.start(1481, primary_tokens=3000) == "token_budget", "20 + 1481 > 1500"
    assert a.start(1481, primary_tokens=4000) is None, "its primaries grew: 1600 allowed"


def test_a_torn_ledger_starts_over(tmp_path: Path) -> None:
    (a,), _ = workers(tmp_path, 1)
    assert a.start(10, primary_tokens=0) is None
    (tmp_path / "triage" / "ledger.json").write_bytes(b'{"tokens": 1')  # a crash mid-write
    assert a.tokens() == 0 and a.start(10, primary_tokens=0) is None
    assert a.tokens() == 10


def test_one_process_keeps_it_in_memory_several_share_the_folder(tmp_path: Path) -> None:
    assert isinstance(triage_account(CONFIG, 1, str(tmp_path)), LocalAccount)
    assert isinstance(triage_account(CONFIG, 2, None), LocalAccount)
    assert isinstance(triage_account(CONFIG, 2, str(tmp_path)), SharedAccount)
