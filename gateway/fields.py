"""What a request may give where the database will look it up or store it: an identifier or a
name without NUL, an integer inside 64 bits. PostgreSQL refuses both (a NUL in text is not in
its repertoire; a bigint stops at 2**63 - 1) with an error raised mid-statement, so each is
a 400 naming the field here, before any statement runs. SQLite takes both, which is why a
test on it alone never sees the difference.

- `Ident`: a string field that names something (a model, a tenant, a key, an id).
- `Int64`, `Count`: an integer field whose value may reach the database (`Count`: >= 0).
- `refuse_nul_params`: the app's dependency that checks every route's query and path
  parameters, whatever the route reads them with.

Free text (prompts, messages, stop sequences) is not checked: a NUL is a character a
tokenizer takes, and no prompt is stored in a text column (a batch line's body is in a JSON
column, where PostgreSQL keeps a NUL escaped, as `\u0000`).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Request
from pydantic import AfterValidator, Field
from pydantic_core import PydanticCustomError

from lockgate.gateway.errors import APIError

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
NUL = "\x00"
NUL_MESSAGE = "must not contain a NUL character (\\u0000)"


def _no_nul(value: str) -> str:
    if NUL in value:
        raise PydanticCustomError("nul_character", NUL_MESSAGE)
    return value


Ident = Annotated[str, AfterValidator(_no_nul)]
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
Count = Annotated[int, Field(ge=0, le=INT64_MAX)]


def refuse_nul(value: str, field: str) -> str:
    """`value`, or a 400 naming `field` if it holds a NUL."""
    if NUL in value:
        raise APIError(400, f"{field}: {NUL_MESSAGE}", param=field, code="invalid_value")
    return value


async def refuse_nul_params(request: Request) -> None:
    """Every path and query parameter (name and value) without NUL: routes read some through
    FastAPI and some from `request.query_params` themselves, and all of them may end up in a
    WHERE clause."""
    for name, value in request.path_params.items():
        if isinstance(value, str):
            refuse_nul(value, name)
    for name, value in request.query_params.multi_items():
        if NUL in name:
            raise APIError(400, f"query parameter {name!r}: a name {NUL_MESSAGE}",
                           param=name.replace(NUL, "\\u0000"), code="invalid_value")
        refuse_nul(value, name)
