"""The audit log: an entry added in the caller's transaction for every change, and the
newest entries read back."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from tenancy.models import AuditEntry, utcnow
from tenancy.validation import check_list_limit


def record(session: AsyncSession, actor: str, action: str, target_type: str,
           target_id: str | None, detail: dict[str, Any] | None = None) -> None:
    """Add an entry to the session; it commits (or rolls back) with the change it records."""
    session.add(AuditEntry(actor=actor, action=action, target_type=target_type,
                           target_id=target_id, detail=detail, created_at=utcnow()))


async def list_audit(session: AsyncSession, limit: int = 100) -> list[AuditEntry]:
    """The newest audit entries first."""
    check_list_limit(limit)
    stmt = select(AuditEntry).order_by(AuditEntry.id.desc()).limit(limit)
    return list((await session.scalars(stmt)).all())
