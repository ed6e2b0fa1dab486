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
from projections.base import Offsets, Projection, versions
from projections.base.dead_letters import Key, park, parked_keys, request_retry
from spark.decode import every_event, parse_events, read_batch, upcast
from spark.event_rows import (
    AGGREGATE,
    CURRENT,
    OFFSET,
    PARTITION,
    POSITION,
    TOPIC,
    aggregate_column,
    arrow_rows,
    first_line,
    keep_ids,
    position,
    rows_json,
    sample_batch,
    upcast_rows,
)
from spark.gaps import Gaps, check_gaps
from spark.parking import FoldBroken, Poison, isolate, letters_of, merge_parking
from spark.session import BatchPlanning
from spark.sink import (
    Reconnecting,
    adopt_version,
    lock_folds,
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
        # Per projection, the poison events the batch being applied found in Spark (`_collect`).
        self.poisons: dict[str, dict[Key, Poison]] = {}
        self.parked = 0  # events it parked (the real-time path tells a poison event by it)
        # Each projection's version; those whose live tables are at another one (not folded).
        self.versions = {p.name: versions.of(p) for p in self.projections}
        self.waiting: set[str] = set()

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

    def with_rows(
        self,
        events: DataFrame,
        names: Collection[str] | None = None,
        parked: dict[str, set[Key]] | None = None,
    ) -> DataFrame:
        """Of `events` (`every_event`), the position columns and every output's rows: what
        `_collect` reads. In the streaming query's plan, Spark analyses these large
        expressions once, when the query starts, instead of once per batch (where a `select`
        in `foreachBatch` would put them); a batch then only optimises its plan. Nothing else
        is selected, so `foreachBatch` collects the batch as it is given: a `select` there
        converts each column through py4j, ~6 ms a live batch.

        `names`: only those projections' rows; the others' columns are null. `parked`: per
        projection, aggregates whose events get `PARKED` columns instead of their rows (a
        real-time query, which a row that raises would stop, never computes them)."""
        none = F.lit(None).cast("string")
        columns: list[Column] = []
        for p in self.projections:
            keys = (parked or {}).get(p.name)
            if (names is None or p.name in names) and keys:
                joined = F.concat_ws("\u0001", F.col("topic"), aggregate_column())
                guard = joined.isin(*(f"{t}\u0001{a}" for t, a in keys))
                columns += [
                    F.when(guard, F.lit(PARKED)).otherwise(c).alias(f"{p.name}.{o.name}")
                    for c, o in zip(self.columns[p.name], p.outputs, strict=True)
                ]
            elif names is None or p.name in names:
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
                # What `_collect` runs for a batch that folds; a failing fold is left to the
                # real batches, which say which projection fails and how (finding a made-up
                # event's fault would cost a job per half of the batch, ~20 s, for nothing).
                arrow_rows(self.with_rows(sample))
        except Exception as e:
            log.warning("warm-up failed: %s", first_line(e))
        log.info("warmed up in %.1f s", time.perf_counter() - started)

    def _collect(
        self, batch: DataFrame, projections: list[Projection], events: Callable[[], DataFrame]
    ) -> tuple[list[Any], dict[str, str]]:
        """The batch's rows (`with_rows`): position, then every output's rows (in projection
        order), through Arrow (a live batch: ~7 ms less than as pickled Rows). If that fails,
        those of `projections` each on its own, from the same records without the rows
        columns (`events()`, as `every_event` gives them: the batch Spark hands to
        `foreachBatch` computes every column, the failing ones too). A projection that fails
        alone has its poison events found (`spark/parking.py`): their rows, and those of the
        events behind them, are `PARKED` (as are those of aggregates it has parked already),
        and `self.poisons` names them for `apply`. A projection whose every event fails is
        not one event's fault: its columns are None (as are those of the projections left out)
        and its error returned."""
        self.poisons = {}
        try:
            return arrow_rows(batch), {}
        except Exception as e:
            log.warning("a projection's rows failed (%s); collecting each alone", first_line(e))
        alone = events()
        positions = arrow_rows(alone.select(*position()))
        parts: dict[str, dict[tuple[str, int, int], Any]] = {}
        errors: dict[str, str] = {}
        parked = self.parked_now()
        for p in projections:
            try:
                found = arrow_rows(alone.select(*position(), *self.columns[p.name]))
            except Exception as e:
                try:
                    found, poisons = isolate(alone, self.columns[p.name], parked.get(p.name, set()))
                except FoldBroken:
                    errors[p.name] = first_line(e)
                    continue
                if not found and len(poisons) > 1:  # every event fails: the fold is at fault
                    errors[p.name] = first_line(e)
                    continue
                self.poisons[p.name] = poisons
            parts[p.name] = {(r[TOPIC], r[PARTITION], r[OFFSET]): r for r in found}
        if not parts:  # not one projection's fault: fail the batch
            raise RuntimeError(f"every projection failed: {errors}")
        rows = []
        for where in positions:
            row = list(where[:POSITION])
            at = (where[TOPIC], where[PARTITION], where[OFFSET])
            for p in self.projections:
                part = parts.get(p.name)
                if part is None:
                    row += [None] * len(p.outputs)
                elif at in part:
                    row += part[at][POSITION:]
                else:  # parked (or poison): computed by a retry, if ever
                    row += [PARKED] * len(p.outputs)
            rows.append(row)
        return rows, errors

    def parked_now(self) -> dict[str, set[Key]]:
        """The aggregates each projection has parked, as of now (`apply` looks again)."""
        conn = self.db.get()
        with conn.transaction():
            return parked_keys(conn, [p.name for p in self.projections])

    def with_upcast(
        self, events: DataFrame, rows: list[Any], errors: dict[str, str]
    ) -> tuple[list[Any], dict[str, str]]:
        """`rows` with those of the events at an older schema version (of `events`, the
        batch's records as `every_event` gives them) replaced by their upcast form's. A
        projection whose upcast rows fail has its poison events found, as `_collect` does
        (added to `self.poisons`; their rows and those behind them `PARKED`). The columns of
        failed projections stay None."""

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
        names = [p.name for p in self.projections]
        breaking = []
        for p in self.active:
            if p.name in failed:
                continue
            try:
                upcast_without([n for n in names if n != p.name])
            except Exception:
                breaking.append(p)
        fixed = [list(r) for r in upcast_without({*failed, *(p.name for p in breaking)})]
        parked = self.parked_now()
        old = upcast(events).withColumn("current", F.lit(True))
        for p in breaking:
            try:
                found, poisons = isolate(old, self.columns[p.name], parked.get(p.name, set()))
            except FoldBroken as e:
                errors = {**errors, p.name: f"the fold raises on every event: {e}"}
                for row in fixed:  # (its columns are None, as a failed projection's)
                    row[self.first[p.name] : self.first[p.name] + len(p.outputs)] = [None] * len(
                        p.outputs
                    )
                continue
            upcast_ = {(r[TOPIC], r[PARTITION], r[OFFSET]): r for r in found}
            mine = {**self.poisons.get(p.name, {})}
            for key, poison in poisons.items():
                known = mine.get(key)
                if known is None or (known.partition, known.offset) > (
                    poison.partition,
                    poison.offset,
                ):
                    mine[key] = poison
            self.poisons[p.name] = mine
            at = self.first[p.name]
            width = len(p.outputs)
            for before, row in zip(rows, fixed, strict=True):
                if before[CURRENT]:
                    continue
                found_row = upcast_.get((row[TOPIC], row[PARTITION], row[OFFSET]))
                row[at : at + width] = (
                    found_row[POSITION:] if found_row is not None else [PARKED] * width
                )
        return fixed, errors

    def apply(
        self, rows: list[Any], errors: dict[str, str], label: str | None = None
    ) -> dict[str, int]:
        """Apply `rows` (`with_rows`'s columns, in log order per partition) in one transaction:
        each active projection the rows after its progress, in its own savepoint; those named
        in `errors` are marked failed. The events of aggregates a projection has parked, and
        its poison events (`self.poisons`, or those Postgres refuses) with every later event of
        theirs, are parked (`spark/parking.py`); its progress moves past them. Returns the
        records taken per projection; logs them under `label` (None: not)."""
        projections = self.active
        poisons, self.poisons = self.poisons, {}
        conn = self.db.get()
        try:
            with conn.transaction():
                t0 = time.perf_counter()
                progress = lock_folds(conn, [p.name for p in projections])
                parked = parked_keys(conn, [p.name for p in projections])
                applied: dict[str, int] = {}
                for p in projections:
                    first = self.first[p.name]
                    offsets, live = progress.get(p.name, ({}, None))
                    if not self._folds_live(conn, p.name, live):
                        continue
                    mine = unapplied_rows(self.reads[p.name], rows, offsets)
                    after, starts = bounds(offsets, mine)
                    if p.name in errors:
                        self._fail(conn, p.name, errors[p.name], offsets, starts)
                        continue
                    if not mine:
                        continue
                    check_gaps(self.gaps, conn, p.name, offsets, starts)
                    letters, merged = parking_of(
                        mine, first, poisons.get(p.name, {}), parked.get(p.name, set())
                    )
                    try:
                        with conn.transaction():
                            count, late, refused = merge_parking(
                                conn,
                                p,
                                self.reads[p.name],
                                self.streams[p.name],
                                merged,
                                first,
                                offsets,
                                self.keep[p.name],
                            )
                            if refused:
                                more, _ = parking_of(merged, first, refusals(refused), set())
                                letters += more
                            parked_n = park(conn, p.name, letters)
                            self.parked += parked_n
                            retry = [(t, a) for t, _, _, a, e in letters if e == UNPARKED]
                            for _, aggregate in retry:
                                request_retry(conn, p.name, aggregate)
                            save_progress(conn, p.name, after, count, late)
                        applied[p.name] = len(mine)
                        if parked_n:
                            log.warning("projection %s parked %d events", p.name, parked_n)
                    except (psycopg.OperationalError, psycopg.InterfaceError):
                        raise
                    except psycopg.Error as e:
                        self._fail(conn, p.name, first_line(e), offsets, starts)
                self.timings["postgres"] = time.perf_counter() - t0
        except psycopg.OperationalError:
            conn.close()
            raise
        if applied and label is not None:
            took = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in self.timings.items())
            done = ", ".join(f"{n} +{c}" for n, c in applied.items())
            log.debug("%s (%s): %s", label, took, done)  # a line a batch: for debugging
        return applied

    def _folds_live(self, conn: psycopg.Connection[Any], name: str, live: str | None) -> bool:
        """Whether this pipeline folds `name`'s live tables: they are at its version (or at
        none yet: then they are from now on). Otherwise another version serves them until this
        one is built beside them and swapped in (the projector's `Deployer`), or a newer one
        has been: it leaves them alone."""
        mine = self.versions[name]
        if live is None:
            adopt_version(conn, name, mine)
            return True
        if live == mine:
            self.waiting.discard(name)
            return True
        if name not in self.waiting:
            self.waiting.add(name)
            log.warning(
                "projection %s: its live tables are at version %s, this projector folds %s: "
                "left to the build of %s (or to a newer projector)",
                name,
                live,
                mine,
                mine,
            )
        return False

    def _fail(
        self,
        conn: psycopg.Connection[Any],
        name: str,
        error: str,
        offsets: Offsets,
        starts: Offsets | None = None,
    ) -> None:
        log.error("projection %s failed after %s: %s", name, offsets, error)
        mark_failed(conn, name, error, offsets, starts)
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


