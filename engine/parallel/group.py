"""The collectives of one tensor-parallel rank group: `RankGroup` over a torch.distributed
process group (gloo on the CPU, NCCL on CUDA), every call bounded by the group's timeout.

The process group is built directly on a TCPStore (rank 0 its server), not through
`init_process_group`: each engine's group is its own object, so an engine process may hold
several (a test's, a rebuilt one) and `torch.distributed` keeps no global default group."""

from __future__ import annotations

import contextlib
import datetime
import time
from typing import Any

import torch
import torch.distributed as dist

from lockgate.engine.errors import RankFailure


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def open_store(host: str, port: int, size: int, *, is_server: bool, timeout_s: float) -> dist.TCPStore:
    """Rank 0 serves the store (port 0: the system picks a free one, read back as `.port`)."""
    return dist.TCPStore(host, port, size, is_master=is_server, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


class RankGroup:
    """One rank's end of the group. `all_reduce` sums in place; `gather_to_first` hands rank 0
    every rank's tensor (others get None). Seconds spent inside collectives add up in
    `collective_s` (the share of a step spent communicating)."""

    def __init__(self, store: dist.Store, rank: int, size: int, device: torch.device, timeout_s: float,
                 name: str = "tp") -> None:
        self.rank, self.size, self.device = rank, size, device
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.backend = backend_for(device)
        prefixed = dist.PrefixStore(name, store)
        # torch's stubs know neither the backends' options nor their collectives
        self.pg: Any
        if self.backend == "gloo":
            opts = getattr(dist.ProcessGroupGloo, "_Options")()  # noqa: B009
            opts._timeout = self.timeout
            # loopback: the ranks of an 'mp' group share one host
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            self.pg = dist.ProcessGroupGloo(prefixed, rank, size, opts)
        else:
            nccl_opts = dist.ProcessGroupNCCL.Options()
            nccl_opts._timeout = self.timeout
            self.pg = dist.ProcessGroupNCCL(prefixed, rank, size, nccl_opts)
        self.collective_s = 0.0
        self.num_collectives = 0

    def _wait(self, work, what: str) -> None:
        t0 = time.perf_counter()
        try:
            if self.backend == "gloo":
                work.wait()                  # bounded by the group's timeout
            else:
                work.wait(self.timeout)
        except RuntimeError as exc:
            raise RankFailure(f"tensor parallel {what} failed on rank {self.rank}: {exc}",
                              rank=None) from exc
        finally:
            self.collective_s += time.perf_counter() - t0
            self.num_collectives += 1

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        self._wait(self.pg.allreduce([t]), "all-reduce")
        return t

    def gather_to_first(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        opts = dist.GatherOptions()
        opts.rootRank = 0
        t = t.contiguous()
        if self.rank == 0:
            out = [[torch.empty_like(t) for _ in range(self.size)]]
            self._wait(self.pg.gather(out, [t], opts), "gather")
            return out[0]
        self._wait(self.pg.gather([], [t], opts), "gather")
        return None

    def barrier(self) -> None:
        self.all_reduce(torch.zeros(1, device=self.device))

    def close(self) -> None:
        # older builds have no shutdown; a peer that is gone already is fine
        with contextlib.suppress(RuntimeError, AttributeError):
            self.pg.shutdown()
