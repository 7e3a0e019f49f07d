"""`lockgate serve --pool` against the tests' local Ray cluster, on PostgreSQL + Redis: two
gateway replicas on one pool (a namespace of their own), a worker killed with kill -9 during
mixed requests, adapters registered through the admin API, exact quotas across replicas."""

from __future__ import annotations

import contextlib
import html
import json
import os
import re
import secrets
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import sqlalchemy as sa

from tests.support.gateway_server import GatewayServer
from tests.support.helpers import demo_model, hf_greedy, random_prompts
from tests.support.lora import MAX_LORA_RANK, install
from tests.support.services import check_redis, drop_redis_prefix, fresh_pg_database

pytestmark = pytest.mark.timeout(400)
MODEL = "tiny"


@pytest.fixture(scope="module")
def replicas(ray_cluster, tmp_path_factory):
    import ray

    ns = "lgtest-gw-" + secrets.token_hex(3)
    redis_url = check_redis()
    prefix = f"lgtest:{os.getpid()}:{secrets.token_hex(4)}:"
    root = tmp_path_factory.mktemp("pool-gw")
    (root / "adapters").mkdir()
    env = {"LOCKGATE_POOL_NAMESPACE": ns, "LOCKGATE_LEASE_TTL_S": "3",
           "LOCKGATE_ADAPTER_ROOT": str(root / "adapters"), "LOCKGATE_MAX_LORA_RANK": str(MAX_LORA_RANK),
           "LOCKGATE_ENGINE_KWARGS": json.dumps({"num_kv_blocks": 256, "max_num_seqs": 16})}
    common = dict(redis_url=redis_url, redis_prefix=prefix, pepper=secrets.token_hex(32),
                  admin_key="lg-" + secrets.token_urlsafe(32),
                  models={MODEL: demo_model("llama", "tiny", 0)},
                  extra_args=["--pool", ray_cluster.address], extra_env=env, timeout=240)
    with fresh_pg_database() as url:
        a = GatewayServer.start(root / "a", database_url=url, **common)
        b = GatewayServer.start(root / "b", database_url=url, **common)
        a.db_url, a.adapter_root = url, root / "adapters"
        try:
            yield a, b
        finally:
            for srv in (a, b):
                srv.stop()
            drop_redis_prefix(prefix)
            if not ray.is_initialized():
                ray.init(address=ray_cluster.address, namespace=ns, log_to_driver=False)
            for name in ("lockgate-worker-0", "lockgate-worker-1", "lockgate-placement"):
                with contextlib.suppress(ValueError):    # never created
                    ray.kill(ray.get_actor(name, namespace=ns), no_restart=True)


def pool_state(srv: GatewayServer) -> dict:
    return srv.admin.get("/models").json()["pool"]


