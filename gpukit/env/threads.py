"""How many CPU threads to compute and time with: the CPUs this process may use, the load, and the rule."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path


def usable_cpus(cgroup_root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")) -> int:
    """CPUs this process may run on: its CPU affinity, capped by its cgroup v2 CPU quota (a container's, a systemd
    unit's), read from `cpu.max` in this process's own cgroup (the "0::" line of `proc_cgroup`), else the root's."""
    count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        own = re.search(r"^0::(.*)$", proc_cgroup.read_text(), re.MULTILINE)
    except OSError:
        own = None  # not Linux
    candidates = [cgroup_root / own[1].strip("/") / "cpu.max"] if own else []
    for file in [*candidates, cgroup_root / "cpu.max"]:
        try:
            quota, period = file.read_text().split()[:2]  # "max 100000" (no limit) or "200000 100000" (2 CPUs)
            cap = count if quota == "max" else max(1, -(-int(quota) // int(period)))  # round up: 1.5 CPUs → 2
        except (OSError, ValueError):
            continue  # no such file (no cgroup v2 here, or the root cgroup, which has none) or not a quota
        return min(count, cap)
    return count


def cpu_load() -> float | None:
    """The 1-minute load average (runnable processes, ours included), or None where the OS has none (Windows)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def cpu_threads(usable: int, load: float | None, default: int) -> tuple[int, str]:
    """The intra-op threads to run and time CPU work with, from `usable` CPUs, the `load` average and torch's
    `default` thread count; with the reason, in words a learner can act on.

    torch's CPU kernels run on OpenMP threads that spin while they wait for each other. When any one of them loses
    its core to another program, the others spin until it comes back, so a step can take many times longer: a small
    GPT's training step took 63 ms on 1 thread and 1,204 ms on 2 (medians of 8, interleaved) on a 2-core machine at
    load 3. One thread per core that nobody else uses is the safe choice: on at most 2 CPUs that is 1 (a notebook's
    own server, a browser or a shared job takes the other), and on a loaded machine every core the load occupies is
    left free. An idle machine with more cores keeps torch's default.
    """
    if usable <= 2:
        return 1, (
            f"{usable} usable CPU(s): more than one thread spins whenever another program takes a core (a small "
            "GPT's step took 19-32x as long on 2 threads as on 1 on busy 2-core machines)"
        )
    busy = 0 if load is None else math.ceil(load - 0.5)  # cores other programs keep busy (the load rounded)
    if busy >= 1:
        threads = max(1, min(default, usable - busy))
        if threads < default:
            return threads, (
                f"load {load:.1f} on {usable} usable CPUs: other programs keep about {busy} core(s) busy, and "
                "threads that lose their core make the others spin"
            )
    return min(default, usable), f"{usable} usable CPUs, load {'unknown' if load is None else f'{load:.1f}'}"
