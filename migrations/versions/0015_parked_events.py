"""dead letters of the projections: events parked behind one a fold could not apply, and those
skipped

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-28 10:00:00.000000

When a projection's fold raises on an event (in Spark, or in Postgres as it merges the rows),
that event and every later event of the same aggregate (for a stream, of the same key) are
parked here, in log order, while the projection's other aggregates keep flowing (guarantee
26). A retry applies them in order and removes them in the same transaction; a skip moves them
to `skipped_events`, which records what the view leaves out. `/health` reads both counts, so
the reader may read them.

The API asks for retries and skips (`/dead-letters`, scope `admin`) by marking parked rows;
the projector carries them out. So, as 0013 does for webhooks, a role of its own,
`logfold_dead_letters` (NOLOGIN), may set only those marks; `logfold migrate` makes the API's
login a member of it.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from migrations.reader import grant_select, writer_role

ROLE = "logfold_dead_letters"

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def _letters(name: str, *extra: sa.Column) -> None:
    op.create_table(
        name,
        sa.Column("projection", sa.Text(), nullable=False),
        sa.Column("topic", sa.Text(), nullable=False),
        sa.Column("partition", sa.Integer(), nullable=False),
        sa.Column("offset", sa.BigInteger(), nullable=False),
        sa.Column("aggregate", sa.Text(), nullable=False),
        sa.Column("error", sa.Text(), nullable=False),
        sa.Column(
            "parked_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False
        ),
        *extra,
        sa.PrimaryKeyConstraint("projection", "topic", "partition", "offset"),
    )
    op.create_index(
        f"ix_{name}_aggregate", name, ["projection", "topic", "aggregate", "partition", "offset"]
    )


def upgrade() -> None:
    _letters(
        "parked_events",
        sa.Column("retry_requested_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("skip_reason", sa.Text(), nullable=True),  # a skip asked for, and why
    )
    _letters(
        "skipped_events",
        sa.Column(
            "skipped_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column("reason", sa.Text(), nullable=False),
    )
    grant_select(op, ["parked_events", "skipped_events"])
    writer_role(
        op,
        ROLE,
        [
            "SELECT ON parked_events, skipped_events",
            "UPDATE (retry_requested_at, skip_reason) ON parked_events",
        ],
    )


def downgrade() -> None:
    op.drop_table("skipped_events")
    op.drop_table("parked_events")
