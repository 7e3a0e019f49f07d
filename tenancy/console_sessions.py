"""The admin console's sessions: an admin key exchanged once for a random token the browser
keeps, stored only as its SHA-256 with the key's id and an expiry. A session is as good as its
key: `session_key_id` finds the key of a live session, and the caller reads the key itself
(`auth.principal_of_key`) on every request, so a revoked or expired key ends its sessions on
every replica at once. Sign-ins, refused sign-ins and sign-outs are audited, never the key.
"""

from __future__ import annotations

import hashlib
import secrets
from datetime import timedelta

from sqlalchemy import delete, select
from sqlalchemy.ext.asyncio import AsyncSession

from lockgate.tenancy import audit
from lockgate.tenancy.db import in_transaction
from lockgate.tenancy.errors import Invalid
from lockgate.tenancy.models import ConsoleSession, utcnow
from lockgate.tenancy.validation import check_actor

TOKEN_BYTES = 32
CLIENT_MAX = 64      # characters of a client's address kept in the audit entry


def token_hash(token: str) -> str:
    """The stored form of a session token."""
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def _client(client: str) -> str:
    return client[:CLIENT_MAX]


async def open_session(session: AsyncSession, *, key_id: str, ttl_s: float, client: str) -> str:
    """A new session of the admin key `key_id` for `ttl_s` seconds: its token (the cookie's
    value, never stored). Expired sessions are swept in the same transaction."""
    check_actor(key_id)
    if not ttl_s > 0:
        raise Invalid("ttl_s", "must be positive")
    token = secrets.token_urlsafe(TOKEN_BYTES)
    now = utcnow()

    async def work() -> str:
        await session.execute(delete(ConsoleSession).where(ConsoleSession.expires_at <= now))
        session.add(ConsoleSession(token_hash=token_hash(token), api_key_id=key_id, created_at=now,
                                   expires_at=now + timedelta(seconds=ttl_s)))
        audit.record(session, key_id, "console.sign_in", "key", key_id, {"client": _client(client)})
        await session.flush()
        return token

    return await in_transaction(session, work)


def refused_sign_in(session: AsyncSession, *, reason: str, client: str, key_id: str | None = None) -> None:
    """Audit a refused sign-in (the caller commits): why, from where, and the key's id when
    the key was a real one (a tenant's, a revoked one); never what was typed."""
    audit.record(session, "console", "console.sign_in_refused", "key", key_id,
                 {"reason": reason, "client": _client(client)})


async def session_key_id(session: AsyncSession, token: str) -> str | None:
    """The admin key of the live session `token`, None for an unknown or expired one."""
    if not token or len(token) > 256:
        return None
    stmt = select(ConsoleSession.api_key_id).where(ConsoleSession.token_hash == token_hash(token),
                                                   ConsoleSession.expires_at > utcnow())
    return await session.scalar(stmt)


async def close_session(session: AsyncSession, token: str, *, key_id: str) -> None:
    """Sign out: the session's row deleted, the sign-out audited."""
    check_actor(key_id)

    async def work() -> None:
        await session.execute(delete(ConsoleSession).where(ConsoleSession.token_hash == token_hash(token)))
        audit.record(session, key_id, "console.sign_out", "key", key_id, None)

    await in_transaction(session, work)
