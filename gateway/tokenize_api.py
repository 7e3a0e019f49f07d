"""vLLM's `/tokenize` and `/detokenize`, behind a tenant's key, for the models it may use.

    POST /tokenize   {model, prompt, add_special_tokens=true, return_token_strs=false}
                  or {model, messages, add_generation_prompt=true, return_token_strs=false}
                  -> {count, max_model_len, tokens[, token_strs]}
    POST /detokenize {model, tokens} -> {prompt}

A chat's tokens are exactly those `/v1/chat/completions` would send the engine (the model's
template; special tokens inside messages read as text). Neither route is billed; each counts
against the key's and the tenant's request rate and concurrency like any request.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator

from lockgate.gateway.deps import StateDep, TenantDep
from lockgate.gateway.errors import APIError
from lockgate.gateway.fields import Ident
from lockgate.gateway.model_catalog import ModelInfo
from lockgate.gateway.openapi import error_responses, json_body
from lockgate.gateway.protocol import Bool, ChatMessage, Int, parse, read_json
from lockgate.gateway.serving.prepare import resolve_model, tokenizer_error
from lockgate.gateway.serving.ticket import admitted
from lockgate.gateway.state import AppState
from lockgate.gateway.tokenize_pool import TokenizerError
from lockgate.gateway.tool_calls import prompt_messages

router = APIRouter()
_ERRORS = error_responses(400, 401, 403, 404, 413, 415, 429, 503)


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Ident = Field(min_length=1, max_length=256)
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: Bool | None = None       # prompt: default true; messages: false only
    add_generation_prompt: Bool = True           # messages only: the template's own default
    return_token_strs: Bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if self.messages is not None and self.add_special_tokens:
            raise ValueError("add_special_tokens: with messages the chat template places every "
                             "special token; it cannot be true")
        if self.prompt is not None and not self.add_generation_prompt:
            raise ValueError("add_generation_prompt: applies to messages only")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Ident = Field(min_length=1, max_length=256)
    tokens: list[Int] = Field(max_length=1 << 20)


async def tokenize_body(state: AppState, info: ModelInfo, req: TokenizeRequest) -> list[int]:
    limit = state.settings.max_prompt_chars
    if req.messages is not None:
        # as the chat route renders them (assistant tool calls included; no tools here)
        messages: list[dict[str, Any]] = prompt_messages(req.messages, None, info.tokenizer.template_renders_tools)[0]
        if sum(len(m["content"]) for m in messages) > limit:
            raise APIError(400, f"messages: longer than {limit} characters", param="messages")
        if not req.add_generation_prompt:
            text = await asyncio.to_thread(info.tokenizer.apply_chat_template, messages,
                                           add_generation_prompt=False)
            return await asyncio.to_thread(info.encode, text, False)
        return await state.tokenize.chat_prompt_ids(info, messages, bound=False)     # any length counted
    prompt = req.prompt or ""
    if len(prompt) > limit:
        raise APIError(400, f"prompt: longer than {limit} characters", param="prompt")
    if req.add_special_tokens is False:
        return await asyncio.to_thread(info.encode, prompt, False)
    return await state.tokenize.encode(info, prompt, bound=False)


@router.post("/tokenize", openapi_extra=json_body(TokenizeRequest), responses=_ERRORS)
async def tokenize(request: Request, principal: TenantDep, state: StateDep) -> dict:
    async with admitted(state, principal, request) as ticket:
        req = parse(TokenizeRequest, await read_json(request))
        entry = await resolve_model(state.models, principal, req.model)
        info = entry.info
        try:
            ids = await tokenize_body(state, info, req)
        except TokenizerError as exc:
            raise tokenizer_error(exc) from None
        except APIError:
            raise
        except Exception as exc:  # noqa: BLE001 - a template's own error is the client's input
            raise APIError(400, f"messages: the chat template refused them: {exc}",
                           param="messages") from None
        if ticket.deferred:
            await ticket.count()        # against the request rate, as any request
        out: dict[str, Any] = {"count": len(ids), "max_model_len": info.max_model_len, "tokens": ids}
        if req.return_token_strs:
            out["token_strs"] = [info.tokenizer.id_to_token(i) for i in ids]
        return out


@router.post("/detokenize", openapi_extra=json_body(DetokenizeRequest), responses=_ERRORS)
async def detokenize(request: Request, principal: TenantDep, state: StateDep) -> dict:
    async with admitted(state, principal, request) as ticket:
        req = parse(DetokenizeRequest, await read_json(request))
        info = (await resolve_model(state.models, principal, req.model)).info
        vocab = info.vocab_size
        bad = next((k for k, t in enumerate(req.tokens) if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"tokens[{bad}]: token ids must be integers in [0, {vocab})",
                           param="tokens")
        text = await asyncio.to_thread(info.tokenizer.decode, req.tokens, False)
        if ticket.deferred:
            await ticket.count()
        return {"prompt": text}


BODY_MODELS = (TokenizeRequest, DetokenizeRequest)      # shown in /openapi.json
