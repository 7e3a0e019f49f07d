"""A tenant's price of cached prompt tokens (`tenants.cached_input_price`, 1.0: as any prompt
token) and its own model aliases (`tenants.model_aliases`, nullable); what a usage row charged
the budgets (`usage_records.budget_tokens`, nullable: rows before it charged prompt + completion,
and are left as they are rather than rewritten).

Revision ID: 0008_cached_price
Revises: 0007_responses
Create Date: 2026-12-04 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008_cached_price"
down_revision: str | None = "0007_responses"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_PRICE_CHECK = "cached_input_price >= 0 AND cached_input_price <= 1"


def upgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        # ADD COLUMN with its own CHECK: batch mode would copy the table, and SQLite refuses to
        # drop a table other rows still reference (files, keys, batches) with foreign keys on
        op.execute("ALTER TABLE tenants ADD COLUMN cached_input_price FLOAT DEFAULT 1.0 NOT NULL "
                   f"CONSTRAINT cached_input_price CHECK ({_PRICE_CHECK})")
        op.add_column("tenants", sa.Column("model_aliases", sa.JSON(none_as_null=True), nullable=True))
    else:
        with op.batch_alter_table("tenants") as batch_op:
            batch_op.add_column(sa.Column("cached_input_price", sa.Float(), nullable=False,
                                          server_default=sa.text("1.0")))
            batch_op.add_column(sa.Column("model_aliases", sa.JSON(none_as_null=True), nullable=True))
            batch_op.create_check_constraint("cached_input_price", _PRICE_CHECK)
    with op.batch_alter_table("usage_records") as batch_op:
        batch_op.add_column(sa.Column("budget_tokens", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("usage_records") as batch_op:
        batch_op.drop_column("budget_tokens")
    if op.get_bind().dialect.name == "sqlite":   # (see upgrade: SQLite's own DROP COLUMN, no copy)
        op.execute("ALTER TABLE tenants DROP COLUMN model_aliases")
        op.execute("ALTER TABLE tenants DROP COLUMN cached_input_price")
        return
    with op.batch_alter_table("tenants") as batch_op:
        batch_op.drop_constraint("cached_input_price", type_="check")
        batch_op.drop_column("model_aliases")
        batch_op.drop_column("cached_input_price")