def chat(srv: GatewayServer, key: str, rid: str, stream: bool, n: int = 24) -> tuple[int, bool]:
    """(status, completed): a stream completes when it reaches [DONE]."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"hello {rid}"}],
            "max_tokens": n, "ignore_eos": True, "stream": stream}
    headers = {"Authorization": f"Bearer {key}", "x-request-id": rid}
    try:
        if not stream:
            r = httpx.post(srv.url + "/v1/chat/completions", json=body, headers=headers, timeout=120)
            return r.status_code, r.status_code == 200
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, headers=headers,
                          timeout=120) as r:
            done = r.status_code == 200 and any(line == "data: [DONE]" for line in r.iter_lines())
            return r.status_code, done
    except httpx.HTTPError:
        return -1, False


def rows_by_client_id(url: str) -> dict[str, list[str]]:
    engine = sa.create_engine(sa.engine.make_url(url).set(drivername="postgresql+psycopg"))
    try:
        with engine.connect() as c:
            out: dict[str, list[str]] = {}
            for cid, status in c.execute(sa.text("SELECT client_request_id, status FROM usage_records")):
                out.setdefault(cid, []).append(status)
            return out
    finally:
        engine.dispose()


def test_two_replicas_share_one_pool_and_its_workers(replicas):
    a, b = replicas
    sa_, sb = pool_state(a), pool_state(b)
    assert set(sa_["workers"]) == set(sb["workers"]) == {"lockgate-worker-0", "lockgate-worker-1"}
    assert {w["pid"] for w in sa_["workers"].values()} == {w["pid"] for w in sb["workers"].values()}
    assert sa_["assigned"][MODEL]
    _, key = a.tenant()
    prompt = random_prompts(demo_model("llama", "tiny", 0), [12], seed=7)[0]
    outs = []
    for srv in (a, b):
        r = httpx.post(srv.url + "/v1/completions", headers={"Authorization": f"Bearer {key}"},
                       json={"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0,
                             "ignore_eos": True, "logprobs": 1}, timeout=60)
        assert r.status_code == 200, r.text
        outs.append(r.json()["choices"][0]["logprobs"]["tokens"])
    assert outs[0] == outs[1]
    # /admin/v1/engine: the model's totals, and each worker's own in the same shape
    eng = a.admin.get(a.url + "/admin/v1/engine", timeout=10).json()["models"][MODEL]
    assert set(eng["workers"]) == {"lockgate-worker-0", "lockgate-worker-1"}
    for part in eng["workers"].values():
        assert set(part) == set(eng) and part["workers"] == {}
    for field in ("generated_tokens", "preemptions"):
        assert eng[field] == sum(part[field] for part in eng["workers"].values())
    assert eng["kv_blocks"]["total"] == sum(p["kv_blocks"]["total"] for p in eng["workers"].values()) > 0
    console_shows_the_pool(a)


def console_shows_the_pool(srv: GatewayServer) -> None:
    """The console's models page: each worker of /admin/v1/models' pool snapshot (its pid, its
    models), which workers serve the model, and the placement's decisions with their reasons."""
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        form = c.get("/console/sign-in")
        token = re.search(r'name="csrf" value="([0-9a-f]{64})"', form.text)
        assert token, form.text[:2000]
        r = c.post("/console/sign-in", data={"key": srv.admin_key, "csrf": token.group(1)})
        assert r.status_code == 303, r.text
        page = c.get("/console/models")
    assert page.status_code == 200, page.text
    pool = pool_state(srv)

    def cells(row: str) -> list[str]:
        m = re.search(rf"<tr {row}[^>]*>(.*?)</tr>", page.text, re.S)
        assert m, (row, page.text[:3000])
        return [html.unescape(re.sub(r"<[^>]+>", "", c)).strip()
                for c in re.findall(r"<td[^>]*>(.*?)</td>", m.group(1), re.S)]
    for name, w in pool["workers"].items():
        row = cells(f'data-worker="{name}"')
        assert row[:4] == [name, "down" if w["down"] else "up", w["node"], str(w["pid"])], row
        assert MODEL in row[4] and row[9] == f"{w['kv_used']} / {w['kv_total']}", row
    served = re.search(rf'<dd data-assigned="{MODEL}">([^<]*)</dd>', page.text)
    assert served and served.group(1).split(", ") == pool["assigned"][MODEL]
    assert pool["decisions"], pool
    shown = re.findall(r'<tr data-decision="[^"]*">(.*?)</tr>', page.text, re.S)
    latest = pool["decisions"][-1]
    first = [html.unescape(re.sub(r"<[^>]+>", "", c)).strip()
             for c in re.findall(r"<td[^>]*>(.*?)</td>", shown[0], re.S)]
    assert len(shown) == len(pool["decisions"])
    assert first[1:] == [latest["model"], latest["worker"], latest["action"], latest["reason"]] and first[4], first


def test_quotas_stay_exact_across_replicas_on_a_pool(replicas):
    a, b = replicas
    _, key = a.tenant(quota={"requests_per_minute": 5})
    with ThreadPoolExecutor(6) as ex:
        results = list(ex.map(lambda i: chat((a, b)[i % 2], key, f"q{i}-{secrets.token_hex(3)}", False, 2),
                              range(12)))
    assert sorted(s for s, _ in results) == [200] * 5 + [429] * 7


