"""The audit log: an entry added in the caller's transaction for every change, and the
newest entries read back."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from lockgate.tenancy.models import AuditEntry, utcnow
from lockgate.tenancy.validation import check_list_limit


def record(session: AsyncSession, actor: str, action: str, target_type: str,
           target_id: str | None, detail: dict[str, Any] | None = None) -> None:
    """Add an entry to the session; it commits (or rolls back) with the change it records."""
    session.add(AuditEntry(actor=actor, action=action, target_type=target_type,
                           target_id=target_id, detail=detail, created_at=utcnow()))


async def list_audit(session: AsyncSession, limit: int = 100, **filters: Any) -> list[AuditEntry]:
    """The newest audit entries first (`filters` as `audit_page`'s)."""
    rows, _ = await audit_page(session, limit, **filters)
    return rows


async def audit_page(
    session: AsyncSession,
    limit: int = 100,
    *,
    before_id: int | None = None,
    action: str | None = None,
    target_type: str | None = None,
    target_id: str | None = None,
    actor: str | None = None,
    start: datetime | None = None,
    end: datetime | None = None,
) -> tuple[list[AuditEntry], bool]:
    """A page of the newest entries first, and whether more follow: entries older than
    `before_id` (the last id of the page before) when given, matching every filter given
    (`start` inclusive, `end` exclusive)."""
    check_list_limit(limit)
    stmt = select(AuditEntry)
    for column, value in ((AuditEntry.action, action), (AuditEntry.target_type, target_type),
                          (AuditEntry.target_id, target_id), (AuditEntry.actor, actor)):
        if value is not None:
            stmt = stmt.where(column == value)
    if before_id is not None:
        stmt = stmt.where(AuditEntry.id < before_id)
    if start is not None:
        stmt = stmt.where(AuditEntry.created_at >= start)
    if end is not None:
        stmt = stmt.where(AuditEntry.created_at < end)
    rows = list((await session.scalars(stmt.order_by(AuditEntry.id.desc()).limit(limit + 1))).all())
    return rows[:limit], len(rows) > limit
