"""Files' bytes in chunks (`file_chunks`, written and read a chunk at a time; `files.content`
kept only for the files stored before), and a batch line's custom_id stored escaped, NUL
characters included (`models.escape_nul`: the existing values' backslashes doubled).

Revision ID: 0006_file_chunks
Revises: 0005
Create Date: 2026-12-03 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006_file_chunks"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # SQLite's batch mode copies the table: before anything refers to it
    with op.batch_alter_table("files") as batch_op:
        batch_op.alter_column("content", existing_type=sa.LargeBinary(), nullable=True)
    op.create_table(
        "file_chunks",
        sa.Column("file_id", sa.String(length=40), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(["file_id"], ["files.id"], name=op.f("fk_file_chunks_file_id_files"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("file_id", "seq", name=op.f("pk_file_chunks")),
    )
    with op.batch_alter_table("batch_lines") as batch_op:
        batch_op.alter_column("custom_id", existing_type=sa.String(length=512), type_=sa.String(length=1024),
                              existing_nullable=True)
    op.execute(sa.text("UPDATE batch_lines SET custom_id = replace(custom_id, :one, :two) "
                       "WHERE custom_id IS NOT NULL").bindparams(one="\\", two="\\\\"))


def downgrade() -> None:
    op.execute(sa.text("UPDATE batch_lines SET custom_id = replace(custom_id, :two, :one) "
                       "WHERE custom_id IS NOT NULL").bindparams(one="\\", two="\\\\"))
    with op.batch_alter_table("batch_lines") as batch_op:
        batch_op.alter_column("custom_id", existing_type=sa.String(length=1024), type_=sa.String(length=512),
                              existing_nullable=True)
    # the chunks back into their files' one column, a file at a time
    conn = op.get_bind()
    ids = conn.execute(sa.text("SELECT id FROM files WHERE content IS NULL")).scalars().all()
    for file_id in ids:
        parts = conn.execute(sa.text("SELECT data FROM file_chunks WHERE file_id = :f ORDER BY seq"),
                             {"f": file_id}).scalars().all()
        conn.execute(sa.text("UPDATE files SET content = :c WHERE id = :f"),
                     {"c": b"".join(parts), "f": file_id})
    with op.batch_alter_table("files") as batch_op:
        batch_op.alter_column("content", existing_type=sa.LargeBinary(), nullable=False)
    op.drop_table("file_chunks")
