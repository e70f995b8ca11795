"""The CPUs this process may use, and so how many threads the engine runs (stdlib only: the API
process sizes the replicas' and shards' shares with it too).

`os.cpu_count()` is the machine's count. A process may use fewer: its affinity mask (`taskset`,
`docker --cpuset-cpus`, Kubernetes' static CPU manager) and its cgroup's CPU quota (`docker --cpus`,
Kubernetes' CPU limits: `cpu.max` in cgroup v2, `cpu.cfs_quota_us` / `cpu.cfs_period_us` in v1, the
smallest along the cgroup's path). Threads beyond the quota are throttled together, mid-step: the
quota is rounded down (at least 1). `--threads` (llama.cpp's `-t`) and `OMP_NUM_THREADS` override
the count (docs/deploy.md, "Threads")."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


@dataclass(frozen=True, slots=True)
class Cpus:
    """What limits this process: the affinity mask's CPUs, the cgroup quota in CPUs (None: none)."""

    affinity: int
    quota: float | None

    @property
    def usable(self) -> int:
        if self.quota is None:
            return self.affinity
        return max(1, min(self.affinity, math.floor(self.quota + 1e-9)))

    def describe(self) -> str:
        quota = "none" if self.quota is None else f"{self.quota:g} CPUs"
        return f"{self.affinity} CPUs in the affinity mask, cgroup quota {quota}"


def affinity_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # (not Linux)
        return os.cpu_count() or 1


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _v2_quota(directory: Path) -> float | None:
    text = _read(directory / "cpu.max")  # "max 100000" or "<quota> <period>"
    if not text:
        return None
    quota, _, period = text.partition(" ")
    if quota == "max":
        return None
    return int(quota) / int(period or 100_000)


def _v1_quota(directory: Path) -> float | None:
    quota, period = _read(directory / "cpu.cfs_quota_us"), _read(directory / "cpu.cfs_period_us")
    if not quota or not period or int(quota) <= 0:
        return None
    return int(quota) / int(period)


def _ancestors(root: Path, path: str) -> list[Path]:
    """The cgroup's directory under `root` and each above it, up to `root` (inside a container the
    process's path may not exist there: the root's own files are the container's)."""
    parts = [p for p in path.split("/") if p]
    dirs = [root.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]
    return [d for d in dirs if d.is_dir()]


def cgroup_quota(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> float | None:
    """The smallest CPU quota along this process's cgroup path (v2, else v1's cpu controller), in CPUs;
    None where there is none or no cgroup file can be read."""
    text = _read(proc_cgroup)
    if text is None:
        return None
    quotas: list[float] = []
    for line in text.splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2's unified hierarchy
            quotas += [q for d in _ancestors(root, path) if (q := _v2_quota(d)) is not None]
        elif "cpu" in controllers.split(","):  # v1: mounted as cpu,cpuacct (or cpu)
            for mount in (root / controllers, root / "cpu", root / "cpu,cpuacct"):
                if mount.is_dir():
                    quotas += [q for d in _ancestors(mount, path) if (q := _v1_quota(d)) is not None]
                    break
    return min(quotas) if quotas else None


def process_cpus(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> Cpus:
    return Cpus(affinity_cpus(), cgroup_quota(root, proc_cgroup))


def engine_threads(threads: int | None, sharing: int = 1, cpus: Cpus | None = None) -> int:
    """One engine process's threads: `threads` (--threads) if given, else OMP_NUM_THREADS if set, else
    the usable CPUs shared evenly by the `sharing` engines on this machine (ranks, replicas)."""
    if threads:
        return threads
    env = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    cpus = cpus or process_cpus()
    return max(1, cpus.usable // max(sharing, 1))
