"""How many cores this process may use: what ``detproxy serve`` starts a worker per.

The CPUs it may run on (``os.sched_getaffinity``: ``taskset``, a cpuset), bounded by its
cgroup's CPU quota where there is one (a Kubernetes pod's ``limits.cpu``, ``docker run
--cpus``), rounded up: a quota of 1.5 cores gets 2 workers, as Go's and the JVM's container
support count it. cgroup v2 says the quota in ``cpu.max`` ("<quota> <period>", or "max" for
none); v1 in ``cpu.cfs_quota_us`` and ``cpu.cfs_period_us`` (-1: none). Only the cgroup root
this process sees (a container's own namespace) is read; anything unreadable means no quota.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _positive(text: str) -> int | None:
    try:
        value = int(text)
    except ValueError:
        return None
    return value if value > 0 else None


def cgroup_quota(root: Path = CGROUP_ROOT) -> float | None:
    """The cgroup's CPU quota in cores (1.5: one and a half), or None where there is none or
    it cannot be read. v2 (``root/cpu.max``) first, then v1 (``root/cpu/`` or ``root/``
    ``cpu,cpuacct/``'s ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us``)."""
    v2 = _read(root / "cpu.max")
    if v2 is not None:
        parts = v2.split()
        if len(parts) != 2 or parts[0] == "max":
            return None
        quota, period = _positive(parts[0]), _positive(parts[1])
        return quota / period if quota is not None and period is not None else None
    for folder in (root / "cpu", root / "cpu,cpuacct", root):
        quota_text = _read(folder / "cpu.cfs_quota_us")
        period_text = _read(folder / "cpu.cfs_period_us")
        if quota_text is None or period_text is None:
            continue
        quota, period = _positive(quota_text), _positive(period_text)
        return quota / period if quota is not None and period is not None else None
    return None


def affinity_count() -> int:
    """The CPUs this process may run on (``os.cpu_count`` where affinity is not known)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def usable_cores(root: Path = CGROUP_ROOT, cpus: int | None = None) -> int:
    """One per core this process may use: ``cpus`` (its affinity, unless given) bounded by the
    cgroup's quota rounded up; at least 1."""
    count = affinity_count() if cpus is None else cpus
    quota = cgroup_quota(root)
    if quota is not None:
        count = min(count, math.ceil(quota - 1e-9))  # 2.0000000001 from a ratio is still 2
    return max(1, count)
