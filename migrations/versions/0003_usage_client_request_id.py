"""usage_records.client_request_id: the client's x-request-id on its usage row (nullable).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("usage_records") as batch_op:
        batch_op.add_column(sa.Column("client_request_id", sa.String(length=128), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("usage_records") as batch_op:
        batch_op.drop_column("client_request_id")
