from __future__ import annotations

from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from sqlalchemy import BigInteger, Column, DateTime, Table, Text

from projections import metadata
from projections.base import Output, Projection
from projections.fold import field, latest, when_type

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
            transform,
            merge=dict.fromkeys(("name", "email", "registered_at"), "latest"),
            filterable=("name", "email"),
        ),
    ),
)
