"""Joined views kept current from CDC changelogs: one Structured Streaming query for every join,
and their rebuild.

Live: the query reads every changelog a join reads (`cdc.<table>`, Spark's Kafka source with
headers, read_committed) from the lowest offsets after the joins' progress, with no trigger
interval. Each micro-batch is read in one Spark job and applied in one Postgres transaction:
per join, lock its progress row, drop records at or below its offsets, keep the newest change
per key, store the changes that are newer than `join_state`'s (by changelog position),
re-derive the joined rows of the side rows they change, write only the rows that differ
(delete the ones that no longer exist), and save its offsets. A batch replayed after a crash
changes nothing, and neither does a change CDC resends. Each join keeps its own progress and
fails alone (in a savepoint), like the projections in `spark/event_pipeline.py`.

A join that did not read records that are no longer in its changelogs (compacted away while it
was further behind than `min.compaction.lag.ms`, or deleted: `spark/gaps.py`) may have missed a
delete, whose tombstone went too: its state would keep that row for good. It applies nothing
more and is rebuilt from the changelogs as they are (which hold every key's last change), then
goes on from the rebuild's offsets.

Rebuild: holding the progress lock (live batches wait), read both changelogs to their end as a
Spark batch, fold them with the same building blocks (`projections/changelog.py`) and a Spark
join, bulk-load state and rows into shadow tables, then in that transaction make the view equal
to the shadow (writing only differing rows), replace the join's state, set its offsets to what
was read, and bump its generation.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import psycopg
from psycopg.types.json import Jsonb
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming.query import StreamingQuery

from config.settings import Settings
from config.topics import Topics
from projections.base import JOIN_STATE, ROLES, Join, Offsets
from spark.changelog import joined_rows, latest, records
from spark.decode import kafka_options
from spark.event_pipeline import LivePath, RealtimeMode, Running, failures_after
from spark.gaps import Gaps, check_gaps, skipped
from spark.session import BatchPlanning, full_planning, idle_poll
from spark.shadows import SHADOW, Report, differences
from spark.sink import (
    Reconnecting,
    bulk_load,
    copy_rows,
    ensure_progress,
    forget_failures,
    last_offsets,
    lock_many,
    lock_progress,
    mark_failed,
    mark_running,
    read_progress,
    replace_contents,
    save_progress,
    unapplied,
)

log = logging.getLogger(__name__)

QUERY = "joins"
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


class Applied(NamedTuple):
    """What a batch of changes did to a joined view."""

    derived: int  # joined rows derived from the state, as they are after the batch
    written: int  # view rows inserted, updated or deleted (only rows that differ)


def apply_changes(conn: psycopg.Connection[Any], join: Join, changes: list[Any]) -> Applied:
    """Merge `changes` (rows with CHANGE_COLUMNS, one per side and key) into the join's state
    and its view. The caller commits."""
    scratch(
        conn,
        "join_changes",
        "(side text, key jsonb, row jsonb, lsn bigint, seq bigint, join_value text)",
    )
    n = copy_rows(conn, "join_changes", CHANGE_COLUMNS, changes)
    conn.execute(f"UPDATE join_changes c SET join_value = {join.join_value_sql('c')}")
    analyze_if_resized(conn, "join_changes", n)
    keys = ", ".join(join.key)
    before, after = f"join_before_{join.name}", f"join_after_{join.name}"
    derive = join.derive_sql("join_changes")
    # The view is the join of the state, so the rows the changed pairs gave before the changes
    # are the candidates for deletion.
    scratch(conn, before, f"AS SELECT {keys} FROM ({derive}) d WITH NO DATA")
    conn.execute(f"INSERT INTO {before} SELECT {keys} FROM ({derive}) d")
    conn.execute(join.state_upsert_sql("join_changes"))
    scratch(conn, after, f"AS {derive} WITH NO DATA")
    derived = conn.execute(f"INSERT INTO {after} {derive}").rowcount
    written = conn.execute(join.upsert_sql(after)).rowcount
    deleted = conn.execute(join.delete_sql(before, after)).rowcount
    return Applied(max(derived, 0), max(written, 0) + max(deleted, 0))


def scratch(conn: psycopg.Connection[Any], table: str, definition: str) -> None:
    """`table`, a temporary table of the connection's session, empty: made the first time
    (`definition`: its columns, or `AS <query> WITH NO DATA`), emptied by every commit (`ON
    COMMIT DELETE ROWS`: its file truncated, no catalog change) and before each use (a
    transaction applies several joins). Made and dropped in every transaction (`ON COMMIT
    DROP`), a join's three tables cost Postgres more than the rest of its apply (~7 ms of
    catalog work a poll at 300 commands/s), and their catalog rows went to the WAL that CDC
    decodes; emptied by `DELETE` alone, they grew without end (nothing vacuums a temporary
    table), and so did each scan of them (`docs/benchmarks-journal.md`, whole pipeline). A
    transaction rolled back with the table's making takes the table with it; the next use
    makes it again."""
    if definition.startswith("AS "):
        definition = f"ON COMMIT DELETE ROWS {definition}"
    else:
        definition = f"{definition} ON COMMIT DELETE ROWS"
    conn.execute(f"CREATE TEMP TABLE IF NOT EXISTS {table} {definition}")
    conn.execute(f"DELETE FROM {table}")


_analyzed: weakref.WeakKeyDictionary[psycopg.Connection[Any], dict[str, int]] = (
    weakref.WeakKeyDictionary()
)


def analyze_if_resized(conn: psycopg.Connection[Any], table: str, rows: int) -> None:
    """ANALYZE `table` when it holds 4x more or fewer rows than when it was last analyzed on
    this connection: the derive query's plan (index lookups from a few changes, or a hash join
    for a catch-up's thousands) follows the size, and an ANALYZE a poll cost ~1 ms of Postgres."""
    seen = _analyzed.setdefault(conn, {})
    last = seen.get(table)
    if last is None or rows > 4 * max(last, 1) or 4 * rows < last:
        conn.execute(f"ANALYZE {table}")
        seen[table] = rows


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
    return {**offsets, **seen}, applied, apply_changes(conn, join, changes).written


