"""The views as they should be: an independent, plain-Python fold of the whole log, to compare
the projector's and the rebuild's output against. Shares no code with the Spark transforms."""

from __future__ import annotations

from collections import defaultdict
from datetime import UTC, datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

import psycopg

from config.settings import Settings
from config.topics import Topics
from events.base import ERASED
from events.keys import find_keys, open_value, subject
from events.serialization import decode
from events.store import read_to_end

LATENESS = timedelta(minutes=10)
Views = dict[str, dict[tuple[Any, ...], dict[str, Any]]]


def _time(iso: str) -> datetime:
    return datetime.fromisoformat(iso.replace("Z", "+00:00"))


def expected(settings: Settings) -> Views:
    topics = Topics(settings.topic_prefix)
    customers: dict[tuple[Any, ...], dict[str, Any]] = {}
    books: dict[tuple[Any, ...], dict[str, Any]] = {}
    orders: dict[tuple[Any, ...], dict[str, Any]] = {}
    royalties: dict[tuple[Any, ...], dict[str, Any]] = defaultdict(
        lambda: {"royalty_cents": 0, "units_sold": 0}
    )
    sales: dict[tuple[Any, ...], dict[str, Any]] = defaultdict(
        lambda: {"units": 0, "revenue_cents": 0}
    )
    sold: dict[str, int] = defaultdict(int)
    late = 0
    with psycopg.connect(settings.database()) as conn:
        keys = find_keys(conn, [r[0] for r in conn.execute("SELECT subject FROM subject_keys")])
    for aggregate in ("customer", "book", "order"):
        records = sorted(
            read_to_end(settings.kafka(), topics.events(aggregate)),
            key=lambda r: (r.partition, r.offset),
        )
        for record in records:
            e = decode(record.value)
            d, key, at = e.data, (e.aggregate_id,), _time(e.occurred_at)
            if aggregate == "customer":  # personal fields, sealed (events/keys.py)
                who = subject("customer", e.aggregate_id)
                d = {k: open_value(keys.get(who), who, v) for k, v in d.items()}
            if e.type == "CustomerErased":
                customers[key].update(name=ERASED, email=ERASED)
            elif e.type == "CustomerRegistered":
                customers[key] = {"name": d["name"], "email": d["email"], "registered_at": at}
            elif e.type == "CustomerRenamed":
                customers[key]["name"] = d["name"]
            elif e.type == "CustomerEmailChanged":
                customers[key]["email"] = d["email"]
            elif e.type == "BookAdded":
                books[key] = {k: d[k] for k in ("title", "author", "price_cents", "royalty_rate")}
            elif e.type == "BookRepriced":
                books[key]["price_cents"] = d["price_cents"]
            elif e.type == "OrderPlaced":
                orders[key] = {
                    "customer_id": d["customer_id"],
                    "status": "placed",
                    "total_cents": d["total_cents"],
                    "line_count": len(d["lines"]),
                    "placed_at": at,
                    "paid_at": None,
                    "shipped_at": None,
                }
            elif e.type == "OrderPaid":
                orders[key].update(status="paid", paid_at=at)
                appended = datetime.fromtimestamp(record.timestamp / 1000, UTC)
                is_late = at < appended - LATENESS
                late += is_late
                for line in d["lines"]:
                    qty, price = line["quantity"], line["unit_price_cents"]
                    exact = Decimal(qty * price) * Decimal(str(line["royalty_rate"]))
                    r = royalties[(line["author"],)]
                    r["royalty_cents"] += int(exact.quantize(Decimal(1), rounding=ROUND_HALF_UP))
                    r["units_sold"] += qty
                    sold[line["book_id"]] += qty
                    if not is_late:
                        s = sales[(line["book_id"], at.replace(minute=0, second=0, microsecond=0))]
                        s["units"] += qty
                        s["revenue_cents"] += qty * price
            elif e.type == "OrderShipped":
                orders[key].update(status="shipped", shipped_at=at)
            elif e.type == "OrderCancelled":
                orders[key]["status"] = "cancelled"
            entity = {"customer": customers, "book": books, "order": orders}[e.aggregate_type]
            if key in entity:
                entity[key]["version"] = e.version
    for (book_id,), row in books.items():
        row["units_sold"] = sold.get(book_id, 0)
    return {
        "customers": customers,
        "books": books,
        "orders": orders,
        "author_royalties": dict(royalties),
        "sales_by_hour": dict(sales),
        "late_events": {("count",): {"n": late}},
    }


def actual(settings: Settings) -> Views:
    """The views' rows in Postgres, keyed like `expected`."""
    keys = {
        "customers": ["customer_id"],
        "books": ["book_id"],
        "orders": ["order_id"],
        "author_royalties": ["author"],
        "sales_by_hour": ["book_id", "window_start"],
    }
    out = read_views(settings, keys)
    with psycopg.connect(settings.database()) as conn:
        (n,) = conn.execute("SELECT count(*) FROM late_events").fetchone() or (0,)
    out["late_events"] = {("count",): {"n": n}}
    return out


def read_views(settings: Settings, keys: dict[str, list[str]]) -> Views:
    """The rows of each view of `keys` (view -> its key columns), by key."""
    out: Views = {}
    with psycopg.connect(settings.database()) as conn:
        for view, key in keys.items():
            cur = conn.execute(f"SELECT * FROM {view}")
            names = [c.name for c in cur.description or []]
            rows = [dict(zip(names, r, strict=True)) for r in cur.fetchall()]
            out[view] = {tuple(r.pop(k) for k in key): r for r in rows}
    return out


def differences(settings: Settings) -> dict[str, Any]:
    """Per view, the keys whose rows differ (expected, actual); empty when all match."""
    return compare(expected(settings), actual(settings))


def compare(want: Views, have: Views) -> dict[str, Any]:
    """Per view of `want`, the keys whose rows differ from `have`'s (the first five of them, and
    how many); empty when all match."""
    diff: dict[str, Any] = {}
    for view, rows in want.items():
        got = have.get(view, {})
        bad = {
            k: (rows.get(k), got.get(k))
            for k in rows.keys() | got.keys()
            if rows.get(k) != got.get(k)
        }
        if bad:
            diff[view] = dict(list(bad.items())[:5]) | {"count": len(bad)}
    return diff
