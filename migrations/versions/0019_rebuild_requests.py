"""rebuild_requests: rebuilds asked of the running projector

Revision ID: 0019
Revises: 0018
Create Date: 2026-11-28 21:00:00.000000

`logfold rebuild` asks the running projector to rebuild (its Spark driver is warm and already
holds the cluster's executors) instead of starting a driver of its own, when that projector folds
the same versions of the projections named (`projections/base/rebuilds.py`). A row is one
request: what was asked, who claimed it and its beat while it works, its progress, and each
projection's report or the error. Only the tables' owner (the CLI, the projector) reads it: no
role is granted it.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "rebuild_requests",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("projections", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("verify", sa.Boolean(), server_default=sa.text("false"), nullable=False),
        sa.Column(
            "asked_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False
        ),
        sa.Column("claimed_by", sa.Text(), nullable=True),
        sa.Column("beat_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("done", sa.BigInteger(), nullable=True),
        sa.Column("total", sa.BigInteger(), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("reports", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )


def downgrade() -> None:
    op.drop_table("rebuild_requests")
