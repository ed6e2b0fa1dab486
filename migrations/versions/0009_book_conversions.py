"""book_conversions (a stream-stream join) and the state it keeps of each side

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-23 23:45:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "book_conversions",
        sa.Column("book_id", sa.Text(), nullable=False),
        sa.Column("day", sa.Date(), nullable=False),
        sa.Column("views", sa.BigInteger(), nullable=False),
        sa.Column("converted_views", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("book_id", "day"),
    )
    op.create_table(
        "conversion_views",
        sa.Column("view_id", sa.Text(), nullable=False),
        sa.Column("customer_id", sa.Text(), nullable=False),
        sa.Column("book_id", sa.Text(), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("converted", sa.Boolean(), nullable=False),
        sa.PrimaryKeyConstraint("view_id"),
    )
    op.create_index(
        "ix_conversion_views_match", "conversion_views", ["customer_id", "book_id", "at"]
    )
    op.create_index("ix_conversion_views_at", "conversion_views", ["at"])
    op.create_table(
        "conversion_orders",
        sa.Column("order_id", sa.Text(), nullable=False),
        sa.Column("book_id", sa.Text(), nullable=False),
        sa.Column("customer_id", sa.Text(), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("order_id", "book_id"),
    )
    op.create_index(
        "ix_conversion_orders_match", "conversion_orders", ["customer_id", "book_id", "at"]
    )
    op.create_index("ix_conversion_orders_at", "conversion_orders", ["at"])


def downgrade() -> None:
    op.drop_table("conversion_orders")
    op.drop_table("conversion_views")
    op.drop_table("book_conversions")
