"""the reader reads the views the API serves, and what /health needs; nothing else

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-28 10:00:00.000000

0007 let `logfold_reader` read every table, now and later, and made it a member of
`pg_monitor`. That was more than the API needs: the folds' own state (`stream_ids`,
`join_state`, `conversion_views`, `conversion_orders`, `author_profile_history`, rebuild
shadows) holds customer ids and fields no view shows, and `pg_monitor` shows the text of every
query of every session on the server. Now the role may read:

- each view the API serves (`projections.registry.VIEWS`, those whose tables exist by now) and
  `projection_progress` (lag, failures, read-your-writes);
- `pg_replication_slots` (readable by every role) and, through `logfold_slot_flush_lag(slot)`
  (SECURITY DEFINER, executable by the reader only), the one figure of `pg_stat_replication`
  that /health shows: how far behind CDC's flush is, in seconds. Its owner is the migrating
  user; without superuser or `pg_read_all_stats` it answers NULL (/health then shows 0).

A view added later is granted by its own migration, `migrations.reader.grant_select(op,
"<table>")` (this one covers only tables that exist when it runs); the reader's tests fail for a
served view the role cannot read, and for any other table it can.
"""

from __future__ import annotations

from alembic import op

from migrations.reader import ROLE, grant_select
from projections.base.progress import table as progress
from projections.registry import VIEWS

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        f"""
        DO $$
        BEGIN
            IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{ROLE}') THEN
                ALTER DEFAULT PRIVILEGES IN SCHEMA public REVOKE SELECT ON TABLES FROM {ROLE};
                REVOKE SELECT ON ALL TABLES IN SCHEMA public FROM {ROLE};
                BEGIN
                    REVOKE pg_monitor FROM {ROLE};
                EXCEPTION WHEN insufficient_privilege THEN
                    RAISE NOTICE 'cannot revoke pg_monitor from {ROLE}: do it as an administrator';
                END;
            END IF;
        END
        $$;
        """
    )
    op.execute(
        """
        CREATE FUNCTION logfold_slot_flush_lag(slot name) RETURNS float8
        LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
            SELECT extract(epoch FROM r.flush_lag)::float8
            FROM pg_replication_slots s JOIN pg_stat_replication r ON r.pid = s.active_pid
            WHERE s.slot_name = slot
        $$
        """
    )
    op.execute("REVOKE ALL ON FUNCTION logfold_slot_flush_lag(name) FROM PUBLIC")
    op.execute(
        f"""
        DO $$
        BEGIN
            IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{ROLE}') THEN
                GRANT EXECUTE ON FUNCTION logfold_slot_flush_lag(name) TO {ROLE};
            END IF;
        END
        $$;
        """
    )
    grant_select(op, [*VIEWS, str(progress.name)])


def downgrade() -> None:
    op.execute("DROP FUNCTION logfold_slot_flush_lag(name)")
    op.execute(
        f"""
        DO $$
        BEGIN
            IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{ROLE}') THEN
                GRANT SELECT ON ALL TABLES IN SCHEMA public TO {ROLE};
                ALTER DEFAULT PRIVILEGES IN SCHEMA public GRANT SELECT ON TABLES TO {ROLE};
                BEGIN
                    GRANT pg_monitor TO {ROLE};
                EXCEPTION WHEN insufficient_privilege THEN
                    RAISE NOTICE 'cannot grant pg_monitor to {ROLE}';
                END;
            END IF;
        END
        $$;
        """
    )
