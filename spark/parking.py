"""Poison events park instead of stopping a view (guarantee 26).

When a projection's fold raises on an event, in Spark (its rows) or in Postgres (merging
them), the pipeline finds that event and parks it, with every later event of its aggregate (for
a stream, of its key), in `parked_events`, in log order; the projection's other aggregates keep
flowing and its progress moves past the parked events (they are kept there, not lost). The
parked aggregate's rows stay at their last good version.

- In Spark (`isolate`): the projection's rows are collected from halves of the events until
  each event that raises alone is found (a batch with one poison event costs about twice the
  log of its size in small jobs, over events cached once).
- In Postgres (`merge_parking`): the rows are merged in savepoints, halving the set of
  aggregates until the one whose merge fails is found, then its events one at a time in order.
- `Retrier`, in the projector: applies the parked events of the aggregates whose retry was
  asked for (`logfold dead-letters retry`), in log order, in chunks of `CHUNK` read from Kafka
  by offset, each chunk's rows and the removal of its letters in one transaction holding the
  projection's progress: a crash mid-retry loses and doubles nothing. An event that fails
  again stops its aggregate's retry there, with its new error.

A rebuild leaves out what is parked (from each aggregate's first parked event on) and what was
skipped, so that the rebuilt view equals the live one (`excluded`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import psycopg
from kafka import KafkaConsumer, TopicPartition
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from config.settings import Settings, kafka_fetch_bounds
from config.topics import Topics
from projections.base import Offsets, Projection, versions
from projections.base import dead_letters as store
from projections.base.dead_letters import Key, Letter
from spark.decode import every_event, parse_events, upcast
from spark.event_rows import (
    AGGREGATE,
    CURRENT,
    KAFKA_RECORD_SCHEMA,
    OFFSET,
    PARTITION,
    POSITION,
    TOPIC,
    aggregate_column,
    arrow_rows,
    first_line,
    merge_share,
    position,
    rows_json,
    share_of,
    upcast_rows,
)
from spark.sink import live_version

log = logging.getLogger(__name__)

CHUNK = 1000  # parked events a retry reads and applies at once
# Poison events of different aggregates in one batch past which the fold, not the events, is
# taken to be at fault: the projection stops whole (guarantee 16) instead of parking them all.
MAX_POISONS = 10


class FoldBroken(Exception):
    """More than MAX_POISONS aggregates' events raise in one batch: the fold is at fault."""


POLL_S = 1.0  # how often the projector looks for retries asked for


@dataclass(frozen=True)
class Poison:
    """An event a projection's fold could not apply."""

    topic: str
    partition: int
    offset: int
    aggregate: str
    error: str

    @property
    def key(self) -> Key:
        return (self.topic, self.aggregate)

    def behind(self) -> str:
        """The error of the later events of its aggregate, parked behind it."""
        return f"behind {self.topic}:{self.partition}:{self.offset}"


def key_of(row: Sequence[Any]) -> Key:
    return (row[TOPIC], row[AGGREGATE])


def _ranges(events: list[tuple[str, int, int]]) -> Column:
    """A filter for the events in `events` ((topic, partition, offset), sorted): one offset
    range per topic-partition (the events between them are the caller's to leave out)."""
    bounds: dict[tuple[str, int], list[int]] = {}
    for t, p, o in events:
        lo_hi = bounds.setdefault((t, p), [o, o])
        lo_hi[0], lo_hi[1] = min(lo_hi[0], o), max(lo_hi[1], o)
    condition = F.lit(False)
    for (t, p), (lo, hi) in bounds.items():
        condition = condition | (
            (F.col("topic") == t) & (F.col("partition") == p) & F.col("offset").between(lo, hi)
        )
    return condition


