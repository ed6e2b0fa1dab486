"""The projector's live paths in Spark's real-time mode (Spark 4.1+): the events query's and
the joins' (`RealTimeEvents`, `RealTimeJoins`, on what `RealTime` shares).

A micro-batch has a floor (planning, a Kafka fetch, checkpoint files and a job: ~100 ms of
Spark's time even for one record), and under load a record waits for the batch in flight and
then for its own. In real-time mode (`trigger(realTime=...)`) one long-lived task per Kafka
partition hands each record on as it arrives; the plan is made once per epoch (the trigger's
interval, which only sets how often Spark checkpoints). So:

- the query computes each record's position and rows and writes them to a topic of their own,
  keyed by the record's topic and partition, so one partition's rows stay in order: each
  event's rows for every projection (`EventSink.with_rows`, the plan the micro-batches run) to
  `projector-rows`, each changelog record (`records`) to `join-rows`. (Spark's Python
  `foreach` sink would hand the rows over seconds late, and `foreachBatch` is not allowed in
  real-time mode.)
- this process reads that topic and applies what each poll returns in one Postgres
  transaction, with the micro-batches' own step (`EventSink.apply`, `JoinSink.apply`: each
  projection or join from its own progress, in its own savepoint). While records come fast,
  a transaction waits until an interval has passed since the last one and takes what arrived
  meanwhile (`Pace`): each transaction's own cost is then shared by many records. Slower, a
  record is applied as soon as it comes.

Exactly once, as with micro-batches: a record at or before a fold's progress changes nothing,
so rows written again (real-time mode delivers at least once: a retried task starts again from
its epoch's first offsets) are skipped. Each start of a query writes under a generation of its
own, and only the rows of the running generation are applied: rows a stopped query left in
flight cannot land in the middle of the next one's.

What real-time mode cannot do stays on micro-batches (`EventPipeline.micro_batches`,
`JoinPipeline.micro_batches`):

- catching up: each start first runs micro-batches up to the log's end, then the real-time
  query starts from the folds' progress;
- a projection whose rows raise stops the whole events query (Spark cannot leave one column
  out). The micro-batches that catch up after it find the event that raises and park it with
  the rest of its aggregate (guarantee 26, `spark/parking.py`; a projection whose every event
  fails is marked failed, guarantee 16, and the next query runs without it). The next query
  never computes the rows of a parked aggregate's events for that projection. A query that
  stops again without anything parked or failed is not a projection's fault: the error is
  raised, and the projector starts the pipeline again after a pause. (A join fails in
  Postgres, in the thread, alone: its query only decodes records.)
- events at an older schema version: their rows come as null, and the Python upcasters run
  in a Spark batch job over just their offsets, from this thread, before the poll is applied.
"""

from __future__ import annotations

import json
import logging
import math
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from functools import partial
from typing import TYPE_CHECKING, Any, Self

import psycopg
from kafka import KafkaConsumer, TopicPartition
from pyspark import InheritableThread
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming.query import StreamingQuery
from pyspark.sql.streaming.readwriter import DataStreamReader

from config.settings import IDLE_POLL_MS, KAFKA_REQUEST_TIMEOUT_MS, Settings, kafka_consumer_options
from config.topics import Topics
from spark.changelog import CHANGELOG_COLUMNS, records
from spark.decode import between_json, every_event, kafka_options, parse_events, read_batch
from spark.event_pipeline import QUERY
from spark.event_rows import CURRENT, OFFSET, PARTITION, TOPIC, first_line
from spark.event_sink import EventSink
from spark.join import QUERY as JOINS_QUERY
from spark.session import full_planning
from spark.sink import mark_running

if TYPE_CHECKING:
    from spark.event_pipeline import EventPipeline
    from spark.join import JoinPipeline, JoinSink

log = logging.getLogger(__name__)

