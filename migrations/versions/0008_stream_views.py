"""views over streams of facts (trending_books, browsing_sessions) and the ids they counted

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-23 23:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "stream_ids",
        sa.Column("fold", sa.Text(), nullable=False),
        sa.Column("id", sa.Text(), nullable=False),
        sa.Column("first_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("fold", "id"),
    )
    op.create_index("ix_stream_ids_first_at", "stream_ids", ["fold", "first_at"], unique=False)
    op.create_table(
        "trending_books",
        sa.Column("book_id", sa.Text(), nullable=False),
        sa.Column("window_start", sa.DateTime(timezone=True), nullable=False),
        sa.Column("window_end", sa.DateTime(timezone=True), nullable=False),
        sa.Column("views", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("book_id", "window_start"),
    )
    op.create_table(
        "browsing_sessions",
        sa.Column("customer_id", sa.Text(), nullable=False),
        sa.Column("session_start", sa.DateTime(timezone=True), nullable=False),
        sa.Column("session_end", sa.DateTime(timezone=True), nullable=False),
        sa.Column("views", sa.BigInteger(), nullable=False),
        sa.Column("books", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.PrimaryKeyConstraint("customer_id", "session_start"),
    )


def downgrade() -> None:
    op.drop_table("browsing_sessions")
    op.drop_table("trending_books")
    op.drop_index("ix_stream_ids_first_at", table_name="stream_ids")
    op.drop_table("stream_ids")
