"""/admin/v1/adapters: register (through `AdapterCatalog.create`), list, read, unload from
this replica's memory, delete. The bodies are `admin_service`'s, which the console calls too."""

from __future__ import annotations

from lockgate.engine import AdapterInUse
from lockgate.gateway import admin_service
from lockgate.gateway.admin.route import admin_router
from lockgate.gateway.admin_service import adapter_public, in_use_error, register_adapter
from lockgate.gateway.deps import AdminDep, SessionDep, StateDep
from lockgate.gateway.schemas import (
    AdapterCreate,
    AdapterDeletedPublic,
    AdapterPublic,
    AdapterUnloadedPublic,
    ListPublic,
)
from lockgate.tenancy import adapters as adapter_rows

__all__ = ["in_use_error", "register_adapter", "router"]

router = admin_router()


@router.post("/adapters", status_code=201)
async def create_adapter(body: AdapterCreate, state: StateDep, session: SessionDep,
                         admin: AdminDep) -> AdapterPublic:
    return await register_adapter(state, session, body, actor=admin.key_id)


@router.get("/adapters")
async def list_adapters(state: StateDep, session: SessionDep) -> ListPublic[AdapterPublic]:
    rows = await adapter_rows.list_adapters(session)
    return ListPublic[AdapterPublic](data=[adapter_public(a, state) for a in rows])


@router.get("/adapters/{adapter_id}")
async def get_adapter(adapter_id: str, state: StateDep, session: SessionDep) -> AdapterPublic:
    return adapter_public(await adapter_rows.get_adapter(session, adapter_id), state)


@router.post("/adapters/{adapter_id}/unload")
async def unload_adapter(adapter_id: str, state: StateDep, session: SessionDep) -> AdapterUnloadedPublic:
    """Drop the adapter's weights from this replica's memory; it stays registered and is
    read again on its next use."""
    return await admin_service.unload_adapter(state, session, adapter_id)


@router.delete("/adapters/{adapter_id}")
async def delete_adapter(adapter_id: str, state: StateDep, session: SessionDep,
                         admin: AdminDep) -> AdapterDeletedPublic:
    """Off this replica's engine (409 while requests use it), then out of the database;
    other replicas stop serving it within `adapter_cache_ttl_s`."""
    a = await adapter_rows.get_adapter(session, adapter_id)
    try:
        await state.models.adapters.delete(session, a, actor=admin.key_id)
    except AdapterInUse as exc:
        raise in_use_error(exc, a.name) from None
    return AdapterDeletedPublic(id=adapter_id, name=a.name)
