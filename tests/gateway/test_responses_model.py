"""What the model writes through the Responses API: the official `openai` client against the
gateway in process with the real engine on the random-weight demo model (its free text is
noise: only the grammar makes an answer parse). `text.format` with a pydantic model
(`responses.parse`) and a forced function call go through the chat path's grammar."""

from __future__ import annotations

import json
from typing import Annotated, Literal

import jsonschema
import pytest
import pytest_asyncio
from pydantic import BaseModel, ConfigDict, Field

pytestmark = pytest.mark.asyncio(loop_scope="module")


class Pet(BaseModel):
    model_config = ConfigDict(extra="forbid")     # additionalProperties: false, a bounded schema
    kind: Literal["cat", "dog", "fish"]
    age: Annotated[int, Field(ge=0, le=30)]


TZ = {"type": "object", "additionalProperties": False, "required": ["tz"],
      "properties": {"tz": {"enum": ["UTC", "CET", "PST"]}}}
TOOLS = [{"type": "function", "name": "get_time", "parameters": TZ}]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(model_gateway):
    _, key = await model_gateway.tenant()
    return model_gateway.openai(key)


async def test_parse_with_a_pydantic_model(client):
    """`responses.parse` sends `text.format` as a strict json_schema: the grammar holds the
    answer to it, so it parses into the model, whole and streamed."""
    for seed_text in ("A pet?", "Another pet?"):
        r = await client.responses.parse(model="tiny", input=seed_text, text_format=Pet, max_output_tokens=60)
        assert r.status == "completed", r.output_text
        assert isinstance(r.output_parsed, Pet)
    async with client.responses.stream(model="tiny", input="A third pet?", text_format=Pet,
                                       max_output_tokens=60) as stream:
        final = await stream.get_final_response()
    assert isinstance(final.output_parsed, Pet)


async def test_forced_call_is_a_function_call_item_with_valid_arguments(client):
    r = await client.responses.create(model="tiny", input="What time is it?", tools=TOOLS, tool_choice="required",
                                      parallel_tool_calls=False, max_output_tokens=40)
    [call] = r.output
    assert call.type == "function_call" and call.name == "get_time" and r.status == "completed"
    jsonschema.validate(json.loads(call.arguments), TZ)
    r2 = await client.responses.create(model="tiny", previous_response_id=r.id, tools=TOOLS, max_output_tokens=4,
                                       input=[{"type": "function_call_output", "call_id": call.call_id,
                                               "output": "12:00"}])
    assert r2.output[0].type == "message" and r2.usage.output_tokens <= 4
