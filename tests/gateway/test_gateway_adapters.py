"""LoRA adapters through a live `lockgate serve` (real uvicorn), on both backends: an operator
registers, lists, unloads and deletes them under /admin/v1/adapters; a tenant calls its own and
the public ones with `model="<adapter>"` (official `openai` client) and gets HF + peft's greedy
tokens; bad registrations are 400s naming the field and change nothing; a second replica on the
same PostgreSQL serves an adapter registered on the first and stops within the cache TTL after
it is deleted."""

from __future__ import annotations

import shutil
import time
from functools import cache
from pathlib import Path

import httpx
import openai
import pytest

from lockgate.engine.lora_demo import write_demo_adapter
from lockgate.engine.tokenizer import Tokenizer
from tests.support.gateway_server import GatewayServer, running_server
from tests.support.helpers import demo_model, hf_greedy
from tests.support.lora import peft_greedy

MAX_LORA_RANK = 8
TTL = 1.0                       # LOCKGATE_ADAPTER_CACHE_TTL_S in these servers
NEW_TOKENS = 10
MESSAGES = [{"role": "user", "content": "Tell me about paging."}]
# name -> (base, rank, targets, seed)
SOURCES = {
    "pub": (("llama", "tiny", 0), 8, "q,v", 1),
    "own": (("llama", "tiny", 0), 4, "q,k,v,o,gate,up,down", 2),
    "big": (("llama", "tiny", 0), 16, "q,v", 3),          # rank over MAX_LORA_RANK
    "foreign": (("llama", "small", 0), 4, "q,v", 4),      # another base model's shapes
}


@cache
def source(name: str) -> Path:
    """A demo adapter, written once per session outside any adapter root."""
    import tempfile

    (family, size, seed), rank, targets, aseed = SOURCES[name]
    out = Path(tempfile.mkdtemp(prefix="lockgate-test-adapters-")) / name
    return write_demo_adapter(demo_model(family, size, seed), out, rank=rank, targets=targets,
                              seed=aseed)


def install(root: Path, name: str, as_: str | None = None) -> str:
    """Copy a demo adapter into `root`; its path relative to the root."""
    dst = root / (as_ or name)
    if not dst.exists():
        shutil.copytree(source(name), dst)
    return dst.name


def server_env(root: Path) -> dict[str, str]:
    return {"LOCKGATE_ADAPTER_ROOT": str(root), "LOCKGATE_MAX_LORA_RANK": str(MAX_LORA_RANK),
            "LOCKGATE_ADAPTER_CACHE_TTL_S": str(TTL)}


@pytest.fixture(scope="module", params=["embedded", "services"])
def server(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    root = tmp / "adapter-root"
    root.mkdir()
    with running_server(tmp / "a", request.param, models={"tiny": demo_model("llama", "tiny", 0)},
                        extra_env=server_env(root)) as srv:
        srv.adapter_root = root
        srv.backend = request.param
        yield srv


@pytest.fixture(scope="module")
def tenants(server):
    """Tenant A owns an adapter, tenant B does not; both see the public one."""
    a, key_a = server.tenant()
    b, key_b = server.tenant()
    return a, key_a, b, key_b


@pytest.fixture(scope="module")
def registered(server, tenants):
    a = tenants[0]
    root = server.adapter_root
    out = {}
    for name, owner in (("pub", None), ("own", a["id"])):
        r = server.admin.post("/adapters", json={"name": f"ada-{name}", "base_model": "tiny",
                                                  "owner_tenant_id": owner,
                                                  "path": install(root, name)})
        assert r.status_code == 201, r.text
        out[name] = r.json()
    return out


def client(server, key) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)


def chat(server, key, model: str) -> str:
    r = client(server, key).chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=NEW_TOKENS, temperature=0,
        extra_body={"ignore_eos": True})
    assert r.model == model and r.usage.completion_tokens == NEW_TOKENS
    return r.choices[0].message.content


def prompt_ids() -> list[int]:
    tok = Tokenizer(demo_model("llama", "tiny", 0))
    return tok.encode(tok.apply_chat_template(MESSAGES), add_special_tokens=False)


def expected_text(adapter: str | None) -> str:
    """HF transformers (+ peft with the adapter): the greedy continuation, decoded."""
    base = demo_model("llama", "tiny", 0)
    ids = (peft_greedy(base, str(source(adapter)), prompt_ids(), NEW_TOKENS) if adapter
           else hf_greedy(base, prompt_ids(), NEW_TOKENS, ignore_eos=True))
    return Tokenizer(base).decode(ids)


def names(server) -> list[str]:
    r = server.admin.get("/adapters")
    assert r.status_code == 200, r.text
    return [a["name"] for a in r.json()["data"]]


def err(r: httpx.Response) -> dict:
    return r.json()["error"]


def lora_stats(server) -> dict:
    return server.admin.get("/engine").json()["models"]["tiny"]["lora"]


