"""The chaos run's three routes, as a client speaks each: `POST /v1/chat/completions`,
`/v1/responses` (OpenAI's Responses API) and `/v1/messages` (Anthropic's Messages API),
streamed or not, over httpx. `send(route, ...)` sends an attempt and reads its answer into
the `Attempt` with the route's own readers (a JSON body, a stream's events): the status, the outcome (see
`chaos_client.OUTCOMES`), the tokens the client was told, the server's request id (from the
answer's own id: the limiter's lease member and the usage row's `request_id`) and the
content events a stream delivered.

Plain httpx rather than each vendor's SDK: one transport for the three, no retries of its
own, and the break of a connection read as it happened (refused before the status line:
"unreachable"; broken after it: "cut"), which the checks need and the SDKs fold into one
exception. A stream has ended properly when its route's last event came: `data: [DONE]`
(chat), `response.completed` or `response.incomplete` (Responses), `message_stop`
(Messages); an error event is "stream_error"; anything else "cut".

A stream may be left on purpose (`Attempt.leave_after`: the client closes it after that many
content events, outcome "left"): a live server must then still write the one row.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    from lockgate.loadtests.harness.chaos_client import Attempt

ROUTES = ("chat", "responses", "messages")
PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}
# the answer's id is the server's request id behind this prefix
_ID_PREFIXES = {"chat": "chatcmpl-", "responses": "resp_", "messages": "msg_"}


class _Left(Exception):
    """The client leaves the stream (`Attempt.leave_after` content events read)."""


def body(route: str, stream: bool, max_tokens: int, i: int) -> dict[str, Any]:
    """Attempt i's request body on `route`: the same prompt and length on each."""
    text = f"chaos request {i}: tell me a story"
    if route == "responses":
        return {"model": "tiny", "input": text, "max_output_tokens": max_tokens, "stream": stream}
    out: dict[str, Any] = {"model": "tiny", "max_tokens": max_tokens, "stream": stream,
                           "messages": [{"role": "user", "content": text}]}
    if stream and route == "chat":
        out["stream_options"] = {"include_usage": True}
    return out


def headers(route: str, key: str, client_id: str) -> dict[str, str]:
    auth = ({"x-api-key": key, "anthropic-version": "2023-06-01"} if route == "messages"
            else {"Authorization": f"Bearer {key}"})
    return {**auth, "x-request-id": client_id}


def server_id(route: str, answer_id: str | None) -> str | None:
    prefix = _ID_PREFIXES[route]
    return answer_id[len(prefix):] if answer_id and answer_id.startswith(prefix) else None


def error_code(route: str, resp: httpx.Response, text: str) -> str | None:
    """OpenAI's `error.code`; Anthropic's shape has only `error.type`, and a spent budget is
    its 429 with `x-should-retry: false` (named `insufficient_quota` as chat's is)."""
    try:
        error = json.loads(text)["error"]
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(error, dict):
        return None
    if route != "messages":
        return error.get("code")
    if resp.status_code == 429 and resp.headers.get("x-should-retry") == "false":
        return "insufficient_quota"
    if resp.status_code == 503 and "rate limiter" in str(error.get("message", "")):
        return "limiter_unavailable"
    return error.get("type")


def _delta(a: Attempt) -> None:
    a.deltas += 1
    if a.leave_after and a.deltas >= a.leave_after:
        raise _Left


# -- each route's stream events and JSON body -----------------------------------------------------
def _chat_event(a: Attempt, event: dict[str, Any]) -> bool:
    if "error" in event:
        a.outcome, a.error_code = "stream_error", event["error"].get("code")
        return True
    a.server_id = a.server_id or server_id("chat", event.get("id"))
    if event.get("usage"):
        a.usage = (event["usage"]["prompt_tokens"], event["usage"]["completion_tokens"])
    if any((c.get("delta") or {}).get("content") for c in event.get("choices") or []):
        _delta(a)
    return False


def _responses_event(a: Attempt, event: dict[str, Any]) -> bool:
    kind = event.get("type")
    response = event.get("response") or {}
    if kind == "response.created":
        a.server_id = server_id("responses", response.get("id"))
    elif kind == "response.output_text.delta":
        _delta(a)
    elif kind in ("response.completed", "response.incomplete"):
        a.usage = (response["usage"]["input_tokens"], response["usage"]["output_tokens"])
        a.outcome = "ok"
        return True
    elif kind in ("response.failed", "error"):
        error = response.get("error") or event.get("error") or {}
        a.outcome, a.error_code = "stream_error", error.get("code")
        return True
    return False


def _messages_usage(u: dict[str, Any]) -> tuple[int, int]:
    prompt = u["input_tokens"] + u.get("cache_read_input_tokens", 0) + u.get("cache_creation_input_tokens", 0)
    return prompt, u["output_tokens"]


def _messages_event(a: Attempt, event: dict[str, Any]) -> bool:
    kind = event.get("type")
    if kind == "message_start":
        a.server_id = server_id("messages", event["message"].get("id"))
    elif kind == "content_block_delta":
        _delta(a)
    elif kind == "message_delta" and event.get("usage"):
        a.usage = _messages_usage(event["usage"])
    elif kind == "message_stop":
        a.outcome = "ok"
        return True
    elif kind == "error":
        a.outcome, a.error_code = "stream_error", event["error"].get("type")
        return True
    return False


def _read_body(route: str, a: Attempt, data: dict[str, Any]) -> None:
    a.server_id = server_id(route, data.get("id"))
    u = data["usage"]
    if route == "chat":
        a.usage = (u["prompt_tokens"], u["completion_tokens"])
    elif route == "responses":
        a.usage = (u["input_tokens"], u["output_tokens"])
    else:
        a.usage = _messages_usage(u)
    a.outcome = "ok"


_EVENTS: dict[str, Callable[[Attempt, dict[str, Any]], bool]] = {
    "chat": _chat_event, "responses": _responses_event, "messages": _messages_event}


async def _read_stream(route: str, resp: httpx.Response, a: Attempt) -> None:
    """Read the SSE body until the route's last event (or an error event); "cut" if it ends
    before; "left" if the client left on purpose."""
    a.outcome = "cut"
    on_event = _EVENTS[route]
    try:
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                a.outcome = "ok" if route == "chat" else "cut"
                return
            if on_event(a, json.loads(line[6:])):
                return
    except _Left:
        a.outcome = "left"


# -- one attempt ------------------------------------------------------------------------------------
async def send(route: str, client: httpx.AsyncClient, url: str, key: str, payload: dict[str, Any],
               a: Attempt, timeout: float) -> httpx.Response | None:
    """One attempt on `route`, recorded in `a`; the response of an HTTP error (to read
    Retry-After)."""
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", url + PATHS[route], json=payload,
                                     headers=headers(route, key, a.client_id)) as resp:
                a.status = resp.status_code
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")
                    a.outcome, a.error_code = "refused", error_code(route, resp, text)
                    return resp
                if payload["stream"]:
                    await _read_stream(route, resp, a)
                else:
                    _read_body(route, a, json.loads(await resp.aread()))
    except (httpx.ConnectError, httpx.ConnectTimeout):
        a.outcome = "unreachable"
    except (TimeoutError, httpx.TimeoutException):
        a.outcome = "timeout"
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, TypeError):
        # the connection broke: before the status line (unreachable) or after it (cut)
        a.outcome = "unreachable" if a.status is None else "cut"
    return None

