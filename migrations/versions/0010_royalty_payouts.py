"""royalty_payouts (a temporal join), author_profiles.payout_account and its history

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-23 23:50:00.000000

A trigger appends every version of an author's profile to `author_profile_history`, valid from
when it was written (a deletion as a version without an account). Profiles that exist already
are taken as valid from the beginning of time: nothing paid before had a payout to compare.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("author_profiles", sa.Column("payout_account", sa.Text(), nullable=True))
    op.create_table(
        "author_profile_history",
        sa.Column("author", sa.Text(), nullable=False),
        sa.Column("valid_from", sa.DateTime(timezone=True), nullable=False),
        sa.Column("payout_account", sa.Text(), nullable=True),
        sa.Column("deleted", sa.Boolean(), server_default="false", nullable=False),
        sa.PrimaryKeyConstraint("author", "valid_from"),
    )
    op.create_table(
        "royalty_payouts",
        sa.Column("order_id", sa.Text(), nullable=False),
        sa.Column("book_id", sa.Text(), nullable=False),
        sa.Column("author", sa.Text(), nullable=False),
        sa.Column("payout_account", sa.Text(), nullable=True),
        sa.Column("amount_cents", sa.BigInteger(), nullable=False),
        sa.Column("paid_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("order_id", "book_id"),
    )
    op.create_index(
        "ix_royalty_payouts_without_account",
        "royalty_payouts",
        ["author"],
        postgresql_where=sa.text("payout_account IS NULL"),
    )
    op.execute(
        "INSERT INTO author_profile_history (author, valid_from, payout_account) "
        "SELECT author, '-infinity', payout_account FROM author_profiles"
    )
    op.execute(
        """
        CREATE FUNCTION author_profile_version() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF TG_OP <> 'INSERT' AND (TG_OP = 'DELETE' OR NEW.author <> OLD.author) THEN
                INSERT INTO author_profile_history (author, valid_from, payout_account, deleted)
                VALUES (OLD.author, clock_timestamp(), NULL, TRUE)
                ON CONFLICT (author, valid_from)
                DO UPDATE SET payout_account = NULL, deleted = TRUE;
            END IF;
            IF TG_OP <> 'DELETE' THEN
                INSERT INTO author_profile_history (author, valid_from, payout_account)
                VALUES (NEW.author, clock_timestamp(), NEW.payout_account)
                ON CONFLICT (author, valid_from)
                DO UPDATE SET payout_account = excluded.payout_account, deleted = FALSE;
            END IF;
            RETURN NULL;
        END
        $$
        """
    )
    op.execute(
        "CREATE TRIGGER author_profile_version AFTER INSERT OR UPDATE OR DELETE "
        "ON author_profiles FOR EACH ROW EXECUTE FUNCTION author_profile_version()"
    )


def downgrade() -> None:
    op.execute("DROP TRIGGER author_profile_version ON author_profiles")
    op.execute("DROP FUNCTION author_profile_version()")
    op.drop_table("royalty_payouts")
    op.drop_table("author_profile_history")
    op.drop_column("author_profiles", "payout_account")
