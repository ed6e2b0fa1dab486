"""baseline: the write side keeps its state in Kafka; views arrive in later revisions

Revision ID: 0001
Revises:
Create Date: 2026-11-21
"""

from __future__ import annotations

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
