"""The API's service tiers (`TIERS`) and the engine's refusals and ends as HTTP errors."""

from __future__ import annotations

import math

from lockgate.engine import EngineDead, EngineOverloaded, InvalidRequest, OverloadStats, PromptTooLong
from lockgate.gateway.errors import APIError

# The one place the API's service tiers meet the engine's service classes (most urgent first:
# priority, online, offline): tier -> (service class, priority within the tenant). A waiting
# `priority` request preempts online and offline work; `flex` is background work, the first to
# be refused (429 `resource_unavailable`, as OpenAI's flex tier answers): by the gateway while
# the engine's queue takes longer than `flex_max_queue_s` to compute (`flex_refusal`), by the
# engine when its queue's memory bound is reached; and its queued non-streaming requests are
# the first shed to make room for more urgent arrivals. The other tiers' refusals are 503
# `engine_overloaded`. The engine itself refuses only what does not fit its queue's tokens, so
# a library user's batch of offline work is queued, not refused.
TIERS = {"priority": ("priority", 0), "default": ("online", 0), "flex": ("offline", 0)}


class RunCut(APIError):
    """The gateway ended the run (shutdown, `request_timeout_s`): its row is `cancelled`."""

    usage_status = "cancelled"


def usage_status(exc: BaseException) -> str:
    """The usage status of a run that ended with `exc`: `cancelled` for a cut, else `error`."""
    return getattr(exc, "usage_status", "error")


def cut_error(reason: str, timeout_s: float) -> RunCut:
    if reason == "timeout":
        return RunCut(504, f"The request exceeded request_timeout_s ({timeout_s:g} s) and was ended.",
                      code="request_timeout")
    return RunCut(503, "The server is shutting down; the request was ended. Retry on another replica.",
                  code="server_shutdown", headers={"retry-after": "5"})


def engine_unavailable(exc: EngineDead, what: str) -> APIError:
    """The answer when the engine cannot serve: it `what` ("stopped", "is not running")."""
    return APIError(503, f"The engine {what}: {exc}", code="engine_unavailable",
                    headers={"retry-after": "5"})


def flex_refusal(tier: str, overload: OverloadStats | None, max_queue_s: float) -> EngineOverloaded | None:
    """The gateway's refusal of a flex request, before it reaches the engine: the engine's
    queued work would take more than `max_queue_s` to compute. None: let it through (the
    engine's own bound still holds; an engine with no cost model yet is not judged)."""
    if tier != "flex" or overload is None or overload.drain_s is None or overload.drain_s <= max_queue_s:
        return None
    return EngineOverloaded(f"service_class 'offline': the queue takes {overload.drain_s:.1f} s to "
                            f"compute, over flex_max_queue_s ({max_queue_s:g} s)",
                            service_class="offline",
                            retry_after=min(60.0, overload.drain_s - max_queue_s))


def overloaded(tier: str, exc: EngineOverloaded) -> APIError:
    """The answer to an engine refusal or shed: flex 429 `resource_unavailable`, the other
    tiers 503 `engine_overloaded`; Retry-After as the engine estimates it."""
    headers = {"retry-after": str(max(1, math.ceil(exc.retry_after)))}
    if tier == "flex":
        return APIError(429, "Resource unavailable: the flex tier has no capacity right now; "
                        "retry later.", code="resource_unavailable", headers=headers)
    return APIError(503, f"The engine is busy: {exc}. Retry shortly.", code="engine_overloaded",
                    headers=headers)


def submit_error(exc: PromptTooLong | EngineDead | InvalidRequest) -> APIError:
    """The answer to an engine's refusal of a prompt at submit."""
    if isinstance(exc, PromptTooLong):
        return APIError(400, str(exc), param="messages", code="context_length_exceeded")
    if isinstance(exc, EngineDead):
        return engine_unavailable(exc, "is not running")
    return APIError(400, str(exc), param=exc.field)
