"""refusal_counts.service_tier: the tier of each refused request, part of the key, so that
the console's overview shows refusals per tier over time. Rows counted before it take their
tenant's default tier (what a refusal before the body is read records today), else "default".

Revision ID: 0010_refusal_tier
Revises: 0009_console_sessions
Create Date: 2026-12-06 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010_refusal_tier"
down_revision: str | None = "0009_console_sessions"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OLD_KEY = ["tenant_id", "api_key_id", "scope", "reason", "minute"]
NEW_KEY = ["tenant_id", "api_key_id", "scope", "reason", "service_tier", "minute"]


def upgrade() -> None:
    with op.batch_alter_table("refusal_counts") as batch_op:
        batch_op.add_column(sa.Column("service_tier", sa.String(length=16), nullable=False,
                                      server_default="default"))
    op.execute("UPDATE refusal_counts SET service_tier = COALESCE((SELECT t.default_tier FROM tenants t "
               "WHERE t.id = refusal_counts.tenant_id), 'default')")
    with op.batch_alter_table("refusal_counts") as batch_op:
        batch_op.alter_column("service_tier", server_default=None)
        batch_op.drop_constraint("pk_refusal_counts", type_="primary")
        batch_op.create_primary_key("pk_refusal_counts", NEW_KEY)


def downgrade() -> None:
    # the tiers of one (tenant, key, scope, reason, minute) add up into one row again
    op.execute("CREATE TEMPORARY TABLE refusal_counts_old AS SELECT tenant_id, api_key_id, scope, reason, "
               "minute, SUM(count) AS count FROM refusal_counts GROUP BY tenant_id, api_key_id, scope, "
               "reason, minute")
    op.execute("DELETE FROM refusal_counts")
    with op.batch_alter_table("refusal_counts") as batch_op:
        batch_op.drop_constraint("pk_refusal_counts", type_="primary")
        batch_op.drop_column("service_tier")
        batch_op.create_primary_key("pk_refusal_counts", OLD_KEY)
    op.execute("INSERT INTO refusal_counts (tenant_id, api_key_id, scope, reason, minute, count) "
               "SELECT tenant_id, api_key_id, scope, reason, minute, count FROM refusal_counts_old")
    op.execute("DROP TABLE refusal_counts_old")
