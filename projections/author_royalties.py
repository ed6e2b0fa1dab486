"""Royalties earned per author from paid orders, at the rate in force when the order was placed."""

from __future__ import annotations

from decimal import ROUND_HALF_UP, Decimal
from typing import TYPE_CHECKING

from sqlalchemy import BigInteger, Column, Table, Text

from projections import metadata
from projections.base import Output, Projection

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

table = Table(
    "author_royalties",
    metadata,
    Column("author", Text, primary_key=True),
    Column("royalty_cents", BigInteger, nullable=False),
    Column("units_sold", BigInteger, nullable=False),
)


def royalty_cents(quantity: int, unit_price_cents: int, rate: float) -> int:
    """The rule, in plain Python: per line, quantity * price * rate, rounded half up."""
    exact = Decimal(quantity * unit_price_cents) * Decimal(str(rate))
    return int(exact.quantize(Decimal(1), rounding=ROUND_HALF_UP))


def transform(events: DataFrame) -> DataFrame:
    from projections._fold import F, paid_lines
    from projections._fold import royalty_cents as royalty_column

    lines = paid_lines(events)
    return lines.groupBy("author").agg(
        F.sum(royalty_column(F.col("quantity"), F.col("unit_price_cents"), F.col("royalty_rate")))
        .cast("long")
        .alias("royalty_cents"),
        F.sum("quantity").cast("long").alias("units_sold"),
    )


projection = Projection(
    "author_royalties",
    topics=("order",),
    outputs=(
        Output(
            table,
            transform=transform,
            merge={"royalty_cents": "sum", "units_sold": "sum"},
            version_column=None,
        ),
    ),
)
