"""Joined views kept current from CDC changelogs: one Structured Streaming query per join, and
its rebuild.

Live: the query reads the join's two changelogs (`cdc.<table>`, Spark's Kafka source with
headers, read_committed) from the offsets after its progress. Each micro-batch runs in one
Postgres transaction: lock the join's progress row, drop records at or below its offsets, keep
the newest change per key, store the changes that are newer than `join_state`'s (by changelog
position), re-derive the joined rows of every join value they touch, write only the rows that
differ (delete the ones that no longer exist), and save the offsets. A batch replayed after a
crash changes nothing, and neither does a change CDC resends.

Rebuild: holding the progress lock (live batches wait), read both changelogs to their end as a
Spark batch, fold them with the same building blocks (`projections/changelog.py`) and a Spark
join, bulk-load state and rows into shadow tables, then in that transaction make the view equal
to the shadow (writing only differing rows), replace the join's state, set its offsets to what
was read, and bump its generation.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import psycopg
from psycopg.types.json import Jsonb
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming.query import StreamingQuery

from projections.base import JOIN_STATE, ROLES, Join
from projections.changelog import latest, records
from spark.decode import kafka_options, offsets_json
from spark.rebuild import SHADOW, Report, differences
from spark.sink import (
    Offsets,
    copy_partition,
    copy_rows,
    ensure_progress,
    last_offsets,
    lock_progress,
    read_progress,
    replace_contents,
    save_progress,
    unapplied,
)
from stack.settings import Settings
from stack.topics import Topics

log = logging.getLogger(__name__)

MAX_RECORDS_PER_BATCH = 50_000
CHANGE_COLUMNS = ("side", "key", "row", "lsn", "seq")


def changelogs(join: Join, topics: Topics) -> dict[str, str]:
    """The join's changelog topics and the table each one carries."""
    return {topics.cdc(t): t for t in join.tables}


def side_changes(join: Join, last: DataFrame) -> DataFrame:
    """The newest change per key (`latest`) as changes of the join's sides: side, key, row,
    lsn, seq (a table on both sides of a self-join gives each side its changes)."""
    per_side = [
        last.where(F.col("table") == join.side(role).table).select(
            F.lit(role).alias("side"), "key", "row", "lsn", "seq"
        )
        for role in ROLES
    ]
    return per_side[0].unionByName(per_side[1])


def apply_changes(conn: psycopg.Connection[Any], join: Join, changes: list[Any]) -> int:
    """Merge `changes` (rows with CHANGE_COLUMNS, one per side and key) into the join's state
    and its view; return how many view rows were written. The caller commits."""
    conn.execute(
        "CREATE TEMP TABLE join_changes (side text, key jsonb, row jsonb, lsn bigint, "
        "seq bigint, join_value text) ON COMMIT DROP"
    )
    copy_rows(conn, "join_changes", CHANGE_COLUMNS, changes)
    conn.execute(f"UPDATE join_changes c SET join_value = {join.join_value_sql('c')}")
    conn.execute(
        f"CREATE TEMP TABLE join_affected ON COMMIT DROP AS {join.affected_sql('join_changes')}"
    )
    conn.execute("ANALYZE join_affected")
    keys = ", ".join(join.key)
    # The view is the join of the state, so the rows these join values gave before the changes
    # are the candidates for deletion.
    conn.execute(
        f"CREATE TEMP TABLE join_before ON COMMIT DROP AS "
        f"SELECT {keys} FROM ({join.derive_sql('join_affected')}) d"
    )
    conn.execute(join.state_upsert_sql("join_changes"))
    conn.execute(
        f"CREATE TEMP TABLE join_after ON COMMIT DROP AS {join.derive_sql('join_affected')}"
    )
    written = conn.execute(join.upsert_sql("join_after")).rowcount
    deleted = conn.execute(join.delete_sql("join_before", "join_after")).rowcount
    for temp in ("join_changes", "join_affected", "join_before", "join_after"):
        conn.execute(f"DROP TABLE {temp}")
    return max(written, 0) + max(deleted, 0)


def apply_records(
    conn: psycopg.Connection[Any], join: Join, recs: DataFrame, offsets: Offsets
) -> tuple[Offsets, int, int]:
    """Merge the changelog records (as `records` returns them) after `offsets` into the join's
    state and view. Returns the new offsets, how many records were applied and how many view
    rows written. The caller commits."""
    fresh = unapplied(recs, offsets).persist()
    try:
        seen, applied = last_offsets(fresh)
        if not seen:
            return offsets, 0, 0
        changes = side_changes(join, latest(fresh)).collect()
    finally:
        fresh.unpersist()
    return {**offsets, **seen}, applied, apply_changes(conn, join, changes)


class JoinSink:
    """`foreachBatch` function of one join's streaming query."""

    def __init__(self, join: Join, database_url: str, tables: dict[str, str]) -> None:
        self.join, self.database_url, self.tables = join, database_url, tables

    def __call__(self, batch: DataFrame, batch_id: int) -> None:
        name = self.join.name
        with psycopg.connect(self.database_url) as conn, conn.transaction():
            offsets = lock_progress(conn, name)
            new, applied, written = apply_records(
                conn, self.join, records(batch, self.tables), offsets
            )
            if applied:
                save_progress(conn, name, new, applied, 0)
        if applied:
            log.info(
                "%s: batch %s applied %s records, wrote %s rows", name, batch_id, applied, written
            )


