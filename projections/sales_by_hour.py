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
    from pyspark.sql import Column

    from projections.base.rows import Rows

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
    from projections.base.rows import F

    return F.col("timestamp") - F.expr(f"INTERVAL {int(ALLOWED_LATENESS.total_seconds())} SECONDS")


def rows() -> Rows:
    """A payment on time adds, per line, its units and revenue to the line's book and hour."""
    from projections.base.rows import F, each_paid_line

    on_time = F.col("occurred_at") >= _watermark()
    return each_paid_line(
        table,
        lambda line: {
            "book_id": line["book_id"],
            "window_start": F.date_trunc("hour", F.col("occurred_at")),
            "units": line["quantity"],
            "revenue_cents": line["quantity"] * line["unit_price_cents"],
        },
        when=on_time,
    )


def late_rows() -> Rows:
    """A payment that comes too late for its window is set aside, with the watermark."""
    from projections.base.rows import F, one

    return one(
        late_events,
        (F.col("type") == "OrderPaid") & (F.col("occurred_at") < _watermark()),
        event_id=F.col("event_id"),
        projection=F.lit("sales_by_hour"),
        topic=F.col("topic"),
        log_partition=F.col("partition"),
        log_offset=F.col("offset"),
        occurred_at=F.col("occurred_at"),
        watermark=_watermark(),
    )


windows = Output(
    table,
    rows=rows,
    merge={"units": "sum", "revenue_cents": "sum"},
    filterable=("book_id",),
    version_column=None,
)
late = Output(
    late_events,
    rows=late_rows,
    merge={},
    filterable=("projection",),
    version_column=None,
    late=True,
)
projection = Projection("sales_by_hour", topics=("order",), outputs=(windows, late))
