"""/admin/v1 keys: a tenant's API keys (create, list), admin and viewer keys (create, list),
reading and revoking one. Each change a call to `admin_service`."""

from __future__ import annotations

from lockgate.gateway import admin_service as service
from lockgate.gateway.admin.route import admin_router
from lockgate.gateway.deps import AdminDep, SessionDep, StateDep
from lockgate.gateway.schemas import (
    AdminKeyCreate,
    KeyCreate,
    KeyCreatedPublic,
    KeyPublic,
    ListPublic,
    RevokedPublic,
)
from lockgate.tenancy import api_keys, tenants

router = admin_router()


@router.post("/tenants/{tenant_id}/keys", status_code=201)
async def create_key(tenant_id: str, body: KeyCreate, state: StateDep, session: SessionDep,
                     admin: AdminDep) -> KeyCreatedPublic:
    k, plaintext = await service.create_tenant_key(state, session, tenant_id, body, actor=admin.key_id)
    return KeyCreatedPublic.from_row(k, key=plaintext)


@router.get("/tenants/{tenant_id}/keys")
async def list_keys(tenant_id: str, session: SessionDep) -> ListPublic[KeyPublic]:
    await tenants.get_tenant(session, tenant_id)
    keys = await api_keys.list_keys(session, tenant_id)
    return ListPublic[KeyPublic](data=[KeyPublic.from_row(k) for k in keys])


@router.post("/keys", status_code=201)
async def create_admin_key(body: AdminKeyCreate, state: StateDep, session: SessionDep,
                           admin: AdminDep) -> KeyCreatedPublic:
    """An admin key, or with `scopes: ["viewer"]` a viewer key: GET on the admin routes only."""
    k, plaintext = await service.create_admin_key(state, session, body, actor=admin.key_id)
    return KeyCreatedPublic.from_row(k, key=plaintext)


@router.get("/keys")
async def list_admin_keys(session: SessionDep) -> ListPublic[KeyPublic]:
    """The admin and viewer keys (revoked ones included)."""
    return ListPublic[KeyPublic](data=[KeyPublic.from_row(k) for k in await api_keys.list_keys(session, None)])


@router.get("/keys/{key_id}")
async def get_key(key_id: str, session: SessionDep) -> KeyPublic:
    return KeyPublic.from_row(await api_keys.get_key(session, key_id))


@router.delete("/keys/{key_id}")
async def revoke_key(key_id: str, state: StateDep, session: SessionDep, admin: AdminDep) -> RevokedPublic:
    await service.revoke_key(state, session, key_id, actor=admin.key_id)
    return RevokedPublic(id=key_id)
