"""Applying a projection's rows to Postgres, exactly once.

Each batch runs in one Postgres transaction: lock the projections' progress rows, drop the
events at or below each one's offsets (already applied: a replayed or duplicated batch changes
nothing), merge the transforms' rows, and advance the offsets. The rebuild's final swap takes
the same lock, so a live batch never interleaves with it."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Callable, Iterable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
import psycopg
from pyspark.sql import DataFrame, Row
from pyspark.sql import functions as F
from pyspark.sql.types import TimestampType

from events.base import ERASED
from events.keys import MARK, open_rows
from projections.base import Offsets, Output, Projection
from projections.base.rows import fold
from spark.erasure import clear_values, erase_copies, erased_subjects

log = logging.getLogger(__name__)

MAX_ERROR_CHARS = 4000


def ensure_progress(conn: psycopg.Connection[Any], projection: str) -> None:
    conn.execute(
        "INSERT INTO projection_progress (projection) VALUES (%s) ON CONFLICT DO NOTHING",
        (projection,),
    )


def lock_progress(conn: psycopg.Connection[Any], projection: str) -> Offsets:
    ensure_progress(conn, projection)
    row = conn.execute(
        "SELECT offsets FROM projection_progress WHERE projection = %s FOR UPDATE", (projection,)
    ).fetchone()
    assert row is not None
    return {k: int(v) for k, v in row[0].items()}


def lock_many(conn: psycopg.Connection[Any], names: list[str]) -> dict[str, Offsets]:
    """Lock the progress rows of `names` (which exist), in name order, and return their
    offsets."""
    rows = conn.execute(
        "SELECT projection, offsets FROM projection_progress WHERE projection = ANY(%s) "
        "ORDER BY projection FOR UPDATE",
        (sorted(names),),
    ).fetchall()
    return {r[0]: {k: int(v) for k, v in r[1].items()} for r in rows}


def lock_folds(
    conn: psycopg.Connection[Any], names: list[str]
) -> dict[str, tuple[Offsets, str | None]]:
    """`lock_many`, with each one's live version (projections/base/versions.py)."""
    rows = conn.execute(
        "SELECT projection, offsets, version FROM projection_progress "
        "WHERE projection = ANY(%s) ORDER BY projection FOR UPDATE",
        (sorted(names),),
    ).fetchall()
    return {r[0]: ({k: int(v) for k, v in r[1].items()}, r[2]) for r in rows}


def live_version(conn: psycopg.Connection[Any], name: str) -> str | None:
    """The version `name`'s live tables were built by (None: not recorded yet)."""
    row = conn.execute(
        "SELECT version FROM projection_progress WHERE projection = %s", (name,)
    ).fetchone()
    return row[0] if row else None


def adopt_version(conn: psycopg.Connection[Any], name: str, version: str) -> None:
    """Record `version` as the one `name`'s live tables are built by, if none is yet (a new
    projection, or one from before versions were recorded)."""
    conn.execute(
        "UPDATE projection_progress SET version = %s WHERE projection = %s AND version IS NULL",
        (version, name),
    )


def mark_started(conn: psycopg.Connection[Any], names: list[str]) -> None:
    """`names` are being folded again: forget their last failure; their query runs."""
    forget_failures(conn, names)
    mark_running(conn, names)


def forget_failures(conn: psycopg.Connection[Any], names: list[str]) -> None:
    """`names` are given another chance: forget their last failure."""
    conn.execute(
        "UPDATE projection_progress SET error = NULL, error_offsets = NULL, failed_at = NULL "
        "WHERE projection = ANY(%s)",
        (names,),
    )


def mark_running(conn: psycopg.Connection[Any], names: list[str]) -> None:
    """The query folding `names` runs, warm: what `logfold run` waits for."""
    conn.execute(
        "UPDATE projection_progress SET started_at = now() WHERE projection = ANY(%s)", (names,)
    )


