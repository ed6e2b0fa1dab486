"""Spark building blocks of the projections' rows.

Only Spark jobs import this module: a projection's `rows()` imports what it needs inside its
body (`from projections._fold import F, field, one, …`), so its declaration loads without
Spark."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import (
    ArrayType,
    DataType,
    DoubleType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)
from sqlalchemy import Column as SqlColumn
from sqlalchemy import Table
from sqlalchemy.sql import sqltypes

if TYPE_CHECKING:
    from projections.base import Output

__all__ = [
    "PAID_LINE",
    "F",
    "each_paid_line",
    "field",
    "fold",
    "hopping_windows",
    "one",
    "row",
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
    """A top-level field of the event's (upcast) data, as decoded with the event
    (`spark.decode.DATA`): a list as typed elements (an order's `lines`: `PAID_LINE`), any other
    value as its JSON text (cast by `row` to the column's type)."""
    return F.col("data").getField(name)


def when_type(types: str | tuple[str, ...], value: Column) -> Column:
    names = (types,) if isinstance(types, str) else types
    return F.when(F.col("type").isin(*names), value)


def hopping_windows(at: Column, size: timedelta, advance: timedelta) -> Column:
    """The starts of the windows `size` long, one every `advance` (from the epoch), that
    contain the time `at`: an array of `size / advance` timestamps, newest first."""
    step, count = int(advance.total_seconds()), int(size / advance)
    newest = F.floor(F.unix_seconds(at) / step) * step
    return F.transform(
        F.sequence(F.lit(0), F.lit(count - 1)),
        lambda k: F.timestamp_seconds(newest - k * step),
    )


def royalty_cents(quantity: Column, unit_price_cents: Column, rate: Column) -> Column:
    """Per line, rounded half up to a cent (see projections.author_royalties.royalty_cents)."""
    exact = (quantity * unit_price_cents).cast("decimal(20,0)") * rate.cast("decimal(12,10)")
    return F.round(exact, 0).cast("long")


# -- an event's rows: an array of structs of the table's columns (see Output.rows) ----------


def spark_type(column: SqlColumn[Any]) -> DataType:
    kind = column.type
    if isinstance(kind, sqltypes.BigInteger):
        return LongType()
    if isinstance(kind, sqltypes.Integer):
        return IntegerType()
    if isinstance(kind, sqltypes.Float):
        return DoubleType()
    if isinstance(kind, sqltypes.DateTime):
        return TimestampType()
    if isinstance(kind, sqltypes.String):
        return StringType()
    raise TypeError(f"no Spark type for {column.table.name}.{column.name} ({kind})")


def row(table: Table, **columns: Column) -> Column:
    """A row of `table`: the given columns, cast to the table's types; the others null."""
    unknown = set(columns) - set(table.columns.keys())
    if unknown:
        raise ValueError(f"{table.name} has no column {', '.join(sorted(unknown))}")
    return F.struct(
        *(
            (columns[c.name] if c.name in columns else F.lit(None))
            .cast(spark_type(c))
            .alias(c.name)
            for c in table.columns
        )
    )


def one(table: Table, condition: Column, **columns: Column) -> Column:
    """One row of `table` when `condition` holds, else none."""
    return F.when(condition, F.array(row(table, **columns))).otherwise(
        F.array().cast(ArrayType(row_type(table)))
    )


def each_paid_line(table: Table, make: Callable[[Column], dict[str, Column]]) -> Column:
    """For an OrderPaid, one row of `table` per paid line (`make(line)` gives its columns,
    from the line's fields: `PAID_LINE`); none for any other event."""
    paid = F.when(F.col("type") == "OrderPaid", field("lines"))
    lines = F.coalesce(paid, F.array().cast(ArrayType(PAID_LINE)))
    return F.transform(lines, lambda line: row(table, **make(line)))


def row_type(table: Table) -> StructType:
    return StructType([StructField(str(c.name), spark_type(c)) for c in table.columns])


# -- combining rows (the rebuild and the tests; the live pipeline combines in Postgres) -------


def fold(output: Output, events: DataFrame) -> DataFrame:
    """One row per key: every event's rows combined by the output's merge rules."""
    rows = events.select(F.explode(output.rows()).alias("row")).select("row.*")
    vc = output.version_column
    aggs = []
    for column in output.table.columns:
        c = str(column.name)
        rule = output.rule(c)
        if rule == "key":
            continue
        if rule == "version":
            aggs.append(F.max(c).alias(c))
        elif rule == "sum":
            aggs.append(F.coalesce(F.sum(c), F.lit(0)).cast(spark_type(column)).alias(c))
        elif rule == "latest":
            aggs.append(F.max_by(c, F.when(F.col(c).isNotNull(), F.col(str(vc)))).alias(c))
        else:
            aggs.append(F.first(c).alias(c))
    combined = rows.groupBy(*output.key).agg(*aggs) if aggs else rows.select(*output.key).distinct()
    return combined.select(*output.columns)
