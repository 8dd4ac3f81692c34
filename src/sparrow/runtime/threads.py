"""How many threads torch computes with: never more than the CPUs this process may run on.

torch starts with one intra-op thread per core it sees, and it sees the machine's cores, not the process's share: in
a container limited to 2 CPUs on a 64-core host (a cgroup `cpu.max` quota), or under `taskset` (the scheduler
affinity), its threads outnumber the CPUs, and a parallel region waits for the threads that do not get one. The
default is therefore min(torch's own default, the CPUs available), where available is the affinity mask's size,
lowered to the cgroup quota (quota / period, rounded up: a fractional CPU still runs a thread part of each period)
where one is set, in this cgroup or an ancestor (cgroup v2), or in the v1 `cpu` controller. `--threads N` (the
`sparrow` command's option) sets N whatever these say.

The count is decided from these inputs only: a core busy with another process's work still counts (how busy the
cores are changes from moment to moment; a busy core was measured to slow speculative and plain decoding alike,
docs/reliability.md).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from sparrow.errors import UserError

CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class CpuBudget:
    """The CPUs this process may use, as the operating system says."""

    affinity: int  # CPUs in the scheduler affinity mask (os.cpu_count() where there is none)
    quota: float | None  # the tightest cgroup CPU quota, in CPUs (quota / period); None: no quota

    @property
    def cpus(self) -> int:
        """Whole CPUs available: the affinity, lowered to the quota rounded up; at least 1."""
        limit = self.affinity if self.quota is None else min(self.affinity, math.ceil(self.quota))
        return max(1, limit)


def affinity_cpus() -> int:
    """CPUs in this process's affinity mask (os.cpu_count() where the platform has none)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def parse_cpu_max(text: str) -> float | None:
    """cgroup v2 `cpu.max` ("max 100000", "150000 100000") -> CPUs (1.5), None where unlimited or unreadable."""
    fields = text.split()
    if len(fields) != 2 or fields[0] == "max":
        return None
    try:
        quota, period = int(fields[0]), int(fields[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def parse_cfs(quota: str, period: str) -> float | None:
    """cgroup v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us` -> CPUs, None where unlimited (-1) or unreadable."""
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def cgroup_quota(proc_cgroup: str, root: Path = CGROUP_ROOT) -> float | None:
    """The tightest CPU quota over this process's cgroup and its ancestors, in CPUs (None: none). `proc_cgroup`:
    the text of /proc/self/cgroup; `root`: where the cgroup file systems are mounted."""
    quotas = []
    for line in proc_cgroup.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if not path.startswith("/"):
            continue
        if hierarchy == "0" and controllers == "":  # v2: cpu.max in the cgroup and every ancestor
            directory = root / path.lstrip("/")
            for where in (directory, *directory.parents):
                text = _read(where / "cpu.max")
                if text is not None:
                    quotas.append(parse_cpu_max(text))
                if where == root:
                    break
        elif "cpu" in controllers.split(","):  # v1: the cpu controller, at its path or (a container) its root
            mount = root / controllers
            mount = mount if mount.is_dir() else root / "cpu"
            for where in (mount / path.lstrip("/"), mount):
                quota, period = _read(where / "cpu.cfs_quota_us"), _read(where / "cpu.cfs_period_us")
                if quota is not None and period is not None:
                    quotas.append(parse_cfs(quota, period))
                    break
    found = [q for q in quotas if q is not None]
    return min(found) if found else None


def cpu_budget() -> CpuBudget:
    """This process's CpuBudget, read from the operating system."""
    return CpuBudget(affinity=affinity_cpus(), quota=cgroup_quota(_read(Path("/proc/self/cgroup")) or ""))


def choose_threads(requested: int | None, default: int, budget: CpuBudget) -> int:
    """The intra-op thread count: `requested` (--threads) where given, else torch's `default` lowered to the
    budget's CPUs."""
    if requested is not None:
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
            raise UserError(f"--threads must be an integer >= 1, got {requested!r}")
        return requested
    return max(1, min(default, budget.cpus))


def set_threads(requested: int | None = None) -> int:
    """Set torch's intra-op threads as `choose_threads` decides (for this process); returns the count."""
    threads = choose_threads(requested, torch.get_num_threads(), cpu_budget())
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
    return threads
