"""The views over streams of facts as they should be: an independent, plain-Python fold of the
stream topics (with each record's Kafka timestamp: when the API received it). Shares no code
with the projections: it applies the rules as `docs/streams.md` states them."""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

import psycopg

from config.settings import Settings
from config.topics import Topics
from events.serialization import decode
from events.store import read_to_end
from tests.oracle import compare, read_views

LATENESS = timedelta(hours=2)  # of every page-view view
HOUR, DAY, GAP = timedelta(hours=1), timedelta(days=1), timedelta(minutes=30)
Rows = dict[tuple[Any, ...], dict[str, Any]]


@dataclass
class Fact:
    id: str
    occurred_at: datetime
    logged_at: datetime  # the Kafka timestamp: when the API received it
    data: dict[str, Any]


@dataclass
class Counted:
    """What a view counts of a stream: the on-time first copies, and how many were late."""

    facts: list[Fact] = field(default_factory=list)
    late: int = 0


def read_stream(settings: Settings, stream: str) -> list[list[Fact]]:
    """Every committed record of the stream, per partition, in log order."""
    out: list[list[Fact]] = [[] for _ in range(settings.partitions)]
    for r in read_to_end(settings.kafka(), Topics(settings.topic_prefix).stream(stream)):
        doc = json.loads(r.value)
        out[r.partition].append(
            Fact(
                doc["id"],
                datetime.fromisoformat(doc["occurred_at"]),
                datetime.fromtimestamp(r.timestamp / 1000, UTC),
                doc["data"],
            )
        )
    return out


@dataclass
class Order:
    customer_id: str
    books: set[str]
    at: datetime


def orders_placed(settings: Settings, lateness: timedelta = LATENESS) -> tuple[list[Order], int]:
    """Every OrderPlaced on time, and how many were late."""
    found, late = [], 0
    for r in read_to_end(settings.kafka(), Topics(settings.topic_prefix).events("order")):
        e = decode(r.value)
        if e.type != "OrderPlaced":
            continue
        at = datetime.fromisoformat(e.occurred_at)
        if datetime.fromtimestamp(r.timestamp / 1000, UTC) - at > lateness:
            late += 1
            continue
        found.append(Order(e.data["customer_id"], {x["book_id"] for x in e.data["lines"]}, at))
    return found, late


def counted(partitions: list[list[Fact]], lateness: timedelta = LATENESS) -> Counted:
    result = Counted()
    seen: set[str] = set()
    for facts in partitions:
        for f in facts:
            if f.logged_at - f.occurred_at > lateness:
                result.late += 1
            elif f.id not in seen:
                seen.add(f.id)
                result.facts.append(f)
    return result


def trending_books(facts: list[Fact]) -> Rows:
    rows: Rows = {}
    for f in facts:
        epoch = int(f.occurred_at.timestamp())
        newest = epoch - epoch % 3600
        for k in range(24):
            start = datetime.fromtimestamp(newest - k * 3600, UTC)
            row = rows.setdefault(
                (f.data["book_id"], start), {"window_end": start + DAY, "views": 0}
            )
            row["views"] += 1
    return rows


def browsing_sessions(facts: list[Fact]) -> Rows:
    by_customer: dict[str, list[Fact]] = defaultdict(list)
    for f in facts:
        by_customer[f.data["customer_id"]].append(f)
    rows: Rows = {}
    for customer, views in by_customer.items():
        views.sort(key=lambda f: f.occurred_at)
        session: list[Fact] = []
        for f in [*views, None]:
            if session and (f is None or f.occurred_at - session[-1].occurred_at >= GAP):
                rows[(customer, session[0].occurred_at)] = {
                    "session_end": session[-1].occurred_at,
                    "views": len(session),
                    "books": sorted({s.data["book_id"] for s in session}),
                }
                session = []
            if f is not None:
                session.append(f)
    return rows


def book_conversions(facts: list[Fact], orders: list[Order]) -> Rows:
    rows: Rows = {}
    for f in facts:
        customer, book = f.data["customer_id"], f.data["book_id"]
        converts = any(
            o.customer_id == customer
            and book in o.books
            and f.occurred_at <= o.at <= f.occurred_at + HOUR
            for o in orders
        )
        row = rows.setdefault(
            (book, f.occurred_at.astimezone(UTC).date()), {"views": 0, "converted_views": 0}
        )
        row["views"] += 1
        row["converted_views"] += int(converts)
    return rows


def expected(settings: Settings) -> tuple[dict[str, Rows], dict[str, int]]:
    """The stream views' rows, and the late records each counts."""
    views = counted(read_stream(settings, "page_views"))
    orders, late_orders = orders_placed(settings)
    return {
        "trending_books": trending_books(views.facts),
        "browsing_sessions": browsing_sessions(views.facts),
        "book_conversions": book_conversions(views.facts, orders),
    }, {
        "trending_books": views.late,
        "browsing_sessions": views.late,
        "book_conversions": views.late + late_orders,
    }


KEYS = {
    "trending_books": ["book_id", "window_start"],
    "browsing_sessions": ["customer_id", "session_start"],
    "book_conversions": ["book_id", "day"],
}


def actual(settings: Settings) -> dict[str, Rows]:
    return read_views(settings, KEYS)


def differences(settings: Settings) -> dict[str, Any]:
    """Per view, the keys whose rows differ (expected, actual); empty when all match."""
    return compare(expected(settings)[0], actual(settings))


def royalty_payouts(settings: Settings) -> Rows:
    """Each paid line with its author's payout account as of the payment: the profile version
    (`author_profile_history`, the table's own record of itself) valid at `paid_at`."""
    with psycopg.connect(settings.database()) as conn:
        history = conn.execute(
            "SELECT author, CASE WHEN valid_from > '-infinity' THEN valid_from END, "
            "payout_account FROM author_profile_history"
        ).fetchall()
    versions: dict[str, list[tuple[datetime, str | None]]] = defaultdict(list)
    for author, valid_from, account in history:
        at = valid_from or datetime.min.replace(tzinfo=UTC)  # None: since ever
        versions[author].append((at, account))
    rows: Rows = {}
    for r in read_to_end(settings.kafka(), Topics(settings.topic_prefix).events("order")):
        e = decode(r.value)
        if e.type != "OrderPaid":
            continue
        paid_at = datetime.fromisoformat(e.occurred_at)
        for line in e.data["lines"]:
            valid = [v for v in versions.get(line["author"], []) if v[0] <= paid_at]
            exact = Decimal(line["quantity"] * line["unit_price_cents"]) * Decimal(
                str(line["royalty_rate"])
            )
            row = rows.setdefault(
                (e.aggregate_id, line["book_id"]),
                {
                    "author": line["author"],
                    "payout_account": max(valid, key=lambda v: v[0])[1] if valid else None,
                    "amount_cents": 0,
                    "paid_at": paid_at,
                },
            )
            row["amount_cents"] += int(exact.quantize(Decimal(1), rounding=ROUND_HALF_UP))
    return rows


def compare_payouts(settings: Settings) -> dict[str, Any]:
    """`royalty_payouts` against `royalty_payouts(settings)`: empty when they match."""
    have = read_views(settings, {"royalty_payouts": ["order_id", "book_id"]})
    return compare({"royalty_payouts": royalty_payouts(settings)}, have)