def isolate(
    frame: DataFrame,
    columns: list[Column],
    parked: set[Key],
) -> tuple[list[Any], dict[Key, Poison]]:
    """Of `frame`'s events (`every_event`, or their upcast form), those whose rows
    (`columns`) Spark can compute: their rows (position, then `columns`), and the events that
    raise alone (the first of each aggregate). Events of the aggregates `parked`, and those of
    an aggregate at or after its poison event, are left out. Raises `FoldBroken` past
    MAX_POISONS aggregates with a poison event."""
    frame = frame.persist()
    try:
        keys = frame.select(*position()).collect()
        candidates = sorted(
            (r[TOPIC], r[PARTITION], r[OFFSET]) for r in keys if key_of(r) not in parked
        )
        aggregates = {(r[TOPIC], r[PARTITION], r[OFFSET]): r[AGGREGATE] for r in keys}
        poisons: dict[Key, Poison] = {}
        rows: list[Any] = []

        def rows_of(events: list[tuple[str, int, int]]) -> list[Any]:
            chosen = set(events)
            where = _ranges(events)
            if parked:  # (their events may raise too: never computed)
                joined = F.concat_ws("\u0001", F.col("topic"), aggregate_column())
                where = where & ~joined.isin(*(f"{t}\u0001{a}" for t, a in parked))
            found = arrow_rows(frame.where(where).select(*position(), *columns))
            return [r for r in found if (r[TOPIC], r[PARTITION], r[OFFSET]) in chosen]

        def attempt(events: list[tuple[str, int, int]]) -> None:
            # (Left to right: an aggregate's earlier poison is found first, and its later
            # events need no look.)
            events = [e for e in events if not _after_poison(e, aggregates[e], poisons)]
            if not events:
                return
            if len(poisons) > MAX_POISONS:
                raise FoldBroken(next(iter(poisons.values())).error)
            try:
                rows.extend(rows_of(events))
                return
            except Exception as e:
                if len(events) == 1:
                    t, p, o = events[0]
                    poison = Poison(t, p, o, aggregates[events[0]], first_line(e))
                    known = poisons.get(poison.key)
                    if known is None or (known.partition, known.offset) > (p, o):
                        poisons[poison.key] = poison
                    return
            half = len(events) // 2
            attempt(events[:half])
            attempt(events[half:])

        attempt(candidates)
    finally:
        frame.unpersist()
    return [r for r in rows if not _behind(r, poisons)], poisons


def isolate_upcast(
    frame: DataFrame,
    rows: list[Any],
    columns: list[Column],
    parked: set[Key],
    poisons: dict[Key, Poison],
) -> tuple[list[Any], dict[Key, Poison]]:
    """`rows` (of `frame`'s events, `isolate`'s) with those of events at an older schema
    version replaced by their upcast form's, and the events whose upcast rows raise added to
    `poisons` (the rows behind any poison left out)."""
    if all(r[CURRENT] for r in rows):
        return rows, poisons
    try:
        return upcast_rows(frame, rows, columns), poisons
    except Exception as e:
        log.warning("upcast rows failed (%s); finding the events", first_line(e))
    fixed, found = isolate(
        upcast(frame).withColumn("current", F.lit(True)), columns, parked | set(poisons)
    )
    for key, poison in found.items():
        known = poisons.get(key)
        if known is None or (known.partition, known.offset) > (poison.partition, poison.offset):
            poisons = {**poisons, key: poison}
    upcast_ = {(r[TOPIC], r[PARTITION], r[OFFSET]): r for r in fixed}
    out = []
    for r in rows:
        if not r[CURRENT]:
            r = upcast_.get((r[TOPIC], r[PARTITION], r[OFFSET]))
            if r is None:  # raised, or behind an event that did
                continue
        if not _behind(r, poisons):
            out.append(r)
    return out, poisons


def _after_poison(event: tuple[str, int, int], aggregate: str, poisons: dict[Key, Poison]) -> bool:
    poison = poisons.get((event[0], aggregate))
    return poison is not None and (event[1], event[2]) > (poison.partition, poison.offset)


def _behind(row: Sequence[Any], poisons: dict[Key, Poison]) -> bool:
    """Whether `row` is its aggregate's poison event or comes after it."""
    poison = poisons.get(key_of(row))
    return poison is not None and (row[PARTITION], row[OFFSET]) >= (
        poison.partition,
        poison.offset,
    )


