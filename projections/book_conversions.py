"""Page views that lead to a purchase: a stream-stream join of `page_views` and `OrderPlaced`.

A page view of a book *converts* when the same customer places an order with that book within
`WITHIN` after it, in event time (`0 <= order - view <= WITHIN`). Per book and UTC day of the
view: `views` and `converted_views`; each view converts at most once, however many orders match.

Both sides are kept, bounded by the watermark (`docs/streams.md`): a view waits for its order
in `conversion_views` and an order for late views in `conversion_orders`. Whether a view
converts depends only on the set of views and orders, not on the order they arrive in, so the
live view and a rebuild agree. State is dropped once nothing on time could still match it: an
order once `LATENESS` (plus margins) older than the newest record, a view `WITHIN` later still.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from sqlalchemy import BigInteger, Boolean, Date, DateTime, Index, Table, Text
from sqlalchemy import Column as SqlColumn

from projections import metadata
from projections.base import Output, Projection

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame

    from projections.base.rows import Rows

WITHIN = timedelta(hours=1)
LATENESS = timedelta(hours=2)
# Beyond the watermark, how much older than the newest record's event time state may still be
# needed: the clocks of API processes and devices differ (the allowed skew and more).
MARGIN = timedelta(minutes=15)

table = Table(
    "book_conversions",
    metadata,
    SqlColumn("book_id", Text, primary_key=True),
    SqlColumn("day", Date, primary_key=True),  # UTC day of the views
    SqlColumn("views", BigInteger, nullable=False),
    SqlColumn("converted_views", BigInteger, nullable=False),
)
views_state = Table(
    "conversion_views",
    metadata,
    SqlColumn("view_id", Text, primary_key=True),
    SqlColumn("customer_id", Text, nullable=False),
    SqlColumn("book_id", Text, nullable=False),
    SqlColumn("at", DateTime(timezone=True), nullable=False),
    SqlColumn("converted", Boolean, nullable=False),
    Index("ix_conversion_views_match", "customer_id", "book_id", "at"),
    Index("ix_conversion_views_at", "at"),
)
orders_state = Table(
    "conversion_orders",
    metadata,
    SqlColumn("order_id", Text, primary_key=True),
    SqlColumn("book_id", Text, primary_key=True),
    SqlColumn("customer_id", Text, nullable=False),
    SqlColumn("at", DateTime(timezone=True), nullable=False),
    Index("ix_conversion_orders_match", "customer_id", "book_id", "at"),
    Index("ix_conversion_orders_at", "at"),
)


def rows() -> Rows:
    """A page view: one view; an OrderPlaced: one order per line (customer, book, time)."""
    from pyspark.sql.types import StringType, StructField, StructType, TimestampType

    from projections.base.rows import F, field, row_per_item, single_row

    side_type = StructType(
        [
            *(StructField(c, StringType()) for c in ("kind", "id", "customer_id", "book_id")),
            StructField("at", TimestampType()),
        ]
    )

    def side(kind: str, record_id: Column, book_id: Column) -> Column:
        return F.struct(
            F.lit(kind).alias("kind"),
            record_id.alias("id"),
            field("customer_id").alias("customer_id"),
            book_id.alias("book_id"),
            F.col("occurred_at").alias("at"),
        )

    view = single_row(
        F.col("type") == "page_views", side("view", F.col("event_id"), field("book_id")), side_type
    )
    orders = row_per_item(
        F.when(F.col("type") == "OrderPlaced", field("lines")),
        lambda line: side("order", F.col("aggregate_id"), line["book_id"]),
        side_type,
    )
    return view + orders


def _seconds(d: timedelta) -> str:
    return f"INTERVAL '{int(d.total_seconds())} seconds'"


@dataclass(frozen=True, kw_only=True)
class Conversions(Output):
    """The join's merge, in Postgres: orders in; views in, converted if an order already
    matches, counted per book and day; views that a new order converts, counted; then the
    state nothing on time can match any more, out."""

    within: timedelta
    lateness: timedelta

    @property
    def replayed(self) -> bool:
        return True

    @property
    def staged(self) -> str:
        return BATCH_COLUMNS

    def merge_statements(self, suffix: str, rows: str) -> list[str]:
        # The batch's rows, read from their JSON once into a scratch table of the session
        # (emptied by each batch and at commit): every later statement reads them from there.
        return [
            f"CREATE TEMP TABLE IF NOT EXISTS {BATCH} ({BATCH_COLUMNS}) ON COMMIT DELETE ROWS",
            f"DELETE FROM {BATCH}",
            f"INSERT INTO {BATCH} SELECT * FROM json_to_recordset({rows}::json) "
            f"AS r ({BATCH_COLUMNS})",
            *self.merge_staged_statements(suffix, BATCH),
        ]

    def merge_staged_statements(self, suffix: str, staged: str, empty: bool = False) -> list[str]:
        t, views, orders = (
            self.name + suffix,
            f"conversion_views{suffix}",
            f"conversion_orders{suffix}",
        )
        within = _seconds(self.within)
        day = "(at AT TIME ZONE 'UTC')::date"
        # The newest event time of the whole batch, for `prune_statements`.
        newest = f"""
