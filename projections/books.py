from __future__ import annotations

from typing import TYPE_CHECKING

from sqlalchemy import BigInteger, Column, Float, Table, Text

from projections import metadata
from projections.base import Output, Projection

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

table = Table(
    "books",
    metadata,
    Column("book_id", Text, primary_key=True),
    Column("title", Text),
    Column("author", Text, index=True),
    Column("price_cents", BigInteger),
    Column("royalty_rate", Float),
    Column("units_sold", BigInteger, nullable=False, server_default="0"),
    Column("version", BigInteger),
)


def transform(events: DataFrame) -> DataFrame:
    from projections._fold import F, field, latest, paid_lines, when_type

    e = events.where(F.col("aggregate_type") == "book")
    details = latest(
        e.select(
            F.col("aggregate_id").alias("book_id"),
            when_type("BookAdded", field("title")).alias("title"),
            when_type("BookAdded", field("author")).alias("author"),
            when_type(("BookAdded", "BookRepriced"), field("price_cents").cast("long")).alias(
                "price_cents"
            ),
            when_type("BookAdded", field("royalty_rate").cast("double")).alias("royalty_rate"),
            F.col("version"),
        ),
        ["book_id"],
    )
    sold = paid_lines(events).groupBy("book_id").agg(F.sum("quantity").alias("units_sold"))
    return (
        details.join(sold, "book_id", "full_outer")
        .withColumn("units_sold", F.coalesce(F.col("units_sold"), F.lit(0)).cast("long"))
        .select(*table.columns.keys())
    )


projection = Projection(
    "books",
    topics=("book", "order"),
    outputs=(
        Output(
            table,
            transform=transform,
            merge={
                **dict.fromkeys(("title", "author", "price_cents", "royalty_rate"), "latest"),
                "units_sold": "sum",
            },
            filterable=("author", "title"),
        ),
    ),
)
