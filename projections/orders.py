from __future__ import annotations

from typing import TYPE_CHECKING

from sqlalchemy import BigInteger, Column, DateTime, Integer, Table, Text

from projections import metadata
from projections.base import Output, Projection

if TYPE_CHECKING:
    from projections.base.rows import Rows

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


def rows() -> Rows:
    """An order event moves its status and sets the fields it carries."""
    from projections.base.rows import F, field, one, when_type

    status = F.create_map(*(F.lit(x) for kv in STATUS.items() for x in kv))[F.col("type")]
    return one(
        table,
        F.col("aggregate_type") == "order",
        order_id=F.col("aggregate_id"),
        customer_id=when_type("OrderPlaced", field("customer_id")),
        status=status,
        total_cents=when_type("OrderPlaced", field("total_cents")),
        line_count=when_type("OrderPlaced", F.size(field("lines"))),
        placed_at=when_type("OrderPlaced", F.col("occurred_at")),
        paid_at=when_type("OrderPaid", F.col("occurred_at")),
        shipped_at=when_type("OrderShipped", F.col("occurred_at")),
        version=F.col("version"),
    )


output = Output(
    table,
    rows=rows,
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
)
projection = Projection("orders", topics=("order",), outputs=(output,))