def wait_for(predicate, timeout: float = 5.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


# -- registration, visibility, use ------------------------------------------------------------------
def test_register_list_and_see_by_tenant(server, tenants, registered):
    a, key_a, _, key_b = tenants
    pub, own = registered["pub"], registered["own"]
    assert pub["object"] == "adapter" and pub["public"] and pub["owner_tenant_id"] is None
    assert own["owner_tenant_id"] == a["id"] and not own["public"]
    assert (pub["rank"], pub["targets"], pub["path"]) == (8, ["q_proj", "v_proj"], "pub")
    assert pub["registered"] is True                  # read by the engine at registration
    assert server.admin.get(f"/adapters/{own['id']}").json() == own
    assert {"ada-pub", "ada-own"} <= set(names(server))

    cards_a = {m.id: m for m in client(server, key_a).models.list().data}
    cards_b = {m.id: m for m in client(server, key_b).models.list().data}
    assert {"tiny", "ada-pub", "ada-own"} <= set(cards_a)
    assert "ada-pub" in cards_b and "ada-own" not in cards_b
    card = cards_a["ada-own"].model_dump()
    assert card["parent"] == "tiny" and card["root"] == "tiny"
    assert cards_a["tiny"].model_dump()["parent"] is None

    # B: A's adapter does not exist, by any route
    with pytest.raises(openai.NotFoundError) as exc:
        chat(server, key_b, "ada-own")
    assert exc.value.code == "model_not_found"
    r = httpx.get(server.url + "/v1/models/ada-own", headers={"Authorization": f"Bearer {key_b}"})
    assert r.status_code == 404
    assert client(server, key_a).models.retrieve("ada-own").id == "ada-own"
    # tenant keys cannot register adapters
    r = httpx.post(server.url + "/admin/v1/adapters", headers={"Authorization": f"Bearer {key_a}"},
                   json={"name": "x", "base_model": "tiny", "owner_tenant_id": None, "path": "pub"})
    assert r.status_code == 403 and err(r)["code"] == "admin_only"


def test_adapter_chat_matches_peft(server, tenants, registered):
    """model=<adapter>: HF + peft's greedy tokens, not the base model's; the usage row names
    the adapter."""
    _, key_a, _, key_b = tenants
    base_text = chat(server, key_a, "tiny")
    assert base_text == expected_text(None)
    own = chat(server, key_a, "ada-own")
    assert own == expected_text("own") and own != base_text
    pub_a, pub_b = chat(server, key_a, "ada-pub"), chat(server, key_b, "ada-pub")
    assert pub_a == pub_b == expected_text("pub") and pub_a != base_text
    stream = client(server, key_a).chat.completions.create(
        model="ada-own", messages=MESSAGES, max_tokens=NEW_TOKENS, temperature=0, stream=True,
        extra_body={"ignore_eos": True})
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == own

    def usage_models() -> set[str]:
        r = httpx.get(server.url + "/v1/usage", params={"group_by": "model"},
                      headers={"Authorization": f"Bearer {key_a}"})
        return {row["group"] for row in r.json()["data"]}

    wait_for(lambda: {"tiny", "ada-own", "ada-pub"} <= usage_models(), what="usage rows")


# -- bad registrations -------------------------------------------------------------------------------
def test_bad_registrations_are_400s_naming_the_field(server, tenants, registered, tmp_path):
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
    gone, _ = server.tenant()
    assert server.admin.delete(f"/tenants/{gone['id']}").status_code == 200

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
    before = server.admin.get("/adapters").json()
    engine_before = set(lora_stats(server)["in_cpu"])
    for payload, param, words in cases:
        r = server.admin.post("/adapters", json=payload)
        what = f"{payload}: {r.status_code} {r.text}"
        assert r.status_code == 400, what
        assert err(r)["param"] == param, what
        assert err(r)["type"] == "invalid_request_error", what
        if words:
            assert words in err(r)["message"], what
    assert server.admin.get("/adapters").json() == before        # nothing half-registered
    assert "ada-new" not in names(server)
    wait_for(lambda: set(lora_stats(server)["in_cpu"]) <= engine_before | {"ada-pub", "ada-own"},
             what="the engine to hold no refused adapter")
    # the engine keeps serving, adapters and base alike
    assert chat(server, key_a, "ada-own") == expected_text("own")
    assert chat(server, key_a, "tiny") == expected_text(None)


# -- unload, delete ------------------------------------------------------------------------------------
def test_unload_then_use_reads_it_again(server, tenants, registered):
    _, key_a, _, _ = tenants
    pub = registered["pub"]
    assert chat(server, key_a, "ada-pub") == expected_text("pub")
    loads = lora_stats(server)["disk_loads"]
    r = server.admin.post(f"/adapters/{pub['id']}/unload")
    assert r.status_code == 200, r.text
    assert r.json()["unloaded"] is True and r.json()["registered"] is True
    wait_for(lambda: "ada-pub" not in lora_stats(server)["in_cpu"], what="the weights to go")
    assert chat(server, key_a, "ada-pub") == expected_text("pub")
    wait_for(lambda: lora_stats(server)["disk_loads"] == loads + 1, what="a fresh disk load")
    assert server.admin.post("/adapters/ada_0000000000000000/unload").status_code == 404


def test_delete_refused_while_in_use_then_404(server, tenants):
    a, key_a, _, _ = tenants
    r = server.admin.post("/adapters", json={"name": "ada-tmp", "base_model": "tiny",
                                             "owner_tenant_id": a["id"],
                                             "path": install(server.adapter_root, "own", "tmp")})
    assert r.status_code == 201, r.text
    tmp = r.json()
    body = {"model": "ada-tmp", "messages": MESSAGES, "max_tokens": 1500, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {key_a}"}) as stream:
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith("data: ") and '"content":"' in line
             and '"content":""' not in line)                       # generating now
        r = server.admin.delete(f"/adapters/{tmp['id']}")
        assert r.status_code == 409, r.text
        assert err(r)["code"] == "adapter_in_use" and "ada-tmp" in err(r)["message"]
    assert "ada-tmp" in names(server)
    wait_for(lambda: server.admin.delete(f"/adapters/{tmp['id']}").status_code == 200,
             what="the delete once the stream is gone")
    assert "ada-tmp" not in names(server)
    with pytest.raises(openai.NotFoundError):
        chat(server, key_a, "ada-tmp")
    assert server.admin.get(f"/adapters/{tmp['id']}").status_code == 404
    assert server.admin.delete(f"/adapters/{tmp['id']}").status_code == 404
    wait_for(lambda: "ada-tmp" not in lora_stats(server)["in_cpu"], what="the weights to go")


# -- replicas ----------------------------------------------------------------------------------------
def test_second_replica_learns_and_forgets_adapters(server, tenants, tmp_path):
    if server.backend != "services":
        pytest.skip("replicas share PostgreSQL")
    a, key_a, _, _ = tenants
    env = server.env
    b = GatewayServer.start(tmp_path / "b", database_url=env["LOCKGATE_DATABASE_URL"],
                            redis_url=env["LOCKGATE_REDIS_URL"],
                            redis_prefix=env["LOCKGATE_REDIS_PREFIX"],
                            pepper=env["LOCKGATE_PEPPER"], admin_key=server.admin_key,
                            models={"tiny": demo_model("llama", "tiny", 0)},
                            extra_env=server_env(server.adapter_root))
    try:
        r = server.admin.post("/adapters", json={"name": "ada-rep", "base_model": "tiny",
                                                 "owner_tenant_id": a["id"],
                                                 "path": install(server.adapter_root, "own", "rep")})
        assert r.status_code == 201, r.text
        rep = r.json()
        assert b.admin.get(f"/adapters/{rep['id']}").json()["registered"] is False
        assert "ada-rep" in {m.id for m in client(b, key_a).models.list().data}
        assert chat(b, key_a, "ada-rep") == expected_text("own")          # read lazily on b
        assert b.admin.get(f"/adapters/{rep['id']}").json()["registered"] is True

        assert server.admin.delete(f"/adapters/{rep['id']}").status_code == 200
        t0 = time.monotonic()
        while True:
            try:
                chat(b, key_a, "ada-rep")
            except openai.NotFoundError:
                break
            assert time.monotonic() - t0 < TTL + 2, "replica b still serves a deleted adapter"
            time.sleep(0.1)
        # and b's engine lets go of it (the sweep, every TTL)
        wait_for(lambda: "ada-rep" not in lora_stats(b)["in_cpu"], timeout=3 * TTL + 2,
                 what="b's engine to drop the adapter")
        assert chat(b, key_a, "tiny") == expected_text(None)
    finally:
        b.stop()


def test_deleting_a_tenant_deletes_its_adapters(server):
    """A deleted tenant's private adapter: its row goes in the same transaction (audited),
    this replica's engine drops it, and its name is free again."""
    c, key_c = server.tenant()
    r = server.admin.post("/adapters", json={"name": "ada-gone", "base_model": "tiny",
                                             "owner_tenant_id": c["id"],
                                             "path": install(server.adapter_root, "own", "gone")})
    assert r.status_code == 201, r.text
    gone = r.json()
    assert chat(server, key_c, "ada-gone") == expected_text("own")     # loaded, in use before
    assert "ada-gone" in lora_stats(server)["in_cpu"]
    assert server.admin.delete(f"/tenants/{c['id']}").status_code == 200
    assert "ada-gone" not in names(server)
    assert server.admin.get(f"/adapters/{gone['id']}").status_code == 404
    wait_for(lambda: "ada-gone" not in lora_stats(server)["in_cpu"], what="the weights to go")
    audit = server.admin.get("/audit", params={"limit": 10}).json()["data"]
    deleted = next(e for e in audit if e["action"] == "tenant.delete" and e["target_id"] == c["id"])
    assert deleted["detail"]["deleted_adapters"] == ["ada-gone"]
    assert any(e["action"] == "adapter.delete" and e["target_id"] == gone["id"] for e in audit)
    # the name is free: another tenant's adapter may take it
    a, _ = server.tenant()
    r = server.admin.post("/adapters", json={"name": "ada-gone", "base_model": "tiny",
                                             "owner_tenant_id": a["id"], "path": "gone"})
    assert r.status_code == 201, r.text
    assert server.admin.delete(f"/adapters/{r.json()['id']}").status_code == 200
