"""The live OpenAPI schema (`/openapi.json` of a real `lockgate serve`, issue 14 finding 11):
the inference routes' request bodies are the protocol's models, and every route documents
the error statuses the app really answers (400 for a bad body, never 422); and schemathesis,
bounded (a few examples per operation, loopback), finds neither a 5xx nor an answer the schema
does not describe, with a tenant key and with an admin key."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from tests.support.gateway_server import GatewayServer

ERRORS = {"400", "401", "403", "404", "413", "429", "503"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = GatewayServer.start(tmp_path_factory.mktemp("openapi"))
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def schema(server) -> dict:
    r = httpx.get(server.url + "/openapi.json", timeout=10)
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
])
def test_inference_routes_describe_their_body_and_errors(schema, path, fields):
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


def test_no_route_documents_422(schema):
    found = [(p, m) for p, ops in schema["paths"].items() for m, op in ops.items()
             if "422" in op.get("responses", {})]
    assert not found, f"422 documented where the app answers 400: {found}"
    assert "HTTPValidationError" not in schema.get("components", {}).get("schemas", {})
    for path, ops in schema["paths"].items():
        for method, op in ops.items():
            if op.get("requestBody") or op.get("parameters"):
                assert "400" in op["responses"], f"{method.upper()} {path}: 400 not documented"


CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"


@pytest.mark.parametrize("who", ["tenant", "admin"])
def test_schemathesis_finds_no_5xx_and_no_schema_violation(server, who, tmp_path):
    key = server.tenant()[1] if who == "tenant" else server.admin_key
    r = subprocess.run([sys.executable, "-m", "schemathesis.cli", "run", server.url + "/openapi.json",
                        "-H", f"Authorization: Bearer {key}", "-c", CHECKS, "-n", "5",
                        "--phases", "coverage,fuzzing", "--generation-deterministic", "--request-timeout", "10"],
                       capture_output=True, text=True, timeout=240, cwd=tmp_path)   # its .schemathesis/ there
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert " passed" in r.stdout, r.stdout[-3000:]
