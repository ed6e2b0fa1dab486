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
