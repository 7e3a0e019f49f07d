"""The OpenAI-compatible routes: chat completions, completions, models, a tenant's usage.
Each parses and authorizes through its dependencies and calls the serving layer once."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from lockgate.gateway.deps import ModelsDep, OwnTenantDep, StateDep, TenantDep
from lockgate.gateway.model_directory import ModelEntry
from lockgate.gateway.openapi import error_responses, json_body
from lockgate.gateway.protocol import UNSUPPORTED_CHAT, UNSUPPORTED_COMPLETION, ChatCompletionRequest, CompletionRequest
from lockgate.gateway.quota_report import TENANT_QUERY, QuotaReportPublic, quota_response
from lockgate.gateway.serving.chat import chat_job
from lockgate.gateway.serving.completion import completion_job
from lockgate.gateway.serving.prepare import resolve_model
from lockgate.gateway.serving.respond import serve_inference
from lockgate.gateway.usage_api import usage_response

router = APIRouter()
BODY_MODELS = (ChatCompletionRequest, CompletionRequest)   # read by the routes, shown in the schema
_INFERENCE_ERRORS = error_responses(400, 401, 403, 404, 413, 415, 429, 503)


@router.post("/v1/chat/completions", openapi_extra=json_body(ChatCompletionRequest), responses=_INFERENCE_ERRORS)
async def chat_completions(request: Request, principal: TenantDep, state: StateDep) -> Response:
    return await serve_inference(request, state, principal, ChatCompletionRequest, UNSUPPORTED_CHAT, chat_job)


@router.post("/v1/completions", openapi_extra=json_body(CompletionRequest), responses=_INFERENCE_ERRORS)
async def completions(request: Request, principal: TenantDep, state: StateDep) -> Response:
    return await serve_inference(request, state, principal, CompletionRequest, UNSUPPORTED_COMPLETION,
                                 completion_job)


def model_card(m: ModelEntry) -> dict:
    """A model's card; an adapter's names its base model as `parent` and `root`."""
    return {"id": m.name, "object": "model", "created": m.created, "owned_by": "lockgate",
            "parent": m.parent, "root": m.parent or m.name, "max_model_len": m.info.max_model_len}


@router.get("/v1/models", responses=error_responses(401, 403))
async def list_models(principal: TenantDep, models: ModelsDep) -> dict:
    entries = models.visible(principal) + await models.visible_adapters(principal)
    return {"object": "list", "data": [model_card(m) for m in entries]}


@router.get("/v1/models/{model_id:path}", responses=error_responses(401, 403, 404))
async def get_model(model_id: str, principal: TenantDep, models: ModelsDep) -> dict:
    return model_card(await resolve_model(models, principal, model_id))


@router.get("/v1/usage", responses=error_responses(400, 401, 403))
async def tenant_usage(request: Request, tenant_id: OwnTenantDep, state: StateDep) -> Response:
    return await usage_response(state, request.query_params, tenant_id)


@router.get("/v1/usage/quota", responses=error_responses(400, 401, 403))
async def tenant_quota(request: Request, tenant_id: OwnTenantDep, state: StateDep) -> QuotaReportPublic:
    """The caller's tenant and its keys: each limit, its live use, and its refusals."""
    return await quota_response(state, request.query_params, tenant_id, allowed=TENANT_QUERY)
