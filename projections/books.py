from __future__ import annotations

from typing import TYPE_CHECKING

from sqlalchemy import BigInteger, Column, Float, Table, Text

from projections import metadata
from projections.base import Output, Projection

if TYPE_CHECKING:
    from projections.base.rows import Rows

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


def rows() -> Rows:
    """A book event sets the fields it carries; a payment adds the units of each line."""
    from projections.base.rows import F, each_paid_line, field, one, when_type

    details = one(
        table,
        F.col("aggregate_type") == "book",
        book_id=F.col("aggregate_id"),
        title=when_type("BookAdded", field("title")),
        author=when_type("BookAdded", field("author")),
        price_cents=when_type(("BookAdded", "BookRepriced"), field("price_cents")),
        royalty_rate=when_type("BookAdded", field("royalty_rate")),
        units_sold=F.lit(0),
        version=F.col("version"),
    )
    sold = each_paid_line(
        table, lambda line: {"book_id": line["book_id"], "units_sold": line["quantity"]}
    )
    return details + sold


output = Output(
    table,
    rows=rows,
    merge={
        **dict.fromkeys(("title", "author", "price_cents", "royalty_rate"), "latest"),
        "units_sold": "sum",
    },
    filterable=("author", "title"),
)
projection = Projection("books", topics=("book", "order"), outputs=(output,))
