"""The OpenAPI schema the gateway serves (`/openapi.json`, the app in process): the inference
routes' request bodies are the protocol's models, and every route documents the error
statuses the app really answers (400 for a bad body, never 422). (schemathesis against a
live server's schema: test_openapi_fuzz.py.)"""

from __future__ import annotations

import pytest
import pytest_asyncio

from tests.support.inprocess_gateway import running_gateway

pytestmark = pytest.mark.asyncio(loop_scope="module")

ERRORS = {"400", "401", "403", "404", "413", "429", "503"}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def schema(tmp_path_factory) -> dict:
    async with running_gateway(tmp_path_factory.mktemp("openapi")) as gw:
        r = await gw.http.get("/openapi.json")
    assert r.status_code == 200, r.text
    return r.json()


def resolve(schema: dict, node: dict) -> dict:
    while "$ref" in node:
        name = node["$ref"].removeprefix("#/components/schemas/")
        node = schema["components"]["schemas"][name]
    return node


@pytest.mark.parametrize(("path", "fields"), [
    ("/v1/chat/completions", {"model", "messages", "max_tokens", "stream"}),
    ("/v1/completions", {"model", "prompt", "max_tokens", "stream"}),
    ("/v1/responses", {"model", "input", "instructions", "tools", "text", "store", "previous_response_id"}),
    ("/v1/messages", {"model", "messages", "max_tokens", "stream", "system", "tools", "tool_choice"}),
    ("/v1/messages/count_tokens", {"model", "messages", "system", "tools"}),
])
async def test_inference_routes_describe_their_body_and_errors(schema, path, fields):
    op = schema["paths"][path]["post"]
    body = op.get("requestBody")
    assert body is not None, f"{path}: no requestBody in the schema"
    assert body["required"] is True
    model = resolve(schema, body["content"]["application/json"]["schema"])
    assert fields <= set(model["properties"]), sorted(model["properties"])
    assert "model" in model["required"]
    assert model.get("additionalProperties") is False
    assert set(op["responses"]) >= ERRORS, sorted(op["responses"])
    err = resolve(schema, op["responses"]["400"]["content"]["application/json"]["schema"])
    assert "error" in err["properties"]


async def test_no_route_documents_422(schema):
    found = [(p, m) for p, ops in schema["paths"].items() for m, op in ops.items()
             if "422" in op.get("responses", {})]
    assert not found, f"422 documented where the app answers 400: {found}"
    assert "HTTPValidationError" not in schema.get("components", {}).get("schemas", {})
    for path, ops in schema["paths"].items():
        for method, op in ops.items():
            if op.get("requestBody") or op.get("parameters"):
                assert "400" in op["responses"], f"{method.upper()} {path}: 400 not documented"


async def test_stored_response_routes_are_described(schema):
    ops = {(m, p) for p, methods in schema["paths"].items() for m in methods if p.startswith("/v1/responses/")}
    assert ops == {("get", "/v1/responses/{response_id}"), ("delete", "/v1/responses/{response_id}"),
                   ("get", "/v1/responses/{response_id}/input_items")}
    listing = schema["paths"]["/v1/responses/{response_id}/input_items"]["get"]
    assert {p["name"] for p in listing["parameters"]} == {"response_id", "after", "before", "limit", "order"}
    for path, methods in schema["paths"].items():
        if path.startswith("/v1/responses/"):
            for op in methods.values():
                assert {"400", "401", "403", "404"} <= set(op["responses"]), (path, sorted(op["responses"]))