def mark_failed(
    conn: psycopg.Connection[Any],
    name: str,
    error: str,
    offsets: Offsets,
    starts: Offsets | None = None,
) -> None:
    """Record that `name` could not apply the records after `offsets` (it keeps them);
    `starts`: the first offsets of the records it failed on, for partitions it has no progress
    in."""
    first = {**(starts or {}), **{k: v + 1 for k, v in offsets.items()}}
    conn.execute(
        "UPDATE projection_progress SET error = %s, error_offsets = %s, failed_at = now() "
        "WHERE projection = %s",
        (error[:MAX_ERROR_CHARS], json.dumps(first), name),
    )


MAX_LOSSES = 20  # the last losses kept per fold (their total is counted apart)


def record_loss(conn: psycopg.Connection[Any], name: str, lost: dict[str, tuple[int, int]]) -> None:
    """Record that the records at `lost` ("topic:partition" -> [first, end) offsets) were
    removed from the log before `name` applied them; its view never had them."""
    row = conn.execute(
        "SELECT data_loss FROM projection_progress WHERE projection = %s", (name,)
    ).fetchone()
    now = datetime.now(UTC).isoformat()
    found = [
        {"partition": k, "from_offset": a, "to_offset": b - 1, "detected_at": now}
        for k, (a, b) in sorted(lost.items())
    ]
    kept = ((row[0] if row and row[0] else []) + found)[-MAX_LOSSES:]
    conn.execute(
        "UPDATE projection_progress SET data_loss = %s, lost_offsets = lost_offsets + %s "
        "WHERE projection = %s",
        (json.dumps(kept), sum(b - a for a, b in lost.values()), name),
    )


def read_progress(conn: psycopg.Connection[Any], projection: str) -> Offsets:
    row = conn.execute(
        "SELECT offsets FROM projection_progress WHERE projection = %s", (projection,)
    ).fetchone()
    return {k: int(v) for k, v in row[0].items()} if row else {}


def unapplied(events: DataFrame, offsets: Offsets) -> DataFrame:
    """The events after `offsets` (all of them for a partition it does not mention)."""
    if not offsets:
        return events
    last = F.create_map(*(F.lit(x) for kv in offsets.items() for x in kv))
    key = F.concat_ws(":", F.col("topic"), F.col("partition").cast("string"))
    return events.where(F.col("offset") > F.coalesce(last[key], F.lit(-1)))


def last_offsets(events: DataFrame) -> tuple[Offsets, int]:
    """The last offset of each topic-partition in `events`, and how many events there are."""
    rows = (
        events.groupBy("topic", "partition")
        .agg(F.max("offset").alias("o"), F.count("*").alias("n"))
        .collect()
    )
    return {f"{r['topic']}:{r['partition']}": int(r["o"]) for r in rows}, sum(r["n"] for r in rows)


def wire_rows(rows: DataFrame) -> DataFrame:
    """Timestamps as ISO text in UTC, so neither Spark nor Python guesses a time zone."""
    return rows.select(
        *(
            F.date_format(f.name, "yyyy-MM-dd'T'HH:mm:ss.SSSSSSXXX").alias(f.name)
            if isinstance(f.dataType, TimestampType)
            else F.col(f.name)
            for f in rows.schema.fields
        )
    )


def copy_rows(
    conn: psycopg.Connection[Any], table: str, columns: tuple[str, ...], rows: Iterable[Row]
) -> int:
    n = 0
    with conn.cursor().copy(f"COPY {table} ({', '.join(columns)}) FROM STDIN") as copy:
        for row in rows:
            copy.write_row(tuple(row[c] for c in columns))
            n += 1
    return n


