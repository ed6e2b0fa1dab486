"""Each projection's rows, combined by its merge rules (as a rebuild does), on given events (a
local Spark session; no Kafka, no Postgres), including windowing with late events. The live
pipeline combines the same rows in Postgres: tests/integration/test_projector.py."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import (
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from events.base import DomainEvent
from events.book import BookAdded, BookRepriced
from events.customer import CustomerEmailChanged, CustomerRegistered, CustomerRenamed
from events.order import OrderCancelled, OrderPaid, OrderPlaced, OrderShipped, PlacedLine
from events.serialization import to_data
from projections import author_royalties, books, customers, orders, sales_by_hour
from projections.base.rows import fold
from spark.decode import data_fields

pytestmark = pytest.mark.spark

T0 = datetime(2026, 11, 21, 10, 15, tzinfo=UTC)
SCHEMA = StructType(
    [
        StructField("topic", StringType()),
        StructField("partition", IntegerType()),
        StructField("offset", LongType()),
        StructField("timestamp", TimestampType()),
        StructField("event_id", StringType()),
        StructField("type", StringType()),
        StructField("aggregate_type", StringType()),
        StructField("aggregate_id", StringType()),
        StructField("version", LongType()),
        StructField("occurred_at", TimestampType()),
        StructField("data", StringType()),
    ]
)
DUNE = PlacedLine("dune", 2, 1000, "Herbert", 0.125)
EMMA = PlacedLine("emma", 1, 999, "Austen", 0.1)


def log(spark: SparkSession, *events: tuple[str, str, int, DomainEvent, Any]) -> DataFrame:
    """(aggregate type, id, version, event, minutes after T0[, minutes appended late])."""
    import json

    rows = []
    for i, (agg, agg_id, version, event, *at) in enumerate(events):
        occurred = T0 + timedelta(minutes=at[0] if at else i)
        appended = occurred + timedelta(minutes=at[1] if len(at) > 1 else 0)
        rows.append(
            (
                f"events.{agg}",
                0,
                i,
                appended.replace(tzinfo=None),
                f"e{i}",
                event.type_name(),
                agg,
                agg_id,
                version,
                occurred.replace(tzinfo=None),
                json.dumps(to_data(event)),
            )
        )
    return data_fields(spark.createDataFrame(rows, SCHEMA))


def rows(df: DataFrame) -> list[dict[str, Any]]:
    return sorted((r.asDict() for r in df.collect()), key=lambda r: str(list(r.values())))


def naive(minutes: float) -> datetime:
    return (T0 + timedelta(minutes=minutes)).replace(tzinfo=None)


def test_customers_take_each_field_from_its_latest_event(spark: SparkSession) -> None:
    events = log(
        spark,
        ("customer", "c1", 1, CustomerRegistered("Ada", "a@x.org"), 0),
        ("customer", "c1", 2, CustomerRenamed("Ada L"), 1),
        ("customer", "c1", 3, CustomerEmailChanged("ada@x.org"), 2),
        ("customer", "c2", 1, CustomerRegistered("Bo", "b@x.org"), 3),
    )
    assert rows(fold(customers.output, events)) == [
        {
            "customer_id": "c1",
            "name": "Ada L",
            "email": "ada@x.org",
            "registered_at": naive(0),
            "version": 3,
        },
        {
            "customer_id": "c2",
            "name": "Bo",
            "email": "b@x.org",
            "registered_at": naive(3),
            "version": 1,
        },
    ]


def test_a_batch_without_the_creating_event_yields_a_partial_row(spark: SparkSession) -> None:
    events = log(spark, ("customer", "c1", 4, CustomerRenamed("New"), 0))
    assert rows(fold(customers.output, events)) == [
        {"customer_id": "c1", "name": "New", "email": None, "registered_at": None, "version": 4}
    ]


def test_orders_follow_status_and_timestamps(spark: SparkSession) -> None:
    events = log(
        spark,
        ("order", "o1", 1, OrderPlaced("c1", (DUNE, EMMA), 2999), 0),
        ("order", "o1", 2, OrderPaid(2999, (DUNE, EMMA)), 5),
        ("order", "o1", 3, OrderShipped(), 9),
        ("order", "o2", 1, OrderPlaced("c2", (EMMA,), 999), 1),
        ("order", "o2", 2, OrderCancelled("no"), 2),
    )
    assert rows(fold(orders.output, events)) == [
        {
            "order_id": "o1",
            "customer_id": "c1",
            "status": "shipped",
            "total_cents": 2999,
            "line_count": 2,
            "placed_at": naive(0),
            "paid_at": naive(5),
            "shipped_at": naive(9),
            "version": 3,
        },
        {
            "order_id": "o2",
            "customer_id": "c2",
            "status": "cancelled",
            "total_cents": 999,
            "line_count": 1,
            "placed_at": naive(1),
            "paid_at": None,
            "shipped_at": None,
            "version": 2,
        },
    ]


def test_books_keep_their_details_and_add_up_units_paid(spark: SparkSession) -> None:
    events = log(
        spark,
        ("book", "dune", 1, BookAdded("Dune", "Herbert", 1000, 0.125), 0),
        ("book", "dune", 2, BookRepriced(1500), 1),
        ("order", "o1", 2, OrderPaid(2999, (DUNE, EMMA)), 2),
        ("order", "o2", 2, OrderPaid(2000, (DUNE,)), 3),
    )
    assert rows(fold(books.output, events)) == [
        {
            "book_id": "dune",
            "title": "Dune",
            "author": "Herbert",
            "price_cents": 1500,
            "royalty_rate": 0.125,
            "units_sold": 4,
            "version": 2,
        },
        {
            "book_id": "emma",
            "title": None,
            "author": None,
            "price_cents": None,
            "royalty_rate": None,
            "units_sold": 1,
            "version": None,
        },
    ]


def test_royalties_count_paid_orders_only_rounding_half_up_per_line(spark: SparkSession) -> None:
    odd = PlacedLine("x", 1, 5, "Herbert", 0.1)  # 0.5 cent rounds up to 1
    events = log(
        spark,
        ("order", "o1", 1, OrderPlaced("c1", (DUNE,), 2000), 0),
        ("order", "o1", 2, OrderPaid(2000, (DUNE, odd)), 1),
        ("order", "o2", 2, OrderPaid(999, (EMMA,)), 2),
    )
    assert rows(fold(author_royalties.output, events)) == [
        {"author": "Austen", "royalty_cents": 100, "units_sold": 1},
        {"author": "Herbert", "royalty_cents": 251, "units_sold": 3},
    ]
    assert author_royalties.royalty_cents(1, 5, 0.1) == 1
    assert author_royalties.royalty_cents(2, 1000, 0.125) == 250


def test_sales_windows_are_hourly_in_event_time_and_late_events_are_set_aside(
    spark: SparkSession,
) -> None:
    events = log(
        spark,
        ("order", "o1", 2, OrderPaid(2000, (DUNE,)), 0),  # 10:15
        ("order", "o2", 2, OrderPaid(2000, (DUNE,)), 50),  # 11:05
        ("order", "o3", 2, OrderPaid(999, (EMMA,)), 44, 9),  # 10:59, 9 min late: ok
        ("order", "o4", 2, OrderPaid(2000, (DUNE,)), 30, 11),
    )  # 10:45, 11 min late
    assert rows(fold(sales_by_hour.windows, events)) == [
        {
            "book_id": "dune",
            "window_start": datetime(2026, 11, 21, 10),
            "units": 2,
            "revenue_cents": 2000,
        },
        {
            "book_id": "dune",
            "window_start": datetime(2026, 11, 21, 11),
            "units": 2,
            "revenue_cents": 2000,
        },
        {
            "book_id": "emma",
            "window_start": datetime(2026, 11, 21, 10),
            "units": 1,
            "revenue_cents": 999,
        },
    ]
    [late] = rows(fold(sales_by_hour.late, events))
    assert (late["event_id"], late["occurred_at"]) == ("e3", naive(30))
    assert late["watermark"] == naive(31)


def test_a_whole_logs_rows_are_each_events_rows_and_run_without_lambdas(
    spark: SparkSession,
) -> None:
    """A rebuild takes a whole log's rows exploded first (`rows_frame`), a live batch each
    event's rows as one array (`rows_column`): both must give the same rows, and the first
    must hold no higher-order function (Spark runs a plan with one interpreted, several times
    slower)."""
    import json

    from projections.base.rows import rows_column, rows_frame
    from projections.registry import PROJECTIONS

    events = log(
        spark,
        ("customer", "c1", 1, CustomerRegistered("Ann", "ann@x.org"), 0),
        ("book", "dune", 1, BookAdded("Dune", "Herbert", 1000, 0.125), 1),
        ("order", "o1", 1, OrderPlaced("c1", (DUNE, EMMA), 2999), 2),
        ("order", "o1", 2, OrderPaid(2999, (DUNE, EMMA)), 3),
        ("order", "o2", 1, OrderPlaced("c1", (DUNE,), 2000), 4),
        ("order", "o2", 2, OrderPaid(2000, (DUNE,)), 80, 70),  # late for sales_by_hour
    )
    at = naive(1)
    view = spark.createDataFrame(
        [
            (
                "streams.page_views",
                0,
                0,
                at,
                "v1",
                "page_views",
                "page_views",
                None,
                None,
                at,
                json.dumps({"customer_id": "c1", "book_id": "dune"}),
            ),
        ],
        SCHEMA,
    )
    events = events.unionByName(data_fields(view))
    checked = 0
    for projection in PROJECTIONS.values():
        for output in projection.outputs:
            frame = rows_frame(output, events)
            plan = frame._jdf.queryExecution().executedPlan().toString()
            assert "lambdafunction" not in plan, (output.name, plan)
            each = events.select(F.explode(rows_column(output)).alias("row")).select("row.*")
            assert rows(frame) == rows(each), output.name
            checked += bool(rows(frame))
    assert checked >= 9  # every output that rows from these events does


def test_a_rebuild_stages_only_the_orders_a_conversion_or_the_prune_keeps(
    spark: SparkSession,
) -> None:
    """`book_conversions` keeps an order for the watermark's hours after the newest record: a
    rebuild of a long log stages the recent orders and the older ones some view matches, and
    what the merge and its prune leave is what it leaves with every order staged."""
    import json

    from projections.base.rows import rows_frame
    from projections.book_conversions import LATENESS, MARGIN, WITHIN, conversions

    newest = T0 + timedelta(days=30)
    horizon = newest - LATENESS - MARGIN
    old = newest - timedelta(days=2)
    orders = {  # order id: customer, book, time
        "recent": ("ann", "dune", newest),
        "at-horizon": ("ann", "dune", horizon),
        "before-horizon": ("ann", "dune", horizon - timedelta(seconds=1)),
        "matched": ("bob", "dune", old),
        "matched-at-bound": ("bob", "emma", old + WITHIN),
        "viewed-after": ("cat", "dune", old),
        "other-book": ("dan", "emma", old),
        "other-customer": ("eve", "dune", old),
        "too-late": ("fay", "dune", old + WITHIN + timedelta(seconds=1)),
    }
    views = {  # view id: customer, book, time
        "v-bob": ("bob", "dune", old - timedelta(minutes=30)),
        "v-bob-emma": ("bob", "emma", old),
        "v-cat": ("cat", "dune", old + timedelta(seconds=1)),
        "v-dan": ("dan", "dune", old),
        "v-ann": ("ann", "dune", old),
        "v-fay": ("fay", "dune", old),
    }
    placed = log(
        spark,
        *(
            ("order", oid, 1, OrderPlaced(c, (PlacedLine(b, 1, 100, "A", 0.1),), 100), 0)
            for oid, (c, b, _) in orders.items()
        ),
    ).withColumn(  # each at its own time
        "occurred_at",
        F.create_map(*(x for o, (*_, t) in orders.items() for x in (F.lit(o), F.lit(naive_at(t)))))[
            F.col("aggregate_id")
        ],
    )
    viewed = data_fields(
        spark.createDataFrame(
            [
                (
                    "streams.page_views",
                    0,
                    n,
                    naive_at(t),
                    v,
                    "page_views",
                    "page_views",
                    None,
                    None,
                    naive_at(t),
                    json.dumps({"customer_id": c, "book_id": b}),
                )
                for n, (v, (c, b, t)) in enumerate(views.items())
            ],
            SCHEMA,
        )
    )
    records = placed.unionByName(viewed)
    # As a rebuild stages them: the rows of the events (stream records go their own way).
    staged = rows_frame(conversions, placed)

    def outcome(staged_orders: set[str]) -> tuple[set[str], set[str]]:
        """The views converted and the orders the prune keeps, as the merge leaves them."""
        converted = {
            v
            for v, (vc, vb, vt) in views.items()
            for o in staged_orders
            if orders[o][:2] == (vc, vb) and vt <= orders[o][2] <= vt + WITHIN
        }
        last = max(t for *_, t in [*(orders[o] for o in staged_orders), *views.values()])
        kept = {o for o in staged_orders if orders[o][2] >= last - LATENESS - MARGIN}
        return converted, kept

    def ids(frame: DataFrame) -> set[str]:
        return {r["id"] for r in frame.collect()}

    narrowed = ids(conversions.whole_log_rows(staged, records))
    assert narrowed == {"recent", "at-horizon", "matched", "matched-at-bound"}
    assert (
        outcome(narrowed)
        == outcome(set(orders))
        == (
            {"v-bob", "v-bob-emma"},
            {"recent", "at-horizon"},
        )
    )
    # Without a view, only the prune's hours.
    assert ids(conversions.whole_log_rows(staged, placed)) == {"recent", "at-horizon"}
    # A log of fewer hours than the prune keeps: every row.
    recent = F.col("occurred_at") >= naive_at(horizon)
    short = conversions.whole_log_rows(
        rows_frame(conversions, placed.where(recent)), records.where(recent)
    )
    assert ids(short) == {"recent", "at-horizon"}


def naive_at(t: datetime) -> datetime:
    return t.replace(tzinfo=None)
