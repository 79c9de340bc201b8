"""What this machine's hardware offers the engine (probed once per process)."""

from __future__ import annotations

import functools
import os
import time


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (``avx2``, ``avx512_bf16`` …); empty where
    that file cannot be read (not Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_has_native_bf16() -> bool:
    """True when the CPU multiplies bfloat16 matrices natively (``avx512_bf16`` or ``amx_bf16``).

    On such CPUs a bfloat16 forward over a verify block of 8 tokens costs little more than
    one token, while a float32 one costs about 1.7× (docs/engine.md).
    """
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def available_memory_bytes() -> int | None:
    """Memory this process can still allocate on the host: ``MemAvailable``, capped by a cgroup v2
    limit (containers) when one is set; None when neither can be read."""
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read().strip())
        if limit != "max":
            headroom = max(0, int(limit) - used)
            available = headroom if available is None else min(available, headroom)
    except (OSError, ValueError):
        pass
    if available is None:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError):
            return None
    return available


def available_cpus(cgroup_root: str = "/sys/fs/cgroup") -> int:
    """CPUs this process may use: its affinity mask, capped by a cgroup v2 CPU quota (``cpu.max``,
    rounded up) when one is set, e.g. a Kubernetes CPU limit. At least 1.

    torch's default thread count is the machine's core count, which ignores both: in a container
    limited to 2 CPUs on a 64-core node it would start 64 threads and be throttled.
    """
    try:
        count = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        count = os.cpu_count() or 1
    try:
        with open(os.path.join(cgroup_root, "cpu.max")) as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            count = min(count, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return max(1, count)


def configure_threads(num_threads: int | None) -> int:
    """Set torch's intra-op CPU threads: ``num_threads`` when given, else at most
    :func:`available_cpus` (torch's own default counts every core of the machine).

    Returns:
        The thread count in effect.
    """
    import torch

    if num_threads:
        torch.set_num_threads(num_threads)
    else:
        usable = available_cpus()
        if torch.get_num_threads() > usable:
            torch.set_num_threads(usable)
    return torch.get_num_threads()


class CpuLoad:
    """Cores that other processes keep busy on this process's CPUs, between two reads.

    From ``/proc/stat``: busy time (user, nice, system, irq, softirq, steal) of the CPUs in this
    process's affinity mask, less this process's own CPU time (and that of the processes given to
    :meth:`exclude`). Steal counts as others' work (a
    hypervisor running other machines on our cores). Linux only; :meth:`others` returns None
    where ``/proc/stat`` cannot be read.

    Args:
        stat_path: the file to read (a stand-in in tests).

    Attributes:
        num_cpus: the CPUs watched (this process's affinity).
    """

    def __init__(self, stat_path: str = "/proc/stat") -> None:
        self.stat_path = stat_path
        try:
            self.cpus = {f"cpu{index}" for index in os.sched_getaffinity(0)}
        except (AttributeError, OSError):
            self.cpus = set()
        self.num_cpus = len(self.cpus) or (os.cpu_count() or 1)
        self._ticks_per_second = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._excluded: dict[int, float] = {}  # pid → its CPU-seconds at the last read
        self._previous = self._sample()

    def exclude(self, pid: int) -> None:
        """Count process ``pid``'s CPU time (and its reaped children's) as this process's own from now
        on: a helper that runs only on otherwise idle cores (the background compile worker) is not a
        neighbour to make room for. After it exits its last reading stays counted."""
        self._excluded[pid] = self._process_seconds(pid) or 0.0

    def _process_seconds(self, pid: int) -> float | None:
        """utime + stime + cutime + cstime of ``pid`` from ``/proc/<pid>/stat``, or None."""
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            return None
        return sum(int(v) for v in fields[11:15]) / self._ticks_per_second

    def _sample(self) -> tuple[float, float, float] | None:
        """(wall seconds, busy CPU-seconds of our CPUs, this process's CPU-seconds), or None."""
        try:
            with open(self.stat_path) as f:
                lines = f.readlines()
        except OSError:
            return None
        busy = 0
        for line in lines:
            name, _, rest = line.partition(" ")
            if name in self.cpus or (not self.cpus and name == "cpu"):
                fields = [int(v) for v in rest.split()]
                busy += fields[0] + fields[1] + fields[2] + sum(fields[5:8])  # user nice system · irq softirq steal
        times = os.times()
        own = times.user + times.system
        for pid, last in self._excluded.items():
            seconds = self._process_seconds(pid)
            if seconds is not None and seconds > last:
                self._excluded[pid] = last = seconds
            own += last
        return time.monotonic(), busy / self._ticks_per_second, own

    def others(self) -> float | None:
        """Cores used by other processes since the previous call (or construction): 0 … CPUs."""
        now = self._sample()
        previous, self._previous = self._previous, now
        if now is None or previous is None or now[0] <= previous[0]:
            return None
        wall = now[0] - previous[0]
        return max(0.0, ((now[1] - previous[1]) - (now[2] - previous[2])) / wall)