SELECT set_config('{_newest(suffix)}', greatest({_newest_sql(suffix)},
    (SELECT max(at) FROM {staged}))::text, true)"""
        if empty:
            # Every view is new and meets every order here: no view an order converts later.
            # A key staged twice (a record sent again, a book on two lines) is kept once.
            return [
                newest,
                f"""
INSERT INTO {orders} (order_id, book_id, customer_id, at)
SELECT DISTINCT ON (id, book_id) id, book_id, customer_id, at FROM {staged}
WHERE kind = 'order'""",
                f"""
INSERT INTO {views} (view_id, customer_id, book_id, at, converted)
SELECT DISTINCT ON (r.id) r.id, r.customer_id, r.book_id, r.at, EXISTS (
    SELECT 1 FROM {orders} o
    WHERE o.customer_id = r.customer_id AND o.book_id = r.book_id
    AND o.at >= r.at AND o.at <= r.at + {within}
)
FROM {staged} r WHERE kind = 'view'""",
                f"""
INSERT INTO {t} (book_id, day, views, converted_views)
SELECT book_id, {day}, count(*), count(*) FILTER (WHERE converted) FROM {views} GROUP BY 1, 2""",
            ]
        return [
            newest,
            f"""
INSERT INTO {orders} (order_id, book_id, customer_id, at)
SELECT id, book_id, customer_id, at FROM {staged} WHERE kind = 'order'
ON CONFLICT DO NOTHING""",
            f"""
WITH new AS (
    INSERT INTO {views} (view_id, customer_id, book_id, at, converted)
    SELECT r.id, r.customer_id, r.book_id, r.at, EXISTS (
        SELECT 1 FROM {orders} o
        WHERE o.customer_id = r.customer_id AND o.book_id = r.book_id
        AND o.at >= r.at AND o.at <= r.at + {within}
    )
    FROM {staged} r WHERE kind = 'view'
    ON CONFLICT DO NOTHING
    RETURNING book_id, at, converted
)
INSERT INTO {t} AS t (book_id, day, views, converted_views)
SELECT book_id, {day}, count(*), count(*) FILTER (WHERE converted) FROM new GROUP BY 1, 2
ON CONFLICT (book_id, day) DO UPDATE SET views = t.views + excluded.views,
    converted_views = t.converted_views + excluded.converted_views""",
            f"""
