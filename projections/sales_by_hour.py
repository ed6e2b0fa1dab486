"""Units and revenue per book in event-time tumbling one-hour windows of payments.

The watermark: a payment is late when its event time is more than `ALLOWED_LATENESS` older than
the time its record was appended to the log (the Kafka record timestamp). Both are stored in the
log, so lateness is the same in the live projector and in a rebuild, whatever the batch
boundaries (a watermark that advanced with micro-batches would make a rebuild differ). Late
payments are kept out of the windows, recorded in `late_events`, and counted in /health and
/metrics: never silently dropped.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

from sqlalchemy import BigInteger, DateTime, Integer, Table, Text
from sqlalchemy import Column as SqlColumn

from projections import metadata
from projections.base import Output, Projection

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame

ALLOWED_LATENESS = timedelta(minutes=10)

table = Table(
    "sales_by_hour",
    metadata,
    SqlColumn("book_id", Text, primary_key=True),
    SqlColumn("window_start", DateTime(timezone=True), primary_key=True),
    SqlColumn("units", BigInteger, nullable=False),
    SqlColumn("revenue_cents", BigInteger, nullable=False),
)

late_events = Table(
    "late_events",
    metadata,
    SqlColumn("event_id", Text, primary_key=True),
    SqlColumn("projection", Text, nullable=False, index=True),
    SqlColumn("topic", Text, nullable=False),
    SqlColumn("log_partition", Integer, nullable=False),
    SqlColumn("log_offset", BigInteger, nullable=False),
    SqlColumn("occurred_at", DateTime(timezone=True), nullable=False),
    SqlColumn("watermark", DateTime(timezone=True), nullable=False),
)


def _watermark() -> Column:
    from projections._fold import F

    return F.col("timestamp") - F.expr(f"INTERVAL {int(ALLOWED_LATENESS.total_seconds())} SECONDS")


def transform(events: DataFrame) -> DataFrame:
    from projections._fold import F, paid_lines

    on_time = paid_lines(events).where(F.col("occurred_at") >= _watermark())
    return on_time.groupBy(
        "book_id", F.date_trunc("hour", F.col("occurred_at")).alias("window_start")
    ).agg(
        F.sum("quantity").cast("long").alias("units"),
        F.sum(F.col("quantity") * F.col("unit_price_cents")).cast("long").alias("revenue_cents"),
    )


def late(events: DataFrame) -> DataFrame:
    from projections._fold import F

    paid = events.where((F.col("type") == "OrderPaid") & (F.col("occurred_at") < _watermark()))
    return paid.select(
        "event_id",
        F.lit("sales_by_hour").alias("projection"),
        "topic",
        F.col("partition").alias("log_partition"),
        F.col("offset").alias("log_offset"),
        "occurred_at",
        _watermark().alias("watermark"),
    )


projection = Projection(
    "sales_by_hour",
    topics=("order",),
    outputs=(
        Output(
            table,
            transform=transform,
            merge={"units": "sum", "revenue_cents": "sum"},
            filterable=("book_id",),
            version_column=None,
        ),
        Output(
            late_events,
            transform=late,
            merge={},
            filterable=("projection",),
            version_column=None,
            late=True,
        ),
    ),
)
