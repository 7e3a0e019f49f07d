"""/admin/v1/engine and /admin/v1/models: the engines' queues, KV cache, overload and cost
model, and every served model and adapter with its residency."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from fastapi import Request

from lockgate.engine import EngineStats
from lockgate.gateway.admin.route import admin_router
from lockgate.gateway.state import app_state

router = admin_router()


def _json(part: Any) -> dict | None:
    return asdict(part) if part is not None else None


def engine_json(s: EngineStats) -> dict:
    """One model's engine as /admin/v1/engine shows it."""
    return {
        "waiting": s.waiting_requests,
        "running": s.running,
        "waiting_by_tenant": s.waiting_by_tenant,
        "running_by_tenant": s.running_by_tenant,
        "kv_blocks": {"total": s.kv.total, "used": s.kv.used, "free": s.kv.free},
        "preemptions": s.num_preemptions,
        "classes": {c: asdict(q) for c, q in s.classes.items()},
        # per tenant and class, fairness counters too
        "tenants": {t: {c: asdict(row) for c, row in by_class.items()} for t, by_class in s.tenants.items()},
        "generated_tokens": s.num_generated_tokens,
        "prefix_cache": {"queries": s.kv.prefix_cache_queries, "hits": s.kv.prefix_cache_hits},
        "lora": _json(s.lora),     # in_slots, in_cpu, requests, slot_loads, disk_loads
        # the engine's bounded queue: queued per class, bounds, refused / shed per tenant
        "overload": _json(s.overload),
        # the step-cost model step sizing uses: fitted seconds per unit of each feature,
        # the median relative error of its recent predictions (each made before its step)
        "cost_model": _json(s.cost_model),
        # a model split over ranks: its size, communication, each rank's memory, rebuilds
        "tensor_parallel": _json(s.parallel),
        # speculative decoding: its settings, drafts verified and tokens kept (in all, by draft
        # position, per class), and per class whether it drafts now (engine/spec/switch.py)
        "speculative": _json(s.spec),
        # served by a Ray pool: each worker's own, in this same shape (the fields above are
        # their sum); one engine in this process: none
        "workers": {w: engine_json(part) for w, part in s.by_worker.items()},
    }


@router.get("/engine")
async def engine(request: Request) -> dict:
    state = app_state(request)
    out = {}
    for name, stats in state.models.engine_stats():
        out[name] = engine_json(stats)
    return {"object": "engine", "models": out, "inflight_requests": len(state.inflight),
            "draining": state.draining}


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
