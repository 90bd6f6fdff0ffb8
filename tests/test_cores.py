"""The cores ``detproxy serve`` starts a worker per, read from fake cgroup files."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.cores import affinity_count, cgroup_quota, own_cgroups, usable_cores

IN_A_CONTAINER = "0::/\n"  # /proc/self/cgroup in its own cgroup namespace
V1_CONTAINER = "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n"  # the host's paths


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
    assert cgroup_quota(v2(tmp_path, text), IN_A_CONTAINER) == cores


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
    assert cgroup_quota(v1(tmp_path, quota, period, folder), V1_CONTAINER) == cores


def test_no_cgroup_files_is_no_quota(tmp_path: Path) -> None:
    assert cgroup_quota(tmp_path, IN_A_CONTAINER) is None
    assert cgroup_quota(tmp_path / "absent", V1_CONTAINER) is None


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
    assert usable_cores(v2(tmp_path, quota), cpus=cpus, proc_cgroup=IN_A_CONTAINER) == workers


def test_usable_cores_without_a_cgroup_is_the_affinity(tmp_path: Path) -> None:
    assert usable_cores(tmp_path, cpus=3, proc_cgroup=IN_A_CONTAINER) == 3
    assert usable_cores(tmp_path) == affinity_count() >= 1


def unit(root: Path, path: str, cpu_max: str) -> None:
    folder = root / path
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "cpu.max").write_text(cpu_max + "\n")


def test_on_a_host_the_cgroup_proc_names_and_those_above_it(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("cpu memory\n")  # the unified root: no cpu.max
    unit(tmp_path, "system.slice", "max 100000")
    unit(tmp_path, "system.slice/detproxy.service", "150000 100000")  # CPUQuota=150%
    assert cgroup_quota(tmp_path, "0::/system.slice/detproxy.service\n") == 1.5
    unit(tmp_path, "system.slice", "100000 100000")  # a tighter slice above it: that one
    assert cgroup_quota(tmp_path, "0::/system.slice/detproxy.service\n") == 1.0
    assert cgroup_quota(tmp_path, "0::/user.slice\n") is None  # another cgroup, no limit


def test_own_cgroups_reads_v2_and_v1_lines() -> None:
    assert own_cgroups("0::/a/b\n") == ("/a/b", "/")
    assert own_cgroups(V1_CONTAINER) == ("/", "/docker/abc")
    assert own_cgroups("") == ("/", "/")


def test_v1_under_the_path_proc_names_where_it_is_mounted(tmp_path: Path) -> None:
    v1(tmp_path, "-1", "100000", "cpu/docker/abc")
    v1(tmp_path, "200000", "100000", "cpu/docker")  # above it: holds too
    assert cgroup_quota(tmp_path, "1:cpu:/docker/abc\n") == 2.0
