"""The clients' salts the server sent: new once, in one process or across its workers."""

from __future__ import annotations

from pathlib import Path

from proxy.audit.salts import SaltsSeen, SharedSalts, salts_seen


def test_a_salt_is_new_once() -> None:
    seen = SaltsSeen()
    assert seen.first_use("tenant-a") and seen.first_use("tenant-b")
    assert not seen.first_use("tenant-a") and not seen.first_use("tenant-b")


def test_the_least_recently_sent_salt_is_forgotten_first() -> None:
    seen = SaltsSeen(capacity=2)
    assert seen.first_use("a") and seen.first_use("b")
    assert not seen.first_use("a")  # a is now the most recent
    assert seen.first_use("c")  # b goes
    assert not seen.first_use("a") and seen.first_use("b")


def test_a_salt_another_worker_sent_is_not_new(tmp_path: Path) -> None:
    path = str(tmp_path / "salts.bin")
    one, two = SaltsSeen(shared=SharedSalts(path)), SaltsSeen(shared=SharedSalts(path))
    try:
        assert one.first_use("tenant-a")
        assert not two.first_use("tenant-a"), "worker two took worker one's salt for new"
        assert two.first_use("tenant-b") and not one.first_use("tenant-b")
        assert not one.first_use("tenant-a")  # its own, remembered without the table too
    finally:
        one.close()
        two.close()


def test_a_slot_keeps_the_last_salt_that_hashed_to_it(tmp_path: Path) -> None:
    table = SharedSalts(str(tmp_path / "salts.bin"), slots=1)
    try:
        assert table.first_use(3) and not table.first_use(3)
        assert table.first_use(5)  # the one slot now holds 5
        assert table.first_use(3), "a slot remembers one salt"
    finally:
        table.close()


def test_one_process_in_memory_several_share_a_table_or_say_nothing(tmp_path: Path) -> None:
    alone = salts_seen(1, str(tmp_path))
    assert alone is not None and alone.first_use("x") and not (tmp_path / "salts.bin").exists()
    shared = salts_seen(3, str(tmp_path))
    assert shared is not None and (tmp_path / "salts.bin").exists()
    shared.close()
    assert salts_seen(3, None) is None, "several workers with no shared table: no salt is new"
