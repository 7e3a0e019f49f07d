"""The console's models and adapters (what /admin/v1/models and /admin/v1/adapters read: each
base model's residency, memory, queue and switches, each adapter's residency, and under a Ray
pool its workers and the placement's decisions with their reasons; registering and unloading
an adapter through the very `admin_service` calls of those routes) and the quota report (each
tenant's and key's limits against their live use, and the refusals per limit: the answer of
/admin/v1/quotas/report for the same query)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import RedirectResponse

from lockgate.gateway import admin_service as service
from lockgate.gateway.console.web import ConsoleRoute, ConsoleUser, authorize, form_of, render, signed_in, url_for
from lockgate.gateway.quota_report import ADMIN_QUERY, quota_response
from lockgate.gateway.schemas import AdapterCreate
from lockgate.gateway.state import app_state
from lockgate.tenancy import adapters
from lockgate.tenancy.quota import QUOTA_FIELDS

router = APIRouter(route_class=ConsoleRoute, include_in_schema=False)
QUOTA_QUERY = ("tenant_id", "start", "end", "after")
QUOTA_PAGE = "20"


async def _models_page(request: Request, user: ConsoleUser, *, status: int = 200,
                       done: str | None = None) -> Response:
    state = app_state(request)
    listing = service.models_listing(state)
    bases = [m for m in listing["data"] if "parent" not in m]
    held = {m["id"]: m for m in listing["data"] if "parent" in m}
    async with state.sessions() as session:
        rows = [service.adapter_public(a, state) for a in await adapters.list_adapters(session)]
    return render(request, "models.html", user, status=status, bases=bases, adapters=rows, held=held,
                  pool=listing["pool"], done=done)


@router.get("/console/models", name="console_models")
async def models_page(request: Request) -> Response:
    user = await signed_in(request)
    authorize(user, "models", "view")
    return await _models_page(request, user)


@router.post("/console/adapters", name="console_adapter_register")
async def adapter_register(request: Request) -> Response:
    user = await signed_in(request)
    form = await form_of(request, user, "models", "register_adapter")
    body = AdapterCreate.model_validate({
        "name": form.get("name", "").strip(), "base_model": form.get("base_model", "").strip(),
        "path": form.get("path", "").strip(), "owner_tenant_id": form.get("owner_tenant_id", "").strip() or None})
    state = app_state(request)
    async with state.sessions() as session:
        a = await service.register_adapter(state, session, body, actor=user.key_id)
    return await _models_page(request, user, status=201, done=f"Adapter {a.name} ({a.id}) registered.")


@router.post("/console/adapters/{adapter_id}/unload", name="console_adapter_unload")
async def adapter_unload(request: Request, adapter_id: str) -> Response:
    user = await signed_in(request)
    await form_of(request, user, "models", "unload_adapter")
    state = app_state(request)
    async with state.sessions() as session:
        await service.unload_adapter(state, session, adapter_id)
    return RedirectResponse(url_for(request, "console_models"), status_code=303)


@router.get("/console/quotas", name="console_quotas")
async def quotas_page(request: Request) -> Response:
    user = await signed_in(request)
    authorize(user, "quotas", "view")
    q = request.query_params
    query = {k: q[k] for k in QUOTA_QUERY if q.get(k)}
    report = await quota_response(app_state(request), {**query, "limit": QUOTA_PAGE}, query.get("tenant_id"),
                                  allowed=ADMIN_QUERY)
    return render(request, "quotas.html", user, report=report, query=query, fields=QUOTA_FIELDS,
                  next_after=report.last_id if report.has_more else None)
