"""One engine pool across devices and machines, placed by Ray (`lockgate serve --pool ...`).

- `worker.EngineWorker`: one device's `AsyncEngine` (every model of the pool, under its memory
  budget) in a Ray actor, named in the pool's namespace so that every gateway replica finds
  the same workers; Ray restarts it when its process dies.
- `placement.Placement` (in one named actor): which workers serve which model, by demand.
- `router.Router`: per request, among the model's workers, the one likely to hold the
  tenant's longest cached prefix (this replica's own decisions, and each worker's reported
  `PrefixSummary`, so every replica finds a prefix any of them placed), else the least loaded.
- `replica.Pool`: the gateway replica's side, a `ModelEngine` of the pool's models (each served
  through a `ModelBinding`, `pool.for_model(name)`), its streams read from the workers
  through Ray streaming generators (`stream.RemoteStream`).

Ray is imported only when a pool starts (`remote.py`); embedded serving never imports it.
"""

from lockgate.engine.pool.placement import Placement
from lockgate.engine.pool.replica import Pool, PoolConfig
from lockgate.engine.pool.router import PrefixSummary, Router, prefix_chain, request_chain, unpack_summary
from lockgate.engine.pool.stream import RemoteStream
from lockgate.engine.pool.worker import EngineWorker, ModelFilesMissing, WorkerReport

__all__ = ["EngineWorker", "ModelFilesMissing", "Placement", "Pool", "PoolConfig",
           "PrefixSummary", "RemoteStream", "Router", "WorkerReport", "prefix_chain", "request_chain",
           "unpack_summary"]