# How often Spark checkpoints the query's progress (real-time mode's least is 5 s). Each epoch
# boundary stalls the query for up to its Kafka fetch wait plus 0.4-0.8 s, and Postgres, not
# the checkpoint, holds progress: so rarely.
EPOCH = "30 minutes"
MAX_POLL_RECORDS = 5000
LOG_EVERY_S = 10.0  # what was applied, logged at most this often
GENERATION = "g"  # the field of a rows record naming the query start that wrote it
# After a wait between transactions, how long the fetch of what arrived meanwhile may take (the
# broker answers at once when there is some; when there is none, this is what is lost).
GATHER_FETCH_MS = 5
RATE_DECAY_S = 1.0  # how long the records' rate `Pace` compares takes to forget a burst


class RealTime:
    """What both real-time paths share: a thread that catches up in micro-batches, then runs a
    real-time query writing each record's rows to a topic, and applies what each poll of that
    topic returns (see the module's docstring). Looks like the `StreamingQuery` it replaces to
    the projector: `isActive`, `exception()`, `stop()`."""

    def __init__(self, spark: SparkSession, settings: Settings, rows_topic: str, name: str):
        self.spark, self.settings, self.rows_topic, self.name = spark, settings, rows_topic, name
        self.applied = 0  # polls applied (transactions)
        self.query_failed = False  # stopped by its real-time query's own error
        self._since_log: dict[str, int] = {}
        self._transactions = 0
        self._logged_at = time.monotonic()
        self._error: BaseException | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._query: StreamingQuery | None = None
        self._thread = InheritableThread(target=self._guarded, name=f"{name}-realtime", daemon=True)

    def start(self) -> Self:
        self._thread.start()
        return self

    @property
    def isActive(self) -> bool:  # as StreamingQuery spells it
        return self._thread.is_alive()

    def exception(self) -> BaseException | None:
        return self._error

    def stop(self) -> None:
        self._stopping.set()
        with self._lock:
            query = self._query
        if query is not None:
            query.stop()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _guarded(self) -> None:
        try:
            self._run()
        except BaseException as e:
            if not self._stopping.is_set():
                log.error("the real-time %s pipeline stopped: %s", self.name, first_line(e))
                self._error = e
        finally:
            self._close()

    def _run(self) -> None:
        raise NotImplementedError

    def _close(self) -> None:
        """Let go of what the thread held (its sink's connection)."""

    def _track(self, query: StreamingQuery) -> StreamingQuery:
        with self._lock:
            self._query = query
        if self._stopping.is_set():
            query.stop()
        return query

    def _catch_up(self, query: StreamingQuery) -> None:
        """Wait for `query`, micro-batches up to the log's end (as it was when it started)."""
        started = time.perf_counter()
        self._track(query).awaitTermination()
        error = query.exception()
        if error is not None and not self._stopping.is_set():
            raise error
        full_planning(self.spark, False)  # as the live small batches want it
        log.info("%s caught up in %.1f s", self.name, time.perf_counter() - started)

    def _live(
        self,
        start_query: Callable[[str], tuple[StreamingQuery, int]],
        running: list[str],
        apply: Callable[[list[list[Any]]], dict[str, int]],
    ) -> BaseException | None:
        """Start the real-time query (`start_query(generation)` returns it and how many
        columns its rows have), mark the folds `running` so, and `apply` its rows until it
        stops (returns why) or the pipeline is stopped (returns None)."""
        generation = uuid.uuid4().hex
        consumer = self._rows_consumer()
        try:
            query, width = start_query(generation)
            self._track(query)
            with psycopg.connect(self.settings.database(), autocommit=True) as conn:
                mark_running(conn, running)
            log.info("real-time %s query running: %s", self.name, ", ".join(sorted(running)))
            last: dict[str, int] = {}
            pace = Pace(
                self.settings.projector_apply_interval_ms / 1e3,
                self.settings.projector_batch_above_per_s,
            )
            while not self._stopping.is_set():
                if not query.isActive:
                    return query.exception() or RuntimeError("the real-time query stopped")
                values = gather(consumer, pace, self._stopping.wait)
                rows = rows_of(values, generation, width, last)
                if rows:
                    pace.begin(len(rows))
                    self._applied(apply(rows))
            return None
        finally:
            consumer.close()
            with self._lock:
                running_query, self._query = self._query, None
            if running_query is not None:
                running_query.stop()

    def _write_rows(self, rows: DataFrame, generation: str, query_name: str) -> StreamingQuery:
        """The real-time query writing `rows` (topic, partition and offset first) to the rows
        topic: keyed by their source partition (so one partition's rows stay in order), each a
        JSON object of the `generation` and the columns by position."""
        value = F.struct(
            F.lit(generation).alias(GENERATION),
            *(F.col(f"`{c}`").alias(str(i)) for i, c in enumerate(rows.columns)),
        )
        return (  # type: ignore[no-any-return]
            rows.select(
                F.concat_ws(":", "topic", F.col("partition").cast("string")).alias("key"),
                F.to_json(value).alias("value"),
            )
            .writeStream.format("kafka")
            .option("kafka.bootstrap.servers", self.settings.kafka())
            .option("kafka.linger.ms", "0")
            .option("topic", self.rows_topic)
            .option("checkpointLocation", self._checkpoint())
            .outputMode("update")
            .queryName(query_name)
            .trigger(realTime=EPOCH)  # type: ignore[call-overload]  # (not in pyspark's types)
            .start()
        )

    def _checkpoint(self) -> str:
        """A new checkpoint directory for the query (Postgres holds the progress)."""
        raise NotImplementedError

    def _source(self, topics: list[str], starting: str) -> DataStreamReader:
        """Spark's Kafka source for a real-time query, to load."""
        return (
            self.spark.readStream.format("kafka")
            .options(**kafka_options(self.settings.kafka()))
            # A long-lived task's fetch returns as soon as a record arrives; a shorter wait
            # only spins while idle.
            .option("kafka.fetch.max.wait.ms", str(self.settings.spark_realtime_fetch_wait_ms))
            .option("subscribe", ",".join(topics))
            .option("startingOffsets", starting)
        )

    def _applied(self, counts: dict[str, int]) -> None:
        """Count a poll applied (`counts`: records per fold), logged every LOG_EVERY_S."""
        self.applied += 1
        for name, n in counts.items():
            self._since_log[name] = self._since_log.get(name, 0) + n
        self._transactions += 1
        if time.monotonic() - self._logged_at >= LOG_EVERY_S:
            done = ", ".join(f"{n} +{c}" for n, c in sorted(self._since_log.items()))
            # Per fold, for debugging; `logfold run` says once a minute what the views applied.
            log.debug("applied in %d transactions: %s", self._transactions, done or "nothing new")
            self._since_log, self._transactions = {}, 0
            self._logged_at = time.monotonic()

    def _rows_consumer(self) -> KafkaConsumer:
        """A reader of the rows topic from its current end: rows written before the query
        starts are not this query's."""
        consumer = KafkaConsumer(
            bootstrap_servers=self.settings.kafka(),
            group_id=None,
            enable_auto_commit=False,
            max_poll_records=MAX_POLL_RECORDS,
            request_timeout_ms=KAFKA_REQUEST_TIMEOUT_MS,
            metrics_enabled=False,
            client_id=f"logfold-projector-{self.name}-rows",
            # Rows deleted before they were read (the thread far behind): an error, which
            # restarts the pipeline from Postgres's progress, not a silent jump ahead.
            auto_offset_reset="none",
            **kafka_consumer_options(),
        )
        try:
            partitions = consumer.partitions_for_topic(self.rows_topic)
            if not partitions:
                raise RuntimeError(
                    f"topic {self.rows_topic} is missing (run `logfold topics --create`)"
                )
            assigned = [TopicPartition(self.rows_topic, p) for p in sorted(partitions)]
            consumer.assign(assigned)
            consumer.seek_to_end(*assigned)
            for tp in assigned:
                consumer.position(tp)  # resolved now, before the query writes
        except BaseException:
            consumer.close()
            raise
        return consumer


