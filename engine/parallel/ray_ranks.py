"""Ranks 1..N-1 as Ray actors (`distributed_executor_backend="ray"`, vLLM's name): each rank
is an actor process of the Ray cluster this process is connected to (started locally when
none is), pinned to this node, that connects back to rank 0 over a Unix socket in a private
directory and then lives as a spawned rank does (worker.py `serve`): the same spec, shard,
step channel (its shared buffer's descriptor passed over that socket, so the ranks must share
rank 0's host) and collectives. `RayRank` gives executor.py the handle it keeps of a spawned
process (`pid`, `poll`, `wait`, `kill`, `returncode`), so failures are named and groups
rebuilt the same way.

Actors ask Ray for no CPU and no GPU: the engine (or the pool worker that runs it, which
placement counted with its devices) already holds them, and each rank takes the device it
would take as a spawned process (`cuda:r` from the engine's own; Ray is told not to hide it).
"""

from __future__ import annotations

import contextlib
import hmac
import os
import secrets
import socket
import subprocess
import tempfile
import time
from multiprocessing.connection import Connection
from typing import Any

TOKEN_BYTES = 32


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ValueError("distributed_executor_backend: 'ray' needs Ray (pip install 'lockgate[pool]')") from None
    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False)
    return ray


class _RankActor:
    """The rank's process (a Ray actor): `run` connects to rank 0 and serves until stopped."""

    def pid(self) -> int:
        return os.getpid()

    def run(self, path: str, token: bytes) -> int:
        from lockgate.engine.parallel.worker import serve

        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        sock.sendall(token)
        return serve(Connection(sock.detach()))


class RayRank:
    """A rank's actor, with the parts of `subprocess.Popen` executor.py uses."""

    def __init__(self, actor: Any, done: Any, pid: int) -> None:
        self.actor, self.done, self.pid = actor, done, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            ready, _ = _ray().wait([self.done], timeout=0)
            if ready:
                self.returncode = self._code()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        ready, _ = _ray().wait([self.done], timeout=timeout)
        if not ready:
            raise subprocess.TimeoutExpired(f"ray rank actor (pid {self.pid})", timeout or 0.0)
        self.returncode = self._code()
        return self.returncode

    def kill(self) -> None:
        _ray().kill(self.actor, no_restart=True)

    def _code(self) -> int:
        ray = _ray()
        try:
            code = int(ray.get(self.done, timeout=1.0))
        except Exception:  # noqa: BLE001 - the actor died (killed, or its process ended): as a signal would
            code = -9
        # A rank whose run returned is still a live actor holding its process: end it, so a stopped
        # rank leaves nothing behind (as a spawned process's exit does).
        with contextlib.suppress(Exception):     # already gone
            ray.kill(self.actor, no_restart=True)
        return code


def start_ray_ranks(num: int, timeout_s: float) -> tuple[list[RayRank], list[Connection]]:
    """Ranks 1..num as actors on this node, each connected back: their handles and
    connections, in rank order. Bounded by `timeout_s` for each rank's connection."""
    ray = _ray()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    actor_cls = ray.remote(_RankActor).options(
        num_cpus=0, num_gpus=0, scheduling_strategy=here, max_concurrency=2,
        runtime_env={"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}})
    ranks: list[RayRank] = []
    conns: list[Connection] = []
    with tempfile.TemporaryDirectory(prefix="lockgate-ranks-") as tmp:    # mode 0700: ours alone
        for rank in range(1, num + 1):
            path = os.path.join(tmp, f"rank{rank}.sock")
            token = secrets.token_bytes(TOKEN_BYTES)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
                listener.bind(path)
                listener.listen(1)
                actor = actor_cls.remote()
                done = actor.run.remote(path, token)
                conn = _accept(listener, token, rank, timeout_s)
            ranks.append(RayRank(actor, done, ray.get(actor.pid.remote(), timeout=timeout_s)))
            conns.append(conn)
    return ranks, conns


def _accept(listener: socket.socket, token: bytes, rank: int, timeout_s: float) -> Connection:
    from lockgate.engine.errors import RankStartupError

    deadline = time.monotonic() + timeout_s
    while True:
        listener.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            sock, _ = listener.accept()
        except TimeoutError:
            raise RankStartupError(f"tensor parallel rank {rank}: its Ray actor did not connect within "
                                   f"{timeout_s:g} s", rank=rank) from None
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            said = sock.recv(TOKEN_BYTES, socket.MSG_WAITALL)
        except OSError:
            said = b""
        if hmac.compare_digest(said, token):
            sock.settimeout(None)
            return Connection(sock.detach())
        sock.close()            # not our actor: keep waiting for it
