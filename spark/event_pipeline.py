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
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import ClassVar, Protocol, TypeVar

import psycopg
from pyspark.sql import SparkSession
from pyspark.sql.streaming.query import StreamingQuery

from config.settings import Settings
from config.topics import Topics
from projections.base import Join, Projection
from spark.decode import every_event, kafka_options, parse_events
from spark.event_sink import BatchRecords, EventSink
from spark.session import BatchPlanning, executors, full_planning, idle_poll
from spark.sink import (
    ensure_progress,
    forget_failures,
    mark_running,
    read_progress,
)

log = logging.getLogger(__name__)

QUERY = "events"
MAX_RECORDS_PER_BATCH = 200_000
# Real-time starts in a row whose query failed on its own (no projection at fault) before the
# live path falls back to micro-batches, until the projector restarts.
MAX_REALTIME_FAILURES = 3


class LivePath:
    """How a live pipeline (EventPipeline's, JoinPipeline's) chooses between Spark's
    real-time mode and micro-batches each time its query starts, and when it may switch back
    (`realtime_again`). `slots_needed` is each pipeline's own."""

    folds: ClassVar[str]  # what its query folds, for its log lines
    spark: SparkSession
    settings: Settings
    realtime_failures: int  # real-time starts in a row whose query failed on its own
    # Why the running query folds in micro-batches (None: it runs in real-time mode); the
    # projector's status (spark/status.py) shows it.
    micro_batches_why: str | None

    def slots_needed(self) -> int | None:
        """The task slots its real-time query needs; None: it has no real-time mode."""
        raise NotImplementedError

    def realtime(self) -> bool:
        """Whether the live path runs in real-time mode: it has one, it is wanted, not failing
        on its own, and Spark has the task slots it needs (`refusal`)."""
        self.micro_batches_why = self.refusal()
        if self.micro_batches_why is not None:
            log.warning("folding %s in micro-batches: %s", self.folds, self.micro_batches_why)
        return self.micro_batches_why is None

    def refusal(self) -> str | None:
        """Why the live path may not run in real-time mode now; None when it may."""
        need = self.slots_needed()
        if need is None:
            return "real-time mode is off (LOGFOLD_SPARK_REALTIME)"
        return realtime_refusal(self.spark, self.settings, self.realtime_failures, need)

    def realtime_again(self) -> bool:
        """Whether its query folds in micro-batches though it may run in real-time mode now:
        it lacked task slots when it started, and Spark has them again (a worker came back)."""
        return self.micro_batches_why is not None and self.refusal() is None


class EventPipeline(LivePath):
    """Runs the live event pipeline of `projections` (see the module's docstring)."""

    folds = "events"

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
        self.realtime_failures = 0
        self.micro_batches_why = "not started"

    def slots_needed(self) -> int | None:
        """One a partition read, two more for other jobs (`realtime_partitions`)."""
        if self.realtime_mode is None:
            return None
        return realtime_partitions(self.settings, self.projections) + 2

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

    def checkpoint(self) -> str:
        """A fresh checkpoint for a query's start, or Spark would resume from its own offsets
        (Postgres's progress says where to start)."""
        return tempfile.mkdtemp(dir=self.scratch)

    def start(self) -> Running:
        """Start the live pipeline from the projections' progress (a restart resumes the
        same way): in real-time mode when it can (`realtime_mode`), else in micro-batches."""
        names = [p.name for p in self.projections]
        first = self.sink is None
        if self.sink is not None:
            self.sink.db.close()
        self.sink = EventSink(self.projections, self.settings)
        full_planning(self.spark, False)  # the query starts on small batches (see BatchPlanning)
        rounds = self.settings.projector_warm_up_rounds
        if first and rounds:  # a restart finds the JVM warm: warming it again only delays views
            self.sink.warm(self.spark, rounds)
        with psycopg.connect(self.settings.database(), autocommit=True) as conn:
            for name in names:
                ensure_progress(conn, name)
            forget_failures(conn, names)  # a failed projection is given another chance
        self.realtime_failures = failures_after(self.running, self.realtime_failures)
        if self.realtime():
            assert self.realtime_mode is not None
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


def realtime_refusal(
    spark: SparkSession, settings: Settings, failures: int, need: int
) -> str | None:
    """Why a live path may not run in real-time mode, or None when it may: it is wanted, its
    query is not failing on its own (`failures` starts in a row, fewer than
    MAX_REALTIME_FAILURES), and Spark has the `need`ed task slots."""
    if not settings.spark_realtime:
        return "real-time mode is off (LOGFOLD_SPARK_REALTIME)"
    if failures >= MAX_REALTIME_FAILURES:
        return (
            f"the real-time query failed {failures} times in a row on its own (see the "
            "projector's errors); it tries real-time mode again when it restarts"
        )
    have = available_slots(spark)
    if have < need:
        return (
            f"real-time mode needs {need} task slots (one per partition read, two more for "
            f"other jobs) and Spark has {have}"
        )
    return None


def available_slots(spark: SparkSession) -> int:
    """The task slots Spark's executors offer now: the cores of the local master, or those
    of the executors registered with a cluster's (none while it has none; Spark's own
    `defaultParallelism` says 2 then)."""
    context = spark.sparkContext
    if (context.master or "").startswith("local") or executors(spark) > 0:
        return int(context.defaultParallelism)
    return 0


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
