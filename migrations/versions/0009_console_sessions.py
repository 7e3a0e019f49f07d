"""console_sessions: the admin console's signed-in browsers, each keyed by the SHA-256 of its
token, with the admin key it was exchanged for and its expiry.

Revision ID: 0009_console_sessions
Revises: 0008_cached_price
Create Date: 2026-12-06 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009_console_sessions"
down_revision: str | None = "0008_cached_price"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "console_sessions",
        sa.Column("token_hash", sa.String(length=64), nullable=False),
        sa.Column("api_key_id", sa.String(length=20), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("expires_at", TS, nullable=False),
        sa.ForeignKeyConstraint(["api_key_id"], ["api_keys.id"],
                                name=op.f("fk_console_sessions_api_key_id_api_keys")),
        sa.PrimaryKeyConstraint("token_hash", name=op.f("pk_console_sessions")),
    )
    with op.batch_alter_table("console_sessions") as batch_op:
        batch_op.create_index(batch_op.f("ix_console_sessions_api_key_id"), ["api_key_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_console_sessions_expires_at"), ["expires_at"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("console_sessions") as batch_op:
        batch_op.drop_index(batch_op.f("ix_console_sessions_expires_at"))
        batch_op.drop_index(batch_op.f("ix_console_sessions_api_key_id"))
    op.drop_table("console_sessions")
