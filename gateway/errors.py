"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Every failure the gateway means to report is an `APIError`; request-validation errors become
400s naming the field; anything else is logged and answered with a 500 that leaks nothing.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DBAPIError, OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _loc_to_param(loc: tuple[Any, ...]) -> str | None:
    # the first item says where (a field may be named "path" or "body" too)
    parts = [str(p) for p in (loc[1:] if loc and loc[0] in ("body", "query", "path", "header") else loc)]
    if not parts:
        return None
    out = parts[0]
    for p in parts[1:]:
        out += f"[{p}]" if p.isdigit() else f".{p}"
    return out


def validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    param = _loc_to_param(tuple(first.get("loc", ())))
    kind = first.get("type", "")
    if kind == "json_invalid":
        param = None          # the location is a character offset, not a field
    if kind == "extra_forbidden":
        msg = f"Unrecognized request argument supplied: {param}"
    elif kind == "json_invalid" or (param is None and "JSON" in str(first.get("msg", ""))):
        msg = f"The request body is not valid JSON: {first.get('msg')}"
    else:
        msg = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
        if len(errors) > 1:
            msg += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return APIError(400, msg, param=param, code="invalid_value" if kind != "extra_forbidden" else "unknown_parameter")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        msg = exc.detail if isinstance(exc.detail, str) else "error"
        if exc.status_code == 404:
            msg = f"Unknown route {request.method} {request.url.path}"
        return APIError(exc.status_code, msg, code=code, headers=dict(exc.headers or {})).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return internal_error().response()


def internal_error() -> APIError:
    """The one 500. It says `Connection: close`: Starlette raises the exception again once the
    answer is sent, and the server then drops the connection; a client told so opens a fresh
    one for its next request instead of sending it down a connection about to close."""
    return APIError(500, "The server had an error while processing your request.",
                    code="internal_error", headers={"connection": "close"})


def database_unavailable() -> APIError:
    """The one 503 for a database that does not answer."""
    return APIError(503, "The database is unavailable; retry shortly.", code="database_unavailable",
                    headers={"retry-after": "2"})


def is_database_down(exc: BaseException) -> bool:
    """A database that is down or does not answer (refused or dropped connections, a bounded
    wait run out), not a statement it refused."""
    if isinstance(exc, (OperationalError, OSError, TimeoutError)):
        return True
    if isinstance(exc, DBAPIError) and (exc.connection_invalidated
                                        or isinstance(exc.orig, (OSError, TimeoutError))):
        return True
    return _sqlstate(exc)[:2] in _DOWN_CLASSES


# SQLSTATE classes of a server that cannot serve now rather than a statement it refused:
# 08 connection exceptions, 57 operator intervention (57P03: still starting up or recovering)
_DOWN_CLASSES = ("08", "57")


def _sqlstate(exc: BaseException) -> str:
    """The PostgreSQL SQLSTATE under ``exc`` (SQLAlchemy's wrapper, its adapter, asyncpg), or ''."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        code = getattr(cur, "sqlstate", None) or getattr(cur, "pgcode", None)
        if isinstance(code, str):
            return code
        cur = getattr(cur, "orig", None) or cur.__cause__
    return ""
