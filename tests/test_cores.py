"""The cores ``detproxy serve`` starts a worker per, read from fake cgroup files."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.cores import affinity_count, cgroup_quota, usable_cores


def v2(root: Path, text: str) -> Path:
    (root / "cpu.max").write_text(text + "\n")
    return root


def v1(root: Path, quota: str, period: str, folder: str = "cpu") -> Path:
    where = root / folder
    where.mkdir(parents=True, exist_ok=True)
    (where / "cpu.cfs_quota_us").write_text(quota + "\n")
    (where / "cpu.cfs_period_us").write_text(period + "\n")
    return root


@pytest.mark.parametrize(
    ("text", "cores"),
    [
        ("max 100000", None),  # no limit
        ("200000 100000", 2.0),
        ("150000 100000", 1.5),
        ("50000 100000", 0.5),
        ("garbage", None),
        ("0 100000", None),
    ],
)
def test_cgroup_v2_quota(tmp_path: Path, text: str, cores: float | None) -> None:
    assert cgroup_quota(v2(tmp_path, text)) == cores


@pytest.mark.parametrize(
    ("quota", "period", "folder", "cores"),
    [
        ("-1", "100000", "cpu", None),  # no limit
        ("300000", "100000", "cpu", 3.0),
        ("250000", "100000", "cpu,cpuacct", 2.5),
        ("100000", "100000", ".", 1.0),
    ],
)
def test_cgroup_v1_quota(
    tmp_path: Path, quota: str, period: str, folder: str, cores: float | None
) -> None:
    assert cgroup_quota(v1(tmp_path, quota, period, folder)) == cores


def test_no_cgroup_files_is_no_quota(tmp_path: Path) -> None:
    assert cgroup_quota(tmp_path) is None
    assert cgroup_quota(tmp_path / "absent") is None


@pytest.mark.parametrize(
    ("quota", "cpus", "workers"),
    [
        ("max 100000", 8, 8),  # no quota: every CPU it may run on
        ("200000 100000", 8, 2),  # a pod's limits.cpu: 2
        ("150000 100000", 8, 2),  # 1.5 cores rounded up
        ("50000 100000", 8, 1),  # half a core: still one
        ("800000 100000", 4, 4),  # a quota above the CPUs it may use: the CPUs
        ("100000000 100000", 1, 1),
    ],
)
def test_usable_cores_is_the_quota_rounded_up_within_the_affinity(
    tmp_path: Path, quota: str, cpus: int, workers: int
) -> None:
    assert usable_cores(v2(tmp_path, quota), cpus=cpus) == workers


def test_usable_cores_without_a_cgroup_is_the_affinity(tmp_path: Path) -> None:
    assert usable_cores(tmp_path, cpus=3) == 3
    assert usable_cores(tmp_path) == affinity_count() >= 1
