"""The changelog fold the joins share (a local Spark session; no Kafka, no Postgres): records as
Spark's Kafka source gives them → newest change per key → joined rows."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
)

from projections.registry import JOINS
from spark.changelog import joined_rows, latest, records

pytestmark = pytest.mark.spark

RAW = StructType(
    [
        StructField("key", BinaryType()),
        StructField("value", BinaryType()),
        StructField("topic", StringType()),
        StructField("partition", IntegerType()),
        StructField("offset", LongType()),
        StructField(
            "headers",
            ArrayType(
                StructType([StructField("key", StringType()), StructField("value", BinaryType())])
            ),
        ),
    ]
)
TABLES = {"p.cdc.orders": "orders", "p.cdc.customers": "customers"}
KEYS = {"orders": "order_id", "customers": "customer_id"}
SUMMARIES = JOINS["order_summaries"]


def raw(spark: SparkSession, *changes: tuple[str, str, dict[str, Any] | None, str]) -> DataFrame:
    """Records of (table, key value, row or None for a delete, position), offsets in order."""
    rows = []
    for offset, (table, key, row, position) in enumerate(changes):
        headers = [("op", b"delete" if row is None else b"update"), ("position", position.encode())]
        value = None if row is None else json.dumps({"row": row, "before": None}).encode()
        topic = next(t for t, name in TABLES.items() if name == table)
        key_json = json.dumps({KEYS[table]: key}, separators=(",", ":")).encode()
        rows.append((key_json, value, topic, 0, offset, headers))
    return spark.createDataFrame(rows, RAW)


def customer(cid: str, name: str) -> dict[str, Any]:
    return {"customer_id": cid, "name": name, "email": f"{cid}@x.org", "registered_at": None}


def order(oid: str, cid: str | None, total: int = 100) -> dict[str, Any]:
    return {
        "order_id": oid,
        "customer_id": cid,
        "status": "placed",
        "total_cents": total,
        "line_count": 1,
        "placed_at": "2026-11-21T10:15:00.5Z",
        "paid_at": None,
        "shipped_at": None,
        "version": 1,
    }


def test_records_carry_table_key_row_and_position(spark: SparkSession) -> None:
    got = records(raw(spark, ("orders", "o1", order("o1", "c1"), "123456789.12")), TABLES)
    (r,) = got.collect()
    assert (r["table"], r["key"], r["lsn"], r["seq"], r["offset"]) == (
        "orders",
        '{"order_id":"o1"}',
        123456789,
        12,
        0,
    )
    assert json.loads(r["row"]) == order("o1", "c1")


def test_the_newest_change_by_position_wins_not_the_last_record(spark: SparkSession) -> None:
    changes = raw(
        spark,
        ("customers", "c1", customer("c1", "new"), "20.1"),
        ("customers", "c1", customer("c1", "old"), "10.1"),  # resent after a CDC restart
        ("customers", "c2", customer("c2", "two"), "10.2"),
        ("customers", "c2", None, "10.3"),
        ("customers", "c3", customer("c3", "x"), "10.4"),
        ("customers", "c3", customer("c3", "y"), "10.5"),
    )
    got = {
        r["key"]: (r["row"] and json.loads(r["row"])["name"], r["lsn"], r["seq"])
        for r in latest(records(changes, TABLES)).collect()
    }
    assert got == {
        '{"customer_id":"c1"}': ("new", 20, 1),
        '{"customer_id":"c2"}': (None, 10, 3),
        '{"customer_id":"c3"}': ("y", 10, 5),
    }


def test_joined_rows_are_the_inner_join_of_the_newest_rows(spark: SparkSession) -> None:
    changes = raw(
        spark,
        ("customers", "c1", customer("c1", "Ada"), "1.1"),
        ("customers", "c2", customer("c2", "Bob"), "1.2"),
        ("customers", "c2", None, "5.1"),  # deleted: its orders leave the view
        ("orders", "o1", order("o1", "c1"), "2.1"),
        ("orders", "o2", order("o2", "c1", total=5), "2.2"),
        ("orders", "o3", order("o3", "c2"), "2.3"),
        ("orders", "o4", order("o4", None), "2.4"),  # null matches nothing
        ("orders", "o5", order("o5", "nobody"), "2.5"),
        ("customers", "c1", customer("c1", "Ada L."), "6.1"),
        ("orders", "o2", None, "7.1"),
        ("orders", "o6", order("o6", "c1", total=7), "8.1"),
    )
    rows = joined_rows(SUMMARIES, records(changes, TABLES))
    assert rows.columns == list(SUMMARIES.columns)
    got = sorted(tuple(r) for r in rows.collect())
    at = "2026-11-21T10:15:00.5Z"
    assert got == [
        ("o1", "c1", "Ada L.", "c1@x.org", "placed", "100", "1", at, None, None),
        ("o6", "c1", "Ada L.", "c1@x.org", "placed", "7", "1", at, None, None),
    ]
