"""`lockgate serve --pool auto --tensor-parallel-size 2`: the pool's worker is a TP group (its
engine's rank 0 in the Ray actor, rank 1 a process beside it), placed on two `lockgate_device`
units of the local Ray the server starts, routed to and reported as one worker. One server for
the module, one worker (LOCKGATE_POOL_WORKERS=1: the test stays cheap on any machine)."""

from __future__ import annotations

import json
import time

import openai
import pytest

from tests.support.gateway_server import running_server
from tests.support.helpers import demo_model

pytestmark = pytest.mark.timeout(400)
MODEL = "tiny"
WORKER = "lockgate-worker-0"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # RAY_ADDRESS empty: `auto` starts a Ray of its own, never the tests' session cluster
    env = {"RAY_ADDRESS": "", "LOCKGATE_POOL_WORKERS": "1", "LOCKGATE_REQUEST_TIMEOUT_S": "60"}
    with running_server(tmp_path_factory.mktemp("pool-tp"), "embedded",
                        models={MODEL: demo_model("llama", "tiny", 0)},
                        extra_args=["--pool", "auto", "--tensor-parallel-size", "2"],
                        extra_env=env, timeout=240) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    _, key = server.tenant()
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)


def test_a_tp_worker_answers_the_openai_client_stream_and_not(client):
    plain = client.completions.create(model=MODEL, prompt="hello there", max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert plain.usage.completion_tokens == 12
    chunks = list(client.completions.create(model=MODEL, prompt="hello there", max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text
    assert chunks[-1].usage.completion_tokens == 12


def test_a_tp_worker_answers_structured_output(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["name", "age"], "additionalProperties": False}
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "a person"}], max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema, "strict": True}})
    value = json.loads(r.choices[0].message.content)
    assert set(value) == {"name", "age"} and isinstance(value["age"], int)


def test_the_tp_group_is_one_worker_holding_two_devices(server, client):
    """Placement took two `lockgate_device` units for the worker (Ray's own count of what the
    actor holds); /admin/v1/models and /metrics show one worker, of TP size 2, two devices."""
    client.completions.create(model=MODEL, prompt="one worker", max_tokens=2)
    workers = server.admin.get("/models").json()["pool"]["workers"]
    assert list(workers) == [WORKER], workers
    w = workers[WORKER]
    assert (w.get("tensor_parallel_size"), w.get("devices")) == (2, 2), w
    deadline = time.monotonic() + 10
    while True:
        text = server.admin.get(server.url + "/metrics").text
        series = [ln for ln in text.splitlines() if ln.startswith("lockgate_pool_worker_devices{")]
        if series or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert series == [f'lockgate_pool_worker_devices{{worker="{WORKER}"}} 2.0'], series
