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
- Retries (`spark/retrier.py`) apply an aggregate's parked events again, in order, once a fix
  is deployed and `logfold dead-letters retry` asks for it.

A rebuild leaves out what is parked (from each aggregate's first parked event on) and what was
skipped, so that the rebuilt view equals the live one (`excluded`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from projections.base import Offsets, Projection
from projections.base.dead_letters import Key
from spark.decode import upcast
from spark.event_rows import (
    AGGREGATE,
    CURRENT,
    OFFSET,
    PARTITION,
    TOPIC,
    aggregate_column,
    arrow_rows,
    first_line,
    merge_share,
    position,
    share_of,
    upcast_rows,
)

log = logging.getLogger(__name__)

# Poison events of different aggregates in one batch past which the fold, not the events, is
# taken to be at fault: the projection stops whole (guarantee 16) instead of parking them all.
MAX_POISONS = 10


class FoldBroken(Exception):
    """More than MAX_POISONS aggregates' events raise in one batch: the fold is at fault."""


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
