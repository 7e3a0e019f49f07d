"""Intra-op threads that follow the cores other processes leave free.

torch's CPU kernels split each op over its threads and wait for the slowest at the op's end.
When another process takes one of our cores, the thread on it is descheduled for whole time
slices and every op waits for it: a stolen core costs more than a core (docs/benchmarks.md,
the neighbour bench). So the engine watches, at step boundaries, how much of the cores it may
run on (its affinity) the rest of the machine used over the last window: the busy time of
those CPUs in /proc/stat (a hypervisor's steal included) less this process's own CPU time.
It runs on the cores that are left, rounded, never fewer than one thread nor more than it
started with, and returns to full width once they come back. A change waits for `confirm`
windows that agree, so one burst does not make it flap.

Only where the thread count is the engine's own to choose: `num_threads` set (or a pool
worker's share) is an override and is never touched, and tensor-parallel ranks each own a
share of the cores, which would count each other as neighbours.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import torch

from lockgate.engine.stats import ThreadStats

logger = logging.getLogger(__name__)

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def affinity_cpus() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def cpus_busy_s(cpus: set[int], path: str = "/proc/stat") -> float | None:
    """Seconds the given CPUs have spent busy since boot (all but idle and iowait; steal
    counts as busy: a hypervisor's neighbour takes the core as surely as a process does).
    None where /proc/stat cannot be read or names none of them."""
    try:
        with open(path) as f:
            lines = f.readlines()
    except OSError:
        return None
    busy, seen = 0, False
    for line in lines:
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu":
            continue
        if not name[3:].isdigit() or int(name[3:]) not in cpus:
            continue
        fields = [int(x) for x in rest.split()]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        busy += sum(fields) - idle
        seen = True
    return busy / _CLK_TCK if seen else None


# processes whose CPU time counts as this one's: an engine process's server (engine/process_child.py),
# whose HTTP loop would be this process's own work were the engine in it, not a neighbour's
partner_pids: set[int] = set()


def own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system + sum(pid_cpu_s(pid) for pid in partner_pids)


def pid_cpu_s(pid: int) -> float:
    """Another process's CPU seconds (user + system) from /proc; 0 where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / _CLK_TCK
    except (OSError, ValueError, IndexError):
        return 0.0


class ThreadGovernor:
    """Sets torch's intra-op thread count at step boundaries from the free cores; `tick()`
    is cheap between windows (a clock read)."""

    def __init__(self, max_threads: int | None = None, *, enabled: bool = True, window_s: float = 0.5, confirm: int = 2,
                 cpus: set[int] | None = None,
                 read_busy: Callable[[], float | None] | None = None,
                 read_own: Callable[[], float] = own_cpu_s,
                 set_threads: Callable[[int], None] = torch.set_num_threads,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.enabled = enabled
        self.cpus = cpus if cpus is not None else affinity_cpus()
        self.max_threads = max(1, max_threads or torch.get_num_threads())
        self.threads = self.max_threads
        self.window_s, self.confirm = window_s, confirm
        self._read_busy = read_busy or (lambda: cpus_busy_s(self.cpus))
        self._read_own, self._set, self._clock = read_own, set_threads, clock
        self.others_cores = 0.0
        self.changes = 0
        self._pending: int | None = None
        self._votes = 0
        self._mark: tuple[float, float, float] | None = None

    def tick(self) -> int:
        """Called before a step: the thread count that step runs with."""
        if not self.enabled:
            return self.threads
        now = self._clock()
        if self._mark is not None and now - self._mark[0] < self.window_s:
            return self.threads
        busy = self._read_busy()
        if busy is None:              # nothing to read (not Linux): keep the width it has
            return self.threads
        own = self._read_own()
        if self._mark is not None:
            t0, busy0, own0 = self._mark
            self.others_cores = max(0.0, ((busy - busy0) - (own - own0)) / max(now - t0, 1e-9))
            self._vote(self.wanted())
        self._mark = (now, busy, own)
        return self.threads

    def wanted(self) -> int:
        free = len(self.cpus) - self.others_cores
        return max(1, min(self.max_threads, int(free + 0.5)))

    def _vote(self, want: int) -> None:
        if want == self.threads:
            self._pending, self._votes = None, 0
            return
        self._votes = self._votes + 1 if want == self._pending else 1
        self._pending = want
        if self._votes >= self.confirm:
            logger.info("intra-op threads %d -> %d (other processes used %.2f of %d cores)",
                        self.threads, want, self.others_cores, len(self.cpus))
            self._set(want)
            self.threads, self.changes = want, self.changes + 1
            self._pending, self._votes = None, 0

    def stats(self) -> ThreadStats | None:
        if not self.enabled:
            return None
        return ThreadStats(self.threads, self.max_threads, round(self.others_cores, 3), self.changes)


_shared: ThreadGovernor | None = None


def governor_for(num_threads: int | None, tensor_parallel_size: int, device: torch.device) -> ThreadGovernor:
    """The process's governor (one for every engine in it: the thread count is the
    process's); a disabled one where the count is not the engine's to choose (`num_threads`
    set: that count, fixed). LOCKGATE_ADAPTIVE_THREADS=0 turns it off (the test suite does,
    so that numerics compared across runs never change width midway)."""
    global _shared
    if num_threads:
        torch.set_num_threads(num_threads)
    if num_threads or tensor_parallel_size > 1 or device.type != "cpu" \
            or os.environ.get("LOCKGATE_ADAPTIVE_THREADS", "1") == "0":
        return ThreadGovernor(enabled=False)
    if _shared is None:
        _shared = ThreadGovernor()
    return _shared