class RealTimeEvents(RealTime):
    """The live event pipeline in real-time mode: micro-batches up to the log's end, then the
    real-time query of every projection not failed, and the thread that applies its rows."""

    def __init__(self, pipeline: EventPipeline, sink: EventSink) -> None:
        super().__init__(pipeline.spark, pipeline.settings, pipeline.topics.projector_rows, QUERY)
        self.pipeline, self.sink = pipeline, sink
        self.upcast_polls = 0  # of them with events at an older schema version

    def _run(self) -> None:
        stopped_by: BaseException | None = None
        live: set[str] = set()
        while not self._stopping.is_set():
            parked = self.sink.parked
            self._catch_up(self.pipeline.micro_batches(self.sink, catch_up=True))
            if self._stopping.is_set():
                break
            names = {p.name for p in self.sink.active}
            if stopped_by is not None and names == live and self.sink.parked == parked:
                self.query_failed = True  # the micro-batches found no projection at fault
                raise stopped_by
            if not names:
                raise RuntimeError(f"every projection failed: {self.sink.failed}")
            live = names
            running = [p.name for p in self.sink.projections]
            stopped_by = self._live(partial(self._query_of, names), running, self._apply)

    def _close(self) -> None:
        self.sink.db.close()

    def _checkpoint(self) -> str:
        return self.pipeline.checkpoint()

    def _query_of(self, names: set[str], generation: str) -> tuple[StreamingQuery, int]:
        """The real-time query of the projections `names` (the others' columns are null),
        from their progress, and how many columns its rows have."""
        records = self._source(
            self.pipeline.topic_names(), self.pipeline.starting_offsets(names)
        ).load()
        events = every_event(parse_events(records, self.pipeline.stream_names()))
        rows = self.sink.with_rows(events, names, self.sink.parked_now())
        return self._write_rows(rows, generation, QUERY), len(rows.columns)

    def _apply(self, rows: list[Any]) -> dict[str, int]:
        errors: dict[str, str] = {}
        if any(not r[CURRENT] for r in rows):
            self.upcast_polls += 1
            rows, errors = self.sink.with_upcast(self._old_events(rows), rows, errors)
        return self.sink.apply(rows, errors)

    def _old_events(self, rows: list[Any]) -> Any:
        """The records of `rows` at an older schema version, read again as a batch."""
        low: dict[str, int] = {}
        high: dict[str, int] = {}
        for r in rows:
            if not r[CURRENT]:
                key = f"{r[TOPIC]}:{r[PARTITION]}"
                low[key] = min(low.get(key, r[OFFSET]), r[OFFSET])
                high[key] = max(high.get(key, r[OFFSET]), r[OFFSET])
        assign, starting, ending = between_json({k: v - 1 for k, v in low.items()}, high)
        raw = read_batch(self.spark, self.settings.kafka(), [], starting, ending, assign)
        return every_event(parse_events(raw, self.pipeline.stream_names()))