def merge_json(conn: psycopg.Connection[Any], output: Output, rows: str, suffix: str = "") -> None:
    """Merge `rows`, a JSON array of row objects (by column name, any number per key), into the
    output's table (+ `suffix`: its shadow) by the output's rules (`Output.merge_statements`).
    Postgres converts the values. A statement that does not name the parameter (one that
    reads rows an earlier statement staged) runs without it.

    Personal columns' sealed values are opened here, in the transaction that writes them
    (`events/keys.py`): nothing before Postgres holds them in clear. Rows that erase a
    subject erase it in the copies outside the view too (`spark/erasure.py`)."""
    erasing: tuple[list[str], set[str]] | None = None
    if output.personal and (MARK in rows or ERASED in rows):
        found = orjson.loads(rows)
        open_rows(conn, found, output.personal)
        rows = orjson.dumps(found).decode()
        subjects = erased_subjects(output, found) if not suffix else []
        if subjects:
            erasing = subjects, clear_values(conn, output, subjects)
    for statement in output.merge_statements(suffix, "%s"):
        conn.execute(statement, (rows,) if "%s" in statement else None)
    if erasing is not None:
        erase_copies(conn, output, *erasing)


def count_once(
    conn: psycopg.Connection[Any], fold: str, records: list[tuple[str, int]], keep: timedelta
) -> list[bool]:
    """Which of a batch's stream `records` (id, log time in microseconds; in log order) `fold`
    counts: the first copy of each id it has not counted before. Counted ids are remembered in
    `stream_ids` for `keep` after the newest log time seen: a later copy could not be on time."""
    if not records:
        return []
    ids = [r[0] for r in records]
    seen = {
        row[0]
        for row in conn.execute(
            "SELECT id FROM stream_ids WHERE fold = %s AND id = ANY(%s)", (fold, ids)
        )
    }
    counted: list[bool] = []
    new_ids: list[str] = []
    new_times: list[datetime] = []
    for record_id, micros in records:
        first = record_id not in seen
        counted.append(first)
        if first:
            seen.add(record_id)
            new_ids.append(record_id)
            new_times.append(_from_micros(micros))
    if new_ids:
        conn.execute(
            "INSERT INTO stream_ids (fold, id, first_at) "
            "SELECT %s, * FROM unnest(%s::text[], %s::timestamptz[])",
            (fold, new_ids, new_times),
        )
    newest = _from_micros(max(r[1] for r in records))
    conn.execute("DELETE FROM stream_ids WHERE fold = %s AND first_at < %s", (fold, newest - keep))
    return counted


def move_stream_ids(conn: psycopg.Connection[Any], source: str, target: str) -> None:
    """Make the ids `source` counted (a rebuild's) those of `target` (the live projection's)."""
    conn.execute("DELETE FROM stream_ids WHERE fold = %s", (target,))
    conn.execute("UPDATE stream_ids SET fold = %s WHERE fold = %s", (target, source))


def _from_micros(micros: int) -> datetime:
    return datetime(1970, 1, 1, tzinfo=UTC) + timedelta(microseconds=micros)


def merge_output(
    conn: psycopg.Connection[Any], output: Output, events: DataFrame, suffix: str
) -> int:
    """Fold `events` into rows and merge them into the output's table (+ `suffix`: its
    shadow). Returns how many rows were merged."""
    rows = wire_rows(fold(output, events))
    found = [
        r["row"] for r in rows.select(F.to_json(F.struct(*output.columns)).alias("row")).collect()
    ]
    if found:
        merge_json(conn, output, "[" + ",".join(found) + "]", suffix)
        for statement in output.prune_statements(suffix):
            conn.execute(statement)
    return len(found)


def apply_events(
    conn: psycopg.Connection[Any],
    projection: Projection,
    events: DataFrame,
    offsets: Offsets,
    suffix: str = "",
) -> tuple[Offsets, int, int]:
    """Merge the events after `offsets` into the projection's tables (+ `suffix`). Returns the
    new offsets, the number of events applied and of late events. The caller commits."""
    fresh = unapplied(events, offsets).persist()
    try:
        seen, applied = last_offsets(fresh)
        if not seen:
            return offsets, 0, 0
        late = 0
        for output in projection.outputs:
            merged = merge_output(conn, output, fresh, suffix)
            if output.late:
                late += merged
        return {**offsets, **seen}, applied, late
    finally:
        fresh.unpersist()


