"""What `logfold_reader` (the role the API logs in through) may read: the views the API serves
and the folds' progress, nothing else (migration 0012). A migration that adds a view grants it
with `grant_select(op, "<table>")`; tests/integration/test_reader_role.py fails for a served view
the role cannot read, and for any other table it can."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

ROLE = "logfold_reader"


def grant_select(op: Any, tables: Iterable[str]) -> None:
    """SELECT on each of `tables` that exists, for the reader (when the role exists: a migrating
    user without CREATEROLE leaves it to the administrator, migration 0007)."""
    names = ", ".join(f"'{name}'" for name in sorted(set(tables)))
    if not names:
        return
    op.execute(
        f"""
        DO $$
        DECLARE t text;
        BEGIN
            IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{ROLE}') THEN
                FOREACH t IN ARRAY ARRAY[{names}]::text[] LOOP
                    IF to_regclass(format('public.%I', t)) IS NOT NULL THEN
                        EXECUTE format('GRANT SELECT ON public.%I TO {ROLE}', t);
                    END IF;
                END LOOP;
            END IF;
        END
        $$;
        """
    )


def writer_role(op: Any, role: str, grants: Iterable[str]) -> None:
    """A NOLOGIN role for one narrow kind of write the API makes (`logfold migrate` makes the
    API's login a member): created when the migrating user may (else a notice says to create
    it as an administrator), then given CONNECT, USAGE and `grants` (GRANT statements' privilege
    and object parts, e.g. `SELECT ON t`)."""
    op.execute(
        f"""
        DO $$
        BEGIN
            IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{role}') THEN
                CREATE ROLE {role} NOLOGIN;
            END IF;
        EXCEPTION WHEN insufficient_privilege THEN
            RAISE NOTICE 'cannot create role {role}: create it as an administrator';
        END
        $$;
        """
    )
    granted = "\n".join(f"GRANT {g} TO {role};" for g in grants)
    op.execute(
        f"""
        DO $$
        BEGIN
            IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{role}') THEN
                EXECUTE format('GRANT CONNECT ON DATABASE %I TO {role}', current_database());
                GRANT USAGE ON SCHEMA public TO {role};
                {granted}
            END IF;
        END
        $$;
        """
    )
