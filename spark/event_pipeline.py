"""The live event pipeline: one Structured Streaming query folds the event log into every
projection's views.

Each micro-batch is read from Kafka once (read_committed), parsed by Spark's JSON reader (the
Python upcasters run only for events at an older schema version) and cached; then, in one
Postgres transaction:

1. lock every projection's progress row;
2. give each projection the batch's events after its own offsets (none, some or all);
3. run every projection's transforms in one Spark job (their rows as JSON, tagged by output);
4. merge each projection's rows and advance its offsets, each in a savepoint.

Each projection keeps its own progress, so it can be behind the others (it catches up as the
query reads from the lowest offsets), fail alone (guarantee 16: a transform or a row that
raises marks that projection failed, with the error and the offsets it could not get past, and
the others go on), or be rebuilt alone. A failed projection is left out until the pipeline
restarts; then it resumes from its own progress and rejoins.

No trigger interval: a batch starts as soon as the previous one ended and records are there.
Postgres's progress, not Spark's checkpoint, says where the query starts, so the checkpoint is
scratch space (in memory where the machine has /dev/shm).
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import reduce
from typing import Any

import psycopg
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming.query import StreamingQuery

from projections.base import Offsets, Projection
from spark.decode import events_of, kafka_options, parse_events
from spark.sink import (
    Reconnecting,
    ensure_progress,
    lock_many,
    mark_failed,
    mark_started,
    merge_json,
    read_progress,
    save_progress,
    unapplied,
    wire_rows,
)
from stack.settings import Settings
from stack.topics import Topics

log = logging.getLogger(__name__)

QUERY = "events"
MAX_RECORDS_PER_BATCH = 200_000

Bounds = dict[str, tuple[int, int, int]]  # "topic:partition" -> (first offset, last, records)


def rows_of(projection: Projection, events: DataFrame) -> DataFrame:
    """Every output's rows of `projection` from `events`: (projection, output, row as JSON)."""
    parts = [
        wire_rows(o.transform(events).select(*o.columns)).select(
            F.lit(projection.name).alias("projection"),
            F.lit(o.name).alias("output"),
            F.to_json(F.struct(*o.columns)).alias("row"),
        )
        for o in projection.outputs
    ]
    return reduce(DataFrame.unionAll, parts)


@dataclass
class Share:
    """What one projection takes from a batch."""

    projection: Projection
    offsets: Offsets  # its progress before the batch
    after: Offsets  # its progress after it
    events: DataFrame
    count: int


def first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return f"{type(error).__name__}: {text}"


class EventSink:
    """`foreachBatch` function of the event pipeline (see the module's docstring)."""

    def __init__(self, projections: Sequence[Projection], settings: Settings) -> None:
        self.projections = list(projections)
        self.url = settings.database()
        self.topics = Topics(settings.topic_prefix)
        self.partitions = settings.partitions
        self.failed: set[str] = set()
        self.timings: dict[str, float] = {}  # of the last batch, by stage
        self.db = Reconnecting(self.url)

    @property
    def active(self) -> list[Projection]:
        return [p for p in self.projections if p.name not in self.failed]

    def __call__(self, batch: DataFrame, batch_id: int) -> None:
        started = time.perf_counter()
        parsed = parse_events(batch).persist()
        try:
            bounds, old = self._bounds(parsed)
            self.timings["read"] = time.perf_counter() - started
            if bounds:
                self._apply(events_of(parsed, upcast=old > 0), bounds, batch_id)
        finally:
            parsed.unpersist()

    def _bounds(self, parsed: DataFrame) -> tuple[Bounds, int]:
        """Per partition, the batch's first and last offset and record count; and how many
        records need upcasting (one Spark job, which also fills the cache)."""
        rows = (
            parsed.groupBy("topic", "partition")
            .agg(
                F.min("offset").alias("lo"),
                F.max("offset").alias("hi"),
                F.count("*").alias("n"),
                F.sum(F.when(F.col("current"), 0).otherwise(1)).alias("old"),
            )
            .collect()
        )
        bounds = {f"{r['topic']}:{r['partition']}": (r["lo"], r["hi"], r["n"]) for r in rows}
        return bounds, sum(int(r["old"]) for r in rows)

    def _apply(self, events: DataFrame, bounds: Bounds, batch_id: int) -> None:
        conn = self.db.get()
        try:
            with conn.transaction():
                progress = lock_many(conn, [p.name for p in self.active])
                shares = [
                    s
                    for p in self.active
                    if (s := self._share(p, events, bounds, progress.get(p.name, {})))
                ]
                if not shares:
                    return
                t0 = time.perf_counter()
                rows, failures = self._rows(shares)
                t1 = time.perf_counter()
                applied = self._merge(conn, shares, rows, failures)
                self.timings.update(transform=t1 - t0, write=time.perf_counter() - t1)
        except psycopg.OperationalError:
            conn.close()
            raise
        if applied:
            took = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in self.timings.items())
            done = ", ".join(f"{n} +{c}" for n, c in applied.items())
            log.info("batch %s (%s): %s", batch_id, took, done)

    def _share(
        self, projection: Projection, events: DataFrame, bounds: Bounds, offsets: Offsets
    ) -> Share | None:
        """The events of `projection`'s partitions after its offsets, or None if none."""
        reads = projection.reads(self.topics, self.partitions)
        mine = {k: b for k in reads if (b := bounds.get(k))}
        fresh = {k: b for k, b in mine.items() if b[1] > offsets.get(k, -1)}
        if not fresh:
            return None
        names = sorted({k.rsplit(":", 1)[0] for k in mine})
        theirs = events.where(F.col("topic").isin(names))
        whole = all(b[0] > offsets.get(k, -1) for k, b in fresh.items())
        count = sum(b[2] for b in fresh.values())
        if not whole:  # it stopped inside this batch (restarted, or caught up from behind)
            theirs = unapplied(theirs, offsets)
            count = theirs.count()
        after = {**offsets, **{k: b[1] for k, b in fresh.items()}}
        return Share(projection, offsets, after, theirs, count)

    def _rows(self, shares: list[Share]) -> tuple[dict[str, list[Any]], dict[str, str]]:
        """Every share's rows in one Spark job; if that fails, each projection's on its own,
        to find which ones fail. Returns rows by projection and errors by projection."""
        try:
            together = reduce(DataFrame.unionAll, [rows_of(s.projection, s.events) for s in shares])
            return _by_projection(together.collect()), {}
        except Exception as e:
            if len(shares) == 1:
                raise
            log.warning("a transform failed (%s); running each projection alone", first_line(e))
        rows: dict[str, list[Any]] = {}
        failures: dict[str, str] = {}
        for share in shares:
            name = share.projection.name
            try:
                rows[name] = rows_of(share.projection, share.events).collect()
            except Exception as e:
                failures[name] = first_line(e)
        if len(failures) == len(shares):  # not one projection's fault: fail the batch
            raise RuntimeError(f"every projection failed: {failures}")
        return rows, failures

    def _merge(
        self,
        conn: psycopg.Connection[Any],
        shares: list[Share],
        rows: dict[str, list[Any]],
        failures: dict[str, str],
    ) -> dict[str, int]:
        """Merge each projection's rows and save its progress, each in a savepoint; a
        projection whose rows Postgres refuses fails alone."""
        applied = {}
        for share in shares:
            name = share.projection.name
            if name not in failures:
                try:
                    with conn.transaction():
                        late = self._merge_one(conn, share, rows.get(name, []))
                        save_progress(conn, name, share.after, share.count, late)
                    applied[name] = share.count
                    continue
                except (psycopg.OperationalError, psycopg.InterfaceError):
                    raise
                except psycopg.Error as e:
                    failures[name] = first_line(e)
            log.error("projection %s failed after %s: %s", name, share.offsets, failures[name])
            mark_failed(conn, name, failures[name], share.offsets)
            self.failed.add(name)
        if not applied and failures and len(failures) == len(shares) > 1:
            raise RuntimeError(f"every projection failed: {failures}")
        return applied

    def _merge_one(self, conn: psycopg.Connection[Any], share: Share, rows: list[Any]) -> int:
        late = 0
        for output in share.projection.outputs:
            mine = [r["row"] for r in rows if r["output"] == output.name]
            merged = merge_json(conn, output, mine, output.name)
            if output.late:
                late += merged
        return late