# A projection's columns in a collected row for an event whose rows were not computed: its
# aggregate is parked, or it is (or comes after) a poison event (`EventSink._collect`).
PARKED = "\u0000parked"
# The error of an event whose rows were left out while its aggregate was parked, and that
# `apply` found no longer parked (a retry finished meanwhile): parked again, and retried.
UNPARKED = "left out while its aggregate was parked; retried"


def unapplied_rows(reads: frozenset[str], rows: list[Any], offsets: Offsets) -> list[Any]:
    """The rows of the records of `reads` ("topic:partition") after `offsets`."""
    return [
        r
        for r in rows
        if (key := f"{r[TOPIC]}:{r[PARTITION]}") in reads and r[OFFSET] > offsets.get(key, -1)
    ]


def bounds(offsets: Offsets, rows: list[Any]) -> tuple[Offsets, Offsets]:
    """The progress after `rows`, and the first offset of each partition among them."""
    after, starts = dict(offsets), dict[str, int]()
    for r in rows:
        key = f"{r[TOPIC]}:{r[PARTITION]}"
        after[key] = max(after.get(key, -1), r[OFFSET])
        starts[key] = min(starts.get(key, r[OFFSET]), r[OFFSET])
    return after, starts


def refusals(refused: list[Poison]) -> dict[Key, Poison]:
    return {poison.key: poison for poison in refused}


def parking_of(
    rows: list[Any], first: int, poisons: dict[Key, Poison], parked: set[Key]
) -> tuple[list[tuple[str, int, int, str, str]], list[Any]]:
    """Of one projection's `rows` (its columns from `first`): what parks (the letters:
    (topic, partition, offset, aggregate, error)), and the rest, to merge. A row whose
    columns are `PARKED` and that nothing parks any more is parked again as `UNPARKED`."""
    letters = letters_of(rows, poisons, parked)
    taken = {(t, p, o) for t, p, o, _, _ in letters}
    merged = []
    for r in rows:
        if (r[TOPIC], r[PARTITION], r[OFFSET]) in taken:
            continue
        if r[first] == PARKED:
            letters.append((r[TOPIC], r[PARTITION], r[OFFSET], r[AGGREGATE], UNPARKED))
            continue
        merged.append(r)
    return letters, merged