def replace_contents(
    conn: psycopg.Connection[Any],
    target: str,
    source: str,
    key: tuple[str, ...],
    columns: tuple[str, ...],
    private: bool = False,
) -> int:
    """Make `target` hold exactly the rows of `source` by writing only the differences: rows
    that changed are updated, new ones inserted, missing ones deleted. Readers see the old
    contents until the caller commits, and CDC sees each real change as a normal row change.
    Returns how many rows were written.

    The differences come from one join of the two tables by key (a row whose columns are not
    all the same on both sides), which reads each table once: comparing them with `EXCEPT`,
    once for the rows and once for the keys, took twice as long (`docs/benchmarks-journal.md`,
    rebuild). An empty `target` (a view no projector has filled) takes every row of `source`
    in one plain insert, with nothing to compare: 1.4-1.9x faster into a view with its
    indexes.

    `private`: no reader but the projection's own merge reads `target` (a projection's state),
    and that merge waits for the caller's lock on the projection's progress. An empty one is
    then filled without its secondary indexes, which are built again after the insert, in the
    same transaction: 2.2x faster for a million rows (`docs/benchmarks-journal.md`, rebuild).
    Dropping an index locks the table until the commit, which is why readers' tables keep theirs."""
    cols, keys = ", ".join(columns), ", ".join(key)
    empty = conn.execute(f"SELECT NOT EXISTS (SELECT FROM {target})").fetchone()
    if empty and empty[0]:
        indexes = drop_indexes(conn, [target]) if private else []
        written = conn.execute(f"INSERT INTO {target} ({cols}) SELECT {cols} FROM {source}")
        for statement in indexes:
            conn.execute(statement)
        return written.rowcount
    on = " AND ".join(f"t.{k} = s.{k}" for k in key)
    source_row, target_row = (", ".join(f"{side}.{c}" for c in columns) for side in "st")
    sets = ", ".join(f"{c} = excluded.{c}" for c in columns if c not in key)
    action = f"DO UPDATE SET {sets}" if sets else "DO NOTHING"
    # Both writes read the same differences and touch different rows: those `source` has
    # (`_in_source`, from a key column, never null there) and those it lacks.
    row = conn.execute(
        f"WITH d AS MATERIALIZED ("
        f"SELECT s.{key[0]} IS NOT NULL AS _in_source, {', '.join(f's.{c}' for c in columns)}, "
        f"{', '.join(f't.{k} AS _gone_{k}' for k in key)} "
        f"FROM {source} s FULL JOIN {target} t ON {on} "
        f"WHERE ({source_row}) IS DISTINCT FROM ({target_row})"
        f"), upserted AS ("
        f"INSERT INTO {target} ({cols}) SELECT {cols} FROM d WHERE _in_source "
        f"ON CONFLICT ({keys}) {action} RETURNING 1"
        f"), deleted AS ("
        f"DELETE FROM {target} t USING d WHERE NOT d._in_source AND "
        + " AND ".join(f"t.{k} = d._gone_{k}" for k in key)
        + " RETURNING 1) SELECT (SELECT count(*) FROM upserted) + (SELECT count(*) FROM deleted)"
    ).fetchone()
    return int(row[0]) if row else 0


def save_progress(
    conn: psycopg.Connection[Any], projection: str, offsets: Offsets, applied: int, late: int
) -> None:
    conn.execute(
        "UPDATE projection_progress SET offsets = %s, events_applied = events_applied + %s, "
        "late_events = late_events + %s, updated_at = now() WHERE projection = %s",
        (json.dumps(offsets), applied, late, projection),
    )


