"""How the event pipeline lays out an event's rows and merges them into Postgres: the columns
of a collected row (where the record is, whether it is current, its id and times), each output's
rows as JSON, a projection's share of a batch, and merging it by its merge rules. Shared by the
live pipeline (`spark/event_sink.py`) and the rebuild (`spark/rebuild.py`)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from config.settings import Settings
from events.catalog import EVENTS_BY_AGGREGATE
from events.serialization import Envelope, encode
from projections.base import Offsets, Output, Projection
from projections.base.rows import rows_column, rows_frame
from spark.decode import every_event, parse_events, upcast
from spark.sink import (
    bulk_load,
    count_once,
    drop_keys,
    merge_json,
)
from streams.registry import STREAMS

log = logging.getLogger(__name__)

WIRE_TIME = "yyyy-MM-dd'T'HH:mm:ss.SSSSSSXXX"  # timestamps as ISO text in UTC


# The first columns of a collected row: where the record is in the log, whether it is at its
# type's current schema version, its id, its log time and delay (log time - event time), in
# microseconds (for watermarks and counting stream records once), and its aggregate (what a
# poison event parks with it: `spark/parking.py`).
def position() -> list[Column]:
    return [
        F.col("topic"),
        F.col("partition"),
        F.col("offset"),
        F.col("current"),
        F.col("event_id"),
        F.unix_micros(F.col("timestamp")).alias("log_us"),
        (F.unix_micros(F.col("timestamp")) - F.unix_micros(F.col("occurred_at"))).alias("delay_us"),
        aggregate_column().alias("aggregate"),
    ]


TOPIC, PARTITION, OFFSET, CURRENT, ID, LOG_US, DELAY_US, AGGREGATE = range(8)
POSITION = 8  # columns


def aggregate_column() -> Column:
    """The aggregate an event belongs to (its aggregate id), or for a stream record the value of
    its stream's key (the field its records are kept in order by); "" for neither."""
    key = F.col("aggregate_id")
    for s in STREAMS.values():
        of_stream = F.when(F.col("aggregate_type") == s.name, F.col("data")[s.key].cast("string"))
        key = F.coalesce(key, of_stream)
    return F.coalesce(key, F.lit(""))


def rows_json(output: Output) -> Column:
    """The rows one event adds to `output`, as a JSON array (`[]` for none); null for an event
    at an older schema version (`_upcast` replaces those). The rows appear once: Spark
    optimises these expressions every batch, at a cost that grows with their size."""
    return F.when(F.col("current"), F.to_json(rows_column(output), {"timestampFormat": WIRE_TIME}))


@dataclass
class Share:
    """What one projection takes from a batch: per output, its rows as JSON arrays."""

    offsets: Offsets  # its progress before the batch
    after: Offsets  # its progress after it
    first: Offsets  # the first offset of each partition after its progress
    count: int  # events
    rows: dict[str, list[str]]
    late: int = 0  # records past the projection's watermark, left out
    # Stream records on time, in log order, counted only if their id is new: (id, log time in
    # microseconds, per output its rows).
    records: list[tuple[str, int, list[str | None]]] = field(default_factory=list)


def share_of(
    p: Projection,
    reads: frozenset[str],
    streams: frozenset[str],
    rows: list[Any],
    first: int,
    offsets: Offsets,
    passed: dict[str, tuple[int, int, int, int]] | None = None,
) -> Share | None:
    """The rows of `p`'s outputs (row columns from `first`, one per output) of the records
    of `reads` ("topic:partition") after its offsets, with its watermark applied; records of
    the topics `streams` are counted once by id (`merge_share`). `passed`: records left out of
    `rows` (all of `reads`, after the offsets, not of `streams`), per "topic:partition" their
    number, first and last offsets, and how many of them are late; the caller adds their rows
    to the share."""
    found: dict[str, list[str]] = {o.name: [] for o in p.outputs}
    last: dict[str, int] = {}
    starts: dict[str, int] = {}
    count = late = 0
    for key, (n, lo, hi, late_n) in (passed or {}).items():
        count += n
        late += late_n
        last[key] = max(last.get(key, -1), hi)
        starts[key] = min(starts.get(key, lo), lo)
    records: list[tuple[str, int, list[str | None]]] = []
    lateness = int(p.lateness.total_seconds() * 1e6) if p.lateness is not None else None
    for row in rows:
        key = f"{row[TOPIC]}:{row[PARTITION]}"
        if key not in reads or row[OFFSET] <= offsets.get(key, -1):
            continue
        count += 1
        last[key] = max(last.get(key, -1), row[OFFSET])
        starts[key] = min(starts.get(key, row[OFFSET]), row[OFFSET])
        if lateness is not None and row[DELAY_US] > lateness:
            late += 1
            continue
        values = row[first : first + len(p.outputs)]
        if row[TOPIC] in streams:
            records.append((row[ID], row[LOG_US], values))
            continue
        for o, value in zip(p.outputs, values, strict=True):
            if value is not None and value != "[]":
                found[o.name].append(value)
    if not count:
        return None
    return Share(offsets, {**offsets, **last}, starts, count, found, late, records)


def upcast_rows(batch: DataFrame, rows: list[Any], columns: list[Column]) -> list[Any]:
    """Replace the rows of events at an older schema version by those of their upcast form."""
    upcast_ = upcast(batch).withColumn("current", F.lit(True))
    fixed = upcast_.select(*position(), *columns)
    found = {(r[TOPIC], r[PARTITION], r[OFFSET]): r for r in fixed.collect()}
    return [r if r[CURRENT] else found.get((r[TOPIC], r[PARTITION], r[OFFSET]), r) for r in rows]


