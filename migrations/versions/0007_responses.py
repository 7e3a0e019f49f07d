"""The Responses API's stored responses: a request's input items and its Response object,
per tenant, until their retention runs out.

Revision ID: 0007_responses
Revises: 0006_file_chunks
Create Date: 2026-12-04 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007_responses"
down_revision: str | None = "0006_file_chunks"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "stored_responses",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("tenant_id", sa.String(length=20), nullable=False),
        sa.Column("previous_response_id", sa.String(length=64), nullable=True),
        sa.Column("input_items", sa.JSON(), nullable=False),
        sa.Column("response", sa.JSON(), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("expires_at", TS, nullable=False),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"],
                                name=op.f("fk_stored_responses_tenant_id_tenants")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_stored_responses")),
    )
    with op.batch_alter_table("stored_responses") as batch_op:
        batch_op.create_index(batch_op.f("ix_stored_responses_tenant_id"), ["tenant_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_stored_responses_expires_at"), ["expires_at"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("stored_responses") as batch_op:
        batch_op.drop_index(batch_op.f("ix_stored_responses_expires_at"))
        batch_op.drop_index(batch_op.f("ix_stored_responses_tenant_id"))
    op.drop_table("stored_responses")
