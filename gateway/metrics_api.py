"""`/metrics` (Prometheus text). It names tenants, so it is not open by default: it takes an
admin key, or the scraper's own `LOCKGATE_METRICS_TOKEN` as a bearer token;
`LOCKGATE_METRICS_PUBLIC=true` opens it to anyone who reaches the port (a scraper on a
private network). And vLLM's `/version` (`{"version": ...}`), open as vLLM's is: the
version `lockgate --version` prints."""

from __future__ import annotations

import hmac

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import lockgate
from lockgate.gateway.caller import admin_principal, bearer
from lockgate.gateway.deps import StateDep
from lockgate.gateway.errors import APIError
from lockgate.gateway.state import AppState

router = APIRouter()


async def authorize_scrape(request: Request, state: AppState) -> None:
    """Public, or the metrics token, or an admin key; else 401 (no key, a wrong one) or 403
    (a tenant's key), each saying what would do."""
    s = state.settings
    if s.metrics_public:
        return
    key = bearer(request)
    token = s.metrics_token
    if key and token is not None and hmac.compare_digest(key.encode(), token.get_secret_value().encode()):
        return
    try:
        await admin_principal(request)
    except APIError as exc:
        raise APIError(exc.status, "/metrics needs an admin key or the metrics token "
                       "(LOCKGATE_METRICS_TOKEN) as a bearer token; LOCKGATE_METRICS_PUBLIC=true "
                       "opens it.", code=exc.code) from None


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request, state: StateDep) -> Response:
    await authorize_scrape(request, state)
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/version", include_in_schema=False)
async def version() -> dict:
    return {"version": lockgate.__version__}
