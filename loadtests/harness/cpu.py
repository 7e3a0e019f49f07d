"""CPU over one benchmark step: the server process, PostgreSQL and Redis, the whole machine,
and what other work on it took."""

from __future__ import annotations

import math
import time
from typing import Any


def _cpu_busy(before: Any, after: Any) -> float:
    """Machine-wide busy fraction (of all cores) between two psutil.cpu_times() snapshots."""
    idle = lambda t: t.idle + getattr(t, "iowait", 0.0)  # noqa: E731
    total = sum(after) - sum(before)
    return 1.0 - (idle(after) - idle(before)) / total if total > 0 else math.nan


def _proc_cpu(proc: Any) -> float:
    t = proc.cpu_times()
    return t.user + t.system


SERVICE_PROCESSES = ("postgres", "redis-server", "redis")


class CpuMeter:
    """CPU over one step: the gateway process, PostgreSQL and Redis (every process of theirs,
    whoever it serves), the whole machine; `others` is the rest of the machine's busy time
    once the load generator (reported by itself), the gateway and the services are taken out:
    other work on a shared machine, which inflates the latencies."""

    def __init__(self, server_proc: Any) -> None:
        import psutil

        self.psutil = psutil
        self.server = server_proc

    def _services(self) -> dict[int, float]:
        out = {}
        for p in self.psutil.process_iter(["name"]):
            try:
                if (p.info["name"] or "").startswith(SERVICE_PROCESSES):
                    out[p.pid] = _proc_cpu(p)
            except (self.psutil.Error, OSError):
                pass
        return out

    def start(self) -> None:
        self.m0, self.g0, self.s0 = self.psutil.cpu_times(), _proc_cpu(self.server), self._services()
        self.w0 = time.perf_counter()

    def stop(self, client_cpu: float) -> dict[str, float]:
        wall = time.perf_counter() - self.w0
        machine = _cpu_busy(self.m0, self.psutil.cpu_times())
        server = (_proc_cpu(self.server) - self.g0) / wall
        s1 = self._services()
        services = sum(v - self.s0.get(pid, 0.0) for pid, v in s1.items()) / wall
        others = max(0.0, machine * (self.psutil.cpu_count() or 1) - client_cpu - server - services)
        return {"server_cpu": server, "services_cpu": services, "machine_cpu": machine,
                "others_cpu": others}


