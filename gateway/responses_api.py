"""OpenAI's Responses API: `POST /v1/responses` (one call to the serving layer, as chat's),
and a tenant's stored responses: `GET /v1/responses/{id}`, its input items
(`GET /v1/responses/{id}/input_items`, pages as OpenAI's lists) and `DELETE`. Another
tenant's response, a deleted one and one past its retention all answer 404."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from lockgate.gateway.deps import SessionDep, StateDep, TenantDep
from lockgate.gateway.openapi import error_responses, json_body
from lockgate.gateway.responses_protocol import ResponsesRequest
from lockgate.gateway.serving.responses import serve_responses
from lockgate.tenancy import stored_responses

router = APIRouter()
BODY_MODELS = (ResponsesRequest,)     # read by the route, shown in the schema


@router.post("/v1/responses", openapi_extra=json_body(ResponsesRequest),
             responses=error_responses(400, 401, 403, 404, 413, 415, 429, 503))
async def create_response(request: Request, principal: TenantDep, state: StateDep) -> Response:
    return await serve_responses(request, state, principal)


@router.get("/v1/responses/{response_id}", responses=error_responses(401, 403, 404))
async def get_response(response_id: str, principal: TenantDep, session: SessionDep) -> dict[str, Any]:
    row = await stored_responses.get_response(session, response_id=response_id,
                                              tenant_id=principal.tenant_id or "")
    return row.response


@router.get("/v1/responses/{response_id}/input_items", responses=error_responses(400, 401, 403, 404))
async def list_input_items(response_id: str, principal: TenantDep, session: SessionDep,
                           after: str | None = None, before: str | None = None,
                           limit: Annotated[int, Query(ge=1, le=100)] = 20,
                           order: Annotated[str, Query(pattern="^(asc|desc)$")] = "desc") -> dict[str, Any]:
    items, more = await stored_responses.input_items_page(
        session, response_id=response_id, tenant_id=principal.tenant_id or "", after=after, before=before,
        limit=limit, order=order)
    return {"object": "list", "data": items, "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None, "has_more": more}


@router.delete("/v1/responses/{response_id}", responses=error_responses(401, 403, 404))
async def delete_response(response_id: str, principal: TenantDep, session: SessionDep) -> dict[str, Any]:
    await stored_responses.delete_response(session, response_id=response_id, tenant_id=principal.tenant_id or "")
    return {"id": response_id, "object": "response.deleted", "deleted": True}
