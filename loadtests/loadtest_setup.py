"""`lockgate loadtest`'s tenants and users: the classes' shares of the users, the tenants made
through the admin API (weights, plans and quotas that differ), each user's tenant, and what
is read back afterwards (the usage report, batches still running).

Users are spread over a class's tenants in proportion to the tenants' weights, so each
tenant's demand is proportional to its weight: a gateway that is fair by weight then gives
every tenant of a class the same weight-normalised throughput whether it is saturated or
not, and Jain's index over those is 1.
"""

from __future__ import annotations

import math
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from lockgate.loadtests.loadtest_batch import TERMINAL_BATCH, collect_batch

CLASSES = ("online", "offline", "batch", "bad")
DEFAULT_MIX = "online=0.5,offline=0.2,batch=0.1,bad=0.2"


@dataclass(slots=True, frozen=True)
class TenantSpec:
    cls: str                                  # the class of user that calls with its keys
    label: str
    weight: float
    service_tiers: list[str] | None = None    # None: the default plan (default, flex)
    default_tier: str | None = None
    quota: dict[str, int] = field(default_factory=dict)


# Three online tenants (weights 1, 1, 2), two offline (1, 2), one batch, one with a tiny
# request rate for the misbehaving users. The quotas differ but, except the last, never bind.
TENANTS = (
    TenantSpec("online", "online-a", 1.0, quota={"max_concurrent_requests": 256}),
    TenantSpec("online", "online-b", 1.0, quota={"daily_token_budget": 500_000_000}),
    TenantSpec("online", "online-c", 2.0, ["priority", "default", "flex"],
               quota={"monthly_token_budget": 5_000_000_000}),
    TenantSpec("offline", "offline-a", 1.0, ["flex"], "flex", {"tokens_per_minute": 100_000_000}),
    TenantSpec("offline", "offline-b", 2.0, ["flex"], "flex"),
    TenantSpec("batch", "batch-a", 1.0),
    TenantSpec("bad", "limited", 1.0, quota={"requests_per_minute": 2}),
)


@dataclass(slots=True)
class Tenant:
    spec: TenantSpec
    name: str
    id: str
    key: str
    num_users: int = 0

    def public(self) -> dict[str, Any]:
        """What the summary shows (never the key)."""
        return {"name": self.name, "id": self.id, "cls": self.spec.cls, "weight": self.spec.weight,
                "service_tiers": self.spec.service_tiers, "quota": self.spec.quota, "users": self.num_users}


def parse_mix(text: str) -> dict[str, float]:
    """`online=0.5,offline=0.2,...` as each class's share (summing to 1); classes not named get 0."""
    shares = dict.fromkeys(CLASSES, 0.0)
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or name not in CLASSES:
            raise ValueError(f"expected CLASS=SHARE with CLASS one of {', '.join(CLASSES)}, got {part!r}")
        try:
            shares[name] = float(value)
        except ValueError:
            raise ValueError(f"{name}: expected a number, got {value!r}") from None
        if not math.isfinite(shares[name]) or shares[name] < 0:
            raise ValueError(f"{name}: must be a finite number >= 0, got {value!r}")
    total = sum(shares.values())
    if total <= 0:
        raise ValueError("no class has a share above 0")
    return {name: share / total for name, share in shares.items()}