def stream(spark: SparkSession, settings: Settings, join: Join, checkpoint: str) -> StreamingQuery:
    """Start the join's streaming query from the offsets after its progress."""
    url = settings.database()
    with psycopg.connect(url, autocommit=True) as conn:
        ensure_progress(conn, join.name)
        offsets = read_progress(conn, join.name)
    tables = changelogs(join, Topics(settings.topic_prefix))
    raw = (
        spark.readStream.format("kafka")
        .options(**kafka_options(settings.kafka()))
        .option("subscribe", ",".join(tables))
        .option("includeHeaders", "true")
        .option("startingOffsets", offsets_json(tables, 1, offsets, 1))
        .option("maxOffsetsPerTrigger", MAX_RECORDS_PER_BATCH)
        .load()
    )
    return (
        raw.writeStream.foreachBatch(JoinSink(join, url, tables))
        .queryName(join.name)
        # Where to resume is Postgres's progress, not Spark's checkpoint.
        .option("checkpointLocation", checkpoint)
        .trigger(processingTime=f"{settings.projector_trigger_s} seconds")
        .start()
    )


class JoinRebuild:
    """Rebuild joined views from their whole changelogs (see the module's docstring)."""

    def __init__(self, settings: Settings, spark: SparkSession) -> None:
        self.settings, self.spark = settings, spark
        self.topics = Topics(settings.topic_prefix)
        self.url = settings.database()

    def run(self, join: Join, verify: bool = False) -> Report:
        started = time.monotonic()
        view, state = join.name + SHADOW, f"{JOIN_STATE}_{join.name}{SHADOW}"
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(f"DROP TABLE IF EXISTS {view}")
            conn.execute(f"CREATE TABLE {view} (LIKE {join.name} INCLUDING ALL)")
            conn.execute(f"DROP TABLE IF EXISTS {state}")
            conn.execute(
                f"CREATE TABLE {state} (side text, key jsonb, row jsonb, lsn bigint, seq bigint)"
            )
        report = Report(join.name, 0, 0.0)
        with psycopg.connect(self.url) as conn, conn.transaction():
            live = lock_progress(conn, join.name)  # live batches wait from here to the commit
            recs = self._read(join).persist()
            try:
                read, report.events = last_offsets(recs)
                self._load(join, recs, view, state)
                # Bring the live view to what was read, as its next batches would have, so
                # that verify compares the two at the same position.
                live, applied, _ = apply_records(conn, join, recs, live)
            finally:
                recs.unpersist()
            if verify:
                cols = ", ".join(join.columns)
                report.differences = {join.name: differences(conn, join.name, view, cols)}
            replace_contents(conn, join.name, view, join.key, join.columns)
            self._replace_state(conn, join, state)
            conn.execute(f"DROP TABLE {view}")
            conn.execute(f"DROP TABLE {state}")
            count = conn.execute(f"SELECT count(*) FROM {join.name}").fetchone()
            report.rows[join.name] = int(count[0]) if count else 0
            conn.execute(
                "UPDATE projection_progress SET offsets = %s, generation = generation + 1, "
                "events_applied = events_applied + %s, updated_at = now() WHERE projection = %s",
                (Jsonb({**live, **read}), applied, join.name),
            )
        report.seconds = time.monotonic() - started
        return report

    def _read(self, join: Join) -> DataFrame:
        """Every record of the join's changelogs, up to their current end."""
        tables = changelogs(join, self.topics)
        raw = (
            self.spark.read.format("kafka")
            .options(**kafka_options(self.settings.kafka()))
            .option("subscribe", ",".join(tables))
            .option("includeHeaders", "true")
            .option("startingOffsets", "earliest")
            .option("endingOffsets", "latest")
            .load()
        )
        return records(raw, tables)

    def _load(self, join: Join, recs: DataFrame, view: str, state: str) -> None:
        """COPY the state folded from `recs` and the joined rows into the shadow tables."""
        changes = side_changes(join, latest(recs))
        changes.foreachPartition(copy_partition(self.url, state, CHANGE_COLUMNS))
        rows = join.output.transform(recs)
        rows.foreachPartition(copy_partition(self.url, view, join.columns))

    def _replace_state(self, conn: psycopg.Connection[Any], join: Join, shadow: str) -> None:
        """The join's state := the shadow's. Deleted keys whose tombstones compaction has
        removed from the changelog stay deleted (a resend of an older insert cannot revive
        them)."""
        conn.execute(
            f"DELETE FROM {JOIN_STATE} s WHERE s.join_name = %s AND (s.row IS NOT NULL OR EXISTS "
            f"(SELECT 1 FROM {shadow} n WHERE n.side = s.side AND n.key = s.key))",
            (join.name,),
        )
        conn.execute(
            f"INSERT INTO {JOIN_STATE} (join_name, side, key, join_value, row, lsn, seq) "
            f"SELECT %s, n.side, n.key, {join.join_value_sql('n')}, n.row, n.lsn, n.seq "
            f"FROM {shadow} n",
            (join.name,),
        )
