"""vLLM's adapter routes, for tools written against vLLM, as aliases of the admin adapter
routes (admin keys only, like every /admin route):

    POST /v1/load_lora_adapter   {lora_name, lora_path[, base_model]}   -> 200, text
    POST /v1/unload_lora_adapter {lora_name}                            -> 200, text

Loading registers a public adapter (every tenant whose model list allows its base model may
use it; `/admin/v1/adapters` makes private ones). `lora_path` is a directory under the
adapter root, as for `/admin/v1/adapters`. `base_model` may be left out when one model is
served. Unloading deletes it, as vLLM's does (`POST /admin/v1/adapters/{id}/unload` only
drops its weights from memory).
"""

from __future__ import annotations

from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from lockgate.engine import AdapterInUse
from lockgate.gateway.admin.adapters import in_use_error, register_adapter
from lockgate.gateway.admin.route import admin_router
from lockgate.gateway.deps import AdminDep, SessionDep, StateDep
from lockgate.gateway.errors import APIError
from lockgate.gateway.fields import Ident, Int64
from lockgate.gateway.openapi import error_responses
from lockgate.gateway.schemas import AdapterCreate
from lockgate.gateway.state import AppState
from lockgate.tenancy import adapters as adapter_rows
from lockgate.tenancy.errors import Invalid

router = admin_router()
PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")    # admin routes outside /admin
_TEXT_OK: dict[int | str, dict] = {200: {"description": "Done, in a sentence (as vLLM answers)",
                                        "content": {"text/plain": {"schema": {"type": "string"}}}}}
_PARAMS = {"name": "lora_name", "path": "lora_path", "base_model": "base_model"}


class LoadLoRAAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: Ident = Field(min_length=1, max_length=64)
    lora_path: Ident = Field(min_length=1, max_length=1024)
    base_model: Ident | None = Field(default=None, min_length=1, max_length=128)
    load_inplace: bool = False      # vLLM's: replace an adapter of the same name (refused here)


class UnloadLoRAAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: Ident = Field(min_length=1, max_length=64)
    lora_int_id: Int64 | None = None  # vLLM's; the name alone identifies an adapter here


def _base_model(state: AppState, given: str | None) -> str:
    if given is not None:
        return given
    if len(state.models) == 1:
        return next(iter(state.models))
    raise APIError(400, f"base_model: several models are served ({', '.join(sorted(state.models))}); "
                   "name the adapter's", param="base_model")


def _renamed(exc: APIError | Invalid) -> APIError:
    """The admin route's refusal, its field named as in vLLM's body."""
    if isinstance(exc, Invalid):
        field = getattr(exc, "field", None)
        exc = APIError(400, str(exc), param=field)
    param = _PARAMS.get(exc.param or "", exc.param)
    message = exc.message
    if exc.param and message.startswith(f"{exc.param}: ") and param:
        message = f"{param}: " + message.removeprefix(f"{exc.param}: ")
    return APIError(exc.status, message, param=param, code=exc.code, headers=exc.headers)


@router.post(PATHS[0], responses={**_TEXT_OK, **error_responses(409)})
async def load_lora_adapter(body: LoadLoRAAdapter, state: StateDep, session: SessionDep,
                            admin: AdminDep) -> PlainTextResponse:
    if body.load_inplace:
        raise APIError(400, "load_inplace: not supported; unload the adapter first",
                       param="load_inplace", code="unsupported_parameter")
    create = AdapterCreate(name=body.lora_name, base_model=_base_model(state, body.base_model),
                           path=body.lora_path)
    try:
        await register_adapter(state, session, create, actor=admin.key_id)
    except (APIError, Invalid) as exc:
        raise _renamed(exc) from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post(PATHS[1], responses={**_TEXT_OK, **error_responses(404, 409)})
async def unload_lora_adapter(body: UnloadLoRAAdapter, state: StateDep, session: SessionDep,
                              admin: AdminDep) -> PlainTextResponse:
    row = await adapter_rows.find_adapter(session, body.lora_name)
    if row is None:
        raise APIError(404, f"lora_name: no adapter named {body.lora_name!r}", param="lora_name",
                       code="not_found")
    try:
        await state.models.adapters.delete(session, row, actor=admin.key_id)
    except AdapterInUse as exc:
        raise in_use_error(exc, row.name) from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
