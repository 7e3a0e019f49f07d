"""What every inference request goes through before its prompts are built: the body parsed
into its typed request, the model (or adapter) the tenant may use, the tier its plan allows,
the server's limits, the token budget of the completion and the engine's sampling parameters."""

from __future__ import annotations

from typing import Any, TypeVar

from lockgate.engine import InvalidRequest, SamplingParams, StructuredOutputsParams
from lockgate.gateway.errors import APIError
from lockgate.gateway.model_directory import ModelDirectory, ModelEntry
from lockgate.gateway.protocol import SamplingBody, parse, refuse_unsupported
from lockgate.gateway.settings import Settings
from lockgate.gateway.tokenize_pool import PromptTooLong, TokenizerBusy, TokenizerError
from lockgate.tenancy.auth import Principal

R = TypeVar("R", bound=SamplingBody)

# the sampling fields passed to the engine as they are, when the request sets them
_PASSED = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "top_k", "min_p",
           "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "skip_special_tokens",
           "include_stop_str_in_output", "speculative")


async def resolve_model(models: ModelDirectory, principal: Principal, name: str) -> ModelEntry:
    """A served model or adapter the tenant may use (404 otherwise: another tenant's
    adapter is indistinguishable from none)."""
    entry = await models.find(principal, name)
    if entry is None:
        raise APIError(404, f"The model `{name}` does not exist or you do not have access to it.",
                       param="model", code="model_not_found")
    return entry


def resolve_tier(principal: Principal, requested: str | None) -> str:
    tier = principal.default_tier if requested in (None, "auto") else requested
    if tier not in principal.service_tiers:
        raise APIError(403, f"service_tier {tier!r} is not in this tenant's plan "
                       f"(allowed: {', '.join(principal.service_tiers)})",
                       param="service_tier", code="service_tier_not_allowed")
    return tier


def check_common(settings: Settings, req: SamplingBody) -> None:
    if (req.n or 1) > settings.max_n:
        raise APIError(400, f"n: at most {settings.max_n} choices per request", param="n")
    if len(req.stop_list()) > settings.max_stop_sequences:
        raise APIError(400, f"stop: at most {settings.max_stop_sequences} stop sequences", param="stop")


async def prepare(models: ModelDirectory, settings: Settings, principal: Principal, data: dict[str, Any],
                  model: type[R], unsupported: tuple[str, ...], tier: str | None = None,
                  ) -> tuple[R, ModelEntry, str]:
    """A request's parsed body, its model (an adapter in use) and its tier (`tier`, when the
    caller fixes it, as a batch does: still checked against the plan); APIError otherwise."""
    refuse_unsupported(data, unsupported)
    req = parse(model, data)
    entry = await resolve_model(models, principal, req.model)
    tier = resolve_tier(principal, tier or req.service_tier)
    check_common(settings, req)
    if entry.parent is not None:
        await models.use_adapter(entry)
    return req, entry, tier


def sampling(req: SamplingBody, max_tokens: int, logprobs: int | None,
             structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
    kw: dict[str, Any] = {
        "n": req.n or 1, "max_tokens": max_tokens, "logprobs": logprobs,
        "stop": req.stop_list() or None, "seed": req.seed, "structured_outputs": structured_outputs,
        "logit_bias": req.token_bias(),
    }
    for name in _PASSED:
        value = getattr(req, name)
        if value is not None:
            kw[name] = value
    if kw.get("min_tokens", 0) > max_tokens:
        raise APIError(400, f"min_tokens ({kw['min_tokens']}) exceeds max_tokens ({max_tokens})",
                       param="min_tokens")
    try:
        return SamplingParams(**kw)
    except InvalidRequest as exc:
        raise APIError(400, str(exc), param=exc.field) from None


def _too_long(max_len: int, prompt_param: str, detail: str) -> APIError:
    return APIError(400, f"This model's maximum context length is {max_len} tokens. However, {detail}. "
                    f"Please reduce the length of the {prompt_param}"
                    + ("." if detail.startswith("your") else " or completion."),
                    param=prompt_param, code="context_length_exceeded")


def max_tokens_for(settings: Settings, entry: ModelEntry, prompt_len: int, requested: int | None,
                   param: str, prompt_param: str) -> int:
    """The completion's token budget: what was asked, or what the context leaves (capped by
    the server's `max_tokens_limit`); 400 when the prompt and it do not fit."""
    max_len = entry.info.max_model_len
    cap = settings.max_tokens_limit
    if requested is not None and cap is not None and requested > cap:
        raise APIError(400, f"{param}: at most {cap} on this server", param=param)
    if requested is None:
        left = max_len - prompt_len
        if left < 1:
            raise _too_long(max_len, prompt_param, f"your {prompt_param} resulted in {prompt_len} tokens")
        return min(left, cap) if cap is not None else left
    if prompt_len + requested > max_len:
        raise _too_long(max_len, prompt_param, f"you requested {prompt_len + requested} tokens ({prompt_len} "
                        f"in the {prompt_param}, {requested} in the completion)")
    return requested


def tokenizer_error(exc: TokenizerError) -> APIError:
    """The tokenizer's worker pool is full (`tokenizer_busy`) or failed: a 503 to retry; or
    the prompt could never fit (`PromptTooLong`, known before tokenizing): a 400."""
    if isinstance(exc, PromptTooLong):
        return _too_long(exc.max_model_len, exc.param,
                         f"your {exc.param} would be at least {exc.min_tokens} tokens")
    busy = isinstance(exc, TokenizerBusy)
    retry = exc.retry_after_s if isinstance(exc, TokenizerBusy) else 1
    return APIError(503, f"The prompt could not be tokenized now: {exc}. Retry shortly.",
                    code="tokenizer_busy" if busy else "tokenizer_unavailable",
                    headers={"retry-after": str(retry)})
