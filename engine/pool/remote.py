"""The pool's Ray side: the worker and placement actors, and the cluster connection. Ray is
imported here only, and only when a pool is used (embedded serving needs no Ray)."""

from __future__ import annotations

import os
from typing import Any

from lockgate.engine.pool.placement import Placement
from lockgate.engine.pool.worker import EngineWorker

DEVICE = "lockgate_device"      # the custom resource a node advertises per device it lends


class PlacementHolder:
    """One `Placement` per pool, in a named actor that every gateway replica shares."""

    def __init__(self, workers: list[str], capacity: dict[str, int], **kw: Any) -> None:
        self.placement = Placement(workers, capacity, **kw)

    def workers_for(self, model: str, demand: dict[str, int]) -> list[str]:
        return self.placement.workers_for(model, demand)

    def place_free(self, models: list[str]) -> dict[str, list[str]]:
        """At start: each model in turn on a free place, while there are any."""
        for m in models:
            if not self.placement.assigned.get(m) and any(self.placement.free(w) > 0
                                                           for w in self.placement.workers):
                self.placement.workers_for(m, {})
        return self.snapshot()["assigned"]

    def rebalance(self, demand: dict[str, int]) -> dict:
        """Apply the rules to `demand`; the placement as it stands, with its recent decisions."""
        self.placement.rebalance(demand)
        return self.snapshot()

    def snapshot(self) -> dict:
        return self.placement.snapshot()


class RayEngineWorker(EngineWorker):
    """The worker as a Ray actor: the devices it reports are those Ray assigned it."""

    def held_devices(self) -> int:
        import ray

        return int(ray.get_runtime_context().get_assigned_resources().get(DEVICE, 0))


def connect(address: str, namespace: str, *, num_cpus: int | None = None,
            min_devices: int = 1) -> dict[str, float]:
    """Join the Ray cluster at `address` ("auto": start a local one, with one device per
    core pair, at least `min_devices` (on the CPU a device is a share of the cores: a
    tensor-parallel worker needs as many as its ranks)) under `namespace`; returns the
    cluster's resources. Blocking: call it on a worker thread."""
    import ray

    if not ray.is_initialized():
        kw: dict[str, Any] = {"namespace": namespace, "include_dashboard": False,
                              "log_to_driver": False, "configure_logging": False}
        if address == "auto":
            # a local Ray on loopback only, with Ray's token authentication on; "local": a Ray
            # of its own even where another runs on this machine (ray.init would join that one)
            cpus = num_cpus or os.cpu_count() or 1
            ray.init(address="local", num_cpus=cpus, resources={DEVICE: max(1, min_devices, cpus // 2)},
                     _node_ip_address="127.0.0.1", **kw)
        else:
            ray.init(address=address, **kw)
    return dict(ray.cluster_resources())


def node_devices() -> list[int]:
    """The `lockgate_device` units each live node of the cluster lends (nodes lending none
    left out)."""
    import ray

    per = [int(n.get("Resources", {}).get(DEVICE, 0)) for n in ray.nodes() if n.get("Alive")]
    return [d for d in per if d > 0]


def worker_handle(name: str, namespace: str, worker_id: str, models: dict[str, str],
                  engine_kwargs: dict[str, Any], *, threads: int, owner_ttl_s: float,
                  devices: int) -> Any:
    """The named worker actor `name` (created by the first gateway replica that asks, with
    these arguments; later ones get the same actor). Ray restarts it if its process dies.
    A tensor-parallel worker holds `devices` (its TP size; 0: the cluster lends none) and
    `threads` CPUs per rank, all on one node: its ranks are processes beside the actor."""
    import ray

    ranks = max(1, int(engine_kwargs.get("tensor_parallel_size", 1)))
    cls = ray.remote(RayEngineWorker)
    opts: dict[str, Any] = {"name": name, "namespace": namespace, "get_if_exists": True,
                            "lifetime": "detached", "max_restarts": -1, "max_task_retries": 0,
                            "num_cpus": threads * ranks, "max_concurrency": 1000}
    if devices > 0:
        opts["resources"] = {DEVICE: devices}
    return cls.options(**opts).remote(worker_id, models, engine_kwargs, threads=threads,
                                      owner_ttl_s=owner_ttl_s, devices=devices)


def placement_handle(namespace: str, workers: list[str], capacity: dict[str, int],
                     **kw: Any) -> Any:
    import ray

    cls = ray.remote(PlacementHolder)
    return cls.options(name="lockgate-placement", namespace=namespace, get_if_exists=True,
                       lifetime="detached", num_cpus=0, max_restarts=-1).remote(
        workers, capacity, **kw)


def actor_failures() -> tuple[type[BaseException], ...]:
    """Ray's errors for an actor that died, restarts, or cannot be reached."""
    from ray import exceptions as rx

    kinds = [rx.RayActorError, rx.ActorUnavailableError, rx.GetTimeoutError,
             rx.ObjectLostError, rx.WorkerCrashedError, rx.RaySystemError]
    return tuple(kinds)
