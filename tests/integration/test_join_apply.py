"""How much of a joined view one batch of changes re-derives, on real Postgres: the pairs of
the side rows it changed, not every row of their join values. A customer with many orders
must not make each of their new orders re-derive all the others (the work of a batch then grew
with the view, and the joined view fell behind under load)."""

from __future__ import annotations

import itertools
import json
from typing import Any

import psycopg
import pytest

from config.settings import Settings
from projections.registry import JOINS
from spark.join import apply_changes

pytestmark = pytest.mark.integration

SUMMARIES = JOINS["order_summaries"]
_lsn = itertools.count(1_000)


def change(side: str, key: str, row: dict[str, Any] | None) -> dict[str, Any]:
    """A change as the join pipeline hands it over (`newest_changes`), at a newer position."""
    name = "order_id" if side == "left" else "customer_id"
    return {
        "side": side,
        "key": json.dumps({name: key}),
        "row": None if row is None else json.dumps(row),
        "lsn": next(_lsn),
        "seq": 1,
    }


def customer(cid: str, name: str) -> dict[str, Any]:
    return {"customer_id": cid, "name": name, "email": f"{cid}@example.com"}


def order(oid: str, cid: str, total: int = 100) -> dict[str, Any]:
    return {"order_id": oid, "customer_id": cid, "status": "placed", "total_cents": total}


def apply(settings: Settings, *changes: dict[str, Any]) -> tuple[int, int]:
    with psycopg.connect(settings.database()) as conn, conn.transaction():
        done = apply_changes(conn, SUMMARIES, list(changes))
    return done.derived, done.written


def summaries(settings: Settings) -> dict[str, tuple[str, str, int]]:
    with psycopg.connect(settings.database()) as conn:
        rows = conn.execute(
            "SELECT order_id, customer_id, customer_name, total_cents FROM order_summaries"
        ).fetchall()
    return {o: (c, n, t) for o, c, n, t in rows}


def test_a_batch_re_derives_the_pairs_of_the_rows_it_changed(deployment: Settings) -> None:
    orders = [f"o{i}" for i in range(40)]
    apply(
        deployment,
        change("right", "ada", customer("ada", "Ada")),
        change("right", "bob", customer("bob", "Bob")),
        *(change("left", o, order(o, "ada")) for o in orders),
        change("left", "b1", order("b1", "bob")),
    )
    assert len(summaries(deployment)) == 41

    # A new order of a customer with 40: its own row, not the customer's 41.
    assert apply(deployment, change("left", "o40", order("o40", "ada"))) == (1, 1)
    # An order changing: its row only; an order moving to another customer: its row, once.
    assert apply(deployment, change("left", "o0", order("o0", "ada", total=250))) == (1, 1)
    assert apply(deployment, change("left", "o1", order("o1", "bob"))) == (1, 1)
    # A renamed customer: every row of that customer, and only those.
    assert apply(deployment, change("right", "ada", customer("ada", "Ada L."))) == (40, 40)
    # An order and its customer in one batch: the pair once.
    derived, written = apply(
        deployment,
        change("left", "b1", order("b1", "bob", total=7)),
        change("right", "bob", customer("bob", "Bobby")),
    )
    assert (derived, written) == (2, 2)  # b1 and o1, bob's two orders
    # A deleted order: nothing derived, its row deleted.
    assert apply(deployment, change("left", "o2", None)) == (0, 1)
    # A deleted customer: nothing derived, each of their rows deleted.
    assert apply(deployment, change("right", "bob", None)) == (0, 2)

    rows = summaries(deployment)
    expected = {o: ("ada", "Ada L.", 100) for o in [*orders, "o40"] if o not in ("o1", "o2")}
    expected["o0"] = ("ada", "Ada L.", 250)
    assert rows == expected


def test_polls_on_one_connection_reuse_their_scratch_tables_and_leave_them_empty(
    deployment: Settings,
) -> None:
    """The live projector applies a poll a transaction on one connection: the join's scratch
    tables are made once (no catalog rows made and dropped a poll) and every commit empties
    their files (a table only ever emptied by DELETE grows, and nothing vacuums it)."""
    scratch = ("join_changes", "join_before_order_summaries", "join_after_order_summaries")

    def tables(conn: psycopg.Connection[Any]) -> dict[str, tuple[int, int, int]]:
        found = {}
        for name in scratch:
            oid, size = conn.execute(
                "SELECT to_regclass(%s)::oid, pg_relation_size(to_regclass(%s))",
                (f"pg_temp.{name}", f"pg_temp.{name}"),
            ).fetchone() or (None, None)
            rows = conn.execute(f"SELECT count(*) FROM {name}").fetchone()
            found[name] = (oid, size, rows[0] if rows else None)
        return found

    seen = []
    # Each transaction commits, as each of the projector's polls does.
    with psycopg.connect(deployment.database(), autocommit=True) as conn:
        for i in range(3):
            with conn.transaction():
                changes = [change("right", f"c{j}", customer(f"c{j}", f"n{i}")) for j in range(50)]
                changes += [change("left", f"o{j}", order(f"o{j}", f"c{j}")) for j in range(50)]
                apply_changes(conn, SUMMARIES, changes)
            seen.append(tables(conn))
    first = seen[0]
    assert all(oid is not None for oid, _, _ in first.values()), first
    assert seen == [first] * 3, seen  # the same tables, empty, their files truncated
    assert {(size, rows) for _, size, rows in first.values()} == {(0, 0)}, first
    assert len(summaries(deployment)) == 50
