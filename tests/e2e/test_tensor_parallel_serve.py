"""`lockgate serve --tensor-parallel-size 2` as a client meets it: one server for the module
(its rank process beside it), answering the official `openai` client, streamed and not, with
structured outputs and a LoRA adapter; --pipeline-parallel-size above 1 refused; a rank
killed under load (the requests in flight fail with one usage row each, the rank group is
rebuilt, the model serves again); its communication and ranks' memory on /admin/v1/engine
and /metrics."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.gateway_server import running_server
from tests.support.helpers import demo_model

MODEL = "tiny"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("tp-serve"), "embedded",
                        models={MODEL: demo_model("llama", "tiny", 0)},
                        extra_args=["--tensor-parallel-size", "2"],
                        extra_env={"LOCKGATE_REQUEST_TIMEOUT_S": "60"}) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    _, key = server.tenant()
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)


def test_answers_stream_and_not(server, client):
    """Two ranks answer like one: the same greedy text streamed and not."""
    plain = client.completions.create(model=MODEL, prompt="hello there", max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert plain.usage.completion_tokens == 12
    chunks = list(client.completions.create(model=MODEL, prompt="hello there", max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text
    assert chunks[-1].usage.completion_tokens == 12
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens >= 1


def test_a_lora_adapter_answers_as_hf_and_peft_do(server, client):
    """An adapter registered at runtime (its cut reaches the other rank) answers with the
    greedy text of HF + peft, and the base model with HF's."""
    from tests.support import lora

    root = Path(server.data_dir) / "adapters"
    root.mkdir(exist_ok=True)
    path = lora.install(root, "own")
    r = server.admin.post("/adapters", json={"name": "tp-own", "base_model": MODEL, "path": path})
    assert r.status_code == 201, r.text
    for model, adapter in (("tp-own", "own"), (MODEL, None)):
        out = client.chat.completions.create(model=model, messages=lora.MESSAGES, max_tokens=lora.NEW_TOKENS,
                                             temperature=0, extra_body={"ignore_eos": True})
        assert out.choices[0].message.content == lora.expected_text(adapter), model


