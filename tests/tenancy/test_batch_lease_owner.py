"""A replica that lost track of a batch it still leases (its round failed while the database
was down, and handing the lease back failed too) takes it up again on its next look for
work, not once its own lease lapses; no other replica can before then."""

from __future__ import annotations

from lockgate.tenancy import batches as store
from tests.tenancy.test_batches_store import make_batch


async def test_an_owner_takes_back_its_own_unexpired_lease_at_once(sessions):
    _, _, b = await make_batch(sessions)
    async with sessions() as s:
        assert await store.claim_batches(s, owner="A", ttl_s=60, limit=5) == [b.id]
    async with sessions() as s:       # A is working it: not claimed twice
        assert await store.claim_batches(s, owner="A", ttl_s=60, limit=5, exclude={b.id}) == []
        assert await store.claim_batches(s, owner="B", ttl_s=60, limit=5) == []
    async with sessions() as s:       # A dropped it (its lease still runs): A takes it back now
        assert await store.claim_batches(s, owner="A", ttl_s=60, limit=5) == [b.id]
        batch = await store.get_batch(s, batch_id=b.id, tenant_id=None)
        assert batch.lease_owner == "A"
