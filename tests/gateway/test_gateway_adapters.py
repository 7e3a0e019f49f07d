"""LoRA adapters through the gateway in process, with the real engine, on both backends: an
operator registers, lists, unloads and deletes them under /admin/v1/adapters; a tenant calls
its own and the public ones with `model="<adapter>"` (official `openai` client) and gets HF +
peft's greedy tokens; bad registrations are 400s naming the field and change nothing. (A
second replica on the same PostgreSQL serving an adapter registered on the first:
tests/gateway/test_gateway_replicas.py.)"""

from __future__ import annotations

import asyncio
import shutil
import time

import httpx
import openai
import pytest
import pytest_asyncio

from tests.support.helpers import demo_model
from tests.support.inprocess_gateway import running_gateway
from tests.support.lora import MAX_LORA_RANK, MESSAGES, NEW_TOKENS, expected_text, install, source

pytestmark = pytest.mark.asyncio(loop_scope="module")

TTL = 1.0                       # adapter_cache_ttl_s of these gateways


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["embedded", "services"])
async def server(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    root = tmp / "adapter-root"
    root.mkdir()
    async with running_gateway(tmp / "a", request.param, engine="real",
                               models={"tiny": demo_model("llama", "tiny", 0)}, adapter_root=root,
                               max_lora_rank=MAX_LORA_RANK, adapter_cache_ttl_s=TTL) as gw:
        gw.adapter_root = root
        yield gw


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def tenants(server):
    """Tenant A owns an adapter, tenant B does not; both see the public one."""
    a, key_a = await server.tenant()
    b, key_b = await server.tenant()
    return a, key_a, b, key_b


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def registered(server, tenants):
    a = tenants[0]
    root = server.adapter_root
    out = {}
    for name, owner in (("pub", None), ("own", a["id"])):
        r = await server.admin.post("/adapters", json={"name": f"ada-{name}", "base_model": "tiny",
                                                        "owner_tenant_id": owner,
                                                        "path": install(root, name)})
        assert r.status_code == 201, r.text
        out[name] = r.json()
    return out


def client(server, key) -> openai.AsyncOpenAI:
    return server.openai(key)


async def chat(server, key, model: str) -> str:
    r = await client(server, key).chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=NEW_TOKENS, temperature=0,
        extra_body={"ignore_eos": True})
    assert r.model == model and r.usage.completion_tokens == NEW_TOKENS
    return r.choices[0].message.content


async def names(server) -> list[str]:
    r = await server.admin.get("/adapters")
    assert r.status_code == 200, r.text
    return [a["name"] for a in r.json()["data"]]


def err(r: httpx.Response) -> dict:
    return r.json()["error"]


async def lora_stats(server) -> dict:
    return (await server.admin.get("/engine")).json()["models"]["tiny"]["lora"]


async def not_in_cpu(server, name: str) -> bool:
    """The engine holds the adapter's weights no more."""
    return name not in (await lora_stats(server))["in_cpu"]


async def wait_for(predicate, timeout: float = 5.0, what: str = "") -> None:
    """Until `await predicate()` is true."""
    deadline = time.monotonic() + timeout
    while not await predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


# -- registration, visibility, use ------------------------------------------------------------------
async def test_register_list_and_see_by_tenant(server, tenants, registered):
    a, key_a, _, key_b = tenants
    pub, own = registered["pub"], registered["own"]
    assert pub["object"] == "adapter" and pub["public"] and pub["owner_tenant_id"] is None
    assert own["owner_tenant_id"] == a["id"] and not own["public"]
    assert (pub["rank"], pub["targets"], pub["path"]) == (8, ["q_proj", "v_proj"], "pub")
    assert pub["registered"] is True                  # read by the engine at registration
    assert (await server.admin.get(f"/adapters/{own['id']}")).json() == own
    assert {"ada-pub", "ada-own"} <= set(await names(server))

    cards_a = {m.id: m for m in (await client(server, key_a).models.list()).data}
    cards_b = {m.id: m for m in (await client(server, key_b).models.list()).data}
    assert {"tiny", "ada-pub", "ada-own"} <= set(cards_a)
    assert "ada-pub" in cards_b and "ada-own" not in cards_b
    card = cards_a["ada-own"].model_dump()
    assert card["parent"] == "tiny" and card["root"] == "tiny"
    assert cards_a["tiny"].model_dump()["parent"] is None

    # B: A's adapter does not exist, by any route
    with pytest.raises(openai.NotFoundError) as exc:
        await chat(server, key_b, "ada-own")
    assert exc.value.code == "model_not_found"
    r = await server.http.get("/v1/models/ada-own", headers=server.auth(key_b))
    assert r.status_code == 404
    assert (await client(server, key_a).models.retrieve("ada-own")).id == "ada-own"
    # tenant keys cannot register adapters
    r = await server.http.post("/admin/v1/adapters", headers=server.auth(key_a),
                               json={"name": "x", "base_model": "tiny", "owner_tenant_id": None, "path": "pub"})
    assert r.status_code == 403 and err(r)["code"] == "admin_only"


