"""/admin/v1/tenants: create, list (a page, `name` filtering by what a name holds), read,
change, delete tenants, and set a tenant's quota. Each a call to `admin_service`."""

from __future__ import annotations

from typing import Annotated

from fastapi import Query

from lockgate.gateway import admin_service as service
from lockgate.gateway.admin.route import admin_router
from lockgate.gateway.deps import AdminDep, SessionDep, StateDep
from lockgate.gateway.fields import Ident
from lockgate.gateway.schemas import (
    DeletedPublic,
    QuotaBody,
    TenantCreate,
    TenantPagePublic,
    TenantPatch,
    TenantPublic,
)
from lockgate.tenancy import tenants

router = admin_router()


@router.post("/tenants", status_code=201)
async def create_tenant(body: TenantCreate, state: StateDep, session: SessionDep,
                        admin: AdminDep) -> TenantPublic:
    return TenantPublic.from_row(await service.create_tenant(state, session, body, actor=admin.key_id))


@router.get("/tenants")
async def list_tenants(session: SessionDep, limit: Annotated[int, Query(ge=1, le=500)] = 50,
                       after: str | None = None,
                       name: Annotated[Ident | None, Query(max_length=64)] = None) -> TenantPagePublic:
    rows, has_more = await service.tenant_page(session, limit=limit, after=after, name=name)
    return TenantPagePublic(data=[TenantPublic.from_row(t) for t in rows], has_more=has_more,
                            last_id=rows[-1].id if rows else None)


@router.get("/tenants/{tenant_id}")
async def get_tenant(tenant_id: str, session: SessionDep) -> TenantPublic:
    return TenantPublic.from_row(await tenants.get_tenant(session, tenant_id))


@router.patch("/tenants/{tenant_id}")
async def patch_tenant(tenant_id: str, body: TenantPatch, state: StateDep, session: SessionDep,
                       admin: AdminDep) -> TenantPublic:
    return TenantPublic.from_row(await service.update_tenant(state, session, tenant_id, body,
                                                             actor=admin.key_id))


@router.delete("/tenants/{tenant_id}")
async def delete_tenant(tenant_id: str, state: StateDep, session: SessionDep,
                        admin: AdminDep) -> DeletedPublic:
    """Soft delete: keys revoked, private adapters deleted (off this replica's engines now,
    unless a request still uses one: then at the next sweep, as on other replicas)."""
    await service.delete_tenant(state, session, tenant_id, actor=admin.key_id)
    return DeletedPublic(id=tenant_id, object="tenant")


@router.put("/tenants/{tenant_id}/quota")
async def put_quota(tenant_id: str, body: QuotaBody, state: StateDep, session: SessionDep,
                    admin: AdminDep) -> TenantPublic:
    return TenantPublic.from_row(await service.set_quota(state, session, tenant_id, body, actor=admin.key_id))
