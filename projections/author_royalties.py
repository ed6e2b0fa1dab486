"""Royalties earned per author from paid orders, at the rate in force when the order was placed."""

from __future__ import annotations

from decimal import ROUND_HALF_UP, Decimal
from typing import TYPE_CHECKING

from sqlalchemy import BigInteger, Column, Table, Text

from projections import metadata
from projections.base import Output, Projection

if TYPE_CHECKING:
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


def rows() -> Rows:
    """A payment adds, per line, the line's royalty and units to its author."""
    from projections.base.rows import each_paid_line
    from projections.base.rows import royalty_cents as royalty_column

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
