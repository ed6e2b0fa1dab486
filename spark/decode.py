"""Kafka records → events.

Events at their type's current schema version (nearly all of them) are decoded by Spark's own
JSON reader, in one pass over each record: the envelope and the fields of its `data` (`DATA`),
which the projections read as columns. Only older ones go through the write side's Python
upcasters (a pandas UDF), so a batch of current events never leaves the JVM."""

from __future__ import annotations

import dataclasses
import json
import types
from collections.abc import Mapping
from typing import Annotated, Any, Union, get_args, get_origin, get_type_hints

import pandas as pd
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.functions import pandas_udf  # type: ignore[attr-defined]
from pyspark.sql.types import (
    ArrayType,
    DataType,
    DoubleType,
    LongType,
    StringType,
    StructField,
    StructType,
)

from events.catalog import EVENT_TYPES
from events.serialization import decode
from streams.registry import STREAMS


def _element_type(hint: Any) -> DataType:
    """The Spark type of a value inside a list of `data`: a record (dataclass) as a struct of
    its fields, integers as long, floats as double, anything else as its JSON text."""
    origin = get_origin(hint)
    if origin is Annotated:
        return _element_type(get_args(hint)[0])
    if origin in (Union, types.UnionType):  # an optional value: its type
        kinds = [a for a in get_args(hint) if a is not type(None)]
        return _element_type(kinds[0]) if len(kinds) == 1 else StringType()
    if origin in (tuple, list):
        return ArrayType(_element_type(get_args(hint)[0]))
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        hints = get_type_hints(hint, include_extras=True)
        fields = dataclasses.fields(hint)
        return StructType([StructField(f.name, _element_type(hints[f.name])) for f in fields])
    if hint is int:
        return LongType()
    if hint is float:
        return DoubleType()
    return StringType()


def _field_type(hint: Any) -> DataType:
    """A top-level field of `data`: a list as its typed elements (`_element_type`), any other
    value as its JSON text (a string's own text), as `get_json_object` would give it."""
    kind = _element_type(hint)
    return kind if isinstance(kind, ArrayType) else StringType()


def data_schema() -> StructType:
    """The struct an event's `data` (or a stream record's) is decoded into: every field of every
    event type at its current schema version and of every stream's records, typed as
    `_field_type` says. A field two types declare differently is kept as JSON text."""
    found: dict[str, DataType] = {}
    for cls in [*EVENT_TYPES.values(), *(s.record_type for s in STREAMS.values())]:
        hints = get_type_hints(cls, include_extras=True)
        for f in dataclasses.fields(cls):
            kind = _field_type(hints[f.name])
            found[f.name] = kind if found.get(f.name, kind) == kind else StringType()
    return StructType([StructField(name, kind) for name, kind in sorted(found.items())])


# The fields of `data`, decoded with the envelope in one pass of Spark's JSON reader. A
# projection reads them by name (`projections.base.rows.field`) instead of parsing the JSON text
# again for each field and each view: a rebuild of 1M events took 0.69x the time
# (`docs/benchmarks-journal.md`, rebuild).
DATA = data_schema()

# The stored envelope as Spark reads it, `data` decoded into its fields (`DATA`).
STORED = StructType(
    [
        StructField("event_id", StringType()),
        StructField("type", StringType()),
        StructField("schema_version", LongType()),
        StructField("aggregate_type", StringType()),
        StructField("aggregate_id", StringType()),
        StructField("version", LongType()),
        StructField("occurred_at", StringType()),
        StructField("data", DATA),
    ]
)

# What Spark's JSON reader reads of a record: an event's envelope (`STORED`) or a stream's
# record (`streams.ingest.FactRecord`: its `id`, `occurred_at` and `data`), in one schema.
RECORD = StructType([*STORED.fields, StructField("id", StringType())])

# What the Python upcasters give for a record (`data` as JSON text, `data_fields` decodes it).
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


def parse_events(raw: DataFrame, streams: Mapping[str, str] | None = None) -> DataFrame:
    """Kafka records → topic, partition, offset, timestamp, value and the envelope `e` as
    Spark's JSON reader sees it, with `current` telling whether it is at its type's current
    schema version (a record it cannot read, or of an unknown type, is not).

    Records of the topics `streams` (topic → stream name) are facts (`streams/ingest.py`): their
    envelope has the record's `id` as `event_id`, the stream's name as `type` and
    `aggregate_type`, no aggregate id or version, and they are always current. Their Kafka
    timestamp is when the API received them."""
    current = F.create_map(
        *(F.lit(x) for t, c in EVENT_TYPES.items() for x in (t, c.SCHEMA_VERSION))
    )
    # Each record is parsed once, in a projection of its own that the next one reads: had the
    # columns below read the fields of a `from_json` directly, Spark's optimizer would have
    # given each its own `from_json` of only that field, every one parsing the whole record
    # again (three parses a record; the decode took 1.5x as long, `docs/benchmarks-journal.md`).
    parsed = raw.where(F.col("value").isNotNull()).select(
        "topic",
        "partition",
        "offset",
        "timestamp",
        "value",
        F.from_json(F.col("value").cast("string"), RECORD).alias("j"),
    )
    j = F.col("j")
    e = F.struct(*(j[f.name].alias(f.name) for f in STORED))
    is_current = F.coalesce(j["schema_version"] == current[j["type"]], F.lit(False))
    if streams:
        names = F.create_map(*(F.lit(x) for kv in streams.items() for x in kv))
        name = names[F.col("topic")]
        as_event = F.struct(
            j["id"].alias("event_id"),
            name.alias("type"),
            F.lit(None).cast("long").alias("schema_version"),
            name.alias("aggregate_type"),
            F.lit(None).cast("string").alias("aggregate_id"),
            F.lit(None).cast("long").alias("version"),
            j["occurred_at"].alias("occurred_at"),
            j["data"].alias("data"),
        )
        is_fact = F.col("topic").isin(*streams)
        e = F.when(is_fact, as_event).otherwise(e)
        is_current = F.when(is_fact, F.lit(True)).otherwise(is_current)
    return parsed.select(
        "topic",
        "partition",
        "offset",
        "timestamp",
        "value",
        e.alias("e"),
        is_current.alias("current"),
    )