class RealTimeJoins(RealTime):
    """The live joins in real-time mode: micro-batches up to the changelogs' ends, then the
    real-time query of the changelog records (`records`: nothing in it can fail for one join
    alone), and the thread that applies each poll with the micro-batches' own step
    (`JoinSink.apply`: each join from its own progress, in its own savepoint)."""

    def __init__(self, pipeline: JoinPipeline, sink: JoinSink) -> None:
        topic = Topics(pipeline.settings.topic_prefix).join_rows
        super().__init__(pipeline.spark, pipeline.settings, topic, JOINS_QUERY)
        self.pipeline, self.sink = pipeline, sink

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._catch_up(self.pipeline.micro_batches(self.sink, catch_up=True))
            if self._stopping.is_set():
                break
            running = [j.name for j in self.pipeline.joins]
            stopped_by = self._live(self._query_of, running, self._apply)
            if stopped_by is not None:
                self.query_failed = True
                raise stopped_by

    def _close(self) -> None:
        self.sink.db.close()

    def _checkpoint(self) -> str:
        return tempfile.mkdtemp(dir=self.pipeline.scratch)

    def _query_of(self, generation: str) -> tuple[StreamingQuery, int]:
        raw = self._source(list(self.pipeline.tables), self.pipeline.starting_offsets())
        rows = records(raw.option("includeHeaders", "true").load(), self.pipeline.tables)
        return self._write_rows(rows, generation, JOINS_QUERY), len(rows.columns)

    def _apply(self, rows: list[list[Any]]) -> dict[str, int]:
        return self.sink.apply([dict(zip(CHANGELOG_COLUMNS, r, strict=True)) for r in rows])