def merge_parking(
    conn: psycopg.Connection[Any],
    p: Projection,
    reads: frozenset[str],
    streams: frozenset[str],
    rows: list[Any],
    first: int,
    offsets: Offsets,
    keep: Any,
) -> tuple[int, int, list[Poison]]:
    """Merge `p`'s share of `rows` (as `share_of` takes it) into its tables; when Postgres
    refuses it, find the events it refuses (see the module's docstring) and merge everything
    else. Returns the events merged, the late ones, and the events refused (the first of each
    aggregate: the caller parks it and what follows)."""

    def merge(chosen: list[Any]) -> tuple[int, int]:
        share = share_of(p, reads, streams, chosen, first, offsets)
        if share is None:
            return 0, 0
        with conn.transaction():
            late = merge_share(conn, p, share, "", keep)
        return share.count, late

    try:
        applied, late = merge(rows)
        return applied, late, []
    except (psycopg.OperationalError, psycopg.InterfaceError):
        raise
    except psycopg.Error as e:
        log.warning("%s: Postgres refused a batch's rows (%s); finding the events", p.name, e)
    order: dict[Key, list[Any]] = {}
    for r in rows:
        order.setdefault(key_of(r), []).append(r)
    totals = [0, 0]
    refused: list[Poison] = []

    def attempt(keys: list[Key]) -> None:
        if not keys:
            return
        chosen = set(keys)
        try:
            applied, late = merge([r for r in rows if key_of(r) in chosen])
            totals[0] += applied
            totals[1] += late
            return
        except (psycopg.OperationalError, psycopg.InterfaceError):
            raise
        except psycopg.Error as e:
            if len(keys) == 1:
                one_by_one(keys[0], e)
                return
        half = len(keys) // 2
        attempt(keys[:half])
        attempt(keys[half:])

    def one_by_one(key: Key, error: psycopg.Error) -> None:
        for r in order[key]:
            try:
                applied, late = merge([r])
            except (psycopg.OperationalError, psycopg.InterfaceError):
                raise
            except psycopg.Error as e:
                refused.append(
                    Poison(r[TOPIC], r[PARTITION], r[OFFSET], r[AGGREGATE], first_line(e))
                )
                return
            totals[0] += applied
            totals[1] += late
        # Each alone was merged: the aggregate's events failed only together. Nothing parks.
        log.warning("%s: %s merged one event at a time (%s)", p.name, key, first_line(error))

    attempt(list(order))
    return totals[0], totals[1], refused


def letters_of(
    rows: list[Any], poisons: dict[Key, Poison], parked: set[Key]
) -> list[tuple[str, int, int, str, str]]:
    """What to park of `rows` (in log order): the poison events, the events behind them, and
    every event of an aggregate parked already."""
    found = []
    for r in rows:
        poison = poisons.get(key_of(r))
        if poison is not None and (r[PARTITION], r[OFFSET]) == (poison.partition, poison.offset):
            found.append((r[TOPIC], r[PARTITION], r[OFFSET], r[AGGREGATE], poison.error))
        elif poison is not None and _behind(r, poisons):
            found.append((r[TOPIC], r[PARTITION], r[OFFSET], r[AGGREGATE], poison.behind()))
        elif key_of(r) in parked:
            found.append(
                (r[TOPIC], r[PARTITION], r[OFFSET], r[AGGREGATE], "behind earlier parked events")
            )
    return found


# -- a rebuild ----------------------------------------------------------------------------------


# What a rebuild leaves out: per parked aggregate (topic, aggregate, partition, first parked
# offset), and every skipped event (topic, partition, offset).
Excluded = tuple[list[tuple[str, str, int, int]], list[tuple[str, int, int]]]


def excluded(conn: psycopg.Connection[Any], projection: str) -> Excluded:
    """What a rebuild of `projection` leaves out, as the live view does: per parked aggregate
    (topic, aggregate, partition, first parked offset), and every skipped event (topic,
    partition, offset)."""
    parked = conn.execute(
        'SELECT topic, aggregate, min(partition), min("offset") FROM parked_events '
        "WHERE projection = %s GROUP BY topic, aggregate ORDER BY topic, aggregate",
        (projection,),
    ).fetchall()
    skipped = conn.execute(
        'SELECT topic, partition, "offset" FROM skipped_events WHERE projection = %s '
        'ORDER BY topic, partition, "offset"',
        (projection,),
    ).fetchall()
    return [(t, a, p, o) for t, a, p, o in parked], [(t, p, o) for t, p, o in skipped]


