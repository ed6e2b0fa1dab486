"""Royalties earned per author from paid orders, at the rate in force when the order was placed."""

from __future__ import annotations

from decimal import ROUND_HALF_UP, Decimal
from typing import TYPE_CHECKING

from sqlalchemy import BigInteger, Column, Table, Text

from projections import metadata
from projections.base import Output, Projection

if TYPE_CHECKING:
    from pyspark.sql import Column as Column_

    from projections.base.rows import Rows

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


def royalty_column(quantity: Column_, unit_price_cents: Column_, rate: Column_) -> Column_:
    """The rule, as a Spark column of a paid line (the same as `royalty_cents`)."""
    from pyspark.sql import functions as F

    exact = (quantity * unit_price_cents).cast("decimal(20,0)") * rate.cast("decimal(12,10)")
    return F.round(exact, 0).cast("long")


def rows() -> Rows:
    """A payment adds, per line, the line's royalty and units to its author."""
    from projections.base.rows import each_paid_line

    return each_paid_line(
        table,
        lambda line: {
            "author": line["author"],
            "royalty_cents": royalty_column(
                line["quantity"], line["unit_price_cents"], line["royalty_rate"]
            ),
            "units_sold": line["quantity"],
        },
    )


output = Output(
    table, rows=rows, merge={"royalty_cents": "sum", "units_sold": "sum"}, version_column=None
)
projection = Projection("author_royalties", topics=("order",), outputs=(output,))