class Pace:
    """When a real-time path's next transaction may begin. A poll returns what arrived while
    the last transaction ran: under load a few records, and each transaction's own cost (its
    progress rows, its commit, their changelog records) is paid for so few. So while records
    come faster than `above_per_s` (a rate decayed over about a second), a transaction begins
    `interval` after the last one at the soonest, with what arrived meanwhile; slower, each
    begins as soon as its records come, and nothing waits."""

    def __init__(
        self, interval: float, above_per_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.interval, self.above_per_s, self.clock = interval, above_per_s, clock
        self.rate = 0.0  # records a second, decayed
        self.began = float("-inf")  # the last transaction

    def begin(self, records: int) -> None:
        """A transaction of `records` begins now."""
        now = self.clock()
        if self.began > float("-inf"):
            self.rate *= math.exp(-(now - self.began) / RATE_DECAY_S)
        self.rate += records / RATE_DECAY_S
        self.began = now

    def wait(self) -> float:
        """Seconds until the next transaction may begin (0: at once)."""
        if self.interval <= 0 or self.rate <= self.above_per_s:
            return 0.0
        return max(0.0, self.began + self.interval - self.clock())


def gather(consumer: KafkaConsumer, pace: Pace, wait: Callable[[float], bool]) -> list[bytes]:
    """The rows records of the next transaction: a poll's, and, when `pace` says it may not
    begin yet, what arrives until it may (`wait(seconds)`: true when the pipeline stops)."""
    values = _values(consumer.poll(timeout_ms=IDLE_POLL_MS))
    left = pace.wait() if values else 0.0
    if left <= 0 or wait(left):
        return values
    # That poll sent the next fetch at once, which took only what had come by then: one more
    # brings what came during the wait (the broker answers at once when there is some).
    values += _values(consumer.poll(timeout_ms=0))
    return values + _values(consumer.poll(timeout_ms=GATHER_FETCH_MS))


def _values(polled: dict[TopicPartition, list[Any]]) -> list[bytes]:
    return [record.value for records in polled.values() for record in records]


def rows_of(
    values: Iterable[bytes], generation: str, width: int, last: dict[str, int]
) -> list[list[Any]]:
    """The rows (`width` columns) in `values` (records of the rows topic, in order) that
    `generation` wrote, each source record's once. `last`, per source partition the last
    offset taken (updated): a retried task writes its epoch's rows again, maybe into the same
    poll, where a projection's progress (read once per transaction) would not skip them."""
    rows = []
    for value in values:
        found = json.loads(value)
        if found.get(GENERATION) != generation:
            continue
        row = [found.get(str(i)) for i in range(width)]
        key = f"{row[TOPIC]}:{row[PARTITION]}"
        if row[OFFSET] > last.get(key, -1):
            last[key] = row[OFFSET]
            rows.append(row)
    return rows