async def test_adapter_chat_matches_peft(server, tenants, registered):
    """model=<adapter>: HF + peft's greedy tokens, not the base model's; the usage row names
    the adapter."""
    _, key_a, _, key_b = tenants
    base_text = await chat(server, key_a, "tiny")
    assert base_text == expected_text(None)
    own = await chat(server, key_a, "ada-own")
    assert own == expected_text("own") and own != base_text
    pub_a, pub_b = await chat(server, key_a, "ada-pub"), await chat(server, key_b, "ada-pub")
    assert pub_a == pub_b == expected_text("pub") and pub_a != base_text
    stream = await client(server, key_a).chat.completions.create(
        model="ada-own", messages=MESSAGES, max_tokens=NEW_TOKENS, temperature=0, stream=True,
        extra_body={"ignore_eos": True})
    assert "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices]) == own

    async def usage_rows_name_the_adapters() -> bool:
        r = await server.http.get("/v1/usage", params={"group_by": "model"}, headers=server.auth(key_a))
        return {"tiny", "ada-own", "ada-pub"} <= {row["group"] for row in r.json()["data"]}

    await wait_for(usage_rows_name_the_adapters, what="usage rows")


# -- bad registrations -------------------------------------------------------------------------------
async def test_bad_registrations_are_400s_naming_the_field(server, tenants, registered, tmp_path):
    _, key_a, _, _ = tenants
    root = server.adapter_root
    install(root, "big")
    install(root, "foreign")
    corrupt = root / "corrupt"
    if not corrupt.exists():
        shutil.copytree(source("pub"), corrupt)
        (corrupt / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00not safetensors")
    outside = tmp_path / "outside"
    shutil.copytree(source("pub"), outside)
    link = root / "escape"
    if not link.exists():
        link.symlink_to(outside, target_is_directory=True)
    gone, _ = await server.tenant()
    assert (await server.admin.delete(f"/tenants/{gone['id']}")).status_code == 200

    def body(**kw) -> dict:
        return {"name": "ada-new", "base_model": "tiny", "owner_tenant_id": None, "path": "pub", **kw}

    cases = [
        (body(path="foreign"), "base_model", "another base model"),
        (body(path="big"), "path", "exceeds max_lora_rank"),
        (body(path="corrupt"), "path", "cannot be read"),
        (body(path="../outside"), "path", "'..'"),
        (body(path=str(outside)), "path", f"outside the adapter root, {root.resolve()}"),   # where it is
        (body(path="escape"), "path", "symbolic link"),
        (body(path="https://example.com/adapters/pub"), "path", "URL"),
        (body(path="file:///etc"), "path", "URL"),
        (body(path="nope"), "path", "not a directory"),
        (body(base_model="no-such-model"), "base_model", "not served"),
        (body(owner_tenant_id="ten_0000000000000000"), "owner_tenant_id", "does not exist"),
        (body(owner_tenant_id=gone["id"]), "owner_tenant_id", "deleted"),
        (body(name="ada-pub"), "name", "already exists"),
        (body(name="tiny"), "name", "served model"),
        (body(name="bad name!"), "name", "must match"),
        # (owner_tenant_id left out registers a public adapter: tests/gateway/test_vllm_compat.py)
    ]
    before = (await server.admin.get("/adapters")).json()
    engine_before = set((await lora_stats(server))["in_cpu"])
    for payload, param, words in cases:
        r = await server.admin.post("/adapters", json=payload)
        what = f"{payload}: {r.status_code} {r.text}"
        assert r.status_code == 400, what
        assert err(r)["param"] == param, what
        assert err(r)["type"] == "invalid_request_error", what
        if words:
            assert words in err(r)["message"], what
    assert (await server.admin.get("/adapters")).json() == before        # nothing half-registered
    assert "ada-new" not in await names(server)

    async def holds_no_refused_adapter() -> bool:
        return set((await lora_stats(server))["in_cpu"]) <= engine_before | {"ada-pub", "ada-own"}

    await wait_for(holds_no_refused_adapter, what="the engine to hold no refused adapter")
    # the engine keeps serving, adapters and base alike
    assert await chat(server, key_a, "ada-own") == expected_text("own")
    assert await chat(server, key_a, "tiny") == expected_text(None)


# -- unload, delete ------------------------------------------------------------------------------------
async def test_unload_then_use_reads_it_again(server, tenants, registered):
    _, key_a, _, _ = tenants
    pub = registered["pub"]
    assert await chat(server, key_a, "ada-pub") == expected_text("pub")
    loads = (await lora_stats(server))["disk_loads"]
    r = await server.admin.post(f"/adapters/{pub['id']}/unload")
    assert r.status_code == 200, r.text
    assert r.json()["unloaded"] is True and r.json()["registered"] is True
    await wait_for(lambda: not_in_cpu(server, "ada-pub"), what="the weights to go")
    assert await chat(server, key_a, "ada-pub") == expected_text("pub")

    async def loaded_again() -> bool:
        return (await lora_stats(server))["disk_loads"] == loads + 1

    await wait_for(loaded_again, what="a fresh disk load")
    assert (await server.admin.post("/adapters/ada_0000000000000000/unload")).status_code == 404


async def test_delete_refused_while_in_use_then_404(server, tenants):
    a, key_a, _, _ = tenants
    r = await server.admin.post("/adapters", json={"name": "ada-tmp", "base_model": "tiny",
                                                   "owner_tenant_id": a["id"],
                                                   "path": install(server.adapter_root, "own", "tmp")})
    assert r.status_code == 201, r.text
    tmp = r.json()
    body = {"model": "ada-tmp", "messages": MESSAGES, "max_tokens": 1500, "ignore_eos": True,
            "stream": True}
    async with server.http.stream("POST", "/v1/chat/completions", json=body,
                                  headers=server.auth(key_a)) as stream:
        async for line in stream.aiter_lines():
            if line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
                break                                              # generating now
        r = await server.admin.delete(f"/adapters/{tmp['id']}")
        assert r.status_code == 409, r.text
        assert err(r)["code"] == "adapter_in_use" and "ada-tmp" in err(r)["message"]
    assert "ada-tmp" in await names(server)

    async def deleted() -> bool:
        return (await server.admin.delete(f"/adapters/{tmp['id']}")).status_code == 200

    await wait_for(deleted, what="the delete once the stream is gone")
    assert "ada-tmp" not in await names(server)
    with pytest.raises(openai.NotFoundError):
        await chat(server, key_a, "ada-tmp")
    assert (await server.admin.get(f"/adapters/{tmp['id']}")).status_code == 404
    assert (await server.admin.delete(f"/adapters/{tmp['id']}")).status_code == 404
    await wait_for(lambda: not_in_cpu(server, "ada-tmp"), what="the weights to go")


async def test_deleting_a_tenant_deletes_its_adapters(server):
    """A deleted tenant's private adapter: its row goes in the same transaction (audited),
    this replica's engine drops it, and its name is free again."""
    c, key_c = await server.tenant()
    r = await server.admin.post("/adapters", json={"name": "ada-gone", "base_model": "tiny",
                                                   "owner_tenant_id": c["id"],
                                                   "path": install(server.adapter_root, "own", "gone")})
    assert r.status_code == 201, r.text
    gone = r.json()
    assert await chat(server, key_c, "ada-gone") == expected_text("own")     # loaded, in use before
    assert "ada-gone" in (await lora_stats(server))["in_cpu"]
    assert (await server.admin.delete(f"/tenants/{c['id']}")).status_code == 200
    assert "ada-gone" not in await names(server)
    assert (await server.admin.get(f"/adapters/{gone['id']}")).status_code == 404
    await wait_for(lambda: not_in_cpu(server, "ada-gone"), what="the weights to go")
    audit = (await server.admin.get("/audit", params={"limit": 10})).json()["data"]
    deleted = next(e for e in audit if e["action"] == "tenant.delete" and e["target_id"] == c["id"])
    assert deleted["detail"]["deleted_adapters"] == ["ada-gone"]
    assert any(e["action"] == "adapter.delete" and e["target_id"] == gone["id"] for e in audit)
    # the name is free: another tenant's adapter may take it
    a, _ = await server.tenant()
    r = await server.admin.post("/adapters", json={"name": "ada-gone", "base_model": "tiny",
                                                   "owner_tenant_id": a["id"], "path": "gone"})
    assert r.status_code == 201, r.text
    assert (await server.admin.delete(f"/adapters/{r.json()['id']}")).status_code == 200


async def test_the_console_registers_and_unloads_as_the_api_does(server, tenants):
    """The console's forms call the API's own service functions: the adapter registered there
    serves its tenant as one registered through the API, and the console's unload drops it."""
    from tests.gateway.test_console import csrf, sign_in

    _, key_a, _, _ = tenants
    c = await sign_in(server, server.admin_key)
    page = await c.get("/console/models")
    r = await c.post("/console/adapters", data={"name": "ada-console", "base_model": "tiny", "csrf": csrf(page),
                                                "path": install(server.adapter_root, "pub", as_="console")})
    assert r.status_code == 201 and "ada-console" in r.text, r.text
    row = next(a for a in (await server.admin.get("/adapters")).json()["data"] if a["name"] == "ada-console")
    assert row["registered"] is True and row["public"] is True
    assert await chat(server, key_a, "ada-console") == expected_text("pub")
    page = await c.get("/console/models")
    assert f'data-unload="{row["id"]}"' in page.text
    r = await c.post(f"/console/adapters/{row['id']}/unload", data={"csrf": csrf(page)})
    assert r.status_code == 303, r.text
    await wait_for(lambda: not_in_cpu(server, "ada-console"), what="the weights to go")
    assert f'data-unload="{row["id"]}"' not in (await c.get("/console/models")).text
