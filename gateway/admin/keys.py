"""/admin/v1 keys: a tenant's API keys (create, list), admin keys, reading and revoking one."""

from __future__ import annotations

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
    await tenants.get_tenant(session, tenant_id)
    k, plaintext = await api_keys.create_key(
        session, tenant_id=tenant_id, name=body.name, scopes=tuple(body.scopes or ("inference",)),
        expires_at=body.expires_at, quota=body.quota.quota() if body.quota else None,
        pepper=state.pepper, actor=admin.key_id)
    state.auth.keys.forget_missing(k.prefix)      # a miss of its prefix, seen before, ends now
    return KeyCreatedPublic.from_row(k, key=plaintext)


@router.get("/tenants/{tenant_id}/keys")
async def list_keys(tenant_id: str, session: SessionDep) -> ListPublic[KeyPublic]:
    await tenants.get_tenant(session, tenant_id)
    keys = await api_keys.list_keys(session, tenant_id)
    return ListPublic[KeyPublic](data=[KeyPublic.from_row(k) for k in keys])


@router.post("/keys", status_code=201)
async def create_admin_key(body: AdminKeyCreate, state: StateDep, session: SessionDep,
                           admin: AdminDep) -> KeyCreatedPublic:
    k, plaintext = await api_keys.create_key(
        session, tenant_id=None, name=body.name, scopes=("admin",), expires_at=body.expires_at,
        pepper=state.pepper, actor=admin.key_id)
    state.auth.keys.forget_missing(k.prefix)      # a miss of its prefix, seen before, ends now
    return KeyCreatedPublic.from_row(k, key=plaintext)


@router.get("/keys/{key_id}")
async def get_key(key_id: str, session: SessionDep) -> KeyPublic:
    return KeyPublic.from_row(await api_keys.get_key(session, key_id))


@router.delete("/keys/{key_id}")
async def revoke_key(key_id: str, state: StateDep, session: SessionDep, admin: AdminDep) -> RevokedPublic:
    await api_keys.revoke_key(session, key_id, actor=admin.key_id)
    state.auth.keys.invalidate_key_id(key_id)
    return RevokedPublic(id=key_id)
