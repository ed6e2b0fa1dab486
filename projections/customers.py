from __future__ import annotations

from typing import TYPE_CHECKING

from sqlalchemy import BigInteger, Column, DateTime, Table, Text

from projections import metadata
from projections.base import Output, Projection

if TYPE_CHECKING:
    from projections.base.rows import Rows

table = Table(
    "customers",
    metadata,
    Column("customer_id", Text, primary_key=True),
    Column("name", Text),
    Column("email", Text),
    Column("registered_at", DateTime(timezone=True)),
    Column("version", BigInteger),
)


def rows() -> Rows:
    """A customer event sets the fields it carries."""
    from projections.base.rows import F, field, one, when_type

    return one(
        table,
        F.col("aggregate_type") == "customer",
        customer_id=F.col("aggregate_id"),
        name=when_type(("CustomerRegistered", "CustomerRenamed"), field("name")),
        email=when_type(("CustomerRegistered", "CustomerEmailChanged"), field("email")),
        registered_at=when_type("CustomerRegistered", F.col("occurred_at")),
        version=F.col("version"),
    )


output = Output(
    table,
    rows=rows,
    merge=dict.fromkeys(("name", "email", "registered_at"), "latest"),
    filterable=("name", "email"),
)
projection = Projection("customers", topics=("customer",), outputs=(output,))
