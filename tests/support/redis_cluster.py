"""A three-node Redis Cluster started from the machine's ``redis-server``, for the limiter's
tests on Cluster (one per test session: the `redis_cluster` fixture of `tests.support.services`).

Each node is a ``redis-server --cluster-enabled yes`` on a free port (and a free cluster bus
port, ``--cluster-port``), without persistence, its files in a directory of its own;
``redis-cli --cluster create ... --cluster-replicas 0 --cluster-yes`` splits the 16384 slots
among the three, and the cluster is ready once every node reports ``cluster_state:ok`` and
knows all three. `url` is the limiter's ``redis+cluster://`` URL of all three nodes.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import redis

from tests.support.gateway_server import free_port

NODES = 3


class LocalRedisCluster:
    """Three cluster-enabled redis-server processes joined into one cluster."""

    def __init__(self, work_dir: Path, *, ready_within: float = 30.0) -> None:
        if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
            raise FileNotFoundError("redis-server and redis-cli are needed for a Redis Cluster")
        self.ports = [free_port() for _ in range(NODES)]
        self.procs: list[subprocess.Popen] = []
        try:
            for port in self.ports:
                self.procs.append(self._start_node(work_dir / f"node-{port}", port))
            for port in self.ports:
                self._wait(lambda p=port: _ping(p), ready_within)
            subprocess.run(["redis-cli", "--cluster", "create",
                            *(f"127.0.0.1:{p}" for p in self.ports),
                            "--cluster-replicas", "0", "--cluster-yes"],
                           check=True, capture_output=True, timeout=ready_within)
            self._wait(self._ready, ready_within)
        except BaseException:
            self.stop()
            raise
        self.url = "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    @staticmethod
    def _start_node(node_dir: Path, port: int) -> subprocess.Popen:
        node_dir.mkdir(parents=True)
        return subprocess.Popen(
            ["redis-server", "--port", str(port), "--cluster-port", str(free_port()),
             "--bind", "127.0.0.1", "--cluster-enabled", "yes",
             "--cluster-config-file", str(node_dir / "nodes.conf"),
             "--cluster-node-timeout", "5000", "--save", "", "--appendonly", "no",
             "--dir", str(node_dir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def _ready(self) -> bool:
        for port in self.ports:
            with _client(port) as c:
                info = c.cluster("info")
            if info.get("cluster_state") != "ok" or int(info.get("cluster_known_nodes", 0)) != NODES:
                return False
        return True

    @staticmethod
    def _wait(check, within: float) -> None:
        deadline = time.monotonic() + within
        while True:
            try:
                if check():
                    return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"Redis Cluster not ready within {within:g} s")
            time.sleep(0.05)

    def client(self) -> redis.RedisCluster:
        """A synchronous redis-py cluster client (for tests that look at keys)."""
        return redis.RedisCluster(host="127.0.0.1", port=self.ports[0], socket_timeout=5)

    def drop_prefix(self, prefix: str) -> None:
        """Delete every key under ``prefix``, on every node."""
        for port in self.ports:
            with _client(port) as c:
                for key in list(c.scan_iter(match=prefix + "*", count=1000)):
                    c.delete(key)       # one at a time: a node holds keys of many slots

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def _client(port: int) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=port, socket_timeout=2, decode_responses=True)


def _ping(port: int) -> bool:
    with _client(port) as c:
        return bool(c.ping())
