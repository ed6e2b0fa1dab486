"""projection_progress: a fold's failure (error, where, when) and when its pipeline started

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23 10:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("projection_progress", sa.Column("error", sa.Text(), nullable=True))
    op.add_column(
        "projection_progress",
        sa.Column("error_offsets", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
    )
    op.add_column(
        "projection_progress", sa.Column("failed_at", sa.DateTime(timezone=True), nullable=True)
    )
    op.add_column(
        "projection_progress", sa.Column("started_at", sa.DateTime(timezone=True), nullable=True)
    )


def downgrade() -> None:
    for column in ("started_at", "failed_at", "error_offsets", "error"):
        op.drop_column("projection_progress", column)
