"""`--root-path /ops`: the prefix is handled by the outermost middleware, so every layer sees
the route's own path whether the request came prefixed (a browser) or stripped (a proxy): the
upload limit of /v1/files, the drain's open paths, the metrics' route labels and the console's
security headers are the same either way."""

from __future__ import annotations

import re

import pytest
import pytest_asyncio

from lockgate.gateway.root_path import RootPath, route_path
from tests.support.inprocess_gateway import InProcessGateway, running_gateway

pytestmark = pytest.mark.asyncio(loop_scope="module")
ROOT = "/ops"
MAX_BODY = 8 << 10


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gw(tmp_path_factory) -> InProcessGateway:
    async with running_gateway(tmp_path_factory.mktemp("root-path"), "embedded", engine="fake",
                               root_path=ROOT, max_body_bytes=MAX_BODY) as g:
        yield g


async def test_route_path():
    assert route_path({"path": "/ops/v1/files", "root_path": "/ops"}) == "/v1/files"
    assert route_path({"path": "/ops", "root_path": "/ops"}) == "/"
    assert route_path({"path": "/opsx/v1", "root_path": "/ops"}) == "/opsx/v1"
    assert route_path({"path": "/v1/files"}) == "/v1/files"


async def test_the_root_path_is_the_outermost_middleware(gw):
    assert gw.app.user_middleware[0].cls is RootPath, [m.cls.__name__ for m in gw.app.user_middleware]


@pytest.mark.parametrize("prefix", [ROOT, ""], ids=["prefixed", "stripped"])
async def test_every_layer_sees_the_routes_path(gw, prefix):
    _, key = await gw.tenant()
    auth = gw.auth(key)
    big = b"x" * (MAX_BODY * 2)
    # the upload limit, not the body limit, for the file route (BodyLimits, RequestContext)
    r = await gw.http.post(prefix + "/v1/files", headers=auth, data={"purpose": "batch"},
                           files={"file": ("a.jsonl", big, "application/jsonl")})
    assert r.status_code != 413, r.text
    r = await gw.http.post(prefix + "/v1/completions", headers={**auth, "content-type": "application/json"},
                           content=b'{"model": "tiny", "prompt": "' + big + b'"}')
    assert r.status_code == 413, r.text
    # the metrics' label is the route's template, without the prefix (CountResponses)
    t, _ = await gw.tenant()
    assert (await gw.http.get(f"{prefix}/admin/v1/tenants/{t['id']}", headers=gw.auth(gw.admin_key))).status_code == 200
    metrics = (await gw.http.get(prefix + "/metrics", headers=gw.auth(gw.admin_key))).text
    assert re.search(r'lockgate_http_requests_total\{[^}]*route="/admin/v1/tenants/\{tenant_id\}"', metrics)
    assert f'route="{ROOT}/' not in metrics
    # the console's headers (SecurityHeaders)
    r = await gw.http.get(prefix + "/console/sign-in")
    assert r.status_code == 200 and "frame-ancestors 'none'" in r.headers["content-security-policy"]
    # while draining, the open paths stay open and the rest is refused (DrainGate)
    lifecycle = gw.app.state.lockgate.lifecycle
    lifecycle.draining = True
    try:
        assert (await gw.http.get(prefix + "/health")).status_code == 200
        assert (await gw.http.get(prefix + "/v1/models", headers=auth)).status_code == 503
    finally:
        lifecycle.draining = False
