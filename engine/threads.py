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

Cores left are not the whole story: a width's steps can wait on a thread the process's own
other work (an embedded server's HTTP loop, its client on the same machine) deschedules, and
small steps (a few sequences' decode) gain little from a second thread while paying its waits
at every op. So every so often the governor measures: `PROBE_PAIRS` steps alternating one
thread narrower and the width it has, and it keeps the narrower width while that step's median
time against its wider neighbour's is at most `NARROW_GAIN`; steps of a similar size follow
each other, so pairing them compares like with like. A probe ends after `PROBE_EARLY` pairs
whose narrow steps were all clearly slower (a full batch's), and one that confirms the choice
doubles the time to the next (up to `PROBE_MAX_S`), so a steady load pays for few probes.

Only where the thread count is the engine's own to choose: `num_threads` set (or a pool
worker's share) is an override and is never touched, and tensor-parallel ranks each own a
share of the cores, which would count each other as neighbours.
"""

from __future__ import annotations

import logging
import os
import threading
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


PROBE_PAIRS = 8            # steps at each width in one probe, alternating
PROBE_EARLY = 2            # pairs after which a probe whose narrow steps were all clearly slower ends
NARROW_GAIN = 0.95         # the narrower width is kept when its steps take at most this of the wider's
PROBE_FIRST_S, PROBE_MAX_S = 2.0, 64.0     # time to the first probe; the most between two


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
        self.base = self.max_threads      # the width the free cores give (`threads` may be one less)
        self.narrow = False               # measured: one thread fewer runs this load's steps faster
        self._probe: list[float] | None = None    # step seconds so far in a probe, in `_narrow_at` order
        self._probe_in_s = PROBE_FIRST_S
        self._next_probe: float | None = None     # None until a step's time was observed
        # the one engine whose steps the probes time: a second engine in the process (another
        # model, stepping on its own thread or in turn) would pair its steps with the first's
        self._engine: int | None = None
        self.probing = True
        self._lock = threading.Lock()             # engines on several threads share the governor

    def tick(self) -> int:
        """Called before a step: the thread count that step runs with."""
        if not self.enabled:
            return self.threads
        with self._lock:
            return self._tick()

    def _tick(self) -> int:
        now = self._clock()
        if self._mark is None or now - self._mark[0] >= self.window_s:
            self._read_window(now)
        width = self._measured_width(now)
        if width != self.threads:
            self._set(width)
            self.threads = width
        return self.threads

    def observe(self, seconds: float, engine: object = None) -> None:
        """After `engine`'s step that ran at `tick()`'s width: its wall time, for the probes."""
        if not self.enabled or not self.probing:
            return
        with self._lock:
            if self._engine is None:
                self._engine = id(engine)
            elif self._engine != id(engine):       # two engines: their steps do not pair
                self.probing, self.narrow, self._probe, self._next_probe = False, False, None, None
                return
            self._observe(seconds)

    @staticmethod
    def _narrow_at(position: int) -> bool:
        """Whether a probe's step at `position` runs narrow: pairs narrow-wide, then wide-narrow,
        in turn, so that a drift in step times (a batch filling up) favours neither."""
        return (position % 2 == 0) == (position // 2 % 2 == 0)

    def _observe(self, seconds: float) -> None:
        if self._probe is None:
            if self._next_probe is None:
                self._next_probe = self._clock() + self._probe_in_s
            return
        self._probe.append(seconds)
        if len(self._probe) % 2:
            return
        pairs = [(a, b) if self._narrow_at(k) else (b, a)      # (narrow, wide)
                 for k, a, b in zip(range(0, len(self._probe), 2), self._probe[::2], self._probe[1::2], strict=True)]
        ratios = sorted(narrow / wide for narrow, wide in pairs if wide > 0)
        # every pair so far clearly slower narrow (large steps, where the second thread pays):
        # each more narrow step would only cost
        lost = len(ratios) >= PROBE_EARLY and ratios[0] >= 1 / NARROW_GAIN
        if not lost and len(self._probe) < 2 * PROBE_PAIRS:
            return
        narrow = not lost and bool(ratios) and ratios[len(ratios) // 2] <= NARROW_GAIN
        self._probe_in_s = min(PROBE_MAX_S, self._probe_in_s * 2) if narrow == self.narrow else PROBE_FIRST_S
        self.narrow, self._probe = narrow, None
        self._next_probe = self._clock() + self._probe_in_s

    def _measured_width(self, now: float) -> int:
        if self.base == 1:
            return 1
        if self._probe is None and self._next_probe is not None and now >= self._next_probe:
            self._probe = []
        if self._probe is not None:
            return self.base - 1 if self._narrow_at(len(self._probe)) else self.base
        return self.base - 1 if self.narrow else self.base

    def _read_window(self, now: float) -> None:
        busy = self._read_busy()
        if busy is None:              # nothing to read (not Linux): keep the width it has
            return
        own = self._read_own()
        if self._mark is not None:
            t0, busy0, own0 = self._mark
            self.others_cores = max(0.0, ((busy - busy0) - (own - own0)) / max(now - t0, 1e-9))
            self._vote(self.wanted())
        self._mark = (now, busy, own)

    def wanted(self) -> int:
        free = len(self.cpus) - self.others_cores
        return max(1, min(self.max_threads, int(free + 0.5)))

    def _vote(self, want: int) -> None:
        if want == self.base:
            self._pending, self._votes = None, 0
            return
        self._votes = self._votes + 1 if want == self._pending else 1
        self._pending = want
        if self._votes >= self.confirm:
            logger.info("intra-op threads %d -> %d (other processes used %.2f of %d cores)",
                        self.base, want, self.others_cores, len(self.cpus))
            self.base, self.changes = want, self.changes + 1
            self._pending, self._votes = None, 0
            # the measurement was of the old width: measure the new one afresh
            self.narrow, self._probe, self._probe_in_s = False, None, PROBE_FIRST_S
            if self._next_probe is not None:
                self._next_probe = self._clock() + self._probe_in_s

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
