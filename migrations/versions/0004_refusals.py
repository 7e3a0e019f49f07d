"""refusal_counts: requests refused by a limit (429s), per tenant, key, limit and UTC minute.

Revision ID: 0004_refusals
Revises: 0003
Create Date: 2026-12-03 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004_refusals"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "refusal_counts",
        sa.Column("tenant_id", sa.String(length=20), nullable=False),
        sa.Column("api_key_id", sa.String(length=20), nullable=False),
        sa.Column("scope", sa.String(length=8), nullable=False),
        sa.Column("reason", sa.String(length=32), nullable=False),
        sa.Column("minute", sa.DateTime(timezone=True), nullable=False),
        sa.Column("count", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("tenant_id", "api_key_id", "scope", "reason", "minute",
                                name=op.f("pk_refusal_counts")),
    )
    with op.batch_alter_table("refusal_counts") as batch_op:
        batch_op.create_index("ix_refusal_counts_minute", ["minute"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("refusal_counts") as batch_op:
        batch_op.drop_index("ix_refusal_counts_minute")
    op.drop_table("refusal_counts")
