"""How many cores this process may use: what ``detproxy serve`` starts a worker per.

The CPUs it may run on (``os.sched_getaffinity``: ``taskset``, a cpuset), bounded by its
cgroup's CPU quota where there is one (a Kubernetes pod's ``limits.cpu``, ``docker run
--cpus``), rounded up: a quota of 1.5 cores gets 2 workers, as Go's and the JVM's container
support count it. cgroup v2 says the quota in ``cpu.max`` ("<quota> <period>", or "max" for
none); v1 in ``cpu.cfs_quota_us`` and ``cpu.cfs_period_us`` (-1: none). The cgroup is the one
``/proc/self/cgroup`` names (a systemd unit's ``CPUQuota=`` on a host) and those above it, or
the root a container sees (its own cgroup namespace); anything unreadable means no quota.
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


def own_cgroups(proc_cgroup: str) -> tuple[str, str]:
    """This process's cgroup paths from ``/proc/self/cgroup``'s text: the v2 one (``0::PATH``)
    and the v1 ``cpu`` controller's (``N:cpu,cpuacct:PATH``); "/" where not named."""
    v2 = v1 = "/"
    for line in proc_cgroup.splitlines():
        number, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if number == "0" and controllers == "":
            v2 = path or "/"
        elif "cpu" in controllers.split(","):
            v1 = path or "/"
    return v2, v1


def _up_from(base: Path, path: str) -> list[Path]:
    """``base``/``path`` and each folder above it, up to ``base``: a limit set on any of them
    holds for this process."""
    parts = [p for p in path.strip("/").split("/") if p and p != ".."]
    return [base.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]


def _v2_quota(folder: Path) -> float | None:
    text = _read(folder / "cpu.max")
    parts = text.split() if text is not None else []
    if len(parts) != 2 or parts[0] == "max":
        return None
    quota, period = _positive(parts[0]), _positive(parts[1])
    return quota / period if quota is not None and period is not None else None


def _v1_quota(folder: Path) -> float | None:
    quota_text = _read(folder / "cpu.cfs_quota_us")
    period_text = _read(folder / "cpu.cfs_period_us")
    if quota_text is None or period_text is None:
        return None
    quota, period = _positive(quota_text), _positive(period_text)  # -1: no limit
    return quota / period if quota is not None and period is not None else None


def _read_proc_cgroup() -> str:
    return _read(Path("/proc/self/cgroup")) or ""


def cgroup_quota(root: Path = CGROUP_ROOT, proc_cgroup: str | None = None) -> float | None:
    """The CPU quota in cores (1.5: one and a half) of this process's cgroup and those above
    it, the smallest one; None where there is none or it cannot be read. ``proc_cgroup``:
    ``/proc/self/cgroup``'s text (read when None), which names this process's cgroup below
    ``root`` (just "/" in a container with its own cgroup namespace). cgroup v2's ``cpu.max``
    where ``root`` has ``cgroup.controllers`` (the unified hierarchy), else v1's
    ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us`` in ``root/cpu`` (or ``cpu,cpuacct``)."""
    v2_path, v1_path = own_cgroups(_read_proc_cgroup() if proc_cgroup is None else proc_cgroup)
    found: list[float] = []
    if (root / "cgroup.controllers").exists() or (root / "cpu.max").exists():
        found = [q for f in _up_from(root, v2_path) if (q := _v2_quota(f)) is not None]
    else:
        for base in (root / "cpu", root / "cpu,cpuacct", root):
            # A v1 path names the host's hierarchy; a container mounts its own cgroup at base.
            folders = [f for f in _up_from(base, v1_path) if f.is_dir()] or [base]
            found = [q for f in folders if (q := _v1_quota(f)) is not None]
            if found:
                break
    return min(found) if found else None


def affinity_count() -> int:
    """The CPUs this process may run on (``os.cpu_count`` where affinity is not known)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def usable_cores(
    root: Path = CGROUP_ROOT, cpus: int | None = None, proc_cgroup: str | None = None
) -> int:
    """One per core this process may use: ``cpus`` (its affinity, unless given) bounded by the
    cgroup's quota rounded up; at least 1."""
    count = affinity_count() if cpus is None else cpus
    quota = cgroup_quota(root, proc_cgroup)
    if quota is not None:
        count = min(count, math.ceil(quota - 1e-9))  # 2.0000000001 from a ratio is still 2
    return max(1, count)
