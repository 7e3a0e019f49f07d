"""LoRA adapters: name, base model, owner tenant (NULL: public), path under the adapter root.

Revision ID: 0002
Revises: 0001
Create Date: 2025-02-01 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "adapters",
        sa.Column("id", sa.String(length=20), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("base_model", sa.String(length=128), nullable=False),
        sa.Column("owner_tenant_id", sa.String(length=20), nullable=True),
        sa.Column("path", sa.String(length=1024), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("targets", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["owner_tenant_id"], ["tenants.id"], name=op.f("fk_adapters_owner_tenant_id_tenants")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_adapters")),
        sa.UniqueConstraint("name", name=op.f("uq_adapters_name")),
    )
    with op.batch_alter_table("adapters") as batch_op:
        batch_op.create_index(
            batch_op.f("ix_adapters_owner_tenant_id"), ["owner_tenant_id"], unique=False
        )


def downgrade() -> None:
    with op.batch_alter_table("adapters") as batch_op:
        batch_op.drop_index(batch_op.f("ix_adapters_owner_tenant_id"))
    op.drop_table("adapters")
