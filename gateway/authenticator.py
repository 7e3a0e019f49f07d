"""`Authenticator`: a presented key -> its `Principal`, from the key cache or the database
(503 when the database is down), expired keys refused, and each key's last use recorded at
most once a minute, off the request's path."""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from lockgate.gateway.background import Background
from lockgate.gateway.errors import database_unavailable, is_database_down
from lockgate.gateway.key_cache import KeyCache
from lockgate.tenancy import api_keys, auth
from lockgate.tenancy.auth import Principal
from lockgate.tenancy.errors import AuthError

logger = logging.getLogger(__name__)
TOUCH_EVERY_S = 60.0


class Authenticator:
    def __init__(self, sessions: async_sessionmaker[AsyncSession], pepper: bytes, cache_ttl_s: float,
                 background: Background) -> None:
        self.sessions = sessions
        self.pepper = pepper
        self.keys = KeyCache(cache_ttl_s)
        self.background = background
        self._touched: dict[str, float] = {}

    async def authenticate(self, key: str) -> Principal:
        principal = await self.keys.resolve(key, self._lookup, self.background.spawn)
        if principal.expires_at is not None and principal.expires_at <= datetime.now(UTC):
            raise AuthError("expired")
        self._touch(principal.key_id)
        return principal

    async def _lookup(self, key: str) -> Principal:
        """A key not in the cache needs the database: down, the request is refused (503)."""
        try:
            async with self.sessions() as session:
                return await auth.authenticate(session, key, self.pepper)
        except Exception as exc:
            if is_database_down(exc):
                logger.warning("key lookup: the database is unavailable: %r", exc)
                raise database_unavailable() from None
            raise

    def _touch(self, key_id: str) -> None:
        """Record last use at most once every `TOUCH_EVERY_S` per key, off the request's path."""
        now = time.monotonic()
        if now - self._touched.get(key_id, -1e9) < TOUCH_EVERY_S:
            return
        self._touched[key_id] = now

        async def touch() -> None:
            try:
                async with self.sessions() as session:
                    await api_keys.touch_key(session, key_id, datetime.now(UTC))
            except Exception:  # any failure, logged: last-used is best effort
                logger.warning("could not record last use of key %s", key_id, exc_info=True)

        self.background.spawn(touch())
