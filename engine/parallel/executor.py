"""Rank 0's side of a tensor-parallel group: `RankProcesses` starts ranks 1..N-1 ('mp':
`python -m lockgate.engine.parallel`, worker.py in a fresh interpreter: nothing of this
process is re-imported or copied; 'ray': Ray actors on this node, ray_ranks.py), waits for
each to read its shard and say how many KV blocks it holds, joins the group with them, hands
each step's inputs over (step_channel.py), fans control calls out, and stops them.

Bounded everywhere: a rank's start-up by `rank_start_timeout_s`, each call by
`distributed_timeout_s` (each collective by the group's own timeout). A rank that fails is
named (`RankStartupError` while starting, `RankFailure` after), with its own words where it
sent any, else its exit code."""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import socket
import subprocess
import sys
import time
import weakref
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from lockgate.engine.config import DTYPES, EngineConfig, ModelConfig
from lockgate.engine.errors import RankFailure, RankStartupError
from lockgate.engine.kv_cache.device_cache import DeviceKVCache
from lockgate.engine.parallel.group import RankGroup, open_store
from lockgate.engine.parallel.shard import check_tensor_parallel
from lockgate.engine.parallel.step_channel import StepArrays, StepSender
from lockgate.engine.parallel.worker import RankCapacity, RankSpec

logger = logging.getLogger(__name__)

STOP_GRACE_S = 5.0     # a stopped rank's time to exit before it is killed


