"""Kafka records → events, decoded and upcast by the same Python code the write side uses."""

from __future__ import annotations

import json
from collections.abc import Iterable

import pandas as pd
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.functions import pandas_udf  # type: ignore[attr-defined]
from pyspark.sql.types import LongType, StringType, StructField, StructType

from events.serialization import decode

ENVELOPE = StructType(
    [
        StructField("event_id", StringType()),
        StructField("type", StringType()),
        StructField("aggregate_type", StringType()),
        StructField("aggregate_id", StringType()),
        StructField("version", LongType()),
        StructField("occurred_at", StringType()),
        StructField("data", StringType()),
    ]
)

COLUMNS = (
    "topic",
    "partition",
    "offset",
    "timestamp",
    "event_id",
    "type",
    "aggregate_type",
    "aggregate_id",
    "version",
    "occurred_at",
    "data",
)


@pandas_udf(ENVELOPE)  # type: ignore[untyped-decorator]
def _upcast(values: pd.Series) -> pd.DataFrame:
    envelopes = [decode(bytes(v)) for v in values]
    return pd.DataFrame(
        {
            "event_id": [e.event_id for e in envelopes],
            "type": [e.type for e in envelopes],
            "aggregate_type": [e.aggregate_type for e in envelopes],
            "aggregate_id": [e.aggregate_id for e in envelopes],
            "version": [e.version for e in envelopes],
            "occurred_at": [e.occurred_at for e in envelopes],
            "data": [json.dumps(e.data) for e in envelopes],
        }
    )


def decode_events(raw: DataFrame) -> DataFrame:
    """Columns: topic, partition, offset, timestamp (of the record), the envelope's fields with
    `occurred_at` as a timestamp and `data` as JSON text at the current schema version."""
    e = raw.where(F.col("value").isNotNull()).select(
        "topic", "partition", "offset", "timestamp", _upcast(F.col("value")).alias("e")
    )
    return e.select(
        "topic",
        "partition",
        "offset",
        "timestamp",
        "e.event_id",
        "e.type",
        "e.aggregate_type",
        "e.aggregate_id",
        "e.version",
        F.col("e.occurred_at").cast("timestamp").alias("occurred_at"),
        "e.data",
    )


def kafka_options(bootstrap: str) -> dict[str, str]:
    return {
        "kafka.bootstrap.servers": bootstrap,
        "kafka.isolation.level": "read_committed",
        "failOnDataLoss": "false",
    }


def offsets_json(
    topics: Iterable[str], partitions: int, offsets: dict[str, int], delta: int
) -> str:
    """Spark's per-partition offsets JSON: `offsets[topic:partition] + delta`, or earliest (-2)."""
    doc = {
        t: {
            str(p): (offsets[f"{t}:{p}"] + delta if f"{t}:{p}" in offsets else -2)
            for p in range(partitions)
        }
        for t in topics
    }
    return json.dumps(doc)


def read_batch(
    spark: SparkSession, bootstrap: str, topics: list[str], starting: str, ending: str
) -> DataFrame:
    reader = spark.read.format("kafka").options(**kafka_options(bootstrap))
    return (
        reader.option("subscribe", ",".join(topics))
        .option("startingOffsets", starting)
        .option("endingOffsets", ending)
        .load()
    )
