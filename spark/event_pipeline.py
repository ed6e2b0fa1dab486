"""The live event pipeline: one Structured Streaming query folds the event log into every
projection's views.

The query's plan is built once: Kafka records are parsed by Spark's JSON reader and each
event's rows for every output (`Output.rows`) are computed as JSON, all in the JVM, in one scan.
Each micro-batch is then one Spark job (`collect`), and one Postgres transaction that:

1. locks every projection's progress row;
2. gives each projection the rows of the batch's events after its own offsets;
3. combines them per key and merges them into its tables by its merge rules, and advances
   its offsets, each projection in a savepoint.

Events at an older schema version (rare) go through the Python upcasters in a second job.

Each projection keeps its own progress, so it can be behind the others (it catches up as the
query reads from the lowest offsets), fail alone (guarantee 16: rows that raise in Spark or
that Postgres refuses mark that projection failed, with the error and the offsets it could not
get past, and the others go on), or be rebuilt alone. A failed projection is left out until the
pipeline restarts; then it resumes from its own progress and rejoins.

No trigger interval: a batch starts as soon as the previous one ended and records are there.
Postgres's progress, not Spark's checkpoint, says where the query starts, so the checkpoint is
scratch space (in memory where the machine has /dev/shm).
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Protocol, TypeVar

import psycopg
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming.query import StreamingQuery

from config.settings import Settings
from config.topics import Topics
from events.catalog import EVENTS_BY_AGGREGATE
from events.serialization import Envelope, encode
from projections.base import Join, Offsets, Output, Projection
from projections.base.rows import rows_column, rows_frame
from spark.decode import every_event, kafka_options, parse_events, read_batch, upcast
from spark.gaps import Gaps, check_gaps
from spark.session import BatchPlanning, full_planning, idle_poll
from spark.sink import (
    Reconnecting,
    bulk_load,
    count_once,
    drop_keys,
    ensure_progress,
    forget_failures,
    lock_many,
    mark_failed,
    mark_running,
    merge_json,
    read_progress,
    save_progress,
)

log = logging.getLogger(__name__)

QUERY = "events"
MAX_RECORDS_PER_BATCH = 200_000
# Real-time starts in a row whose query failed on its own (no projection at fault) before the
# live path falls back to micro-batches, until the projector restarts.
MAX_REALTIME_FAILURES = 3
WIRE_TIME = "yyyy-MM-dd'T'HH:mm:ss.SSSSSSXXX"  # timestamps as ISO text in UTC


# The first columns of a collected row: where the record is in the log, whether it is at its
# type's current schema version, its id, and its log time and delay (log time - event time),
# in microseconds (for watermarks and counting stream records once).
def position() -> list[Column]:
    return [
        F.col("topic"),
        F.col("partition"),
        F.col("offset"),
        F.col("current"),
        F.col("event_id"),
        F.unix_micros(F.col("timestamp")).alias("log_us"),
        (F.unix_micros(F.col("timestamp")) - F.unix_micros(F.col("occurred_at"))).alias("delay_us"),
    ]


TOPIC, PARTITION, OFFSET, CURRENT, ID, LOG_US, DELAY_US = range(7)
POSITION = 7  # columns


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
) -> int:
    """Merge the rows of `events` into `output` (one that stages its rows: `Output.staged`)
    through a table they are COPYed into first; returns how many rows were merged. The table
    is created and filled outside `conn`'s transaction (Spark's tasks COPY in their own
    connections) and dropped in it.

    `empty`: `output`'s tables (+ `suffix`) are empty, new ones (a rebuild's shadows). Their
    keys are then dropped for the merge and built once after it, in the same transaction:
    building a key from a million rows costs a fraction of looking each row up in it."""
    staged = f"{output.name}_staged{suffix}"
    with psycopg.connect(database, autocommit=True) as setup:
        setup.execute(f"DROP TABLE IF EXISTS {staged}")
        setup.execute(f"CREATE UNLOGGED TABLE {staged} ({output.staged})")
    rows = rows_frame(output, events)
    n = bulk_load(database, rows, staged, tuple(rows.columns))
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


class EventSink:
    """`foreachBatch` function of the event pipeline (see the module's docstring). A batch is
    `every_event(parse_events(records))`."""

    def __init__(self, projections: Sequence[Projection], settings: Settings) -> None:
        self.projections = list(projections)
        self.topics = Topics(settings.topic_prefix)
        self.reads = {
            p.name: frozenset(p.reads(self.topics, settings.partitions)) for p in self.projections
        }
        self.streams = {
            p.name: frozenset(self.topics.stream(s) for s in p.streams) for p in self.projections
        }
        self.keep = {p.name: keep_ids(p, settings) for p in self.projections}
        # Built once: a Column is an unresolved expression, valid for every batch.
        self.columns = {
            p.name: [rows_json(o).alias(f"{p.name}.{o.name}") for o in p.outputs]
            for p in self.projections
        }
        # Where each projection's columns start in a collected row.
        self.first: dict[str, int] = {}
        column = POSITION
        for p in self.projections:
            self.first[p.name], column = column, column + len(p.outputs)
        self.failed: dict[str, str] = {}
        self.timings: dict[str, float] = {}  # of the last batch, by stage
        self.planning = BatchPlanning()
        self.last_batch = 0  # records
        self.db = Reconnecting(settings.database())
        self.gaps = Gaps(settings.kafka(), settings.kafka_timeout_s)
        self.records: BatchRecords | None = None  # set by the pipeline that runs it

    @property
    def active(self) -> list[Projection]:
        return [p for p in self.projections if p.name not in self.failed]

    def __call__(self, batch: DataFrame, batch_id: int) -> None:
        started = time.perf_counter()
        self.planning.fit(batch.sparkSession, self.last_batch)
        assert self.records is not None, "the pipeline sets where its batches can be read again"
        records = self.records
        rows, errors = self._collect(batch, self.active, lambda: records(batch_id))
        self.last_batch = len(rows)
        if not rows:
            return
        if any(not r[CURRENT] for r in rows):
            rows, errors = self.with_upcast(records(batch_id), rows, errors)
        self.timings["spark"] = time.perf_counter() - started
        self.apply(rows, errors, f"batch {batch_id}")

    def with_rows(self, events: DataFrame, names: Collection[str] | None = None) -> DataFrame:
        """Of `events` (`every_event`), the position columns and every output's rows: what
        `_collect` reads. In the streaming query's plan, Spark analyses these large
        expressions once, when the query starts, instead of once per batch (where a `select`
        in `foreachBatch` would put them); a batch then only optimises its plan. Nothing else
        is selected, so `foreachBatch` collects the batch as it is given: a `select` there
        converts each column through py4j, ~6 ms a live batch.

        `names`: only those projections' rows; the others' columns are null."""
        none = F.lit(None).cast("string")
        columns: list[Column] = []
        for p in self.projections:
            if names is None or p.name in names:
                columns += self.columns[p.name]
            else:
                columns += [none.alias(f"{p.name}.{o.name}") for o in p.outputs]
        return events.select(*position(), *columns)

    def warm(self, spark: SparkSession, rounds: int = 3) -> None:
        """Run the batch job on made-up events of every type, writing nothing: the first
        batches of a fresh JVM pay for code generation and JIT compilation, and without
        this the first command after a start would wait for it."""
        started = time.perf_counter()
        try:
            sample = sample_batch(spark)
            for _ in range(rounds):
                self._collect(self.with_rows(sample), self.active, lambda: sample)
        except Exception as e:  # the real batches will say which projection fails, and how
            log.warning("warm-up failed: %s", first_line(e))
        log.info("warmed up in %.1f s", time.perf_counter() - started)

    def _collect(
        self, batch: DataFrame, projections: list[Projection], events: Callable[[], DataFrame]
    ) -> tuple[list[Any], dict[str, str]]:
        """The batch's rows (`with_rows`): position, then every output's rows (in projection
        order), through Arrow (a live batch: ~7 ms less than as pickled Rows). If that fails,
        those of `projections` each on its own, from the same records without the rows
        columns (`events()`, as `every_event` gives them: the batch Spark hands to
        `foreachBatch` computes every column, the failing ones too), to find the ones that
        fail: their columns are None (as are those of the projections left out) and their
        errors returned."""
        try:
            return arrow_rows(batch), {}
        except Exception as e:
            if len(projections) <= 1:
                raise
            log.warning("a projection's rows failed (%s); collecting each alone", first_line(e))
        alone = events()
        parts: dict[str, list[Any]] = {}
        errors: dict[str, str] = {}
        for p in projections:
            try:
                parts[p.name] = arrow_rows(alone.select(*position(), *self.columns[p.name]))
            except Exception as e:
                errors[p.name] = first_line(e)
        if not parts:  # not one projection's fault: fail the batch
            raise RuntimeError(f"every projection failed: {errors}")
        base = next(iter(parts.values()))
        rows = []
        for i, first in enumerate(base):
            row = list(first[:POSITION])
            for p in self.projections:
                part = parts.get(p.name)
                row += part[i][POSITION:] if part else [None] * len(p.outputs)
            rows.append(row)
        return rows, errors

    def with_upcast(
        self, events: DataFrame, rows: list[Any], errors: dict[str, str]
    ) -> tuple[list[Any], dict[str, str]]:
        """`rows` with those of the events at an older schema version (of `events`, the
        batch's records as `every_event` gives them) replaced by their upcast form's, and
        `errors` with those of the projections whose rows fail on an upcast event (found each
        alone, as `_collect` does). The columns of failed projections stay None."""

        def upcast_without(failed: Collection[str]) -> list[Any]:
            none = F.lit(None).cast("string")
            columns = [
                c if p.name not in failed else none
                for p in self.projections
                for c in self.columns[p.name]
            ]
            return upcast_rows(events, rows, columns)

        failed = {*self.failed, *errors}
        try:
            return upcast_without(failed), errors
        except Exception as e:
            log.warning(
                "a projection's upcast rows failed (%s); upcasting each alone", first_line(e)
            )
        errors = dict(errors)
        names = [p.name for p in self.projections]
        for p in self.active:
            if p.name in failed:
                continue
            try:
                upcast_without([n for n in names if n != p.name])
            except Exception as e:
                errors[p.name] = first_line(e)
        if len(errors) == len(self.active):  # not one projection's fault: fail the batch
            raise RuntimeError(f"every projection failed: {errors}")
        return upcast_without({*failed, *errors}), errors

    def apply(
        self, rows: list[Any], errors: dict[str, str], label: str | None = None
    ) -> dict[str, int]:
        """Apply `rows` (`with_rows`'s columns, in log order per partition) in one transaction:
        each active projection the rows after its progress, in its own savepoint; those named
        in `errors` are marked failed. Returns the events applied per projection; logs them
        under `label` (None: not)."""
        projections = self.active
        conn = self.db.get()
        try:
            with conn.transaction():
                t0 = time.perf_counter()
                progress = lock_many(conn, [p.name for p in projections])
                applied: dict[str, int] = {}
                for p in projections:
                    first = self.first[p.name]
                    offsets = progress.get(p.name, {})
                    if p.name in errors:
                        self._fail(conn, p.name, errors[p.name], offsets)
                        continue
                    share = share_of(
                        p, self.reads[p.name], self.streams[p.name], rows, first, offsets
                    )
                    if share is None:
                        continue
                    check_gaps(self.gaps, conn, p.name, share.offsets, share.first)
                    try:
                        with conn.transaction():
                            late = merge_share(conn, p, share, "", self.keep[p.name])
                            save_progress(conn, p.name, share.after, share.count, late)
                        applied[p.name] = share.count
                    except (psycopg.OperationalError, psycopg.InterfaceError):
                        raise
                    except psycopg.Error as e:
                        self._fail(conn, p.name, first_line(e), offsets)
                self.timings["postgres"] = time.perf_counter() - t0
        except psycopg.OperationalError:
            conn.close()
            raise
        if applied and label is not None:
            took = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in self.timings.items())
            done = ", ".join(f"{n} +{c}" for n, c in applied.items())
            log.debug("%s (%s): %s", label, took, done)  # a line a batch: for debugging
        return applied

    def _fail(self, conn: psycopg.Connection[Any], name: str, error: str, offsets: Offsets) -> None:
        log.error("projection %s failed after %s: %s", name, offsets, error)
        mark_failed(conn, name, error, offsets)
        self.failed[name] = error


@dataclass(frozen=True)
class BatchRecords:
    """A micro-batch's records read again from Kafka, as `every_event` gives them: from the
    end offsets Spark logged for the batch before running it (`offsets/<batch id>` in the
    query's checkpoint) back to the previous batch's (or the query's starting offsets)."""

    spark: SparkSession
    bootstrap: str
    topics: list[str]
    streams: dict[str, str]
    checkpoint: Path
    starting: str  # the query's startingOffsets

    def __call__(self, batch_id: int) -> DataFrame:
        before = self.checkpoint / "offsets" / str(batch_id - 1)
        starting = _logged_offsets(before) if before.exists() else self.starting
        ending = _logged_offsets(self.checkpoint / "offsets" / str(batch_id))
        raw = read_batch(self.spark, self.bootstrap, self.topics, starting, ending)
        return every_event(parse_events(raw, self.streams))


def _logged_offsets(path: Path) -> str:
    """The source's offsets in a file of a checkpoint's offset log (Spark's `OffsetSeq`: a
    version line, a metadata line, then one line per source; the pipeline has one)."""
    return path.read_text().splitlines()[2]


class EventPipeline:
    """Runs the live event pipeline of `projections` (see the module's docstring)."""

    def __init__(
        self,
        spark: SparkSession,
        settings: Settings,
        projections: Sequence[Projection],
        scratch: str,
        realtime_mode: RealtimeMode[EventPipeline, EventSink] | None = None,
    ) -> None:
        """`realtime_mode`: how the live path runs in Spark's real-time mode, when it can
        (the projector passes `spark.realtime.RealTimeEvents`); None: always in micro-batches."""
        self.spark, self.settings, self.scratch = spark, settings, scratch
        self.realtime_mode = realtime_mode
        self.projections = list(projections)
        self.topics = Topics(settings.topic_prefix)
        self.sink: EventSink | None = None
        self.running: Running | None = None
        self.realtime_failures = 0  # real-time starts in a row whose query failed on its own

    def topic_names(self) -> list[str]:
        return sorted({t for p in self.projections for t in p.topic_names(self.topics)})

    def stream_names(self) -> dict[str, str]:
        """The stream topics it reads, with their streams' names."""
        return {self.topics.stream(s): s for p in self.projections for s in p.streams}

    def starting_offsets(self, names: Collection[str] | None = None) -> str:
        """Spark's startingOffsets: per partition, after the lowest progress of the
        projections (of `names`, if given) that read it (earliest where none has one)."""
        n = self.settings.partitions
        chosen = [p for p in self.projections if names is None or p.name in names]
        with psycopg.connect(self.settings.database(), autocommit=True) as conn:
            progress = {p.name: read_progress(conn, p.name) for p in chosen}
        doc: dict[str, dict[str, int]] = {}
        for t in self.topic_names():
            doc[t] = {}
            for part in range(n):
                key = f"{t}:{part}"
                readers = [
                    progress[p.name].get(key, -1) for p in chosen if key in p.reads(self.topics, n)
                ]
                if not readers:  # read only by projections left out: from its end
                    doc[t][str(part)] = -1
                    continue
                low = min(readers)
                doc[t][str(part)] = low + 1 if low >= 0 else -2
        return json.dumps(doc)

    def realtime(self) -> bool:
        """Whether the live path runs in real-time mode: it has one, it is wanted, not failing
        on its own, and Spark has the task slots `realtime_slots` counts."""
        if self.realtime_mode is None:
            return False
        need = realtime_partitions(self.settings, self.projections) + 2
        return realtime_allowed(self.spark, self.settings, "events", self.realtime_failures, need)

    def checkpoint(self) -> str:
        """A fresh checkpoint for a query's start, or Spark would resume from its own offsets
        (Postgres's progress says where to start)."""
        return tempfile.mkdtemp(dir=self.scratch)

    def start(self) -> Running:
        """Start the live pipeline from the projections' progress (a restart resumes the
        same way): in real-time mode when it can (`realtime_mode`), else in micro-batches."""
        names = [p.name for p in self.projections]
        if self.sink is not None:
            self.sink.db.close()
        self.sink = EventSink(self.projections, self.settings)
        full_planning(self.spark, False)  # the query starts on small batches (see BatchPlanning)
        self.sink.warm(self.spark)
        with psycopg.connect(self.settings.database(), autocommit=True) as conn:
            for name in names:
                ensure_progress(conn, name)
            forget_failures(conn, names)  # a failed projection is given another chance
        self.realtime_failures = failures_after(self.running, self.realtime_failures)
        if self.realtime_mode is not None and self.realtime():
            self.running = self.realtime_mode(self, self.sink).start()
            return self.running
        self.running = self.micro_batches(self.sink)
        with psycopg.connect(self.settings.database(), autocommit=True) as conn:
            mark_running(conn, names)
        return self.running

    def micro_batches(self, sink: EventSink, catch_up: bool = False) -> StreamingQuery:
        """The query in micro-batches, from the projections' progress; `catch_up`: up to the
        log's end as it is now, then it stops."""
        full_planning(self.spark, False)  # the query starts on small batches (see BatchPlanning)
        sink.planning, sink.last_batch = BatchPlanning(), 0
        starting = self.starting_offsets()
        records = (
            self.spark.readStream.format("kafka")
            .options(**kafka_options(self.settings.kafka()))
            .option("subscribe", ",".join(self.topic_names()))
            .option("startingOffsets", starting)
            .option("maxOffsetsPerTrigger", MAX_RECORDS_PER_BATCH)
            .load()
        )
        idle_poll(self.spark, self.settings.spark_idle_poll_ms)
        checkpoint = self.checkpoint()
        sink.records = BatchRecords(
            self.spark,
            self.settings.kafka(),
            self.topic_names(),
            self.stream_names(),
            Path(checkpoint),
            starting,
        )
        writer = (
            sink.with_rows(every_event(parse_events(records, self.stream_names())))
            .writeStream.foreachBatch(sink)
            .queryName(f"{QUERY}-catch-up" if catch_up else QUERY)
            .option("checkpointLocation", checkpoint)
        )
        if catch_up:
            writer = writer.trigger(availableNow=True)
        return writer.start()


class Running(Protocol):
    """A running pipeline, as the projector watches it: a `StreamingQuery`, or what stands
    for one."""

    @property
    def isActive(self) -> bool: ...  # as StreamingQuery spells it

    def exception(self) -> BaseException | None: ...

    def stop(self) -> None: ...


class RealtimeRunning(Running, Protocol):
    """A live path running in real-time mode (`spark/realtime.py`)."""

    @property
    def query_failed(self) -> bool: ...  # its query failed on its own

    @property
    def applied(self) -> int: ...  # polls it applied (transactions)

    def start(self) -> RealtimeRunning: ...


P_contra = TypeVar("P_contra", contravariant=True)
S_contra = TypeVar("S_contra", contravariant=True)


class RealtimeMode(Protocol[P_contra, S_contra]):
    """How a pipeline's live path runs in real-time mode: made from the pipeline and its sink."""

    def __call__(self, pipeline: P_contra, sink: S_contra) -> RealtimeRunning: ...


def failures_after(previous: Running | None, failures: int) -> int:
    """Real-time starts in a row whose query failed on its own, once `previous` has ended."""
    query_failed, applied = getattr(previous, "query_failed", None), getattr(previous, "applied", 0)
    if query_failed is None:
        return failures  # micro-batches (or nothing) ran: the count stands
    failed = query_failed and not applied
    return failures + 1 if failed else 0


def realtime_allowed(
    spark: SparkSession, settings: Settings, fold: str, failures: int, need: int
) -> bool:
    """Whether a live path (`fold`: events, joins) may run in real-time mode: wanted, its
    query not failing on its own (`failures` starts in a row, fewer than
    MAX_REALTIME_FAILURES), and Spark has the `need`ed task slots. Logs why not."""
    if not settings.spark_realtime:
        return False
    if failures >= MAX_REALTIME_FAILURES:
        log.warning(
            "folding %s in micro-batches: the real-time query failed %d times in a row on its "
            "own (see the errors above); the projector tries real-time mode again when it "
            "restarts",
            fold,
            failures,
        )
        return False
    have = spark.sparkContext.defaultParallelism
    if have < need:
        log.warning(
            "folding %s in micro-batches: real-time mode needs %d task slots (one per partition "
            "read, two more for other jobs) and Spark has %d",
            fold,
            need,
            have,
        )
        return False
    return True


def realtime_slots(
    settings: Settings, projections: Sequence[Projection], joins: Sequence[Join] = ()
) -> int:
    """Task slots the real-time queries of `projections` and of `joins` need: one per partition
    they read, and two more for the jobs beside them (catching up, upcasting)."""
    return realtime_partitions(settings, projections) + len(join_tables(joins)) + 2


def realtime_partitions(settings: Settings, projections: Sequence[Projection]) -> int:
    """The event partitions the real-time query of `projections` reads: a task slot each."""
    topics = Topics(settings.topic_prefix)
    return len({t for p in projections for t in p.topic_names(topics)}) * settings.partitions


def join_tables(joins: Sequence[Join]) -> set[str]:
    """The tables whose changelogs (one partition each) the joins' query reads."""
    return {t for j in joins for t in j.tables}
