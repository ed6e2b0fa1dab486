"""Shadow tables: where a rebuild builds a view beside the live one (`<table>__rebuild`,
unlogged scratch tables), and what it reports when it swaps one in. Projections' rebuilds
(`spark/rebuild.py`) and joins' (`spark/join.py`) both build into them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import psycopg

from projections.base import Projection

SHADOW = "__rebuild"


@dataclass
class Report:
    projection: str
    events: int
    seconds: float
    rows: dict[str, int] = field(default_factory=dict)
    differences: dict[str, list[Any]] | None = None  # with verify: rows only in old / new
    # Left out, as the live view leaves them out (spark/parking.py): aggregates parked (from
    # their first parked event on) and events skipped on purpose.
    parked_aggregates: int = 0
    skipped_events: int = 0
    # The kept version (spark/keeping.py) it started from instead of the whole log, if any.
    restored: str | None = None
    # Seconds of each step: "read" (the shared read, whole), "load" (its shadows), "swap"
    # (catch-up and swap).
    steps: dict[str, float] = field(default_factory=dict)


def common_columns(conn: psycopg.Connection[Any], table: str, other: str) -> list[str]:
    """The columns `table` and `other` both have (a kept copy may predate a column a
    migration added since, or have one since dropped)."""
    rows = conn.execute(
        "SELECT a.attname FROM pg_attribute a JOIN pg_attribute b "
        "ON b.attrelid = %s::regclass AND b.attname = a.attname "
        "AND b.attnum > 0 AND NOT b.attisdropped "
        "WHERE a.attrelid = %s::regclass AND a.attnum > 0 AND NOT a.attisdropped "
        "ORDER BY a.attnum",
        (other, table),
    ).fetchall()
    return [str(r[0]) for r in rows]


def count_rows(conn: psycopg.Connection[Any], table: str) -> int:
    return int(conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0])  # type: ignore[index]


def shadowed_tables(projection: Projection) -> list[str]:
    """The tables a rebuild of `projection` fills in shadows: its outputs and their state."""
    return [t for o in projection.outputs for t in (o.name, *(str(s.name) for s in o.state))]


def differences(conn: psycopg.Connection[Any], live: str, rebuilt: str, columns: str) -> list[Any]:
    """Rows only in `live` or only in `rebuilt` (as multisets), at most 1000."""
    rows = conn.execute(
        f"(SELECT 'only_in_live' AS side, {columns} FROM {live} EXCEPT ALL "
        f" SELECT 'only_in_live', {columns} FROM {rebuilt}) UNION ALL "
        f"(SELECT 'only_in_rebuild', {columns} FROM {rebuilt} EXCEPT ALL "
        f" SELECT 'only_in_rebuild', {columns} FROM {live}) LIMIT 1000"
    ).fetchall()
    return [tuple(r) for r in rows]
