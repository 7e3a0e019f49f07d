"""The console's one table of page x action, each with the /admin/v1 route it stands for and
the console route that does it. Who may do an action is who may call that API route:
`allowed(role, page, action)` asks `caller.may` with the API route's method, the rule the
/admin/v1 routes apply, so the console can never allow what the API refuses.
tests/gateway/test_console_roles.py walks the table against both."""

from __future__ import annotations

from dataclasses import dataclass

from lockgate.gateway.caller import ADMIN_ROLES, may


@dataclass(frozen=True)
class Action:
    page: str
    action: str
    method: str          # the /admin/v1 route's method and path
    api: str
    console: str         # the console route's method and path
    console_path: str


ACTIONS: tuple[Action, ...] = (
    Action("overview", "view", "GET", "/admin/v1/usage", "GET", "/console/"),
    Action("tenants", "view", "GET", "/admin/v1/tenants", "GET", "/console/tenants"),
    Action("tenants", "create", "POST", "/admin/v1/tenants", "POST", "/console/tenants"),
    Action("tenant", "view", "GET", "/admin/v1/tenants/{tenant_id}", "GET", "/console/tenants/{tenant_id}"),
    Action("tenant", "edit_quota", "PUT", "/admin/v1/tenants/{tenant_id}/quota",
           "POST", "/console/tenants/{tenant_id}/quota"),
    Action("tenant", "delete", "DELETE", "/admin/v1/tenants/{tenant_id}",
           "POST", "/console/tenants/{tenant_id}/delete"),
    Action("tenant", "create_key", "POST", "/admin/v1/tenants/{tenant_id}/keys",
           "POST", "/console/tenants/{tenant_id}/keys"),
    Action("keys", "view", "GET", "/admin/v1/keys", "GET", "/console/keys"),
    Action("keys", "create", "POST", "/admin/v1/keys", "POST", "/console/keys"),
    Action("keys", "revoke", "DELETE", "/admin/v1/keys/{key_id}", "POST", "/console/keys/{key_id}/revoke"),
    Action("usage", "view", "GET", "/admin/v1/usage", "GET", "/console/usage"),
    Action("usage", "download", "GET", "/admin/v1/usage", "GET", "/console/usage.csv"),
    Action("engine", "view", "GET", "/admin/v1/engine", "GET", "/console/engine"),
    Action("engine", "refresh", "GET", "/admin/v1/engine", "GET", "/console/engine/live"),
    Action("models", "view", "GET", "/admin/v1/models", "GET", "/console/models"),
    Action("models", "register_adapter", "POST", "/admin/v1/adapters", "POST", "/console/adapters"),
    Action("models", "unload_adapter", "POST", "/admin/v1/adapters/{adapter_id}/unload",
           "POST", "/console/adapters/{adapter_id}/unload"),
    Action("quotas", "view", "GET", "/admin/v1/quotas/report", "GET", "/console/quotas"),
    Action("audit", "view", "GET", "/admin/v1/audit", "GET", "/console/audit"),
)
ACTION_BY_NAME = {(a.page, a.action): a for a in ACTIONS}


def allowed(role: str | None, page: str, action: str) -> bool:
    """Whether `role` may do `action` on `page`: exactly when it may call its API route."""
    return may(role, ACTION_BY_NAME[(page, action)].method)


def table() -> list[tuple[str, str, str, dict[str, bool]]]:
    """(page, action, API route, {role: allowed}) of every action, for the docs and tests."""
    return [(a.page, a.action, f"{a.method} {a.api}", {r: allowed(r, a.page, a.action) for r in ADMIN_ROLES})
            for a in ACTIONS]