WITH new AS (
    SELECT customer_id, book_id, at FROM {staged} WHERE kind = 'order'
), converted AS (
    UPDATE {views} v SET converted = TRUE
    WHERE NOT v.converted AND EXISTS (
        SELECT 1 FROM new o
        WHERE o.customer_id = v.customer_id AND o.book_id = v.book_id
        AND o.at >= v.at AND o.at <= v.at + {within}
    )
    RETURNING v.book_id, v.at
)
UPDATE {t} AS t SET converted_views = t.converted_views + c.n
FROM (SELECT book_id, {day} AS day, count(*) AS n FROM converted GROUP BY 1, 2) c
WHERE t.book_id = c.book_id AND t.day = c.day""",
        ]

    def prune_statements(self, suffix: str) -> list[str]:
        views, orders, newest = (
            f"conversion_views{suffix}",
            f"conversion_orders{suffix}",
            _newest_sql(suffix),
        )
        return [
            f"DELETE FROM {orders} WHERE at < {newest} - {_seconds(self.lateness + MARGIN)}",
            f"DELETE FROM {views} "
            f"WHERE at < {newest} - {_seconds(self.lateness + self.within + MARGIN)}",
        ]

    def whole_log_rows(self, staged: DataFrame, records: DataFrame) -> DataFrame:
        """The views, the orders the prune keeps (those within `lateness` of the newest row
        staged: the newest of all is no older, so no fewer are kept), and the older orders that
        some view matches. The other orders change nothing: no view converts by them and the
        prune drops them. A log of orders without page views then stages only its last hours;
        a log of fewer hours than the prune keeps, everything, without a look at the rows."""
        from pyspark.sql import functions as F

        from projections.base.rows import rows_frame

        horizon = _micros(self.lateness + MARGIN)
        occurred = F.unix_micros(F.col("occurred_at"))
        first, last = records.agg(F.min(occurred), F.max(occurred)).first() or (None, None)
        if first is None or last - first <= horizon:  # a row's time is its record's
            return staged
        at = F.unix_micros(F.col("at"))
        newest, oldest = staged.agg(F.max(at), F.min(at)).first() or (None, None)
        if newest is None or oldest >= newest - horizon:
            return staged
        old = (F.col("kind") == "order") & (at < newest - horizon)
        kept = staged.where(~F.coalesce(old, F.lit(False)))
        views = (
            rows_frame(self, records)
            .where(F.col("kind") == "view")
            .select(
                F.col("customer_id").alias("v_customer"),
                F.col("book_id").alias("v_book"),
                F.unix_micros(F.col("at")).alias("v_at"),
            )
        )
        if views.isEmpty():
            return kept
        matches = (
            (F.col("customer_id") == F.col("v_customer"))
            & (F.col("book_id") == F.col("v_book"))
            & (at >= F.col("v_at"))
            & (at <= F.col("v_at") + _micros(self.within))
        )
        return kept.unionByName(staged.where(old).join(views, matches, "left_semi"))


def _micros(d: timedelta) -> int:
    return d // timedelta(microseconds=1)


BATCH = "conversion_batch"
BATCH_COLUMNS = "kind text, id text, customer_id text, book_id text, at timestamptz"


def _newest(suffix: str) -> str:
    """The setting that holds the newest event time of the batch being merged (transaction
    scoped: each batch's transaction starts without it)."""
    return f"logfold.conversions_newest{suffix}"


def _newest_sql(suffix: str) -> str:
    # A subquery, so Postgres reads the setting once per statement, not once per row it
    # scans (a prune of a million rows without an index on `at`: 1.3 s, then 0.14 s).
    return f"(SELECT nullif(current_setting('{_newest(suffix)}', true), '')::timestamptz)"


conversions = Conversions(
    table,
    rows=rows,
    merge={},
    filterable=("book_id",),
    version_column=None,
    state=(views_state, orders_state),
    within=WITHIN,
    lateness=LATENESS,
)
projection = Projection(
    "book_conversions",
    topics=("order",),
    streams=("page_views",),
    lateness=LATENESS,
    outputs=(conversions,),
)
