from __future__ import annotations

from typing import TYPE_CHECKING

from sqlalchemy import BigInteger, Column, DateTime, Table, Text

from events.base import ERASED
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
    """A customer event sets the fields it carries; an erasure marks its personal ones erased.
    They come sealed (events/keys.py) and are only copied: they are opened in Postgres."""
    from projections.base.rows import F, field, one, when_type

    erased = F.col("type") == "CustomerErased"
    return one(
        table,
        F.col("aggregate_type") == "customer",
        customer_id=F.col("aggregate_id"),
        name=F.when(erased, F.lit(ERASED)).otherwise(
            when_type(("CustomerRegistered", "CustomerRenamed"), field("name"))
        ),
        email=F.when(erased, F.lit(ERASED)).otherwise(
            when_type(("CustomerRegistered", "CustomerEmailChanged"), field("email"))
        ),
        registered_at=when_type("CustomerRegistered", F.col("occurred_at")),
        version=F.col("version"),
    )


output = Output(
    table,
    rows=rows,
    merge=dict.fromkeys(("name", "email", "registered_at"), "latest"),
    filterable=("name", "email"),
    personal={"name": ("customer", "customer_id"), "email": ("customer", "customer_id")},
)
projection = Projection("customers", topics=("customer",), outputs=(output,))
