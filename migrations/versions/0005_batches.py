"""The Batch API: files (their bytes in the database), batches (status, counts, the lease of
the replica working each) and batch lines (input and, once run, answer or error); usage rows
tagged with their batch.

Revision ID: 0005
Revises: 0004_refusals
Create Date: 2026-12-02 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004_refusals"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "files",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("tenant_id", sa.String(length=20), nullable=False),
        sa.Column("purpose", sa.String(length=16), nullable=False),
        sa.Column("filename", sa.String(length=256), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("content", sa.LargeBinary(), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("expires_at", TS, nullable=True),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], name=op.f("fk_files_tenant_id_tenants")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_files")),
    )
    with op.batch_alter_table("files") as batch_op:
        batch_op.create_index("ix_files_tenant_id_created_at", ["tenant_id", "created_at"], unique=False)
        batch_op.create_index(batch_op.f("ix_files_expires_at"), ["expires_at"], unique=False)
    op.create_table(
        "batches",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("tenant_id", sa.String(length=20), nullable=False),
        sa.Column("api_key_id", sa.String(length=20), nullable=False),
        sa.Column("endpoint", sa.String(length=64), nullable=False),
        sa.Column("input_file_id", sa.String(length=40), nullable=False),
        sa.Column("completion_window", sa.String(length=8), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("meta", sa.JSON(), nullable=True),
        sa.Column("output_file_id", sa.String(length=40), nullable=True),
        sa.Column("error_file_id", sa.String(length=40), nullable=True),
        sa.Column("errors", sa.JSON(), nullable=True),
        sa.Column("total", sa.Integer(), nullable=False),
        sa.Column("output_expires_s", sa.Integer(), nullable=True),
        sa.Column("paused", sa.String(length=256), nullable=True),
        sa.Column("lease_owner", sa.String(length=64), nullable=True),
        sa.Column("lease_expires_at", TS, nullable=True),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("expires_at", TS, nullable=False),
        sa.Column("in_progress_at", TS, nullable=True),
        sa.Column("finalizing_at", TS, nullable=True),
        sa.Column("completed_at", TS, nullable=True),
        sa.Column("failed_at", TS, nullable=True),
        sa.Column("expired_at", TS, nullable=True),
        sa.Column("cancelling_at", TS, nullable=True),
        sa.Column("cancelled_at", TS, nullable=True),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], name=op.f("fk_batches_tenant_id_tenants")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_batches")),
    )
    with op.batch_alter_table("batches") as batch_op:
        batch_op.create_index("ix_batches_tenant_id_created_at", ["tenant_id", "created_at"], unique=False)
        batch_op.create_index("ix_batches_status", ["status"], unique=False)
    op.create_table(
        "batch_lines",
        sa.Column("batch_id", sa.String(length=40), nullable=False),
        sa.Column("line", sa.Integer(), nullable=False),
        sa.Column("custom_id", sa.String(length=512), nullable=True),
        sa.Column("body", sa.JSON(), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("status_code", sa.Integer(), nullable=True),
        sa.Column("response", sa.JSON(), nullable=True),
        sa.Column("error", sa.JSON(), nullable=True),
        sa.Column("request_id", sa.String(length=128), nullable=True),
        sa.ForeignKeyConstraint(["batch_id"], ["batches.id"], name=op.f("fk_batch_lines_batch_id_batches"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("batch_id", "line", name=op.f("pk_batch_lines")),
    )
    with op.batch_alter_table("batch_lines") as batch_op:
        batch_op.create_index("ix_batch_lines_batch_id_status", ["batch_id", "status"], unique=False)
    with op.batch_alter_table("usage_records") as batch_op:
        batch_op.add_column(sa.Column("batch_id", sa.String(length=40), nullable=True))
        batch_op.create_index(batch_op.f("ix_usage_records_batch_id"), ["batch_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("usage_records") as batch_op:
        batch_op.drop_index(batch_op.f("ix_usage_records_batch_id"))
        batch_op.drop_column("batch_id")
    op.drop_table("batch_lines")
    op.drop_table("batches")
    op.drop_table("files")
