"""Errors in Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`, for the
Messages API's routes (`AnthropicRoute`): the same `APIError`s every route raises (from
authentication, admission, the limiter, parsing, the engine), each rendered with the status
the `anthropic` client maps to its exception (400 BadRequestError, 401 AuthenticationError,
404 NotFoundError, 429 RateLimitError, 529 OverloadedError...). An engine too busy to take the
request is Anthropic's 529 `overloaded_error`; the client retries it, as it retries 429s.

Errors answered before a route runs (the body-size limit's 413, a draining server's 503) keep
the OpenAI shape: the client still raises by their status."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from lockgate.gateway.errors import APIError, internal_error, validation_error

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    499: "api_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}
OVERLOADED = 529


def anthropic_status(exc: APIError) -> int:
    """The status Anthropic answers with: its 529 where the engine is overloaded."""
    return OVERLOADED if exc.code == "engine_overloaded" else exc.status


def error_body(exc: APIError) -> dict[str, Any]:
    """The error in Anthropic's shape; the field a 400 is about leads its message (as
    Anthropic writes `messages.0.content: ...`), so it is named there."""
    message = exc.message
    if exc.param and not message.startswith(exc.param):
        message = f"{exc.param}: {message}"
    message = message.replace(".function.parameters", ".input_schema")   # the chat path's name for it
    kind = _TYPES.get(anthropic_status(exc), "api_error" if exc.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(error_body(exc), status_code=anthropic_status(exc), headers=exc.headers)


def sse_error(exc: APIError) -> bytes:
    """A stream's error event, once its 200 went out."""
    return b"event: error\ndata: " + json.dumps(error_body(exc), separators=(",", ":")).encode() + b"\n\n"


class AnthropicRoute(APIRoute):
    """A route whose every error, its dependencies' included, is in Anthropic's shape."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def anthropic_errors(request: Request) -> Response:
            try:
                return await handler(request)
            except APIError as exc:
                return error_response(exc)
            except RequestValidationError as exc:
                return error_response(validation_error(exc))
            except StarletteHTTPException as exc:
                detail = exc.detail if isinstance(exc.detail, str) else "error"
                return error_response(APIError(exc.status_code, detail, headers=dict(exc.headers or {})))
            except Exception:
                logger.exception("unhandled error on %s %s", request.method, request.url.path)
                return error_response(internal_error())

        return anthropic_errors