def test_an_adapter_registered_by_admin_is_served_by_a_pool_worker(replicas):
    a, b = replicas
    _, key = a.tenant()
    r = a.admin.post("/adapters", json={"name": "pool-ada", "base_model": MODEL, "owner_tenant_id": None,
                                         "path": install(a.adapter_root, "pub")})
    assert r.status_code == 201, r.text
    for srv in (a, b):
        resp = httpx.post(srv.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                          json={"model": "pool-ada", "messages": [{"role": "user", "content": "hi"}],
                                "max_tokens": 4}, timeout=60)
        assert resp.status_code == 200, resp.text
        assert resp.json()["model"] == "pool-ada"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        workers = pool_state(a)["workers"]
        if any("pool-ada" in w["loras"] for w in workers.values()):
            break
        time.sleep(0.2)
    assert any("pool-ada" in w["loras"] for w in workers.values()), workers


def test_a_worker_killed_during_mixed_requests_loses_no_usage_row(replicas):
    a, b = replicas
    _, key = a.tenant()
    state = pool_state(a)
    victim = state["assigned"][MODEL][0]
    pid = state["workers"][victim]["pid"]
    run = secrets.token_hex(3)
    jobs = [((a, b)[i % 2], f"kill-{run}-{i}", i % 2 == 0) for i in range(50)]
    with ThreadPoolExecutor(10) as ex:
        futures = [ex.submit(chat, srv, key, rid, stream, 48) for srv, rid, stream in jobs]
        time.sleep(1.0)
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        results = {rid: f.result(timeout=300) for (_, rid, _), f in zip(jobs, futures, strict=True)}
    statuses = [s for s, _ in results.values()]
    assert 500 not in statuses and -1 not in statuses, statuses
    assert all(s in (200, 503) for s in statuses), statuses
    # every completed request has exactly one row; every other at most one
    deadline = time.monotonic() + 20
    while True:
        rows = rows_by_client_id(a.db_url)
        done = [rid for rid, (_, ok) in results.items() if ok]
        if all(len(rows.get(rid, [])) == 1 for rid in done) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    for rid, (status, ok) in results.items():
        got = rows.get(rid, [])
        assert len(got) == (1 if ok else len(got)) and len(got) <= 1, (rid, status, got)
        if ok:
            assert got == ["ok"], (rid, got)
    # the pool serves again once Ray restarted the actor (from the pool's own state)
    while True:
        w = pool_state(a)["workers"][victim]
        if w["pid"] != pid and not w["down"]:
            break
        assert time.monotonic() - killed < 180, w
        time.sleep(0.5)
    print(f"{victim} back {time.monotonic() - killed:.1f} s after the kill; "
          f"{sum(ok for _, ok in results.values())}/50 completed, statuses {sorted(set(statuses))}")
    prompt = random_prompts(demo_model("llama", "tiny", 0), [10], seed=8)[0]
    r = httpx.post(a.url + "/v1/completions", headers={"Authorization": f"Bearer {key}"},
                   json={"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0,
                         "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    from lockgate.engine import Tokenizer
    tok = Tokenizer(demo_model("llama", "tiny", 0))
    assert r.json()["choices"][0]["text"] == tok.decode(hf_greedy(demo_model("llama", "tiny", 0), prompt, 6))


def test_metrics_carry_each_workers_series(replicas):
    a, _ = replicas
    deadline = time.monotonic() + 10
    while True:
        text = a.admin.get(a.url + "/metrics", timeout=10).text
        ok = all(f'vllm:kv_cache_usage_perc{{worker="lockgate-worker-{i}"}}' in text for i in (0, 1))
        if ok or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert ok, text[-2000:]
    assert 'lockgate_pool_worker_up{worker="lockgate-worker-0"} 1.0' in text
    assert "lockgate_pool_worker_restarts_total" in text
