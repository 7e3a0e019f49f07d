"""A tenant plan's speculative decoding (`tenants.speculative`, true: its requests may carry
draft tokens where the engine speculates; false: they decode without drafts, whatever a
request asks). Existing rows get true, as before the column.

Revision ID: 0011_tenant_speculative
Revises: 0010_refusal_tier
Create Date: 2026-12-06 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011_tenant_speculative"
down_revision: str | None = "0010_refusal_tier"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # a plain ADD COLUMN on every dialect: batch mode would copy the table on SQLite, which
    # refuses to drop a table other rows still reference with foreign keys on
    op.add_column("tenants", sa.Column("speculative", sa.Boolean(), nullable=False, server_default=sa.true()))


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":   # SQLite's own DROP COLUMN, no copy
        op.execute("ALTER TABLE tenants DROP COLUMN speculative")
        return
    op.drop_column("tenants", "speculative")