class Reconnecting:
    """One Postgres connection kept across micro-batches (or polls), opened again once it
    breaks: a connection for each costs Postgres a backend's start and an authentication."""

    def __init__(self, url: str, autocommit: bool = False) -> None:
        self.url, self.autocommit = url, autocommit
        self._conn: psycopg.Connection[Any] | None = None

    def get(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed or self._conn.broken:
            self._conn = psycopg.connect(self.url, autocommit=self.autocommit)
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()


def drop_indexes(conn: psycopg.Connection[Any], tables: list[str]) -> list[str]:
    """Drop the indexes of `tables` that no key or constraint needs (`ON CONFLICT` needs the
    unique ones), in `conn`'s transaction; returns the statements that create them again."""
    rows = conn.execute(
        "SELECT i.indexrelid::regclass::text, pg_get_indexdef(i.indexrelid) FROM pg_index i "
        "WHERE i.indrelid = ANY(%s::regclass[]) AND NOT i.indisunique",
        (tables,),
    ).fetchall()
    for name, _ in rows:
        conn.execute(f"DROP INDEX {name}")
    return [definition for _, definition in rows]


def drop_keys(conn: psycopg.Connection[Any], tables: list[str]) -> list[str]:
    """Drop the primary keys and unique constraints of `tables`, in `conn`'s transaction;
    returns the statements that add them again."""
    found = conn.execute(
        "SELECT conrelid::regclass::text, conname, pg_get_constraintdef(oid) FROM pg_constraint "
        "WHERE conrelid = ANY(%s::regclass[]) AND contype IN ('p', 'u')",
        (tables,),
    ).fetchall()
    for table, name, _ in found:
        conn.execute(f"ALTER TABLE {table} DROP CONSTRAINT {name}")
    return [f"ALTER TABLE {table} ADD CONSTRAINT {name} {d}" for table, name, d in found]


def bulk_load(
    database_url: str,
    rows: DataFrame,
    table: str,
    columns: tuple[str, ...],
    personal: dict[str, tuple[str, str]] | None = None,
) -> int:
    """COPY `rows` into `table` (`columns` in that order), each Spark partition in its own
    connection and transaction; returns the rows written. Spark hands the rows to Python as
    Arrow batches, written to Postgres as CSV: several times faster than row by row
    (`docs/benchmarks-journal.md`, rebuild). The sealed values of `personal` columns (as
    `Output.personal`) are opened on the way, with the keys of the batch's subjects."""
    statement = f"COPY {table} ({', '.join(columns)}) FROM STDIN (FORMAT csv)"
    personal = {c: s for c, s in (personal or {}).items() if c in columns}

    def load(batches: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa
        from pyarrow import csv

        options = csv.WriteOptions(include_header=False)  # null: empty; "": quoted
        n = 0
        keys = psycopg.connect(database_url, autocommit=True) if personal else None
        with psycopg.connect(database_url) as conn, conn.cursor().copy(statement) as copy:
            for batch in batches:
                if keys is not None:
                    found = batch.to_pylist()
                    open_rows(keys, found, personal)
                    batch = pa.RecordBatch.from_pylist(found, schema=batch.schema)
                buffer = io.BytesIO()
                csv.write_csv(batch, buffer, write_options=options)
                copy.write(buffer.getbuffer())
                n += batch.num_rows
        if keys is not None:
            keys.close()
        yield pa.RecordBatch.from_pydict({"rows": [n]})

    return _through_arrow(rows, columns, load)


def handed_over(rows: DataFrame, columns: tuple[str, ...]) -> int:
    """What `bulk_load` does with `rows` up to Postgres: the same plan hands them to Python as
    Arrow batches, which are counted, not written. Returns the rows."""

    def count(batches: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa

        yield pa.RecordBatch.from_pydict({"rows": [sum(b.num_rows for b in batches)]})

    return _through_arrow(rows, columns, count)


def _through_arrow(
    rows: DataFrame, columns: tuple[str, ...], each: Callable[[Iterator[Any]], Iterator[Any]]
) -> int:
    """`rows` (`columns`, as `wire_rows` sends them) handed to `each` as Arrow batches, one
    call per Spark partition, each yielding a batch of one `rows` count; returns their sum."""
    counted = wire_rows(rows.select(*columns)).mapInArrow(each, "rows long").collect()
    return sum(int(r["rows"]) for r in counted)