def newest_changes(join: Join, recs: Sequence[Any], offsets: Offsets) -> list[dict[str, Any]]:
    """The records (as `records` returns them) of `join`'s tables after `offsets`, reduced to
    the newest change of each key by position (as `latest` does in Spark), as changes of the
    join's sides (as `side_changes` returns them)."""
    newest: dict[tuple[str, str], Any] = {}
    for r in recs:
        done = offsets.get(f"{r['topic']}:{r['partition']}", -1)
        if r["table"] not in join.tables or r["offset"] <= done:
            continue
        seen = newest.get((r["table"], r["key"]))
        if seen is None or (r["lsn"], r["seq"], r["offset"]) > (
            seen["lsn"],
            seen["seq"],
            seen["offset"],
        ):
            newest[(r["table"], r["key"])] = r
    return [
        {"side": role, "key": r["key"], "row": r["row"], "lsn": r["lsn"], "seq": r["seq"]}
        for role in ROLES
        for (table, _), r in newest.items()
        if table == join.side(role).table
    ]


class JoinSink:
    """`foreachBatch` function of the join pipeline: every join, each with its own progress."""

    def __init__(
        self,
        joins: Sequence[Join],
        database_url: str,
        tables: dict[str, str],
        gaps: Gaps,
        rebuild: Callable[[Join], object] | None = None,
    ) -> None:
        self.joins, self.database_url, self.tables = list(joins), database_url, tables
        self.gaps = gaps
        self.rebuild = rebuild  # of a join that missed removed records; None: left failed
        self.failed: set[str] = set()
        self.unread: dict[str, str] = {}  # joins that missed removed records: why
        self.db = Reconnecting(database_url)
        self.planning = BatchPlanning()
        self.last_batch = 0  # records

    def __call__(self, batch: DataFrame, batch_id: int) -> None:
        """`batch`: the changelog records of `records` (in the streaming plan, planned once)."""
        started = time.perf_counter()
        self.planning.fit(batch.sparkSession, self.last_batch)
        recs = batch.collect()
        self.last_batch = len(recs)
        if not recs:
            return
        collected = time.perf_counter()
        self.apply(recs, f"batch {batch_id}")
        log.debug(  # a line a batch: for debugging
            "batch %s (spark %.0f ms, postgres %.0f ms)",
            batch_id,
            (collected - started) * 1e3,
            (time.perf_counter() - collected) * 1e3,
        )

    def apply(self, recs: Sequence[Any], label: str | None = None) -> dict[str, int]:
        """Apply changelog records (as `records` returns them, in order per partition) in one
        transaction: each join from its own progress, in its own savepoint. Returns the
        records each join applied. `label`: the micro-batch, logged per join."""
        last: Offsets = {}
        for r in recs:
            k = f"{r['topic']}:{r['partition']}"
            last[k] = max(last.get(k, -1), r["offset"])
        conn = self.db.get()
        try:
            with conn.transaction():
                counts = self._apply(conn, recs, last, label)
        except psycopg.OperationalError:
            conn.close()
            raise
        self._rebuild_unread()
        return counts

    def _rebuild_unread(self) -> None:
        """Rebuild the joins that missed removed records (`unread`); each then goes on from
        the rebuild's offsets. One whose rebuild fails stays failed: the next start of the
        pipeline finds its gap again and tries again."""
        for name, why in list(self.unread.items()):
            del self.unread[name]
            join = next(j for j in self.joins if j.name == name)
            if self.rebuild is None:
                continue
            try:
                self.rebuild(join)
            except Exception:
                log.exception("join %s: the rebuild after %s failed", name, why)
                continue
            conn = self.db.get()
            with conn.transaction():
                forget_failures(conn, [name])
            self.failed.discard(name)
            log.warning("join %s rebuilt after %s; it goes on from there", name, why)

    def _apply(
        self, conn: psycopg.Connection[Any], recs: Sequence[Any], last: Offsets, label: str | None
    ) -> dict[str, int]:
        active = [j for j in self.joins if j.name not in self.failed]
        progress = lock_many(conn, [j.name for j in active])
        counts: dict[str, int] = {}
        for join in active:
            offsets = progress.get(join.name, {})
            mine = {k: o for k, o in last.items() if self.tables[_topic(k)] in join.tables}
            after = {k: o for k, o in mine.items() if o > offsets.get(k, -1)}
            if not after:
                continue
            changes = newest_changes(join, recs, offsets)
            starts: Offsets = {}  # per partition, the first record after its progress
            applied = 0
            for r in recs:
                k = f"{r['topic']}:{r['partition']}"
                if r["table"] in join.tables and r["offset"] > offsets.get(k, -1):
                    starts[k] = min(starts.get(k, r["offset"]), r["offset"])
                    applied += 1
            lost = check_gaps(self.gaps, conn, join.name, offsets, starts)
            unread = {**skipped(offsets, starts), **{k: v for k, v in lost.items() if k in offsets}}
            if unread:
                ranges = ", ".join(
                    f"{k} offsets {a}..{b - 1}" for k, (a, b) in sorted(unread.items())
                )
                why = f"records removed from its changelogs before it read them ({ranges})"
                fix = (
                    "rebuilding it" if self.rebuild else f"rebuild it: logfold rebuild {join.name}"
                )
                log.error("join %s: %s, a delete may be among them: %s", join.name, why, fix)
                mark_failed(conn, join.name, f"{why}, a delete may be among them: {fix}", offsets)
                self.failed.add(join.name)
                self.unread[join.name] = why
                continue
            try:
                with conn.transaction():
                    done = apply_changes(conn, join, changes)
                    save_progress(conn, join.name, {**offsets, **after}, applied, 0)
            except (psycopg.OperationalError, psycopg.InterfaceError):
                raise
            except psycopg.Error as e:
                error = f"{type(e).__name__}: {e}"
                log.error("join %s failed after %s: %s", join.name, offsets, error)
                mark_failed(conn, join.name, error, offsets)
                self.failed.add(join.name)
                continue
            counts[join.name] = applied
            log.debug(
                "%s: %s applied %s records, derived %s rows, wrote %s",
                join.name,
                label or "poll",
                applied,
                done.derived,
                done.written,
            )
        return counts


