"""subject_keys: each data subject's key, with which its personal fields are sealed

Revision ID: 0018
Revises: 0017
Create Date: 2026-11-28 12:30:00.000000

Personal fields of events (`DomainEvent.PERSONAL`) are stored sealed with a key of their
aggregate's own (AES-GCM, `events/keys.py`), never in the log; erasing the subject sets its key
to NULL, and what it sealed can no longer be opened (guarantee 27). Only the tables' owner (the
processors, the projector) reads it: no role is granted it.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "subject_keys",
        sa.Column("subject", sa.Text(), nullable=False),
        sa.Column("key", sa.LargeBinary(), nullable=True),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column("erased_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("subject"),
    )


def downgrade() -> None:
    op.drop_table("subject_keys")