def without_excluded(
    spark: SparkSession,
    events: DataFrame,
    parked: list[tuple[str, str, int, int]],
    skipped: list[tuple[str, int, int]],
) -> DataFrame:
    """`events` without what `excluded` names (broadcast: these are few)."""
    if parked:
        frame = spark.createDataFrame(
            parked, "p_topic string, p_aggregate string, p_partition int, p_offset long"
        )
        joined = events.join(
            F.broadcast(frame),
            (events["topic"] == frame["p_topic"])
            & (events["partition"] == frame["p_partition"])
            & (aggregate_column() == frame["p_aggregate"])
            & (events["offset"] >= frame["p_offset"]),
            "left_anti",
        )
        events = joined
    if skipped:
        frame = spark.createDataFrame(skipped, "s_topic string, s_partition int, s_offset long")
        events = events.join(
            F.broadcast(frame),
            (events["topic"] == frame["s_topic"])
            & (events["partition"] == frame["s_partition"])
            & (events["offset"] == frame["s_offset"]),
            "left_anti",
        )
    return events


# -- retries ------------------------------------------------------------------------------------


class Retrier:
    """The projector's thread that applies parked events whose retry was asked for."""

    def __init__(
        self,
        spark: SparkSession,
        settings: Settings,
        projections: Sequence[Projection],
        keep: Callable[[Projection], Any],
    ) -> None:
        self.spark, self.settings = spark, settings
        self.projections = {p.name: p for p in projections}
        self.topics = Topics(settings.topic_prefix)
        self.keep = keep
        self.columns = {p.name: [rows_json(o) for o in p.outputs] for p in projections}
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.retried = 0  # events applied by retries (tests, logs)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="dead-letters", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _run(self) -> None:
        self.spark.sparkContext.setLocalProperty("spark.scheduler.pool", "dead-letters")
        while not self._stopping.wait(POLL_S):
            try:
                self.run_once()
            except Exception:
                log.exception("dead letters: a retry failed; it is tried again")

    def run_once(self) -> int:
        """Carry out the skips asked for, then apply the retries asked for; returns the events
        applied."""
        with psycopg.connect(self.settings.database(), autocommit=True) as conn:
            for name in store.skip_requests(conn, self.projections):
                with conn.transaction():
                    skipped = store.carry_out_skips(conn, name)
                log.warning("dead letters: %s skipped %d parked events", name, len(skipped))
            asked = store.retry_requests(conn, self.projections)
        applied = 0
        for name, key in asked:
            applied += self.retry(self.projections[name], key)
        return applied

    def retry(self, p: Projection, key: Key) -> int:
        """Apply the parked events of one aggregate in order, a chunk at a time, until none is
        left or one fails again."""
        applied = 0
        with psycopg.connect(self.settings.database()) as conn:
            while not self._stopping.is_set():
                with conn.transaction():
                    chunk = store.first_parked(conn, p.name, key, CHUNK)
                if not chunk or chunk[0].retry_requested_at is None:
                    break
                rows, poisons = self._rows(p, chunk)
                done, stopped = self._apply(conn, p, key, chunk, rows, poisons)
                applied += done
                self.retried += done
                if stopped:
                    break
        if applied:
            log.info("dead letters: %s applied %d parked events of %s", p.name, applied, key)
        return applied

    def _rows(self, p: Projection, chunk: list[Letter]) -> tuple[list[Any], dict[Key, Poison]]:
        """The rows of the chunk's events (read from Kafka by offset) that Spark computes, and
        the first that raises."""
        records = read_records(self.settings, [(c.topic, c.partition, c.offset) for c in chunk])
        streams = {self.topics.stream(s): s for s in p.streams}
        frame = every_event(
            parse_events(self.spark.createDataFrame(records, KAFKA_RECORD_SCHEMA), streams)
        )
        columns = self.columns[p.name]
        rows, poisons = isolate(frame, columns, set())
        return isolate_upcast(frame, rows, columns, set(), poisons)

    def _apply(
        self,
        conn: psycopg.Connection[Any],
        p: Projection,
        key: Key,
        chunk: list[Letter],
        rows: list[Any],
        poisons: dict[Key, Poison],
    ) -> tuple[int, bool]:
        """Merge the chunk's rows up to its first failing event, and unpark them, in one
        transaction holding the projection's progress; (events applied, whether it stopped)."""
        spark_poison = poisons.get(key)
        with conn.transaction():
            if not store.lock(conn, p.name):
                return 0, True
            if live_version(conn, p.name) not in (None, versions.of(p)):
                log.warning("dead letters: %s is at another version; not retried here", p.name)
                return 0, True
            still = {
                (c.topic, c.partition, c.offset)
                for c in store.first_parked(conn, p.name, key, CHUNK, lock_rows=True)
            }
            chosen = [c for c in chunk if (c.topic, c.partition, c.offset) in still]
            if spark_poison is not None:
                at = (spark_poison.partition, spark_poison.offset)
                chosen = [c for c in chosen if (c.partition, c.offset) < at]
            wanted = {(c.topic, c.partition, c.offset) for c in chosen}
            mine = [r for r in rows if (r[TOPIC], r[PARTITION], r[OFFSET]) in wanted]
            reads = frozenset(f"{c.topic}:{c.partition}" for c in chosen)
            streams = frozenset(self.topics.stream(s) for s in p.streams)
            _, late, refused = merge_parking(
                conn, p, reads, streams, mine, POSITION, {}, self.keep(p)
            )
            failed: tuple[Letter, str] | None = None
            if refused:
                at = (refused[0].partition, refused[0].offset)
                failed_letter = next(c for c in chosen if (c.partition, c.offset) == at)
                failed = (failed_letter, refused[0].error)
                chosen = [c for c in chosen if (c.partition, c.offset) < at]
            elif spark_poison is not None:
                at = (spark_poison.partition, spark_poison.offset)
                failed_letter = next(c for c in chunk if (c.partition, c.offset) == at)
                failed = (failed_letter, spark_poison.error)
            store.unpark(conn, chosen)
            conn.execute(
                "UPDATE projection_progress SET events_applied = events_applied + %s, "
                "late_events = late_events + %s, updated_at = now() WHERE projection = %s",
                (len(chosen), late, p.name),
            )
            if failed is not None:
                store.retry_failed(conn, p.name, key, failed[0], failed[1])
        return len(chosen), failed is not None


