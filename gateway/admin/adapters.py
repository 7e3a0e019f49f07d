"""/admin/v1/adapters: register (through `AdapterCatalog.create`), list, read, unload from
this replica's memory, delete."""

from __future__ import annotations

from typing import Any

from lockgate.engine import AdapterInUse, LoRAError
from lockgate.gateway.adapter_catalog import AdapterRefused
from lockgate.gateway.admin.route import admin_router
from lockgate.gateway.deps import AdminDep, SessionDep, StateDep
from lockgate.gateway.errors import APIError
from lockgate.gateway.schemas import (
    AdapterCreate,
    AdapterDeletedPublic,
    AdapterPublic,
    AdapterUnloadedPublic,
    ListPublic,
)
from lockgate.gateway.state import AppState
from lockgate.tenancy import adapters as adapter_rows

router = admin_router()


def _registered(a: Any, state: AppState) -> bool:
    """Whether this replica's engine serves the adapter row `a` now."""
    entry = state.models.get(a.base_model)
    return entry is not None and state.models.adapters.is_current(entry.engine, a.name, a.id)


def adapter_public(a: Any, state: AppState) -> AdapterPublic:
    return AdapterPublic.from_row(a, registered=_registered(a, state))


def _lora_error(exc: LoRAError, body: AdapterCreate) -> APIError:
    """The engine's refusal as a 400 naming the request's field it is about."""
    msg = str(exc)
    if exc.field == "lora_name":
        return APIError(400, f"name: {msg}", param="name")
    if exc.field == "base_model_name":
        return APIError(400, f"base_model: the adapter in {body.path!r} does not fit "
                        f"{body.base_model!r}: {msg}", param="base_model")
    return APIError(400, f"path: the adapter in {body.path!r} cannot be served: {msg}", param="path")


def in_use_error(exc: LoRAError, name: str) -> APIError:
    return APIError(409, f"adapter {name!r} is in use by requests on this replica; retry when "
                    f"they have finished ({exc})", code="adapter_in_use")


@router.post("/adapters", status_code=201)
async def create_adapter(body: AdapterCreate, state: StateDep, session: SessionDep,
                         admin: AdminDep) -> AdapterPublic:
    return await register_adapter(state, session, body, actor=admin.key_id)


async def register_adapter(state: AppState, session: Any, body: AdapterCreate, *, actor: str) -> AdapterPublic:
    """Check the names here, then let the catalog register it (engine first, then the row)."""
    if body.name in state.models:
        raise APIError(400, f"name: {body.name!r} is a served model's name", param="name")
    base = state.models.get(body.base_model)
    if base is None:
        raise APIError(400, f"base_model: {body.base_model!r} is not served here (served: "
                       f"{', '.join(sorted(state.models))})", param="base_model")
    try:
        row = await state.models.adapters.create(session, base, name=body.name, path=body.path,
                                          owner_tenant_id=body.owner_tenant_id, actor=actor)
    except AdapterInUse as exc:
        raise in_use_error(exc, body.name) from None
    except AdapterRefused as exc:
        raise _lora_error(exc.cause, body) from None
    return adapter_public(row, state)


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
    a = await adapter_rows.get_adapter(session, adapter_id)
    entry = state.models.get(a.base_model)
    unloaded = False
    if entry is not None and state.models.adapters.is_current(entry.engine, a.name, a.id):
        try:
            unloaded = entry.engine.unload_lora(a.name)
        except LoRAError as exc:
            raise in_use_error(exc, a.name) from None
    return AdapterUnloadedPublic.from_row(a, registered=_registered(a, state), unloaded=unloaded)


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
