"""projection_progress: records removed from the log before the fold applied them

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-23 14:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "projection_progress",
        sa.Column("lost_offsets", sa.BigInteger(), server_default="0", nullable=False),
    )
    op.add_column(
        "projection_progress",
        sa.Column("data_loss", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
    )


def downgrade() -> None:
    for column in ("data_loss", "lost_offsets"):
        op.drop_column("projection_progress", column)
