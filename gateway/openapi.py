"""The OpenAPI schema (`/openapi.json`) as the app really answers, so schemathesis and client
generators can check it: the inference routes' request bodies (the protocol's models; those
routes read their bodies themselves, after authentication, so FastAPI cannot see them), the
OpenAI-shaped error body for each error status, and no 422 (a bad body is a 400 here)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

_REF = "#/components/schemas/{model}"
_STATUS_TEXT = {
    400: "The request is malformed: the error's `param` names the field",
    401: "No API key, or one that is invalid, expired or revoked",
    403: "The key may not do this (an admin key on a tenant route, a tier outside the plan)",
    404: "No such model or object, or one the tenant may not see",
    409: "The object conflicts with an existing one",
    413: "The request body is over the server's limit",
    415: "The body is not JSON in UTF-8",
    429: "A rate limit, quota or budget refused the request (see `Retry-After`)",
    503: "The server is draining, overloaded, or its limiter is unavailable",
}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """Every error's body, in OpenAI's shape."""

    error: ErrorDetail


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` for a route: each status with its meaning and the error body."""
    return {s: {"model": ErrorBody, "description": _STATUS_TEXT[s]} for s in statuses}


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra=` for a route that reads `model` from its JSON body itself."""
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}}}}


def common_errors(path: str, method: str, validated: bool) -> set[int]:
    """The errors any route of this shape may answer, whatever its own: a bad argument (400,
    where FastAPI validates one: it documented a 422), authentication and the key's kind
    (401, 403), a missing path object (404), the body limit (413), an admin object that
    conflicts (409), and the database or a draining server (503)."""
    statuses = {400} if validated else set()
    if path.startswith(("/v1/", "/admin/")):
        statuses |= {401, 403, 503}
    if "{" in path:
        statuses.add(404)
    if method in ("post", "put", "patch"):
        statuses |= {400, 413} | ({409} if path.startswith("/admin/") else set())
    return statuses


def install_openapi(app: FastAPI, bodies: Iterable[type[BaseModel]]) -> None:
    """`app.openapi()` (built once, on first request): FastAPI's schema with `bodies` and the
    error body among the components, every documented 422 turned into a 400, and each
    route's `common_errors` documented."""
    models: tuple[type[BaseModel], ...] = (*bodies, ErrorBody)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                js = model.model_json_schema(ref_template=_REF)
                components.update(js.pop("$defs", {}))
                components[model.__name__] = js
            for path, ops in schema["paths"].items():
                for method, op in ops.items():
                    responses = op.setdefault("responses", {})
                    validated = responses.pop("422", None) is not None
                    for status in sorted(common_errors(path, method, validated)):
                        responses.setdefault(str(status), {"description": _STATUS_TEXT[status], "content": {
                            "application/json": {"schema": {"$ref": _REF.format(model="ErrorBody")}}}})
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