def rank_spec(config: EngineConfig, model_config: ModelConfig, device: torch.device, dtype: torch.dtype,
              max_model_len: int) -> RankSpec | None:
    """With tensor parallelism, what ranks 1..N-1 start from (the model checked against N
    first); None for one rank. On the CPU the ranks share the cores: each takes its part
    (this process too)."""
    size = config.tensor_parallel_size
    if size == 1:
        return None
    check_tensor_parallel(model_config, size)
    threads = config.num_threads or max(1, len(os.sched_getaffinity(0)) // size)
    if device.type == "cpu":
        torch.set_num_threads(threads)
    return RankSpec(
        model_dir=config.model, rank=0, size=size, dtype=next(n for n, d in DTYPES.items() if d == dtype),
        device=str(device), max_model_len=max_model_len, store_port=0, timeout_s=config.distributed_timeout_s,
        start_timeout_s=config.rank_start_timeout_s, num_threads=threads, block_size=config.block_size,
        num_kv_blocks=config.num_kv_blocks, kv_cache_memory=config.kv_cache_memory,
        gpu_memory_utilization=config.gpu_memory_utilization,
        lora_slots=(config.max_loras, config.max_lora_rank) if config.enable_lora else None,
        backend=config.distributed_executor_backend or "mp")


def rank_device(device: torch.device, rank: int) -> str:
    """Rank r's device: the CPU for every rank, or the r-th CUDA device from the engine's."""
    if device.type != "cuda":
        return "cpu"
    return f"cuda:{(device.index or 0) + rank}"


def _child_env() -> dict[str, str]:
    """The environment of a rank: this one's, with `lockgate` importable from where it is
    imported here (a source checkout on sys.path need not be on PYTHONPATH)."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[3])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def _spawn(num: int) -> tuple[list[subprocess.Popen], list[Connection]]:
    """Ranks 1..num as fresh interpreters, each with a socket of its own to this process."""
    env = _child_env()
    procs, conns = [], []
    for _ in range(num):
        ours, theirs = socket.socketpair()
        procs.append(subprocess.Popen(  # noqa: S603 - this interpreter, our own module, no shell
            [sys.executable, "-m", "lockgate.engine.parallel", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),), env=env, close_fds=True))
        theirs.close()
        conns.append(Connection(ours.detach()))
    return procs, conns


def _reap(procs: list[Any], conns: list[Connection], sender: StepSender) -> None:
    """Stop every rank (a stop message, then SIGKILL past the grace period) and remove the
    step buffer: run by `close` or, if the engine is dropped without it, by the finalizer."""
    sender.send_stop()
    deadline = time.monotonic() + STOP_GRACE_S
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for conn in conns:
        conn.close()
    sender.close()


class RankProcesses:
    def __init__(self, template: RankSpec, device: torch.device) -> None:
        size = template.size
        self.template, self.size, self.device = template, size, device
        self.timeout_s, self.start_timeout_s = template.timeout_s, template.start_timeout_s
        self.store = open_store("127.0.0.1", 0, size, is_server=True, timeout_s=self.start_timeout_s)
        self.procs: list[Any]       # subprocess.Popen, or ray_ranks.RayRank (the same parts)
        if template.backend == "ray":
            from lockgate.engine.parallel.ray_ranks import start_ray_ranks

            self.procs, self.conns = start_ray_ranks(size - 1, self.start_timeout_s)
        else:
            self.procs, self.conns = _spawn(size - 1)
        for rank, conn in enumerate(self.conns, start=1):
            spec = dataclasses.replace(template, rank=rank, device=rank_device(device, rank),
                                       store_port=self.store.port)
            conn.send_bytes(pickle.dumps(spec))
        self.sender = StepSender(self.conns, [p.pid for p in self.procs])
        self.group: RankGroup | None = None
        self.capacities: list[RankCapacity] | None = None
        self._finalizer = weakref.finalize(self, _reap, self.procs, self.conns, self.sender)

    # -- start-up ---------------------------------------------------------------------------
    def wait_loaded(self) -> list[RankCapacity]:
        """Each other rank's KV block capacity and memory, once it has read its shard."""
        if self.capacities is None:
            deadline = time.monotonic() + self.start_timeout_s
            self.capacities = [self._receive(r, deadline, starting=True) for r in range(1, self.size)]
        return self.capacities

    def connect(self, rank0_timeout_s: float) -> RankGroup:
        """Rank 0 joins the group (every rank has loaded by now); each rank confirms."""
        self.wait_loaded()
        try:
            self.group = RankGroup(self.store, 0, self.size, self.device, rank0_timeout_s)
        except RuntimeError as exc:
            raise self._named(exc, starting=True) from exc
        deadline = time.monotonic() + self.start_timeout_s
        for r in range(1, self.size):
            self._receive(r, deadline, starting=True)
        return self.group

    # -- serving ----------------------------------------------------------------------------
    def send_step(self, arrays: StepArrays) -> None:
        try:
            self.sender.send_step(arrays)
        except OSError as exc:
            raise self._named(exc, starting=False) from exc

    def call(self, method: str, **kwargs: Any) -> list[Any]:
        """Every other rank runs `method` (worker.RankWorker.CALLS); their answers in rank order."""
        for conn in self.conns:
            try:
                self.sender.send_call(conn, method, kwargs)
            except OSError as exc:
                raise self._named(exc, starting=False) from exc
        deadline = time.monotonic() + self.timeout_s
        return [self._receive(r, deadline, starting=False) for r in range(1, self.size)]

    def failure(self, exc: BaseException) -> RankFailure:
        """A collective failed: the rank behind it named where one died or said why."""
        return self._named(exc, starting=False)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
        self._finalizer()

    # -- inside -----------------------------------------------------------------------------
    def _receive(self, rank: int, deadline: float, *, starting: bool) -> Any:
        conn, proc = self.conns[rank - 1], self.procs[rank - 1]
        error = RankStartupError if starting else RankFailure
        phase = "while starting" if starting else "while serving"
        while True:
            left = deadline - time.monotonic()
            try:
                message = conn.recv_bytes() if conn.poll(max(0.0, min(left, 0.2))) else None
            except (EOFError, OSError):
                try:
                    code: int | None = proc.wait(timeout=STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    code = None
                raise error(f"tensor parallel rank {rank} closed its channel {phase} (exit code {code})",
                            rank=rank) from None
            if message is not None:
                status, value = pickle.loads(message)  # noqa: S301 - our own rank's, over a private socketpair
                if status == "error":
                    raise error(f"tensor parallel rank {rank} failed {phase}: {value}", rank=rank)
                return value
            if proc.poll() is not None:
                raise error(f"tensor parallel rank {rank} exited with code {proc.returncode} {phase}", rank=rank)
            if left <= 0:
                what = "started" if starting else "answered"
                raise error(f"tensor parallel rank {rank} has not {what} within "
                            f"{self.start_timeout_s if starting else self.timeout_s:g} s", rank=rank)

    def _named(self, exc: BaseException, *, starting: bool) -> RankFailure:
        error = RankStartupError if starting else RankFailure
        time.sleep(0.05)     # a rank that failed a moment ago has had time to say so, or to exit
        for rank, (conn, proc) in enumerate(zip(self.conns, self.procs, strict=True), start=1):
            try:
                said = pickle.loads(conn.recv_bytes()) if conn.poll(0) else None  # noqa: S301 - as above
            except (EOFError, OSError):
                said = None
            if said is not None and said[0] == "error":
                return error(f"tensor parallel rank {rank} failed: {said[1]}", rank=rank)
            if proc.poll() is not None:
                return error(f"tensor parallel rank {rank} exited with code {proc.returncode}: {exc}", rank=rank)
        return error(f"tensor parallel group failed: {exc}", rank=None)


class GroupKV:
    """`KVCacheOps` over every rank: rank 0's own cache, and the same call on the others."""

    def __init__(self, local: DeviceKVCache, ranks: RankProcesses) -> None:
        self.local, self.ranks = local, ranks

    def allocate(self, num_blocks: int, block_size: int) -> None:
        self.local.allocate(num_blocks, block_size)
        self.ranks.call("kv_allocate", num_blocks=num_blocks, block_size=block_size)

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        self.local.copy_blocks(src, dst)
        self.ranks.call("kv_copy", src=src, dst=dst)

    def free(self) -> None:
        self.local.free()
        self.ranks.call("kv_free")