def read_records(
    settings: Settings, wanted: list[tuple[str, int, int]]
) -> list[tuple[str, int, int, datetime, bytes]]:
    """The Kafka records at `wanted` ((topic, partition, offset)), as Spark's Kafka source
    gives them (`KAFKA_RECORD_SCHEMA`): read by offset, committed ones only."""
    consumer = KafkaConsumer(
        bootstrap_servers=settings.kafka(),
        enable_auto_commit=False,
        isolation_level="read_committed",
        consumer_timeout_ms=int(settings.kafka_timeout_s * 1000),
        **kafka_fetch_bounds(),
    )
    found: dict[tuple[str, int, int], tuple[str, int, int, datetime, bytes]] = {}
    try:
        by_partition: dict[TopicPartition, set[int]] = {}
        for t, p, o in wanted:
            by_partition.setdefault(TopicPartition(t, p), set()).add(o)
        for tp, offsets in by_partition.items():
            consumer.assign([tp])
            for offset in sorted(offsets):
                if (tp.topic, tp.partition, offset) in found:
                    continue
                consumer.seek(tp, offset)
                deadline = time.monotonic() + settings.kafka_timeout_s
                while (tp.topic, tp.partition, offset) not in found:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"could not read {tp.topic}:{tp.partition} at {offset}")
                    for records in consumer.poll(timeout_ms=500).values():
                        for r in records:
                            if r.offset in offsets:
                                when = datetime.fromtimestamp(r.timestamp / 1000, UTC)
                                found[(r.topic, r.partition, r.offset)] = (
                                    r.topic,
                                    r.partition,
                                    r.offset,
                                    when,
                                    r.value,
                                )
                    gone = consumer.position(tp) > offset
                    if gone and (tp.topic, tp.partition, offset) not in found:
                        log.warning("%s:%s: no record at %s", tp.topic, tp.partition, offset)
                        break  # gone from the log: nothing to apply for it
    finally:
        consumer.close()
    return [found[w] for w in wanted if w in found]
