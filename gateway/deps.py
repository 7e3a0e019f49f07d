"""The FastAPI dependencies routes declare as parameters: the app's state, a database
session (503 `database_unavailable` when the database is down or does not answer: each of
its calls is bounded by `database_timeout_s`, see `app.database_engine`), and the caller as
a tenant or as an admin.

    async def route(session: SessionDep, admin: AdminDep) -> TenantPublic: ...
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends
from sqlalchemy.ext.asyncio import AsyncSession

from lockgate.gateway.auth import admin_principal, tenant_principal
from lockgate.gateway.errors import APIError
from lockgate.gateway.state import AppState, app_state, database_unavailable, is_database_down
from lockgate.tenancy.auth import Principal
from lockgate.tenancy.errors import Conflict, Invalid, NotFound

StateDep = Annotated[AppState, Depends(app_state)]


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
