"""/admin/v1/engine and /admin/v1/models: the engines' queues, KV cache, overload and cost
model, and every served model and adapter with its residency."""

from __future__ import annotations

from dataclasses import asdict

from fastapi import Request

from lockgate.engine import EngineStats
from lockgate.gateway import admin_service
from lockgate.gateway.admin.route import admin_router
from lockgate.gateway.state import app_state

router = admin_router()


@router.get("/engine")
async def engine(request: Request) -> dict:
    return admin_service.engine_snapshot(app_state(request))


@router.get("/models")
async def models(request: Request) -> dict:
    """Every served variant: base models with their residency (on the device or offloaded),
    memory, queue and switch counts, and the adapters each engine holds (in a device slot,
    in host memory, or registered and on disk)."""
    state = app_state(request)
    data = []
    pool = None
    for m in state.models.values():
        stats = m.engine.stats()
        if stats.workers is not None:     # a Ray pool's workers, placement and its reasons, ready or not
            pool = asdict(stats.workers)
        if not m.engine.is_ready:
            stats = EngineStats()
        own = stats.residency
        data.append({
            "id": m.name, "object": "model", "path": str(m.path), "private": m.private,
            "max_model_len": m.info.max_model_len,
            "resident": own.resident if own else m.engine.is_ready,
            "memory_bytes": own.memory_bytes if own else sum(v for k, v in stats.memory.items() if k != "total_bytes"),
            "waiting": sum(stats.waiting_requests.values()),
            "running": sum(stats.running.values()),
            "loads": own.loads if own else 1, "offloads": own.offloads if own else 0,
            "turns": own.turns if own else 0,
            "pool": {"memory": stats.pool.memory, "switches": stats.pool.switches,
                     "switch_s": stats.pool.switch_s, "current_model": stats.pool.current_model}
            if stats.pool else None,
        })
        lora = stats.lora
        for name, req in m.engine.loras.items():
            if (req.base_model_name or m.name) != m.name and req.base_model_name is not None:
                continue
            where = ("slot" if lora and name in lora.in_slots else
                     "host" if lora and name in lora.in_cpu else "disk")
            data.append({"id": name, "object": "model", "parent": m.name, "residency": where,
                         "requests": lora.requests.get(name, 0) if lora else 0})
    return {"object": "list", "data": data, "pool": pool}
