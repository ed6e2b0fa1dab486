"""joined views (order_summaries, author_pages), the plain table author_profiles, join state

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-21 16:20:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "author_pages",
        sa.Column("author", sa.Text(), nullable=False),
        sa.Column("bio", sa.Text(), nullable=True),
        sa.Column("website", sa.Text(), nullable=True),
        sa.Column("royalty_cents", sa.BigInteger(), nullable=True),
        sa.Column("units_sold", sa.BigInteger(), nullable=True),
        sa.PrimaryKeyConstraint("author"),
    )
    op.create_table(
        "author_profiles",
        sa.Column("author", sa.Text(), nullable=False),
        sa.Column("bio", sa.Text(), nullable=True),
        sa.Column("website", sa.Text(), nullable=True),
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=True,
        ),
        sa.PrimaryKeyConstraint("author"),
    )
    op.create_table(
        "join_state",
        sa.Column("join_name", sa.Text(), nullable=False),
        sa.Column("side", sa.Text(), nullable=False),
        sa.Column("key", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("join_value", sa.Text(), nullable=True),
        sa.Column("row", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("lsn", sa.BigInteger(), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("join_name", "side", "key"),
    )
    op.create_index(
        "ix_join_state_join_value",
        "join_state",
        ["join_name", "side", "join_value"],
        unique=False,
    )
    op.create_table(
        "order_summaries",
        sa.Column("order_id", sa.Text(), nullable=False),
        sa.Column("customer_id", sa.Text(), nullable=True),
        sa.Column("customer_name", sa.Text(), nullable=True),
        sa.Column("customer_email", sa.Text(), nullable=True),
        sa.Column("status", sa.Text(), nullable=True),
        sa.Column("total_cents", sa.BigInteger(), nullable=True),
        sa.Column("line_count", sa.Integer(), nullable=True),
        sa.Column("placed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("paid_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("shipped_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("order_id"),
    )
    op.create_index(
        op.f("ix_order_summaries_customer_id"), "order_summaries", ["customer_id"], unique=False
    )
    op.create_index(op.f("ix_order_summaries_status"), "order_summaries", ["status"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_order_summaries_status"), table_name="order_summaries")
    op.drop_index(op.f("ix_order_summaries_customer_id"), table_name="order_summaries")
    op.drop_table("order_summaries")
    op.drop_index("ix_join_state_join_value", table_name="join_state")
    op.drop_table("join_state")
    op.drop_table("author_profiles")
    op.drop_table("author_pages")