def every_event(parsed: DataFrame) -> DataFrame:
    """Parsed records (`parse_events`) → one row per record: the columns of `events_of`, plus
    `current` and the record's `value`. The envelope fields of a record that is not current
    are only what Spark's reader made of it: `upcast` gives the real ones."""
    return _flat(parsed)


def _flat(records: DataFrame) -> DataFrame:
    """Records with their envelope as a struct `e` → the columns of `every_event`."""
    return records.select(
        "topic",
        "partition",
        "offset",
        "timestamp",
        "current",
        "value",
        *(F.col(f"e.{f.name}").alias(f.name) for f in ENVELOPE),
    ).withColumn("occurred_at", F.col("occurred_at").cast("timestamp"))


def data_fields(events: DataFrame) -> DataFrame:
    """`events` whose `data` is JSON text (at the current schema version) with it decoded
    into its fields (`DATA`), as `every_event` gives them."""
    return events.withColumn("data", F.from_json(F.col("data"), DATA))


def upcast(events: DataFrame) -> DataFrame:
    """The records of `every_event(…)` that are not current, decoded by the Python upcasters
    (same columns)."""
    old = events.where(~F.col("current")).select(
        "topic", "partition", "offset", "timestamp", "current", "value", _upcast("value").alias("e")
    )
    return data_fields(_flat(old))


def events_of(parsed: DataFrame) -> DataFrame:
    """Parsed records (`parse_events`) → events: topic, partition, offset, timestamp (of the
    record), the envelope's fields with `occurred_at` as a timestamp and `data` decoded into
    its fields (`DATA`) at the current schema version."""
    native = parsed.where("current").select(
        "topic", "partition", "offset", "timestamp", *(f"e.{f.name}" for f in ENVELOPE)
    )
    old = parsed.where(~F.col("current")).select(
        "topic", "partition", "offset", "timestamp", _upcast(F.col("value")).alias("e")
    )
    upcast_ = data_fields(
        old.select("topic", "partition", "offset", "timestamp", *(f"e.{f.name}" for f in ENVELOPE))
    )
    events = native.unionByName(upcast_)
    return events.withColumn("occurred_at", F.col("occurred_at").cast("timestamp"))


def decode_events(raw: DataFrame, streams: Mapping[str, str] | None = None) -> DataFrame:
    """Kafka records → events (see `events_of`; `streams` as in `parse_events`)."""
    return events_of(parse_events(raw, streams))


def kafka_options(bootstrap: str) -> dict[str, str]:
    return {
        "kafka.bootstrap.servers": bootstrap,
        "kafka.isolation.level": "read_committed",
        "failOnDataLoss": "false",
        # Spark fetches only offsets it knows are there, but a fetch that ends on a
        # transaction marker finds no record and waits this long (the consumer's default is
        # 500 ms) inside every micro-batch, once per partition read. Idle queries wait on
        # their polling delay, not on fetches. (`bench/read_side.py batch`: 12 partitions of
        # one record each read in 74 ms with 0, 108 ms with 10.)
        "kafka.fetch.max.wait.ms": "0",
    }


# A batch read fetches up to 16 MB of a partition at a time (the consumer's default is 1 MB):
# reading a million records took 2.2-2.6 s against 3.1-3.5 s (`docs/benchmarks-journal.md`,
# rebuild).
# A live batch's read of a few records gets what is there either way.
BATCH_FETCH = {
    "kafka.max.partition.fetch.bytes": str(16 << 20),
    "kafka.fetch.max.bytes": str(64 << 20),
}


def between_json(after: dict[str, int], upto: dict[str, int]) -> tuple[str, str, str]:
    """Spark's `assign`, `startingOffsets` and `endingOffsets` for the records after `after`
    up to `upto` ("topic:partition" -> last offset), of the partitions `upto` names only (one
    it does not name has nothing to read, and Spark takes no "earliest" as an end)."""
    assign: dict[str, list[int]] = {}
    starting: dict[str, dict[str, int]] = {}
    ending: dict[str, dict[str, int]] = {}
    for key, last in sorted(upto.items()):
        topic, partition = key.rsplit(":", 1)
        assign.setdefault(topic, []).append(int(partition))
        starting.setdefault(topic, {})[partition] = after[key] + 1 if key in after else -2
        ending.setdefault(topic, {})[partition] = last + 1
    return json.dumps(assign), json.dumps(starting), json.dumps(ending)


def read_batch(
    spark: SparkSession,
    bootstrap: str,
    topics: list[str],
    starting: str,
    ending: str,
    assign: str | None = None,
) -> DataFrame:
    """A batch read of `topics` (or of the partitions `assign` names) between two offsets."""
    reader = spark.read.format("kafka").options(**kafka_options(bootstrap), **BATCH_FETCH)
    if assign is not None:
        reader = reader.option("assign", assign)
    else:
        reader = reader.option("subscribe", ",".join(topics))
    return reader.option("startingOffsets", starting).option("endingOffsets", ending).load()
