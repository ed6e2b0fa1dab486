"""Join declarations, the registry's view of them, and the SQL they build (no I/O)."""

from __future__ import annotations

import pytest
from sqlalchemy import BigInteger, Column, MetaData, Table, Text

from projections.base import Join, Side
from projections.registry import CAPTURED, JOINS, PROJECTIONS, VIEWS

ORDERS = Side("orders", key=("order_id",), on="customer_id")
CUSTOMERS = Side("customers", key=("customer_id",), on="customer_id")


def view(*columns: Column[object]) -> Table:
    return Table("v", MetaData(), *columns)


def test_the_registry_serves_joined_views_and_captures_their_tables() -> None:
    assert set(JOINS) == {"order_summaries", "author_pages"}
    assert not set(JOINS) & set(PROJECTIONS)
    for name, join in JOINS.items():
        fold, view = VIEWS[name]
        assert fold is join and join.inputs == join.tables
        assert (view.name, view.key, view.filterable) == (name, join.key, join.filterable)
    assert VIEWS["order_summaries"][1].filterable == ("customer_id", "status")
    assert {"order_summaries", "author_pages", "author_profiles"} <= set(CAPTURED)
    assert "join_state" not in CAPTURED
    for join in JOINS.values():
        assert set(join.tables) <= set(CAPTURED)


def test_order_summaries_columns_come_from_orders_and_customers() -> None:
    join = JOINS["order_summaries"]
    assert join.key == ("order_id",)
    assert join.columns == (
        "order_id",
        "customer_id",
        "customer_name",
        "customer_email",
        "status",
        "total_cents",
        "line_count",
        "placed_at",
        "paid_at",
        "shipped_at",
    )
    assert (join.left.table, join.right.table) == ("orders", "customers")
    assert join.sources["customer_name"] == ("right", "name")


def test_every_view_column_needs_a_source() -> None:
    with pytest.raises(ValueError, match="no source for column total"):
        Join(
            view(Column("order_id", Text, primary_key=True), Column("total", BigInteger)),
            ORDERS,
            CUSTOMERS,
            {"order_id": ("left", "order_id")},
        )


def test_filterable_columns_must_exist() -> None:
    with pytest.raises(ValueError, match="filterable colour is not a column"):
        Join(
            view(Column("order_id", Text, primary_key=True)),
            ORDERS,
            CUSTOMERS,
            {"order_id": ("left", "order_id")},
            filterable=("colour",),
        )


def test_the_key_must_identify_a_pair_of_joined_rows() -> None:
    """Keyed by the customer, a customer with two orders would give two rows with one key."""
    with pytest.raises(ValueError, match="does not identify a pair"):
        Join(
            view(Column("customer_id", Text, primary_key=True)),
            ORDERS,
            CUSTOMERS,
            {"customer_id": ("right", "customer_id")},
        )
    many = Side("tags", key=("tag_id",), on="customer_id")  # not keyed by its join column
    with pytest.raises(ValueError, match="does not identify a pair"):
        Join(
            view(Column("order_id", Text, primary_key=True)),
            ORDERS,
            many,
            {"order_id": ("left", "order_id")},
        )
    pairs = Join(
        view(Column("order_id", Text, primary_key=True), Column("tag_id", Text, primary_key=True)),
        ORDERS,
        many,
        {"order_id": ("left", "order_id"), "tag_id": ("right", "tag_id")},
    )
    assert pairs.key == ("order_id", "tag_id")


def test_names_are_plain_sql_names() -> None:
    with pytest.raises(ValueError, match="not a plain lower-case SQL name"):
        Join(
            view(Column("order_id", Text, primary_key=True)),
            ORDERS,
            Side("customers", key=("customer_id",), on="id'; DROP TABLE orders; --"),
            {"order_id": ("left", "order_id")},
        )


def test_derived_rows_cast_each_source_value_to_the_view_column_type() -> None:
    sql = JOINS["order_summaries"].derive_sql("changes")
    assert "CAST(r.row ->> 'name' AS TEXT) AS customer_name" in sql
    assert "CAST(l.row ->> 'total_cents' AS BIGINT) AS total_cents" in sql
    assert "CAST(l.row ->> 'placed_at' AS TIMESTAMP WITH TIME ZONE) AS placed_at" in sql
    assert "l.join_name = 'order_summaries' AND l.side = 'left'" in sql
    assert "c.side = 'left' AND c.key = l.key" in sql
    assert "c.side = 'right' AND c.key = r.key" in sql


def test_only_newer_changes_are_stored() -> None:
    sql = JOINS["order_summaries"].state_upsert_sql("changes")
    assert sql.endswith("WHERE (excluded.lsn, excluded.seq) > (join_state.lsn, join_state.seq)")


def test_only_rows_that_differ_are_written() -> None:
    sql = JOINS["author_pages"].upsert_sql("after")
    assert "ON CONFLICT (author) DO UPDATE SET bio = excluded.bio" in sql
    assert sql.endswith(
        "WHERE ROW(author_pages.bio, author_pages.website, author_pages.royalty_cents, "
        "author_pages.units_sold) IS DISTINCT FROM ROW(excluded.bio, excluded.website, "
        "excluded.royalty_cents, excluded.units_sold)"
    )
    keys_only = Join(
        Table("pairs", MetaData(), Column("order_id", Text, primary_key=True)),
        ORDERS,
        CUSTOMERS,
        {"order_id": ("left", "order_id")},
    )
    assert keys_only.upsert_sql("after").endswith("ON CONFLICT (order_id) DO NOTHING")


def test_rows_gone_from_the_join_are_deleted() -> None:
    sql = JOINS["order_summaries"].delete_sql("before", "after")
    assert sql == (
        "DELETE FROM order_summaries t USING (SELECT order_id FROM before EXCEPT "
        "SELECT order_id FROM after) gone WHERE t.order_id = gone.order_id"
    )