def largest_remainder(total: int, shares: list[float], *, at_least_one: bool = False) -> list[int]:
    """`total` split in proportion to `shares`: whole numbers summing to `total`, each the
    floor of its exact part or one more (the largest remainders, ties to the first). With
    `at_least_one`, a positive share left at 0 then takes one from the largest count."""
    norm = sum(shares)
    exact = [total * s / norm for s in shares]
    counts = [math.floor(x) for x in exact]
    order = sorted(range(len(shares)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[:total - sum(counts)]:
        counts[i] += 1
    if at_least_one:
        starved = [i for i, s in enumerate(shares) if s > 0 and counts[i] == 0]
        if total < sum(s > 0 for s in shares):
            raise ValueError(f"{total} users for {sum(s > 0 for s in shares)} classes: give each at least one")
        for i in starved:
            counts[max(range(len(counts)), key=lambda j: (counts[j], -j))] -= 1
            counts[i] = 1
    return counts


def users_per_class(num_users: int, mix: dict[str, float]) -> dict[str, int]:
    return dict(zip(CLASSES, largest_remainder(num_users, [mix[c] for c in CLASSES], at_least_one=True),
                    strict=True))


def spread(tenants: list[Tenant], num_users: int) -> list[Tenant]:
    """`num_users` users over `tenants` by weight; the users' tenants, interleaved."""
    counts = largest_remainder(num_users, [t.spec.weight for t in tenants])
    for t, n in zip(tenants, counts, strict=True):
        t.num_users = n
    order = []
    for round_ in range(max(counts, default=0)):
        order += [t for t, n in zip(tenants, counts, strict=True) if n > round_]
    return order


class Admin:
    """The admin API calls the load test makes (an httpx client with the admin key)."""

    def __init__(self, url: str, admin_key: str) -> None:
        self.url = url
        self.http = httpx.Client(base_url=url, timeout=30, headers={"Authorization": f"Bearer {admin_key}"})

    def close(self) -> None:
        self.http.close()

    def check(self) -> None:
        """Raise RuntimeError unless the gateway is ready and takes the admin key."""
        ready = self.http.get("/ready")
        if ready.status_code != 200:
            raise RuntimeError(f"{self.url}/ready answered {ready.status_code}: {ready.text[:200]}")
        r = self.http.get("/admin/v1/tenants", params={"limit": 1})
        if r.status_code != 200:
            raise RuntimeError(f"the admin key was refused ({r.status_code}): {r.text[:200]}")

    def create_tenants(self, run_id: str, specs: tuple[TenantSpec, ...] = TENANTS) -> list[Tenant]:
        made = []
        for spec in specs:
            name = f"lt-{run_id}-{spec.label}"
            body = {"name": name, "weight": spec.weight, "quota": spec.quota or None,
                    "service_tiers": spec.service_tiers, "default_tier": spec.default_tier}
            r = self.http.post("/admin/v1/tenants", json={k: v for k, v in body.items() if v is not None})
            r.raise_for_status()
            tenant_id = r.json()["id"]
            k = self.http.post(f"/admin/v1/tenants/{tenant_id}/keys", json={"name": "loadtest"})
            k.raise_for_status()
            made.append(Tenant(spec, name, tenant_id, k.json()["key"]))
        return made

    def delete_tenants(self, tenants: list[Tenant]) -> None:
        for t in tenants:
            self.http.delete(f"/admin/v1/tenants/{t.id}")

    def usage(self, tenant: Tenant) -> dict[str, int]:
        """The usage report's token sums for the tenant (all its usage rows: it is new)."""
        r = self.http.get("/admin/v1/usage", params={"tenant_id": tenant.id})
        r.raise_for_status()
        rows = r.json()["data"]
        return {k: sum(row[k] for row in rows) for k in ("requests", "prompt_tokens", "completion_tokens")}


def first_model(url: str, key: str) -> str:
    r = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30)
    r.raise_for_status()
    models = r.json()["data"]
    if not models:
        raise RuntimeError("GET /v1/models lists no model")
    return models[0]["id"]


def locust_config(tenants: list[Tenant], class_users: dict[str, int], *, model: str,
                  samples_dir: str, **sizes: Any) -> dict[str, Any]:
    """What the locustfile reads from LOCKGATE_LOADTEST: each class's users' (tenant, key)."""
    users = {}
    for cls in CLASSES:
        mine = [t for t in tenants if t.spec.cls == cls]
        users[cls] = [{"tenant": t.name, "key": t.key} for t in spread(mine, class_users[cls])]
    return {"model": model, "samples_dir": samples_dir, "users": users, **sizes}


def finish_batches(url: str, key: str, batch_ids: list[str], timeout_s: float) -> list[dict]:
    """Batches created but not collected when locust stopped: polled until they end (at most
    `timeout_s` in all), then collected as the submitter would have."""
    results = []
    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=url, timeout=30, headers={"Authorization": f"Bearer {key}"}) as http:
        def download(path: str) -> bytes | None:
            r = http.get(path)
            return r.content if r.status_code == 200 else None

        for batch_id in batch_ids:
            batch = http.get(f"/v1/batches/{batch_id}").json()
            while batch.get("status") not in TERMINAL_BATCH and time.monotonic() < deadline:
                time.sleep(0.5)
                batch = http.get(f"/v1/batches/{batch_id}").json()
            results.append({"batch_id": batch_id, **collect_batch(batch, download)})
    return results


def new_run_id() -> str:
    return time.strftime("%m%d%H%M") + "-" + secrets.token_hex(2)

