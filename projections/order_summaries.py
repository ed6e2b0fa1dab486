"""Each order with its customer's name and email: orders ⨝ customers on customer_id, kept current
from both tables' changelogs (a rename reaches every order summary of the customer)."""

from __future__ import annotations

from sqlalchemy import BigInteger, Column, DateTime, Integer, Table, Text

from projections import metadata
from projections.base import Join, Side

table = Table(
    "order_summaries",
    metadata,
    Column("order_id", Text, primary_key=True),
    Column("customer_id", Text, index=True),
    Column("customer_name", Text),
    Column("customer_email", Text),
    Column("status", Text, index=True),
    Column("total_cents", BigInteger),
    Column("line_count", Integer),
    Column("placed_at", DateTime(timezone=True)),
    Column("paid_at", DateTime(timezone=True)),
    Column("shipped_at", DateTime(timezone=True)),
)

join = Join(
    table,
    left=Side("orders", key=("order_id",), on="customer_id"),
    right=Side("customers", key=("customer_id",), on="customer_id"),
    sources={
        "order_id": ("left", "order_id"),
        "customer_id": ("left", "customer_id"),
        "customer_name": ("right", "name"),
        "customer_email": ("right", "email"),
        "status": ("left", "status"),
        "total_cents": ("left", "total_cents"),
        "line_count": ("left", "line_count"),
        "placed_at": ("left", "placed_at"),
        "paid_at": ("left", "paid_at"),
        "shipped_at": ("left", "shipped_at"),
    },
    filterable=("customer_id", "status"),
)
