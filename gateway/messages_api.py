"""Anthropic's Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`, for
the `anthropic` client and Claude Code. The key comes as `x-api-key` (a Lockgate tenant key)
or `Authorization: Bearer`; `anthropic-version` and `anthropic-beta` are accepted and not
needed. Every error is in Anthropic's shape (`AnthropicRoute`). Each route parses and
authorizes through its dependencies and calls the serving layer once."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel

from lockgate.gateway.anthropic_errors import AnthropicRoute
from lockgate.gateway.anthropic_protocol import CountTokensRequest, MessagesRequest
from lockgate.gateway.deps import StateDep, TenantDep
from lockgate.gateway.openapi import json_body
from lockgate.gateway.serving.messages import count_tokens, serve_messages

router = APIRouter(route_class=AnthropicRoute)
BODY_MODELS = (MessagesRequest, CountTokensRequest)   # read by the routes, shown in the schema


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    """Every error of these routes, in Anthropic's shape."""

    type: str
    error: AnthropicErrorDetail


_STATUSES = {400: "The request is malformed or asks for what Lockgate cannot honour (the message names the field)",
             401: "No API key, or one that is invalid, expired or revoked",
             403: "The key may not do this (an admin key, a tier outside the plan)",
             404: "No such model (after the aliases), or one the tenant may not see",
             413: "The request body is over the server's limit",
             415: "The body is not JSON in UTF-8",
             429: "A rate limit, quota or budget refused the request (see `Retry-After`)",
             503: "The server is draining, or its limiter or database is unavailable",
             529: "The engine is overloaded; retry"}


def _errors(*statuses: int) -> dict[int | str, dict]:
    return {s: {"model": AnthropicError, "description": _STATUSES[s]} for s in statuses}


@router.post("/v1/messages", openapi_extra=json_body(MessagesRequest),
             responses=_errors(400, 401, 403, 404, 413, 415, 429, 503, 529))
async def messages(request: Request, principal: TenantDep, state: StateDep) -> Response:
    return await serve_messages(request, state, principal)


@router.post("/v1/messages/count_tokens", openapi_extra=json_body(CountTokensRequest),
             responses=_errors(400, 401, 403, 404, 413, 415, 429, 503))
async def messages_count_tokens(request: Request, principal: TenantDep, state: StateDep) -> dict[str, int]:
    return await count_tokens(request, state, principal)
