"""/admin/v1/engine and /admin/v1/models: the engines' queues, KV cache, overload and cost
model, and every served model and adapter with its residency (`admin_service`'s, which the
console shows too)."""

from __future__ import annotations

from fastapi import Request

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
    return admin_service.models_listing(app_state(request))