def _by_projection(rows: list[Any]) -> dict[str, list[Any]]:
    found: dict[str, list[Any]] = {}
    for row in rows:
        found.setdefault(row["projection"], []).append(row)
    return found


class EventPipeline:
    """Runs the live event pipeline of `projections` (see the module's docstring)."""

    def __init__(
        self,
        spark: SparkSession,
        settings: Settings,
        projections: Sequence[Projection],
        scratch: str,
    ) -> None:
        self.spark, self.settings, self.scratch = spark, settings, scratch
        self.projections = list(projections)
        self.topics = Topics(settings.topic_prefix)
        self.sink: EventSink | None = None

    def topic_names(self) -> list[str]:
        return sorted({self.topics.events(t) for p in self.projections for t in p.topics})

    def starting_offsets(self) -> str:
        """Spark's startingOffsets: per partition, after the lowest progress of the
        projections that read it (earliest where one has none)."""
        n = self.settings.partitions
        with psycopg.connect(self.settings.database(), autocommit=True) as conn:
            progress = {p.name: read_progress(conn, p.name) for p in self.projections}
        doc: dict[str, dict[str, int]] = {}
        for t in self.topic_names():
            doc[t] = {}
            for part in range(n):
                key = f"{t}:{part}"
                readers = [
                    progress[p.name].get(key, -1)
                    for p in self.projections
                    if key in p.reads(self.topics, n)
                ]
                low = min(readers, default=-1)
                doc[t][str(part)] = low + 1 if low >= 0 else -2
        return json.dumps(doc)

    def start(self) -> StreamingQuery:
        """Start the query from the projections' progress (a restart resumes the same way)."""
        names = [p.name for p in self.projections]
        with psycopg.connect(self.settings.database(), autocommit=True) as conn:
            for name in names:
                ensure_progress(conn, name)
            mark_started(conn, names)  # a failed projection is given another chance
        raw = (
            self.spark.readStream.format("kafka")
            .options(**kafka_options(self.settings.kafka()))
            .option("subscribe", ",".join(self.topic_names()))
            .option("startingOffsets", self.starting_offsets())
            .option("maxOffsetsPerTrigger", MAX_RECORDS_PER_BATCH)
            .load()
        )
        if self.sink is not None:
            self.sink.db.close()
        self.sink = EventSink(self.projections, self.settings)
        query = (
            raw.writeStream.foreachBatch(self.sink)
            .queryName(QUERY)
            # A fresh checkpoint per start, or Spark would resume from its own offsets.
            .option("checkpointLocation", tempfile.mkdtemp(dir=self.scratch))
            .start()
        )
        return query
