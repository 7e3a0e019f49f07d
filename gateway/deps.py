"""The FastAPI dependencies routes declare as parameters: the app's state, a database
session (503 `database_unavailable` when the database is down or does not answer: each of
its calls is bounded by `database_timeout_s`, see `app.database_engine`), and the caller as
a tenant or as an admin; the served models (`ModelsDep`); the caller's own tenant, for the
routes that report on one (`OwnTenantDep`).

    async def route(session: SessionDep, admin: AdminDep) -> TenantPublic: ...
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.ext.asyncio import AsyncSession

from lockgate.gateway.caller import admin_principal, tenant_principal
from lockgate.gateway.errors import APIError, database_unavailable, is_database_down
from lockgate.gateway.model_directory import ModelDirectory
from lockgate.gateway.state import AppState, app_state
from lockgate.tenancy.auth import Principal
from lockgate.tenancy.errors import Conflict, Invalid, NotFound

StateDep = Annotated[AppState, Depends(app_state)]


def model_directory(state: StateDep) -> ModelDirectory:
    return state.models


ModelsDep = Annotated[ModelDirectory, Depends(model_directory)]   # the served models and adapters


async def open_session(state: StateDep) -> AsyncIterator[AsyncSession]:
    """A session for one route, closed when the route returns; tenancy's refusals raised in
    the route become 404, 409 or 400 naming the field, a database that is down 503."""
    try:
        async with state.sessions() as session:
            yield session
    except NotFound as exc:
        raise APIError(404, str(exc), code="not_found") from None
    except Conflict as exc:
        raise APIError(409, str(exc), param=getattr(exc, "field", None), code="conflict") from None
    except Invalid as exc:
        raise APIError(400, str(exc), param=getattr(exc, "field", None)) from None
    except Exception as exc:
        if is_database_down(exc):
            raise database_unavailable() from None
        raise


SessionDep = Annotated[AsyncSession, Depends(open_session, scope="function")]
TenantDep = Annotated[Principal, Depends(tenant_principal)]    # a tenant's key, scope inference
AdminDep = Annotated[Principal, Depends(admin_principal)]      # an admin key


def own_tenant(request: Request, principal: TenantDep) -> str:
    """The caller's tenant, for a tenant route that reads one tenant's reports: a
    `tenant_id` query naming another tenant is refused (403), never silently widened."""
    asked = request.query_params.get("tenant_id")
    if principal.tenant_id is None or asked not in (None, "", principal.tenant_id):
        raise APIError(403, "A tenant's key reads only its own tenant's usage and quotas.", param="tenant_id",
                       code="permission_denied")
    return principal.tenant_id


OwnTenantDep = Annotated[str, Depends(own_tenant)]   # the caller's own tenant id
