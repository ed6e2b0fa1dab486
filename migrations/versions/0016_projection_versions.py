"""projection_progress: the version of a projection its live tables were built by, and the
version being built beside them

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-28 12:00:00.000000

A projection's version is declared or derived from what changes its rows
(`projections/base/versions.py`). The projector records the version it folds into
`version`; a projector whose version differs builds its own into shadow tables from the log
(`building_version`, since `build_started_at`) while the live tables keep serving, and swaps it
in atomically; a build that fails leaves them serving, with its error in `build_error`
(guarantee 25).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

COLUMNS = ("version", "building_version", "build_error")


def upgrade() -> None:
    for column in COLUMNS:
        op.add_column("projection_progress", sa.Column(column, sa.Text(), nullable=True))
    op.add_column(
        "projection_progress",
        sa.Column("build_started_at", sa.DateTime(timezone=True), nullable=True),
    )


def downgrade() -> None:
    for column in ("build_started_at", *reversed(COLUMNS)):
        op.drop_column("projection_progress", column)
