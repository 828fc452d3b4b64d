"""How many cores this process may keep busy: its CPU affinity (taskset, a cpuset), capped by a
cgroup CPU quota (a Kubernetes CPU limit), rounded up.

A pod limited to 2 CPUs on a 64-core node sees 64 cores in `os.cpu_count()` and in its
affinity; 64 threads under a 2-CPU quota spend most of each 100 ms period throttled, and a
step waits for its slowest thread. Thread defaults start from this count instead.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")  # cgroup v2's mount; v1's cpu controller under cpu/
PROC_CGROUP = Path("/proc/self/cgroup")


@dataclass(frozen=True)
class Cores:
    count: int  # at least 1
    source: str  # what decided it, for the start-up log


def affinity_cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:  # absent, or not readable in this container
        return None


def own_cgroups(proc_cgroup: Path = PROC_CGROUP) -> tuple[str | None, str | None]:
    """This process's cgroup v2 path and cgroup v1 cpu-controller path, where it has them."""
    v2 = v1 = None
    for line in (_read(proc_cgroup) or "").splitlines():
        if line.count(":") < 2:
            continue
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0" and not controllers:
            v2 = path
        elif "cpu" in controllers.split(","):
            v1 = path
    return v2, v1


def _up_to(root: Path, path: str | None) -> list[Path]:
    """The cgroup's folder and each above it up to the mount, those that exist: without a
    cgroup namespace the path names the host's tree, which a container sees at its root."""
    folder = root / (path or "/").lstrip("/")
    return [f for f in (folder, *folder.parents) if f.is_relative_to(root) and f.is_dir()]


def _cpus(quota: str | None, period: str | None) -> float | None:
    """quota / period in CPUs; None for no quota ("max", -1) or text that is not one"""
    try:
        cpus = int(quota or "") / int(period or "")
    except (ValueError, ZeroDivisionError):
        return None
    return cpus if cpus > 0 else None


def _v2_quota(folder: Path) -> float | None:
    quota, _, period = (_read(folder / "cpu.max") or "max").partition(" ")
    return _cpus(quota, period)


def _v1_quota(folder: Path) -> float | None:
    return _cpus(_read(folder / "cpu.cfs_quota_us"), _read(folder / "cpu.cfs_period_us"))


def quota_cpus(root: Path = CGROUP_ROOT,
               proc_cgroup: Path = PROC_CGROUP) -> tuple[float, str] | None:
    """The tightest CPU quota on this process's cgroup or any above it, in CPUs, and the file
    it came from; None where there is none (cgroup v2 first, then v1's cpu controller)."""
    v2, v1 = own_cgroups(proc_cgroup)
    found = [(q, str(f / "cpu.max")) for f in _up_to(root, v2)
             if (q := _v2_quota(f)) is not None]
    if not found:
        found = [(q, str(f / "cpu.cfs_quota_us")) for f in _up_to(root / "cpu", v1)
                 if (q := _v1_quota(f)) is not None]
    return min(found) if found else None


def usable_cores() -> Cores:
    affinity = affinity_cores()
    quota = quota_cpus()
    if quota is None or math.ceil(quota[0]) >= affinity:
        return Cores(affinity, "CPU affinity")
    cpus, source = quota
    return Cores(max(1, math.ceil(cpus)), f"CPU quota {cpus:g} in {source}")