def _topic(partition_key: str) -> str:
    return partition_key.rsplit(":", 1)[0]


class JoinPipeline(LivePath):
    """Runs the live pipeline of every join (see the module's docstring)."""

    folds = "joins"

    def __init__(
        self,
        spark: SparkSession,
        settings: Settings,
        joins: Sequence[Join],
        scratch: str,
        beside: int = 0,
        realtime_mode: RealtimeMode[JoinPipeline, JoinSink] | None = None,
    ) -> None:
        """`realtime_mode`: how the live path runs in Spark's real-time mode, when it can
        (the projector passes `spark.realtime.RealTimeJoins`); None: always in micro-batches."""
        self.spark, self.settings, self.scratch = spark, settings, scratch
        self.joins = list(joins)
        topics = Topics(settings.topic_prefix)
        self.tables = {topics.cdc(t): t for j in self.joins for t in j.tables}
        self.beside = beside  # task slots other real-time queries of this Spark hold
        self.sink: JoinSink | None = None
        self.running: Running | None = None
        self.realtime_failures = 0
        self.micro_batches_why = "not started"
        self.realtime_mode = realtime_mode

    def slots_needed(self) -> int | None:
        """One a changelog read besides the ones other real-time queries hold, two more for
        other jobs."""
        if self.realtime_mode is None:
            return None
        return self.beside + len(self.tables) + 2

    def starting_offsets(self) -> str:
        """After the lowest progress of the joins that read each changelog."""
        with psycopg.connect(self.settings.database(), autocommit=True) as conn:
            progress = {j.name: read_progress(conn, j.name) for j in self.joins}
        doc = {}
        for topic, table in self.tables.items():
            done = [progress[j.name].get(f"{topic}:0", -1) for j in self.joins if table in j.tables]
            low = min(done, default=-1)
            doc[topic] = {"0": low + 1 if low >= 0 else -2}
        return json.dumps(doc)

    def rebuild(self, join: Join) -> None:
        """Rebuild `join` from its changelogs as they are now (it missed removed records)."""
        report = JoinRebuild(self.settings, self.spark).run(join)
        log.warning("join %s rebuilt: %s rows", join.name, report.rows.get(join.name))

    def start(self) -> Running:
        """Start the live pipeline from the joins' progress (a restart resumes the same way):
        in real-time mode when it can (`realtime_mode`), else in micro-batches."""
        url = self.settings.database()
        names = [j.name for j in self.joins]
        with psycopg.connect(url, autocommit=True) as conn:
            for name in names:
                ensure_progress(conn, name)
            forget_failures(conn, names)  # a failed join is given another chance
        if self.sink is not None:
            self.sink.db.close()
        gaps = Gaps(self.settings.kafka(), self.settings.kafka_timeout_s)
        self.sink = JoinSink(self.joins, url, self.tables, gaps, self.rebuild)
        full_planning(self.spark, False)  # the query starts on small batches (see BatchPlanning)
        self.realtime_failures = failures_after(self.running, self.realtime_failures)
        if self.realtime():
            assert self.realtime_mode is not None
            self.running = self.realtime_mode(self, self.sink).start()
        else:
            self.running = self.micro_batches(self.sink, catch_up=False)
            with psycopg.connect(url, autocommit=True) as conn:
                mark_running(conn, names)
        return self.running

    def micro_batches(self, sink: JoinSink, catch_up: bool) -> StreamingQuery:
        """The joins' micro-batch query from their progress: with no trigger interval, or with
        `catch_up` up to the changelogs' ends as they are now, then it stops."""
        raw = (
            self.spark.readStream.format("kafka")
            .options(**kafka_options(self.settings.kafka()))
            .option("subscribe", ",".join(self.tables))
            .option("includeHeaders", "true")
            .option("startingOffsets", self.starting_offsets())
            .option("maxOffsetsPerTrigger", MAX_RECORDS_PER_BATCH)
            .load()
        )
        idle_poll(self.spark, self.settings.spark_joins_idle_poll_ms)
        writer = (
            records(raw, self.tables)
            .writeStream.foreachBatch(sink)
            .queryName(QUERY)
            # A fresh checkpoint per start, or Spark would resume from its own offsets.
            .option("checkpointLocation", tempfile.mkdtemp(dir=self.scratch))
        )
        if catch_up:
            writer = writer.trigger(availableNow=True)
        return writer.start()


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
        bulk_load(self.url, changes, state, CHANGE_COLUMNS)
        bulk_load(self.url, joined_rows(join, recs), view, join.columns)

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
