"""Spark building blocks for folding CDC changelogs (format: docs/cdc.md) into joined views.

The live join applies them to micro-batches (then merges with `join_state` in Postgres); the
rebuild applies them to whole changelogs. Values stay JSON text here: Postgres casts them to the
view's column types, in the live job and in the rebuild alike."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

if TYPE_CHECKING:
    from projections.base import Join, Role


def _header(name: str) -> Column:
    return F.get(F.filter("headers", lambda h: h["key"] == F.lit(name)), 0)["value"]


CHANGELOG_COLUMNS = ("topic", "partition", "offset", "table", "key", "row", "lsn", "seq")


def records(raw: DataFrame, tables: dict[str, str]) -> DataFrame:
    """Changelog records as read by Spark's Kafka source (with `includeHeaders`) → topic,
    partition, offset, table (`tables`: topic -> table), key (the primary key as JSON text),
    row (JSON text; NULL for a delete), lsn and seq (the change's position)."""
    table_of = F.create_map(*(F.lit(x) for kv in tables.items() for x in kv))
    position = F.split(_header("position").cast("string"), r"\.")
    return raw.select(
        "topic",
        "partition",
        "offset",
        table_of[F.col("topic")].alias("table"),
        F.col("key").cast("string").alias("key"),
        F.get_json_object(F.col("value").cast("string"), "$.row").alias("row"),
        F.get(position, 0).cast("long").alias("lsn"),
        F.get(position, 1).cast("long").alias("seq"),
    )


def latest(changes: DataFrame) -> DataFrame:
    """The newest change of each key of each table, by position (not by offset: CDC resends
    older changes after a restart): table, key, row (NULL: deleted), lsn, seq."""
    newest = F.max(F.struct("lsn", "seq", "offset", "row")).alias("last")
    return (
        changes.groupBy("table", "key")
        .agg(newest)
        .select("table", "key", "last.row", "last.lsn", "last.seq")
    )


def side_rows(join: Join, role: Role, last: DataFrame) -> DataFrame:
    """The live rows of one side of `join`: key, row, join_value (JSON text of the join column,
    NULL when absent, so it matches nothing)."""
    side = join.side(role)
    return last.where((F.col("table") == side.table) & F.col("row").isNotNull()).select(
        "key", "row", F.get_json_object("row", f"$.{side.on}").alias("join_value")
    )


def joined_rows(join: Join, changes: DataFrame) -> DataFrame:
    """The view's rows given every change of its tables (columns as `records` returns), each
    column as text (JSON scalars; NULL for null)."""
    last = latest(changes)
    left, right = (
        side_rows(join, "left", last).alias("l"),
        side_rows(join, "right", last).alias("r"),
    )
    pairs = left.join(right, F.col("l.join_value") == F.col("r.join_value"))
    return pairs.select(
        *(
            F.get_json_object(
                F.col(f"{join.sources[c][0][0]}.row"), f"$.{join.sources[c][1]}"
            ).alias(c)
            for c in join.columns
        )
    )
