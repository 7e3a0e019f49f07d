"""The engine's adaptive threads (engine/threads.py) as an operator sees them: on
/admin/v1/engine and /metrics, read from the real engine in process."""

from __future__ import annotations

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from tests.support.helpers import demo_model
from tests.support.inprocess_gateway import REAL_ENGINE_KWARGS, running_gateway

pytestmark = pytest.mark.asyncio(loop_scope="module")


async def test_threads_on_admin_engine_and_metrics(tmp_path, monkeypatch):
    import lockgate.engine.threads as threads

    monkeypatch.setenv("LOCKGATE_ADAPTIVE_THREADS", "1")
    monkeypatch.setattr(threads, "_shared", threads.ThreadGovernor(3, window_s=0.0, confirm=10**6))
    kwargs = {k: v for k, v in REAL_ENGINE_KWARGS.items() if k != "num_threads"}
    old = torch.get_num_threads()
    try:
        async with running_gateway(tmp_path, engine="real", models={"demo": demo_model()},
                                   engine_kwargs=kwargs) as gw:
            _, key = await gw.tenant()
            body = {"model": "demo", "prompt": "a b c", "max_tokens": 4, "temperature": 0}
            r = await gw.http.post("/v1/completions", headers=gw.auth(key), json=body)
            assert r.status_code == 200, r.text
            view = (await gw.admin.get("/engine")).json()["models"]["demo"]["threads"]
            metrics = (await gw.admin.get(gw.url + "/metrics")).text
    finally:
        torch.set_num_threads(old)
    assert view["threads"] == 3 and view["max_threads"] == 3 and view["changes"] == 0
    assert view["others_cores"] >= 0
    got = {(s.name, s.labels.get("width")): s.value for f in text_string_to_metric_families(metrics)
           if f.name.startswith("lockgate_engine_") for s in f.samples if s.labels.get("model") == "demo"}
    assert got[("lockgate_engine_threads", "now")] == 3 and got[("lockgate_engine_threads", "full")] == 3
    assert got[("lockgate_engine_neighbour_cores", None)] == view["others_cores"]
