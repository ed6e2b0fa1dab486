"""the projector's status: its Spark executors, task slots and each query's mode

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-30 10:00:00.000000

The projector (the Spark driver) writes one row every few seconds: how many executors it has
and their task slots, how many its real-time queries need, and whether each query runs in
real-time mode or in micro-batches (and why). `/health` reads it (component `projector`): a
projector left without executors, or silent, is reported within seconds, before any lag grows.
The reader may read it, as it reads `projection_progress`.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

from migrations.reader import grant_select

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "projector_status",
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("master", sa.Text(), nullable=False),
        sa.Column("executors", sa.Integer(), nullable=False),
        sa.Column("slots", sa.Integer(), nullable=False),
        sa.Column("slots_needed", sa.Integer(), nullable=False),
        sa.Column(
            "queries",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.Column(
            "beat_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False
        ),
        sa.PrimaryKeyConstraint("name"),
    )
    grant_select(op, ["projector_status"])


def downgrade() -> None:
    op.drop_table("projector_status")
