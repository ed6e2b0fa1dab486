"""Spark building blocks of the projections' rows.

Only Spark jobs import this module: a projection's `rows()` imports what it needs inside its
body (`from projections.base.rows import F, field, one, …`), so its declaration loads without
Spark."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from functools import reduce
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
    from projections.base.declarations import Output

__all__ = [
    "PAID_LINE",
    "F",
    "Rows",
    "each",
    "each_paid_line",
    "field",
    "fold",
    "hopping_windows",
    "one",
    "row",
    "row_per_item",
    "rows_column",
    "rows_frame",
    "single_row",
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
    contain the time `at`: an array of `size / advance` times in epoch seconds, newest first
    (`F.timestamp_seconds` makes one a timestamp)."""
    step, count = int(advance.total_seconds()), int(size / advance)
    newest = (F.floor(F.unix_seconds(at) / step) * step).cast("long")
    return F.sequence(newest, newest - (count - 1) * step, F.lit(-step).cast("long"))


# -- an event's rows: structs of the table's columns, in `Rows` parts (see Output.rows) -----


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


def one(table: Table, condition: Column, **columns: Column) -> Rows:
    """One row of `table` when `condition` holds, else none."""
    return single_row(condition, row(table, **columns), row_type(table))


def each(table: Table, items: Column, make: Callable[[Column], dict[str, Column]]) -> Rows:
    """One row of `table` per element of the array `items` (null: none): `make(item)` gives its
    columns."""
    return row_per_item(items, lambda item: row(table, **make(item)), row_type(table))


def single_row(condition: Column, value: Column, type: StructType) -> Rows:
    """The row `value` (a struct of type `type`) when `condition` holds, else none."""
    return Rows((_One(condition, value, type),))


def row_per_item(items: Column, make: Callable[[Column], Column], type: StructType) -> Rows:
    """One row (`make(item)`, a struct of type `type`) per element of the array `items` (null:
    none)."""
    return Rows((_Each(items, make, type),))


def each_paid_line(
    table: Table, make: Callable[[Column], dict[str, Column]], when: Column | None = None
) -> Rows:
    """For an OrderPaid (for which `when` holds, if given), one row of `table` per paid line
    (`make(line)` gives its columns, from the line's fields: `PAID_LINE`); none for any other
    event."""
    paid = F.col("type") == "OrderPaid"
    return each(table, F.when(paid if when is None else paid & when, field("lines")), make)


@dataclass(frozen=True)
class _One:
    """One row when `condition` holds."""

    condition: Column
    row: Column
    type: DataType

    def column(self) -> Column:
        empty = F.array().cast(ArrayType(self.type))
        return F.when(self.condition, F.array(self.row)).otherwise(empty)

    def frame(self, events: DataFrame) -> DataFrame:
        return events.where(self.condition).select(self.row.alias(ROW))


@dataclass(frozen=True)
class _Each:
    """One row per element of `items`."""

    items: Column
    make: Callable[[Column], Column]
    type: DataType

    def column(self) -> Column:
        empty = F.array().cast(ArrayType(self.type))
        return F.coalesce(F.transform(self.items, self.make), empty)

    def frame(self, events: DataFrame) -> DataFrame:
        exploded = events.select("*", F.explode(self.items).alias(ITEM))
        return exploded.select(self.make(F.col(ITEM)).alias(ROW))


@dataclass(frozen=True)
class _Array:
    """The rows of an array column (of structs) given whole."""

    array: Column

    def column(self) -> Column:
        return self.array

    def frame(self, events: DataFrame) -> DataFrame:
        return events.select(F.explode(self.array).alias(ROW))


ROW, ITEM = "row", "_item"


@dataclass(frozen=True)
class Rows:
    """The rows one event adds to a view, in parts (`one`, `each`, `each_paid_line`, joined
    with `+`), each row a struct of the same columns.

    An event's rows as one array column (`rows_column`, for a live batch's JSON) evaluate
    `each`'s `make` per element in a higher-order function (`F.transform`); the rows of a
    whole log (`rows_frame`, for a rebuild's folds and COPYs) explode the elements first and
    evaluate `make` on the exploded rows. Spark generates no code for higher-order functions,
    and one in a plan makes its whole stage run interpreted: the paid lines' rows took 4x as
    long to build that way, their views' loads up to twice (`docs/benchmarks-journal.md`,
    rebuild)."""

    parts: tuple[_One | _Each | _Array, ...]

    def __add__(self, other: Rows) -> Rows:
        return Rows(self.parts + other.parts)


def _as_rows(rows: Rows | Column) -> Rows:
    return rows if isinstance(rows, Rows) else Rows((_Array(rows),))


def rows_column(output: Output) -> Column:
    """The rows one event adds to `output`: an array of structs of its columns."""
    columns = [part.column() for part in _as_rows(output.rows()).parts]
    return columns[0] if len(columns) == 1 else F.concat(*columns)


def rows_frame(output: Output, events: DataFrame) -> DataFrame:
    """The rows every one of `events` adds to `output`, one per Spark row (its columns)."""
    frames = [part.frame(events) for part in _as_rows(output.rows()).parts]
    return reduce(DataFrame.union, frames).select(f"{ROW}.*")


def row_type(table: Table) -> StructType:
    return StructType([StructField(str(c.name), spark_type(c)) for c in table.columns])


# -- combining rows (the rebuild and the tests; the live pipeline combines in Postgres) -------


def fold(output: Output, events: DataFrame) -> DataFrame:
    """One row per key: every event's rows combined by the output's merge rules."""
    rows = rows_frame(output, events)
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
