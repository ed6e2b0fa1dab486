"""The live event pipeline's sink: each micro-batch (or real-time poll) of events applied to
every projection in one Postgres transaction (see `spark/event_pipeline.py`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from config.settings import Settings
from config.topics import Topics
from projections.base import Offsets, Projection
from spark.decode import every_event, parse_events, read_batch
from spark.event_rows import (
    CURRENT,
    POSITION,
    arrow_rows,
    first_line,
    keep_ids,
    merge_share,
    position,
    rows_json,
    sample_batch,
    share_of,
    upcast_rows,
)
from spark.gaps import Gaps, check_gaps
from spark.session import BatchPlanning
from spark.sink import (
    Reconnecting,
    lock_many,
    mark_failed,
    save_progress,
)

log = logging.getLogger(__name__)


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
