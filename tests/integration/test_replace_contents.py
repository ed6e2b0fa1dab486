"""A rebuild's swap on real Postgres (`spark.sink.replace_contents`): the live table becomes
equal to its shadow by writing only the rows that differ, so readers and CDC see each real
change and nothing else."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg
import pytest

from config.settings import Settings
from spark.sink import replace_contents

pytestmark = pytest.mark.integration

KEY = ("shop", "item")
COLUMNS = (*KEY, "label", "price", "rate", "at")
TABLE = "shop text, item text, label text, price bigint, rate double precision, at timestamptz"


def rows(conn: psycopg.Connection[Any], table: str) -> dict[tuple[str, str], tuple[Any, ...]]:
    found = conn.execute(f"SELECT {', '.join(COLUMNS)} FROM {table}").fetchall()
    return {(r[0], r[1]): tuple(r[2:]) for r in found}


def live_and_shadow(
    conn: psycopg.Connection[Any], shadow_rows: Sequence[Any], live_rows: Sequence[Any] = ()
) -> None:
    """Temporary tables `live` and `shadow`, keyed by `KEY`, holding those rows."""
    insert = f"INSERT INTO {{}} ({', '.join(COLUMNS)}) VALUES ({', '.join(['%s'] * 6)})"
    for table, found in (("live", live_rows), ("shadow", shadow_rows)):
        conn.execute(f"CREATE TEMP TABLE {table} ({TABLE}, PRIMARY KEY (shop, item))")
        conn.cursor().executemany(insert.format(table), found)


def test_only_the_rows_that_differ_are_written(deployment: Settings) -> None:
    unchanged = [
        ("s1", "same", "a", 1, 0.5, "2026-11-26T10:00:00Z"),
        ("s1", "nulls", None, None, None, None),  # nulls on both sides are no difference
        ("s2", "same", "b", 2, None, "2026-11-26T11:00:00Z"),
    ]
    live_only = [("s2", "gone", "g", 9, 0.1, None), ("s3", "gone", None, None, None, None)]
    changed_live = [
        ("s1", "label", "old", 1, 0.5, None),
        ("s1", "to-null", "x", 5, 0.25, "2026-11-26T10:00:00Z"),
        ("s2", "from-null", None, None, None, None),
    ]
    changed_shadow = [
        ("s1", "label", "new", 1, 0.5, None),
        ("s1", "to-null", "x", None, 0.25, "2026-11-26T10:00:00Z"),
        ("s2", "from-null", None, None, 0.75, None),
    ]
    shadow_only = [("s3", "new", "n", 3, 0.125, "2026-11-26T12:00:00Z")]
    with psycopg.connect(deployment.database()) as conn:
        live_and_shadow(
            conn, unchanged + changed_shadow + shadow_only, unchanged + live_only + changed_live
        )
        conn.commit()  # the rows of `unchanged` now belong to an earlier transaction
        before = dict(conn.execute("SELECT (shop, item)::text, xmin::text FROM live").fetchall())

        written = replace_contents(conn, "live", "shadow", KEY, COLUMNS)

        assert written == len(live_only) + len(changed_live) + len(shadow_only)
        assert rows(conn, "live") == rows(conn, "shadow")
        after = dict(conn.execute("SELECT (shop, item)::text, xmin::text FROM live").fetchall())
        untouched = {k for k, xmin in after.items() if before.get(k) == xmin}
        # The rows already equal were not rewritten (a rewrite would be a change for CDC).
        assert untouched == {f"({shop},{item})" for shop, item, *_ in unchanged}
        # Written again with nothing to change, nothing is written.
        assert replace_contents(conn, "live", "shadow", KEY, COLUMNS) == 0


def test_an_empty_table_takes_every_row(deployment: Settings) -> None:
    """A view no projector has filled yet takes the shadow's rows whole (one plain insert)."""
    shadow_rows = [
        ("s1", "a", "x", 1, 0.5, "2026-11-26T10:00:00Z"),
        ("s1", "b", None, None, None, None),
        ("s2", "a", "y", 2, None, None),
    ]
    with psycopg.connect(deployment.database()) as conn:
        live_and_shadow(conn, shadow_rows)

        assert replace_contents(conn, "live", "shadow", KEY, COLUMNS) == len(shadow_rows)
        assert rows(conn, "live") == rows(conn, "shadow")
        assert replace_contents(conn, "live", "shadow", KEY, COLUMNS) == 0


def test_an_empty_private_table_is_filled_and_gets_every_index_back(deployment: Settings) -> None:
    """A projection's state (`private`): filled without its secondary indexes, which are then
    built again as they were, in the caller's transaction."""
    shadow_rows = [(f"s{i % 7}", f"i{i}", f"l{i % 3}", i, i / 4, None) for i in range(500)]

    def indexes(conn: psycopg.Connection[Any]) -> dict[str, str]:
        found = conn.execute("SELECT indexname, indexdef FROM pg_indexes WHERE tablename = 'live'")
        return dict(found.fetchall())

    with psycopg.connect(deployment.database()) as conn:
        live_and_shadow(conn, shadow_rows)
        conn.execute("CREATE INDEX live_label_price ON live (label, price DESC)")
        conn.execute("CREATE INDEX live_priced ON live (at) WHERE price > 10")
        conn.commit()
        before = indexes(conn)
        assert len(before) == 3
        oids = (
            "SELECT indexrelid::regclass::text, indexrelid FROM pg_index "
            "WHERE indrelid = 'live'::regclass"
        )
        built = dict(conn.execute(oids).fetchall())

        assert replace_contents(conn, "live", "shadow", KEY, COLUMNS, private=True) == 500
        assert indexes(conn) == before
        # The secondary indexes were built after the insert (new ones); the key was kept.
        rebuilt = dict(conn.execute(oids).fetchall())
        assert {n for n in built if rebuilt[n] != built[n]} == {"live_label_price", "live_priced"}
        assert rows(conn, "live") == rows(conn, "shadow")
        # The indexes hold every row: a lookup through one finds what a scan finds.
        conn.execute("SET LOCAL enable_seqscan = off")
        plan = conn.execute("EXPLAIN SELECT item FROM live WHERE label = 'l1'").fetchall()
        assert "live_label_price" in str(plan)
        found = conn.execute("SELECT count(*) FROM live WHERE label = 'l1'").fetchone()
        assert found == (sum(1 for r in shadow_rows if r[2] == "l1"),)

        conn.rollback()  # nothing of it outlives the caller's transaction
        assert indexes(conn) == before
        assert conn.execute("SELECT count(*) FROM live").fetchone() == (0,)
