"""The CPU time a container may use (its cgroup's quota), and the torch thread count it implies.

Why: in a Kubernetes pod without a cpuset, a process sees every core of the node, and torch
starts one OpenMP thread per core. Under a CPU limit of 2 on a 64-core node those 64 threads
share 2 CPUs' worth of quota: each parallel op waits at its barrier for threads the kernel has
throttled until the next period (100 ms by default), the known OpenMP-in-a-container stall. So a
worker told no thread count uses no more threads than its quota allows, rounded up (the chart
also passes the pod's CPU request, which covers pods with no limit). No torch here.
"""

from __future__ import annotations

import math
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _v2_limit(text: str | None) -> float | None:
    """cpu.max: "max 100000" (none) or "<quota> <period>" (microseconds)."""
    parts = (text or "").split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    try:
        quota, period = int(parts[0]), int(parts[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _v1_limit(folder: Path) -> float | None:
    """cpu.cfs_quota_us (-1: none) over cpu.cfs_period_us."""
    try:
        quota, period = int(_read(folder / "cpu.cfs_quota_us") or ""), int(_read(folder / "cpu.cfs_period_us") or "")
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def cgroup_cpu_limit(root: Path = CGROUP_ROOT, self_cgroup: Path = PROC_SELF_CGROUP) -> float | None:
    """CPUs' worth of time this process's cgroup may use (e.g. 2.0, 0.5), None where nothing limits it.

    cgroup v2: the tightest cpu.max from this process's cgroup up to the root (a container sees
    its own cgroup as the root; on a host the path comes from /proc/self/cgroup). v1: the cpu
    controller's quota at the mount's root, which is the container's cgroup.
    """
    if (root / "cgroup.controllers").exists():
        entry = next((line[3:] for line in (_read(self_cgroup) or "").splitlines() if line.startswith("0::")), "/")
        folder = root / entry.strip("/")
        limits = []
        while True:
            if (limit := _v2_limit(_read(folder / "cpu.max"))) is not None:
                limits.append(limit)
            if folder == root or root not in folder.parents:
                break
            folder = folder.parent
        return min(limits, default=None)
    for name in ("cpu", "cpu,cpuacct"):
        if (limit := _v1_limit(root / name)) is not None:
            return limit
    return None


def threads_for_quota(cores: int, limit: float | None) -> int | None:
    """The thread count a quota of `limit` CPUs implies on `cores` usable cores (its ceiling), or
    None where it would not cap them (no quota, or one as large as the cores)."""
    if limit is None:
        return None
    threads = max(1, math.ceil(limit - 1e-9))
    return threads if threads < cores else None