def test_structured_output(client):
    """response_format json_schema: the answer parses and has the schema's fields."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["name", "age"], "additionalProperties": False}
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "a person"}], max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema, "strict": True}})
    value = json.loads(r.choices[0].message.content)
    assert set(value) == {"name", "age"} and isinstance(value["age"], int)


def test_pipeline_parallel_refused(tmp_path):
    """--pipeline-parallel-size 2: refused before anything starts, naming the flag."""
    out = subprocess.run([sys.executable, "-m", "lockgate.gateway.cli", "serve", "--pipeline-parallel-size", "2",
                          "--data-dir", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert "--pipeline-parallel-size" in out.stderr and "pipeline parallelism is not supported" in out.stderr


def test_engine_kwargs_tensor_parallel_keeps_lora_on(monkeypatch, tmp_path):
    """LOCKGATE_ENGINE_KWARGS with tensor_parallel_size 2 does what the flag does, LoRA on."""
    from lockgate.gateway.settings import Settings

    monkeypatch.setenv("LOCKGATE_ENGINE_KWARGS", json.dumps({"tensor_parallel_size": 2}))
    s = Settings(data_dir=tmp_path)
    assert s.lora_engine_kwargs()["enable_lora"] is True
    assert s.lora_engine_kwargs()["tensor_parallel_size"] == 2


def tp_state(server) -> dict:
    return server.admin.get("/engine").json()["models"][MODEL]["tensor_parallel"]


async def _attempt(http: httpx.AsyncClient, key: str, i: int) -> tuple[str, int, str]:
    """One request (even i streamed): (its x-request-id, status, how it ended)."""
    rid = f"tp-kill-{i}-{os.getpid()}-{time.monotonic_ns()}"
    body = {"model": MODEL, "prompt": f"request {i}", "max_tokens": 120, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {key}", "x-request-id": rid}
    if i % 2:
        r = await http.post("/v1/completions", json=body, headers=headers)
        return rid, r.status_code, "body"
    async with http.stream("POST", "/v1/completions", json={**body, "stream": True}, headers=headers) as r:
        last = ""
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                last = line
        ended = "done" if last == "data: [DONE]" else "error" if '"error"' in last else "cut"
        return rid, r.status_code, ended


async def _load_and_kill(server, key: str, rank_pid: int) -> list[tuple[str, int, str]]:
    """20 requests, half streamed; rank 1 killed once tokens flow."""
    async with httpx.AsyncClient(base_url=server.url, timeout=90) as http:
        tasks = [asyncio.create_task(_attempt(http, key, i)) for i in range(20)]
        for _ in range(500):
            if server.admin.get("/engine").json()["models"][MODEL]["generated_tokens"] > 0:
                break
            await asyncio.sleep(0.02)
        os.kill(rank_pid, signal.SIGKILL)
        return await asyncio.gather(*tasks)


def test_rank_killed_under_load(server, client):
    """kill -9 of rank 1 during 20 mixed requests: none hangs (each ends within the client's
    bound, below request_timeout_s), the streams cut short end with an error event, every 200
    has exactly one usage row and nothing else has more than one (none unknown), the group is
    rebuilt (a fresh rank 1) and the model answers as before."""
    prompt = dict(model=MODEL, prompt="the same words", max_tokens=10, temperature=0)
    before = client.completions.create(**prompt).choices[0].text
    state = tp_state(server)
    old_pid, failures = state["ranks"][1]["pid"], state["rank_failures"]
    _, key = server.tenant()
    results = asyncio.run(_load_and_kill(server, key, old_pid))
    with sqlite3.connect(server.data_dir / "lockgate.db") as db:
        rows = db.execute("SELECT client_request_id FROM usage_records WHERE client_request_id LIKE 'tp-kill-%'"
                          ).fetchall()
    counts = {rid: 0 for rid, _, _ in results}
    for (rid,) in rows:
        assert rid in counts, f"a usage row no request made: {rid}"
        counts[rid] += 1
    ended = [(status, how) for _, status, how in results]
    assert all(counts[rid] == 1 for rid, status, _ in results if status == 200), (ended, counts)
    assert all(n <= 1 for n in counts.values()), counts
    assert ("cut" not in {how for _, how in ended}), ended
    assert any(how == "error" or status != 200 for status, how in ended), ended   # the kill hit some
    for _ in range(600):
        state = tp_state(server)
        if state["rank_failures"] > failures:
            break
        time.sleep(0.1)
    assert state["rank_failures"] == failures + 1 and state["ranks"][1]["pid"] != old_pid, state
    assert client.completions.create(**prompt).choices[0].text == before
    print(f"rank 1 killed: {sum(s == 200 for s, _ in ended)} of 20 answered 200 "
          f"({sum(h == 'error' for _, h in ended)} streams ended with an error event; "
          f"the others: {sorted({s for s, _ in ended if s != 200})}), "
          f"{len(rows)} usage rows; rank group rebuilt in {state['last_recovery_s']:.2f} s (engine's own state)")


def test_communication_and_rank_memory_are_observable(server, client):
    """/admin/v1/engine: the TP size, each rank's process, device and memory, the seconds in
    collectives against the forward's; /metrics: the same as lockgate_tp_* series."""
    client.completions.create(model=MODEL, prompt="count the collectives", max_tokens=4)
    state = tp_state(server)
    assert state["tensor_parallel_size"] == 2 and state["backend"] in ("gloo", "nccl")
    assert [r["rank"] for r in state["ranks"]] == [0, 1]
    assert all(r["weights_bytes"] > 0 and r["kv_cache_bytes"] > 0 and r["pid"] > 0 for r in state["ranks"])
    assert state["num_collectives"] > 0 and 0 < state["collective_s"] < state["forward_s"]
    text = server.admin.get(server.url + "/metrics").text
    lines = {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in text.splitlines() if ln.startswith("lockgate_tp_")}
    assert lines[f'lockgate_tp_size{{model="{MODEL}"}}'] == 2
    assert lines[f'lockgate_tp_collective_seconds_total{{model="{MODEL}"}}'] > 0
    assert lines[f'lockgate_tp_forward_seconds_total{{model="{MODEL}"}}'] > 0
    assert f'lockgate_tp_step_collective_seconds{{model="{MODEL}"}}' in lines
    for rank in ("0", "1"):
        assert lines[f'lockgate_tp_rank_memory_bytes{{model="{MODEL}",part="weights",rank="{rank}"}}'] > 0
