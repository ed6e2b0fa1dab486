"""Postgres notifies `logfold_progress` whenever a fold's progress is written

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-25 02:50:00.000000

Readers waiting for a view to include a position (read-your-writes, REST `wait` and websocket
`consistent_with`) LISTEN on the channel and look again when it fires, instead of only every
50 ms. A statement trigger with a fixed payload: Postgres sends one notification per committed
transaction, however many progress rows a micro-batch writes.
"""

from __future__ import annotations

from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        """
CREATE FUNCTION logfold_progress_written() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('logfold_progress', '');
    RETURN NULL;
END
$$"""
    )
    op.execute(
        "CREATE TRIGGER progress_written AFTER INSERT OR UPDATE ON projection_progress "
        "FOR EACH STATEMENT EXECUTE FUNCTION logfold_progress_written()"
    )


def downgrade() -> None:
    op.execute("DROP TRIGGER progress_written ON projection_progress")
    op.execute("DROP FUNCTION logfold_progress_written()")
