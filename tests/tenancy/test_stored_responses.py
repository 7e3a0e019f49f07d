"""The Responses API's stored responses (tenancy/stored_responses.py) on SQLite and PostgreSQL:
a chain read back oldest first, per tenant only; a link gone ends the chain; text with NUL
kept exactly; expired ones unseen at once and swept."""

from __future__ import annotations

from datetime import timedelta

import pytest

from lockgate.tenancy import stored_responses as store
from lockgate.tenancy import tenants
from lockgate.tenancy.errors import NotFound
from lockgate.tenancy.models import utcnow

ACTOR = "key_0000000000000000"
DAY = 86400.0


def message(role: str, text: str, n: int) -> dict:
    return {"id": f"msg_{n}", "type": "message", "role": role, "content": [{"type": "input_text", "text": text}]}


async def keep(sessions, tenant_id: str, n: int, previous: str | None, retention_s: float = DAY, **kw) -> str:
    response = {"id": f"resp_{n}", "previous_response_id": previous,
                "output": [message("assistant", f"answer {n}", 100 + n)]}
    async with sessions() as s:
        await store.store_response(s, tenant_id=tenant_id, response=response,
                                   input_items=[message("user", f"question {n}\x00", n)], retention_s=retention_s, **kw)
    return response["id"]


def texts(items: list[dict]) -> list[str]:
    return [i["content"][0]["text"] for i in items]


async def test_a_chain_is_read_back_oldest_first_by_its_tenant_only(sessions):
    async with sessions() as s:
        a = await tenants.create_tenant(s, name="a", actor=ACTOR)
        b = await tenants.create_tenant(s, name="b", actor=ACTOR)
    first = await keep(sessions, a.id, 1, None)
    second = await keep(sessions, a.id, 2, first)
    third = await keep(sessions, a.id, 3, second)
    async with sessions() as s:
        got = await store.conversation(s, response_id=third, tenant_id=a.id)
        assert texts(got) == ["question 1\x00", "answer 1", "question 2\x00", "answer 2",
                              "question 3\x00", "answer 3"]
        with pytest.raises(NotFound):
            await store.conversation(s, response_id=third, tenant_id=b.id)
        await store.delete_response(s, response_id=second, tenant_id=a.id)
        assert texts(await store.conversation(s, response_id=third, tenant_id=a.id)) == \
            ["question 3\x00", "answer 3"]          # the chain ends at a link that is gone
        with pytest.raises(NotFound):
            await store.delete_response(s, response_id=second, tenant_id=a.id)


async def test_expired_responses_are_unseen_then_swept(sessions):
    async with sessions() as s:
        t = await tenants.create_tenant(s, name="t", actor=ACTOR)
    old = await keep(sessions, t.id, 1, None, retention_s=60, now=utcnow() - timedelta(seconds=61))
    young = await keep(sessions, t.id, 2, old)
    async with sessions() as s:
        with pytest.raises(NotFound):
            await store.get_response(s, response_id=old, tenant_id=t.id)
        assert len(await store.conversation(s, response_id=young, tenant_id=t.id)) == 2
        assert await store.sweep_responses(s) == 1
        assert await store.sweep_responses(s) == 0
        assert (await store.get_response(s, response_id=young, tenant_id=t.id)).id == young
