"""A flood of one invalid key costs the database one lookup per key-cache ttl, not one per
request: a key whose lookup prefix no key has is remembered as missing (bounded in number
and in time), and a key created after that miss works within the ttl.

Before: every request with an unknown key was a database lookup, so ~100 invalid keys a
second raised other tenants' median latency sevenfold.
"""

from __future__ import annotations

import asyncio
import secrets

import pytest

from lockgate.tenancy import api_keys, auth, keys

pytestmark = pytest.mark.asyncio(loop_scope="module")
GATEWAY_OPTIONS = {"key_cache_ttl_s": 0.5}


@pytest.fixture
def lookups(monkeypatch) -> list[str]:
    """Every key the database is asked about, in order."""
    asked: list[str] = []
    real = auth.authenticate

    async def counted(session, plaintext, pepper):
        asked.append(plaintext)
        return await real(session, plaintext, pepper)

    monkeypatch.setattr(auth, "authenticate", counted)
    return asked


async def test_one_unknown_key_many_times_is_one_lookup(gateway, lookups):
    unknown = "lg-" + secrets.token_urlsafe(32)
    headers = gateway.auth(unknown)
    first = [await gateway.http.get("/v1/models", headers=headers) for _ in range(10)]
    burst = await asyncio.gather(*(gateway.http.get("/v1/models", headers=headers) for _ in range(40)))
    assert {r.status_code for r in first + list(burst)} == {401}
    assert {r.json()["error"]["code"] for r in first + list(burst)} == {"invalid_api_key"}
    assert lookups == [unknown]
    # another secret behind the same unknown prefix is just as unknown: no lookup either
    same_prefix = unknown[:15] + secrets.token_urlsafe(32)
    assert (await gateway.http.get("/v1/models", headers=gateway.auth(same_prefix))).status_code == 401
    assert lookups == [unknown]


async def test_a_key_created_after_a_miss_works_within_the_ttl(gateway, lookups):
    key = "lg-" + secrets.token_urlsafe(40)
    headers = gateway.auth(key)
    assert (await gateway.http.get("/admin/v1/tenants", headers=headers)).status_code == 401
    state = gateway.app.state.lockgate
    async with state.sessions() as session:      # as another replica or `lockgate` would
        assert await api_keys.ensure_admin_key(session, key, state.pepper, name="late")
    statuses = []
    for _ in range(100):                          # 2 s at most: the ttl is 0.5 s
        statuses.append((await gateway.http.get("/admin/v1/tenants", headers=headers)).status_code)
        if statuses[-1] == 200:
            break
        await asyncio.sleep(0.02)
    assert statuses[-1] == 200, statuses
    assert set(statuses[:-1]) <= {401}


async def test_a_key_made_through_this_replica_works_at_once_after_a_miss(gateway, lookups,
                                                                           monkeypatch):
    t, _ = await gateway.tenant()
    plaintext = "lg-" + secrets.token_urlsafe(32)
    assert (await gateway.http.get("/v1/models", headers=gateway.auth(plaintext))).status_code == 401
    # the next key generated is the one just refused (its prefix is remembered as missing)
    monkeypatch.setattr(keys, "generate_key", lambda: (plaintext, keys.lookup_prefix(plaintext)))
    r = await gateway.admin.post(f"/tenants/{t['id']}/keys", json={"name": "late"})
    assert r.status_code == 201 and r.json()["key"] == plaintext, r.text
    # well within the ttl: the miss is forgotten on this replica as the key is made
    assert (await gateway.http.get("/v1/models", headers=gateway.auth(plaintext))).status_code == 200
    assert lookups.count(plaintext) == 2


async def test_a_wrong_secret_behind_a_real_prefix_never_locks_out_the_real_key(gateway, lookups):
    _, key = await gateway.tenant()
    forged = key[:15] + secrets.token_urlsafe(32)
    for _ in range(5):
        assert (await gateway.http.get("/v1/models", headers=gateway.auth(forged))).status_code == 401
    assert lookups.count(forged) == 1           # remembered by the whole key, not its prefix
    assert (await gateway.http.get("/v1/models", headers=gateway.auth(key))).status_code == 200
