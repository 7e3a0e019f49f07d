"""The admin REST console under /admin/v1, one router per resource: tenants, keys, adapters,
reports (usage, audit), the engine and its models, files and batches.

Every route is an `AdminRoute`, which authenticates the admin key before the body is read, so
a route added here cannot be left open: no key is 401, a tenant's key is 403.
"""

from __future__ import annotations

from lockgate.gateway.admin import adapters, batches, engine_status, keys, reports, tenants
from lockgate.gateway.admin.route import admin_router

router = admin_router(prefix="/admin/v1")
for _resource in (tenants, keys, adapters, reports, engine_status, batches):
    router.include_router(_resource.router)