def merge_staged(
    conn: psycopg.Connection[Any],
    database: str,
    output: Output,
    events: DataFrame,
    suffix: str,
    empty: bool = False,
    every: DataFrame | None = None,
) -> int:
    """Merge the rows of `events` into `output` (one that stages its rows: `Output.staged`)
    through a table they are COPYed into first; returns how many rows were merged. The table
    is created and filled outside `conn`'s transaction (Spark's tasks COPY in their own
    connections) and dropped in it.

    `empty`: `output`'s tables (+ `suffix`) are empty, new ones (a rebuild's shadows). Their
    keys are then dropped for the merge and built once after it, in the same transaction:
    building a key from a million rows costs a fraction of looking each row up in it, and with
    `every` (the records `events` came from: the whole log, for empty tables) only the rows
    that can change the tables are staged (`Output.whole_log_rows`)."""
    staged = f"{output.name}_staged{suffix}"
    with psycopg.connect(database, autocommit=True) as setup:
        setup.execute(f"DROP TABLE IF EXISTS {staged}")
        setup.execute(f"CREATE UNLOGGED TABLE {staged} ({output.staged})")
    rows = rows_frame(output, events)
    if empty and every is not None:
        rows = output.whole_log_rows(rows, every)
    n = bulk_load(database, rows, staged, tuple(rows.columns), output.personal)
    if n:
        tables = [output.name + suffix, *(f"{s.name}{suffix}" for s in output.state)]
        keys = drop_keys(conn, tables) if empty else []
        for statement in output.merge_staged_statements(suffix, staged, empty=empty):
            conn.execute(statement)
        for statement in keys:
            conn.execute(statement)
    conn.execute(f"DROP TABLE {staged}")
    return n


def arrow_rows(frame: DataFrame) -> list[Any]:
    table = frame.toArrow()
    return list(zip(*(c.to_pylist() for c in table.columns), strict=True))


def keep_ids(p: Projection, settings: Settings) -> timedelta:
    """How long `p` remembers a counted id after the newest log time: a copy sent later would
    be late (its watermark, plus the clock skew the API allows, plus ten minutes for the
    clocks of API processes to differ)."""
    return (p.lateness or timedelta(0)) + timedelta(seconds=settings.clock_skew_s + 600)


def merge_share(
    conn: psycopg.Connection[Any], p: Projection, share: Share, suffix: str, keep: timedelta
) -> int:
    """Merge a projection's share of a batch into its tables (+ `suffix`, a rebuild's shadows):
    its stream records whose ids are new, and every other row. Returns the late records."""
    counted = count_once(conn, p.name + suffix, [(r[0], r[1]) for r in share.records], keep)
    late = share.late
    for i, o in enumerate(p.outputs):
        arrays = list(share.rows[o.name])
        arrays += [
            value
            for (_, _, values), new in zip(share.records, counted, strict=True)
            if new and (value := values[i]) is not None and value != "[]"
        ]
        for chunk in _chunks(arrays):
            merge_json(conn, o, "[" + ",".join(a[1:-1] for a in chunk) + "]", suffix)
        for statement in o.prune_statements(suffix):
            conn.execute(statement)
        if o.late:
            late += len(arrays)
    return late


MERGE_CHUNK_BYTES = 32 * 1024 * 1024  # of JSON per statement (far under Postgres's 1 GiB cap)


def _chunks(arrays: list[str]) -> Iterator[list[str]]:
    """`arrays` in runs of at most MERGE_CHUNK_BYTES: merging a batch's rows in parts gives the
    same table (rows of one key combine across statements by the same rules)."""
    chunk: list[str] = []
    size = 0
    for a in arrays:
        if chunk and size + len(a) > MERGE_CHUNK_BYTES:
            yield chunk
            chunk, size = [], 0
        chunk.append(a)
        size += len(a)
    if chunk:
        yield chunk


KAFKA_RECORD_SCHEMA = "topic string, partition int, offset long, timestamp timestamp, value binary"


def sample_batch(spark: SparkSession) -> DataFrame:
    """One made-up record of every event type, decoded as the live query decodes a batch's
    (`every_event(parse_events(…))`), for the warm-up: its first batches then run the plan
    the real ones run, Spark's JSON reader included."""
    now = datetime.now(UTC)
    line = {"book_id": "b", "quantity": 1, "unit_price_cents": 100, "author": "a"}
    data = {
        "lines": [{**line, "royalty_rate": 0.1}],
        "customer_id": "c",
        "total_cents": 100,
        "name": "n",
        "email": "e",
        "title": "t",
        "author": "a",
        "price_cents": 100,
        "royalty_rate": 0.1,
    }
    kinds = [(a, cls) for a, classes in EVENTS_BY_AGGREGATE.items() for cls in classes]
    records = [
        (
            f"warm.{a}",
            0,
            i,
            now.replace(tzinfo=None),
            encode(
                Envelope(
                    **dict.fromkeys(("command_id", "correlation_id", "causation_id"), "warm"),
                    event_id=f"warm-{i}",
                    type=cls.type_name(),
                    schema_version=cls.SCHEMA_VERSION,
                    aggregate_type=a,
                    aggregate_id="warm",
                    version=1,
                    occurred_at=now.isoformat(),
                    data=data,
                )
            ),
        )
        for i, (a, cls) in enumerate(kinds)
    ]
    return every_event(parse_events(spark.createDataFrame(records, KAFKA_RECORD_SCHEMA)))


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return f"{type(error).__name__}: {text}"
