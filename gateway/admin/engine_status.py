"""/admin/v1/engine and /admin/v1/models: the engines' queues, KV cache, overload and cost
model, and every served model and adapter with its residency."""

from __future__ import annotations

from fastapi import Request

from gateway.admin.route import admin_router
from gateway.state import app_state

router = admin_router()


@router.get("/engine")
async def engine(request: Request) -> dict:
    state = app_state(request)
    out = {}
    for name, stats in state.engine_stats():
        out[name] = {
            "waiting": stats.get("waiting_requests", {}),
            "running": stats.get("running", {}),
            "waiting_by_tenant": stats.get("waiting_by_tenant", {}),
            "running_by_tenant": stats.get("running_by_tenant", {}),
            "kv_blocks": {"total": stats.get("kv_blocks_total"), "used": stats.get("kv_blocks_used"),
                          "free": stats.get("kv_blocks_free")},
            "preemptions": stats.get("num_preemptions", 0),
            "classes": stats.get("classes", {}),
            "tenants": stats.get("tenants", {}),     # per tenant and class, fairness counters too
            "generated_tokens": stats.get("num_generated_tokens", 0),
            "prefix_cache": {"queries": stats.get("prefix_cache_queries", 0),
                             "hits": stats.get("prefix_cache_hits", 0)},
            "lora": stats.get("lora"),     # in_slots, in_cpu, requests, slot_loads, disk_loads
            # the engine's bounded queue: queued per class, bounds, refused / shed per tenant
            "overload": stats.get("overload"),
            # the step-cost model step sizing uses: fitted seconds per unit of each feature,
            # the median relative error of its recent predictions (each made before its step)
            "cost_model": stats.get("cost_model"),
        }
    return {"object": "engine", "models": out, "inflight_requests": len(state.inflight),
            "draining": state.draining}


@router.get("/models")
async def models(request: Request) -> dict:
    """Every served variant: base models with their residency (on the device or offloaded),
    memory, queue and switch counts, and the adapters each engine holds (in a device slot,
    in host memory, or registered and on disk)."""
    state = app_state(request)
    data = []
    for m in state.models.values():
        stats = m.engine.stats() if m.engine.core is not None else {}
        pool = stats.get("model_pool")
        lora = stats.get("lora") or {}
        memory = stats.get("memory", {})
        data.append({
            "id": m.name, "object": "model", "path": str(m.path), "private": m.private,
            "max_model_len": m.engine.max_model_len,
            "resident": pool["resident"] if pool else m.engine.core is not None,
            "memory_bytes": pool["memory_bytes"] if pool else sum(v for k, v in memory.items() if k != "total_bytes"),
            "waiting": sum(stats.get("waiting_requests", {}).values()),
            "running": sum(stats.get("running", {}).values()),
            "loads": pool["loads"] if pool else 1, "offloads": pool["offloads"] if pool else 0,
            "turns": pool["turns"] if pool else 0,
            "pool": stats.get("pool"),
        })
        registered = getattr(m.engine, "loras", {})
        for name, req in registered.items():
            if (req.base_model_name or m.name) != m.name and req.base_model_name is not None:
                continue
            where = ("slot" if name in lora.get("in_slots", {}) else
                     "host" if name in lora.get("in_cpu", []) else "disk")
            data.append({"id": name, "object": "model", "parent": m.name, "residency": where,
                         "requests": lora.get("requests", {}).get(name, 0)})
    return {"object": "list", "data": data}
