"""Spark building blocks shared by the projections' transforms.

Only Spark jobs import this module: a transform imports what it needs inside its body
(`from projections._fold import F, field, …`), so its projection's declaration loads without
Spark."""

from __future__ import annotations

from collections.abc import Callable

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import ArrayType, DoubleType, LongType, StringType, StructField, StructType

__all__ = [
    "PAID_LINE",
    "F",
    "each_paid_line",
    "field",
    "latest",
    "one",
    "paid_lines",
    "royalty_cents",
    "when_type",
]

PAID_LINE = StructType(
    [
        StructField("book_id", StringType()),
        StructField("quantity", LongType()),
        StructField("unit_price_cents", LongType()),
        StructField("author", StringType()),
        StructField("royalty_rate", DoubleType()),
    ]
)


def field(name: str) -> Column:
    """A top-level field of the event's (upcast) data."""
    return F.get_json_object(F.col("data"), f"$.{name}")


def when_type(types: str | tuple[str, ...], value: Column) -> Column:
    names = (types,) if isinstance(types, str) else types
    return F.when(F.col("type").isin(*names), value)


def latest(rows: DataFrame, key: list[str], version: str = "version") -> DataFrame:
    """One row per key: each column from the newest row (by `version`) where it is not null."""
    values = [c for c in rows.columns if c not in key and c != version]
    return rows.groupBy(*key).agg(
        *(F.max_by(c, F.when(F.col(c).isNotNull(), F.col(version))).alias(c) for c in values),
        F.max(version).alias(version),
    )


def paid_lines(events: DataFrame) -> DataFrame:
    """One row per line of every OrderPaid: order_id, occurred_at and the line's fields."""
    paid = events.where(F.col("type") == "OrderPaid").select(
        F.col("aggregate_id").alias("order_id"),
        F.col("occurred_at"),
        F.col("timestamp"),
        F.explode(F.from_json(field("lines"), ArrayType(PAID_LINE))).alias("line"),
    )
    return paid.select("order_id", "occurred_at", "timestamp", "line.*")


def royalty_cents(quantity: Column, unit_price_cents: Column, rate: Column) -> Column:
    """Per line, rounded half up to a cent (see projections.author_royalties.royalty_cents)."""
    exact = (quantity * unit_price_cents).cast("decimal(20,0)") * rate.cast("decimal(12,10)")
    return F.round(exact, 0).cast("long")


# -- contributions: the rows one event adds to an output (the next design; see WIP-issue-8.md)


def one(condition: Column, **columns: Column) -> Column:
    """An event's contribution: one row of these columns when `condition` holds, else none
    (an array of at most one struct, so outputs can be exploded in one pass)."""
    row = F.struct(*(c.alias(n) for n, c in columns.items()))
    return F.filter(F.array(row), lambda _: condition)


def each_paid_line(make: Callable[[Column], dict[str, Column]]) -> Column:
    """An event's contribution: for an OrderPaid, one row per paid line (`make(line)` gives
    its columns); none for any other event."""
    lines = F.when(
        F.col("type") == "OrderPaid", F.from_json(field("lines"), ArrayType(PAID_LINE))
    ).otherwise(F.array().cast(ArrayType(PAID_LINE)))
    return F.transform(lines, lambda line: F.struct(*(c.alias(n) for n, c in make(line).items())))
