"""The event pipeline's live path in Spark's real-time mode (Spark 4.1+).

A micro-batch has a floor (planning, a Kafka fetch, checkpoint files and a job: ~100 ms of
Spark's time even for one event), and under load an event waits for the batch in flight and
then for its own. In real-time mode (`trigger(realTime=...)`) one long-lived task per Kafka
partition hands each record on as it arrives; the plan is made once per epoch (the trigger's
interval, which only sets how often Spark checkpoints). So:

- the query computes each event's position and rows (`EventSink.with_rows`, the plan the
  micro-batches run) and writes them to the `projector-rows` topic, keyed by the event's topic
  and partition, so one partition's rows stay in order. (Its Python `foreach` sink would hand
  the rows over seconds late, and `foreachBatch` is not allowed in real-time mode.)
- this process reads that topic and applies what each poll returns in one Postgres
  transaction, with the micro-batches' own step (`EventSink.apply`: each projection from its
  own progress, in its own savepoint). Under load a poll returns what arrived during the
  previous transaction, so transactions group events by themselves.

Exactly once, as with micro-batches: a record at or before a projection's progress changes
nothing, so rows written again (real-time mode delivers at least once: a retried task starts
again from its epoch's first offsets) are skipped. Each start of the query writes under a
generation of its own, and only the rows of the running generation are applied: rows a
stopped query left in flight cannot land in the middle of the next one's.

What real-time mode cannot do stays on micro-batches (`EventPipeline.micro_batches`):

- catching up: each start first runs micro-batches up to the log's end, then the real-time
  query starts from the projections' progress;
- a projection whose rows raise stops the whole query (Spark cannot leave one column out).
  The micro-batches that catch up after it find that projection alone, as they always do
  (guarantee 16), mark it failed, and the next query runs without it. A query that stops
  again without a new failure found is not a projection's fault: the error is raised, and
  the projector starts the pipeline again after a pause;
- events at an older schema version: their rows come as null, and the Python upcasters run
  in a Spark batch job over just their offsets, from this thread, before the poll is applied.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import psycopg
from kafka import KafkaConsumer, TopicPartition
from pyspark import InheritableThread
from pyspark.sql import functions as F
from pyspark.sql.streaming.query import StreamingQuery

from spark.decode import between_json, every_event, kafka_options, parse_events, read_batch
from spark.event_pipeline import CURRENT, OFFSET, PARTITION, TOPIC, EventSink, first_line
from spark.session import full_planning
from spark.sink import mark_running
from stack.settings import IDLE_POLL_MS, KAFKA_REQUEST_TIMEOUT_MS

if TYPE_CHECKING:
    from spark.event_pipeline import EventPipeline

log = logging.getLogger(__name__)

QUERY = "events"
# How often Spark checkpoints the query's progress (real-time mode's least is 5 s). Each epoch
# boundary stalls the query for up to its Kafka fetch wait plus 0.4-0.8 s, and Postgres, not
# the checkpoint, holds progress: so rarely.
EPOCH = "30 minutes"
MAX_POLL_RECORDS = 5000
LOG_EVERY_S = 10.0  # what was applied, logged at most this often
GENERATION = "g"  # the field of a rows record naming the query start that wrote it


class RealTimeEvents:
    """The live event pipeline in real-time mode: micro-batches up to the log's end, then the
    real-time query and the thread that applies its rows (see the module's docstring). Looks
    like the `StreamingQuery` it replaces to the projector: `isActive`, `exception()`,
    `stop()`."""

    def __init__(self, pipeline: EventPipeline, sink: EventSink) -> None:
        self.pipeline, self.sink = pipeline, sink
        self.settings = pipeline.settings
        self.rows_topic = pipeline.topics.projector_rows
        self.applied = 0  # polls applied (transactions)
        self.upcast_polls = 0  # of them with events at an older schema version
        self.query_failed = False  # stopped by its real-time query's own error
        self._since_log: dict[str, int] = {}
        self._transactions = 0
        self._logged_at = time.monotonic()
        self._error: BaseException | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._query: StreamingQuery | None = None
        self._thread = InheritableThread(target=self._run, name="events-realtime", daemon=True)

    def start(self) -> RealTimeEvents:
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

    def _run(self) -> None:
        try:
            stopped_by: BaseException | None = None
            live: set[str] = set()
            while not self._stopping.is_set():
                self._catch_up()
                if self._stopping.is_set():
                    break
                names = {p.name for p in self.sink.active}
                if stopped_by is not None and names == live:
                    self.query_failed = True  # the micro-batches found no projection at fault
                    raise stopped_by
                if not names:
                    raise RuntimeError(f"every projection failed: {self.sink.failed}")
                live = names
                stopped_by = self._live(names)
        except BaseException as e:
            if not self._stopping.is_set():
                log.error("the real-time event pipeline stopped: %s", first_line(e))
                self._error = e
        finally:
            self.sink.db.close()

    def _track(self, query: StreamingQuery) -> StreamingQuery:
        with self._lock:
            self._query = query
        if self._stopping.is_set():
            query.stop()
        return query

    def _catch_up(self) -> None:
        """Micro-batches from the projections' progress to the log's end (as it is now)."""
        started = time.perf_counter()
        query = self._track(self.pipeline.micro_batches(self.sink, catch_up=True))
        query.awaitTermination()
        error = query.exception()
        if error is not None and not self._stopping.is_set():
            raise error
        full_planning(self.pipeline.spark, False)  # as the joins' small batches want it
        log.info("caught up in %.1f s", time.perf_counter() - started)

    def _live(self, names: set[str]) -> BaseException | None:
        """Run the real-time query of the projections `names` and apply its rows until it
        stops (returns why) or the pipeline is stopped (returns None)."""
        generation = uuid.uuid4().hex
        consumer = self._rows_consumer()
        try:
            query, width = self._query_of(names, generation)
            self._track(query)
            with psycopg.connect(self.settings.database(), autocommit=True) as conn:
                mark_running(conn, [p.name for p in self.sink.projections])
            log.info("real-time query running: %s", ", ".join(sorted(names)))
            last: dict[str, int] = {}
            while not self._stopping.is_set():
                if not query.isActive:
                    return query.exception() or RuntimeError("the real-time query stopped")
                polled = consumer.poll(timeout_ms=IDLE_POLL_MS).values()
                values = (record.value for records in polled for record in records)
                rows = rows_of(values, generation, width, last)
                if rows:
                    self._apply(rows)
            return None
        finally:
            consumer.close()
            with self._lock:
                running, self._query = self._query, None
            if running is not None:
                running.stop()

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
            client_id="logfold-projector-rows",
            # Rows deleted before they were read (the thread far behind): an error, which
            # restarts the pipeline from Postgres's progress, not a silent jump ahead.
            auto_offset_reset="none",
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

    def _query_of(self, names: set[str], generation: str) -> tuple[StreamingQuery, int]:
        """The real-time query of the projections `names` (the others' columns are null),
        from their progress, and how many columns its rows have."""
        records = (
            self.pipeline.spark.readStream.format("kafka")
            .options(**kafka_options(self.settings.kafka()))
            # A long-lived task's fetch returns as soon as a record arrives; a shorter wait
            # only spins while idle.
            .option("kafka.fetch.max.wait.ms", str(self.settings.spark_realtime_fetch_wait_ms))
            .option("subscribe", ",".join(self.pipeline.topic_names()))
            .option("startingOffsets", self.pipeline.starting_offsets(names))
            .load()
        )
        events = every_event(parse_events(records, self.pipeline.stream_names()))
        rows = self.sink.with_rows(events, names)
        value = F.struct(
            F.lit(generation).alias(GENERATION),
            *(F.col(f"`{c}`").alias(str(i)) for i, c in enumerate(rows.columns)),
        )
        query = (
            rows.select(
                F.concat_ws(":", "topic", F.col("partition").cast("string")).alias("key"),
                F.to_json(value).alias("value"),
            )
            .writeStream.format("kafka")
            .option("kafka.bootstrap.servers", self.settings.kafka())
            .option("kafka.linger.ms", "0")
            .option("topic", self.rows_topic)
            .option("checkpointLocation", self.pipeline.checkpoint())
            .outputMode("update")
            .queryName(QUERY)
            .trigger(realTime=EPOCH)  # type: ignore[call-overload]  # (not in pyspark's types)
            .start()
        )
        return query, len(rows.columns)

    def _apply(self, rows: list[Any]) -> None:
        errors: dict[str, str] = {}
        if any(not r[CURRENT] for r in rows):
            self.upcast_polls += 1
            rows, errors = self.sink.with_upcast(self._old_events(rows), rows, errors)
        self.applied += 1
        for name, n in self.sink.apply(rows, errors).items():
            self._since_log[name] = self._since_log.get(name, 0) + n
        self._transactions += 1
        if time.monotonic() - self._logged_at >= LOG_EVERY_S:
            done = ", ".join(f"{n} +{c}" for n, c in sorted(self._since_log.items()))
            log.info("applied in %d transactions: %s", self._transactions, done or "nothing new")
            self._since_log, self._transactions = {}, 0
            self._logged_at = time.monotonic()

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
        raw = read_batch(self.pipeline.spark, self.settings.kafka(), [], starting, ending, assign)
        return every_event(parse_events(raw, self.pipeline.stream_names()))


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
