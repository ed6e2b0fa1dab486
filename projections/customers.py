from __future__ import annotations

from typing import TYPE_CHECKING

from sqlalchemy import BigInteger, Column, DateTime, Table, Text

from projections import metadata
from projections.base import Output, Projection

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

table = Table(
    "customers",
    metadata,
    Column("customer_id", Text, primary_key=True),
    Column("name", Text),
    Column("email", Text),
    Column("registered_at", DateTime(timezone=True)),
    Column("version", BigInteger),
)


def transform(events: DataFrame) -> DataFrame:
    from projections._fold import F, field, latest, when_type

    e = events.where(F.col("aggregate_type") == "customer")
    rows = e.select(
        F.col("aggregate_id").alias("customer_id"),
        when_type(("CustomerRegistered", "CustomerRenamed"), field("name")).alias("name"),
        when_type(("CustomerRegistered", "CustomerEmailChanged"), field("email")).alias("email"),
        when_type("CustomerRegistered", F.col("occurred_at")).alias("registered_at"),
        F.col("version"),
    )
    return latest(rows, ["customer_id"])


projection = Projection(
    "customers",
    topics=("customer",),
    outputs=(
        Output(
            table,
            transform=transform,
            merge=dict.fromkeys(("name", "email", "registered_at"), "latest"),
            filterable=("name", "email"),
        ),
    ),
)
