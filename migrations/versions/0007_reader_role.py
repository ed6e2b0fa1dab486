"""a role that can read the views and nothing else, for the API

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-23 15:00:00.000000

`logfold_reader` (NOLOGIN) may read every table of the schema, now and later, and the
replication statistics /health shows; the API logs in as a role that is a member of it
(`logfold run` makes one: `logfold_api`), so a flaw in the API cannot write a view. Roles are
the server's, not the database's: an existing one is reused. A migrating user without
CREATEROLE leaves the role to the administrator (a notice says so).
"""

from __future__ import annotations

from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

ROLE = "logfold_reader"


def upgrade() -> None:
    op.execute(
        f"""
        DO $$
        BEGIN
            IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{ROLE}') THEN
                CREATE ROLE {ROLE} NOLOGIN;
            END IF;
        EXCEPTION WHEN insufficient_privilege THEN
            RAISE NOTICE 'cannot create role {ROLE}: create it as an administrator';
        END
        $$;
        """
    )
    op.execute(
        f"""
        DO $$
        BEGIN
            IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{ROLE}') THEN
                EXECUTE format('GRANT CONNECT ON DATABASE %I TO {ROLE}', current_database());
                GRANT USAGE ON SCHEMA public TO {ROLE};
                GRANT SELECT ON ALL TABLES IN SCHEMA public TO {ROLE};
                ALTER DEFAULT PRIVILEGES IN SCHEMA public GRANT SELECT ON TABLES TO {ROLE};
                BEGIN
                    GRANT pg_monitor TO {ROLE};  -- replication lag in /health
                EXCEPTION WHEN insufficient_privilege THEN
                    RAISE NOTICE 'cannot grant pg_monitor to {ROLE}: /health shows no lag';
                END;
            END IF;
        END
        $$;
        """
    )


def downgrade() -> None:
    op.execute(
        f"""
        DO $$
        BEGIN
            IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{ROLE}') THEN
                ALTER DEFAULT PRIVILEGES IN SCHEMA public REVOKE SELECT ON TABLES FROM {ROLE};
                REVOKE SELECT ON ALL TABLES IN SCHEMA public FROM {ROLE};
                REVOKE USAGE ON SCHEMA public FROM {ROLE};
                EXECUTE format('REVOKE CONNECT ON DATABASE %I FROM {ROLE}', current_database());
            END IF;
        END
        $$;
        """
    )
