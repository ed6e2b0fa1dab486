"""kept_versions: earlier versions of a projection's tables kept for a quick rollback; a build's
progress and report

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-28 11:30:00.000000

When a changed projection is swapped in (guarantee 25), the version it replaces is kept: a copy
of its tables at one position of the log (`kept_versions.offsets`), taken in one snapshot while
it served. Deploying that version again starts from the copy and folds only the events since,
instead of the whole log (`spark/keeping.py`). How many are kept is `LOGFOLD_KEEP_VERSIONS`.

A projector's build records how far it is (`build_done` of `build_total` events) and, with
`LOGFOLD_DEPLOY_VERIFY`, what the new version changes (`build_report`): `logfold projections`.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("projection_progress", sa.Column("build_done", sa.BigInteger(), nullable=True))
    op.add_column("projection_progress", sa.Column("build_total", sa.BigInteger(), nullable=True))
    op.add_column(
        "projection_progress",
        sa.Column("build_report", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
    )
    op.create_table(
        "kept_versions",
        sa.Column("projection", sa.Text(), nullable=False),
        sa.Column("version", sa.Text(), nullable=False),
        sa.Column("offsets", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("tables", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("skipped_events", sa.BigInteger(), nullable=False),
        sa.Column(
            "kept_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False
        ),
        sa.PrimaryKeyConstraint("projection", "version"),
    )


def downgrade() -> None:
    op.drop_table("kept_versions")
    for column in ("build_report", "build_total", "build_done"):
        op.drop_column("projection_progress", column)
