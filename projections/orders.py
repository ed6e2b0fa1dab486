from __future__ import annotations

from typing import TYPE_CHECKING

from sqlalchemy import BigInteger, Column, DateTime, Integer, Table, Text

from projections import metadata
from projections.base import Output, Projection

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

table = Table(
    "orders",
    metadata,
    Column("order_id", Text, primary_key=True),
    Column("customer_id", Text, index=True),
    Column("status", Text, index=True),
    Column("total_cents", BigInteger),
    Column("line_count", Integer),
    Column("placed_at", DateTime(timezone=True)),
    Column("paid_at", DateTime(timezone=True)),
    Column("shipped_at", DateTime(timezone=True)),
    Column("version", BigInteger),
)

STATUS = {
    "OrderPlaced": "placed",
    "OrderPaid": "paid",
    "OrderShipped": "shipped",
    "OrderCancelled": "cancelled",
}


def transform(events: DataFrame) -> DataFrame:
    from projections._fold import F, field, latest, when_type

    e = events.where(F.col("aggregate_type") == "order")
    status = F.create_map(*(F.lit(x) for kv in STATUS.items() for x in kv))[F.col("type")]
    rows = e.select(
        F.col("aggregate_id").alias("order_id"),
        when_type("OrderPlaced", field("customer_id")).alias("customer_id"),
        status.alias("status"),
        when_type("OrderPlaced", field("total_cents").cast("long")).alias("total_cents"),
        when_type("OrderPlaced", F.json_array_length(field("lines"))).alias("line_count"),
        when_type("OrderPlaced", F.col("occurred_at")).alias("placed_at"),
        when_type("OrderPaid", F.col("occurred_at")).alias("paid_at"),
        when_type("OrderShipped", F.col("occurred_at")).alias("shipped_at"),
        F.col("version"),
    )
    return latest(rows, ["order_id"])


projection = Projection(
    "orders",
    topics=("order",),
    outputs=(
        Output(
            table,
            transform=transform,
            merge=dict.fromkeys(
                (
                    "customer_id",
                    "status",
                    "total_cents",
                    "line_count",
                    "placed_at",
                    "paid_at",
                    "shipped_at",
                ),
                "latest",
            ),
            filterable=("customer_id", "status"),
        ),
    ),
)
