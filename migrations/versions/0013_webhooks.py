"""webhook endpoints with their durable cursors, and their dead letters

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-29 10:00:00.000000

The API registers, pauses, resumes and deletes endpoints and replays dead letters, and it logs
in as a member of `logfold_reader`, which writes nothing. So the webhook tables have a role of
their own, `logfold_webhooks` (NOLOGIN): it may read and write these two tables and nothing
else; `logfold migrate` makes the API's login a member of it too. Like 0007, a migrating user
without CREATEROLE leaves the role to the administrator (a notice says so).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

from migrations.reader import writer_role

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

ROLE = "logfold_webhooks"
TABLES = ("webhook_endpoints", "webhook_dead_letters")


def upgrade() -> None:
    op.create_table(
        "webhook_endpoints",
        sa.Column("id", sa.Text(), nullable=False),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column("view", sa.Text(), nullable=False),
        sa.Column(
            "filter",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.Column("secret", sa.Text(), nullable=False),
        sa.Column("status", sa.Text(), server_default="active", nullable=False),
        sa.Column("paused_reason", sa.Text(), nullable=True),
        sa.Column("cursor", sa.BigInteger(), nullable=False),
        sa.Column("last_position", sa.Text(), nullable=True),
        sa.Column("failing_since", sa.DateTime(timezone=True), nullable=True),
        sa.Column("retrying_offset", sa.BigInteger(), nullable=True),
        sa.Column("retrying_since", sa.DateTime(timezone=True), nullable=True),
        sa.Column("attempts", sa.Integer(), server_default="0", nullable=False),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("skipped_offsets", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.CheckConstraint("status IN ('active', 'paused')", name="ck_webhook_endpoints_status"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_table(
        "webhook_dead_letters",
        sa.Column("message_id", sa.Text(), nullable=False),
        sa.Column("endpoint_id", sa.Text(), nullable=False),
        sa.Column("offset", sa.BigInteger(), nullable=False),
        sa.Column("position", sa.Text(), nullable=False),
        sa.Column("key", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("body", sa.Text(), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("last_error", sa.Text(), nullable=False),
        sa.Column("first_attempt_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("failed_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("status", sa.Text(), server_default="failed", nullable=False),
        sa.Column("replayed_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(
            "status IN ('failed', 'replaying', 'delivered')",
            name="ck_webhook_dead_letters_status",
        ),
        sa.ForeignKeyConstraint(["endpoint_id"], ["webhook_endpoints.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("message_id"),
    )
    op.create_index(
        "ix_webhook_dead_letters_endpoint",
        "webhook_dead_letters",
        ["endpoint_id", "status", "offset"],
    )
    tables = ", ".join(TABLES)
    writer_role(op, ROLE, [f"SELECT, INSERT, UPDATE, DELETE ON {tables}"])


def downgrade() -> None:
    # Dropping the tables drops their grants; the role stays, as 0007's does (roles are the
    # server's, and another database may use it).
    op.drop_index("ix_webhook_dead_letters_endpoint", table_name="webhook_dead_letters")
    op.drop_table("webhook_dead_letters")
    op.drop_table("webhook_endpoints")
