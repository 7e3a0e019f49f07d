"""A deleted tenant's cached prefixes leave the engine: the admin delete, through the real
engine in process, drops every KV block salted with the tenant (another tenant's stay)."""

from __future__ import annotations

import pytest

from tests.support.helpers import demo_model
from tests.support.inprocess_gateway import REAL_ENGINE_KWARGS, running_gateway

pytestmark = pytest.mark.asyncio(loop_scope="module")


async def test_deleting_a_tenant_drops_its_cached_blocks_and_keeps_the_others(tmp_path):
    async with running_gateway(tmp_path, engine="real", models={"demo": demo_model()},
                               engine_kwargs=REAL_ENGINE_KWARGS) as gw:
        core = gw.app.state.lockgate.models.entries["demo"].engine.engine.core
        gone, gone_key = await gw.tenant()
        kept, kept_key = await gw.tenant()
        body = {"model": "demo", "prompt": [5 + i % 50 for i in range(80)], "max_tokens": 2, "temperature": 0}

        def tagged(tenant_id: str) -> int:
            return sum(1 for b in core.kv.pool.cached.values() if b.tag[2] == f"t:{tenant_id}")

        for key in (gone_key, kept_key):
            r = await gw.http.post("/v1/completions", headers=gw.auth(key), json=body)
            assert r.status_code == 200, r.text
        assert tagged(gone["id"]) >= 4 and tagged(kept["id"]) >= 4
        kept_before = tagged(kept["id"])
        assert (await gw.admin.delete(f"/tenants/{gone['id']}")).status_code in (200, 204)
        # the drop is applied before the engine's next lookup: the kept tenant's next request
        r = await gw.http.post("/v1/completions", headers=gw.auth(kept_key), json=body)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert tagged(gone["id"]) == 0
        assert tagged(kept["id"]) == kept_before
