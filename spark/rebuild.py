"""Rebuild projections by replaying the whole log, without readers ever seeing them half-built.

1. Read every committed event of the projections' topics once (a Spark batch up to the current
   end offsets, decoded once and cached), fold it into each output's rows by the output's own
   rules (`Output.transform`), and bulk-load them (COPY) into shadow tables `<table>__rebuild`
   (unlogged scratch tables), then run the output's `load_statements` (what its live merge
   adds in Postgres) and give the shadow its key.
   A projection whose rows combine only in Postgres, or that counts stream records once
   (`Projection.replayed`), is merged from the same read into its shadows by the live
   pipeline's merge instead.
2. Catch each shadow up, in batches, to whatever the live projector has applied meanwhile.
3. Holding the projection's progress lock (live batches wait): apply the last few events,
   optionally compare live and shadow row for row, then make the live table equal to the shadow
   by writing only the rows that differ (usually none), all in one transaction of the
   projection's own: readers see the old rows until the commit, and CDC sees each real change,
   so changelogs, joined views and websocket subscribers follow. Other projections are not
   touched. (A live view no projector has ever applied anything to is simply replaced: its
   rows and progress become the shadow's.)
Two projections are rebuilt at a time, each swapped as soon as its shadows are loaded: a
replayed projection's merge, or a swap, keeps a Postgres backend busy while Spark folds and
copies another.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any

import psycopg
from kafka import TopicPartition
from psycopg.types.json import Jsonb
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from tqdm import tqdm

from config.settings import Settings
from config.topics import Topics
from events.store import committed_reader
from projections.base import Output, Projection, versions
from projections.base.rows import fold
from spark import keeping
from spark.decode import (
    between_json,
    decode_events,
    every_event,
    parse_events,
    read_batch,
    upcast,
)
from spark.parking import Excluded, excluded, without_excluded
from spark.replay import replay
from spark.shadows import (
    SHADOW,
    Report,
    common_columns,
    count_rows,
    differences,
    shadowed_tables,
)
from spark.sink import (
    apply_events,
    bulk_load,
    drop_indexes,
    handed_over,
    live_version,
    lock_progress,
    move_stream_ids,
    read_progress,
    replace_contents,
)

log = logging.getLogger(__name__)

CATCH_UP_ROUNDS, CATCH_UP_ENOUGH = 3, 2000  # offsets left for the final, locked step
AT_ONCE = 2  # projections rebuilt at once (each loaded, then swapped)
# Memory for the swap's row-for-row comparison (enough to hash a large view's rows instead
# of sorting both copies on disk, `docs/benchmarks-journal.md`, rebuild) and for building a
# shadow's indexes and keys after its load, and an empty state table's indexes after the swap
# fills it.
WORK_MEM = "256MB"


class Rebuild:
    def __init__(self, settings: Settings, spark: SparkSession) -> None:
        self.settings, self.spark = settings, spark
        self.topics = Topics(settings.topic_prefix)
        self.url = settings.database()
        self.excluded: dict[str, Excluded] = {}  # per projection, as the rebuild started
        self.live_versions: dict[str, str | None] = {}  # the same
        # Set by a projector's build of a version (spark/deploy.py): its swap goes ahead only
        # while that version is still the one being built (a later projector's supersedes it).
        self.building: str | None = None
        # The progress bar of `run_many`, while it runs (a projector's build reads it), and
        # where it is drawn when not asked to be (None: not drawn, and not counted).
        self.bar: tqdm | None = None
        self.bar_out: IO[str] | None = None

    def _read(
        self, projection: Projection, starting: str, ending: str, assign: str | None = None
    ) -> DataFrame:
        names = self._names(projection)
        raw = read_batch(self.spark, self.settings.kafka(), names, starting, ending, assign)
        if projection.replayed:  # the live pipeline's columns
            return self._without_excluded(
                projection, every_event(parse_events(raw, self._streams([projection])))
            )
        return self._without_excluded(projection, decode_events(raw))

    def _without_excluded(self, projection: Projection, events: DataFrame) -> DataFrame:
        parked, skipped = self.excluded.get(projection.name, ([], []))
        return without_excluded(self.spark, events, parked, skipped)

    def _streams(self, projections: list[Projection]) -> dict[str, str]:
        return {self.topics.stream(s): s for p in projections for s in p.streams}

    def _decoded(self, raw: DataFrame, projections: list[Projection]) -> DataFrame:
        """One cached read: every record decoded, its data into the fields the views read
        (`spark.decode.DATA`); a record's bytes are kept only if the upcasters must decode it."""
        records = every_event(parse_events(raw, self._streams(projections)))
        return records.withColumn("value", F.when(~F.col("current"), F.col("value"))).persist()

    def _apply(
        self,
        conn: psycopg.Connection[Any],
        projection: Projection,
        batch: DataFrame,
        offsets: dict[str, int],
        suffix: str = "",
        empty: bool = False,
    ) -> tuple[dict[str, int], int, int]:
        if projection.replayed:
            return replay(conn, projection, batch, offsets, suffix, self.settings, empty)
        return apply_events(conn, projection, batch, offsets, suffix)

    def _between(
        self, projection: Projection, after: dict[str, int], upto: dict[str, int]
    ) -> DataFrame:
        assign, starting, ending = between_json(after, upto)
        return self._read(projection, starting, ending, assign)

    def run(self, projection: Projection, verify: bool = False, progress: bool = True) -> Report:
        return self.run_many([projection], verify, progress)[0]

    def run_many(
        self, projections: list[Projection], verify: bool = False, progress: bool = True
    ) -> list[Report]:
        """Rebuild `projections` from one read of their topics (see the module's docstring)."""
        if not projections:
            return []
        started = time.monotonic()
        with psycopg.connect(self.url) as conn:
            self.live_versions = {p.name: live_version(conn, p.name) for p in projections}
            self.excluded = {p.name: excluded(conn, p.name) for p in projections}
        for p in projections:
            if self._changing(p):  # a new version folds what the old one parked
                self.excluded[p.name] = ([], self.excluded[p.name][1])
        names = sorted({t for p in projections for t in self._names(p)})
        raw = read_batch(self.spark, self.settings.kafka(), names, "earliest", "latest")
        decoded = self._decoded(raw, projections)
        reports: dict[str, Report] = {}
        try:
            seen, counts, old = _survey(decoded)  # reads the log, once, into the cache
            events = decoded
            if old:
                # Every record decoded at its type's current version (the replay's `current`).
                upcast_ = upcast(decoded)
                events = decoded.where("current").unionByName(upcast_)
                events = events.withColumn("current", F.lit(True)).persist()
            try:
                if old:
                    events.count()  # fills the upcast events' cache
                    decoded.unpersist()
                shares = {p.name: self._share(p, counts) for p in projections}
                self._create_shadows(projections)
                read = time.monotonic() - started
                total = sum(shares[p.name] * len(p.outputs) for p in projections)
                label = projections[0].name if len(projections) == 1 else "every projection"
                bar = tqdm(
                    total=total,
                    unit="ev",
                    desc=f"rebuild {label}",
                    disable=not progress and self.bar_out is None,
                    file=None if progress else self.bar_out,
                )
                self.bar = bar
                with bar:
                    # Two projections at a time, each loaded then swapped at once: a replayed
                    # projection's merge, or a swap, keeps one Postgres backend (a core) busy
                    # while Spark folds and copies another. The heaviest start first
                    # (replayed ones, then by their events).
                    heaviest = sorted(
                        projections, key=lambda p: (p.replayed, shares[p.name]), reverse=True
                    )

                    def rebuild_one(p: Projection) -> None:
                        t0 = time.monotonic()
                        covered, counted = self._load(p, events, seen, shares[p.name], bar)
                        t1 = time.monotonic()
                        report = self._keeping(
                            p, lambda: self._swap(p, self._catch_up(p, covered), verify, counted)
                        )
                        done = time.monotonic()
                        report.events = shares[p.name]
                        # The shared read is split between projections by their events.
                        part = shares[p.name] / max(sum(shares.values()), 1)
                        report.seconds = read * part + done - t0
                        report.steps = {"read": read, "load": t1 - t0, "swap": done - t1}
                        reports[p.name] = report

                    with ThreadPoolExecutor(AT_ONCE, thread_name_prefix="rebuild") as pool:
                        list(pool.map(rebuild_one, heaviest))
                    bar.n = total
                    bar.refresh()
            finally:
                events.unpersist()
        finally:
            decoded.unpersist()
        return [reports[p.name] for p in projections]

    def rehearse(self, projections: list[Projection], records: int) -> int:
        """The Spark side of `run_many` over about `records` of the log (the first of each
        partition of the projections' topics, in equal shares), writing nothing: each folded
        output is handed to Python as a load hands it, and counted. A JVM that has run it has
        generated and compiled the code a rebuild runs, so the first one asked of it is nearly
        as fast as its next ones (a projector's: `spark/rebuilder.py`). The projections a
        rebuild replays through Postgres (`Projection.replayed`) are left out. Returns the
        rows folded."""
        folded = [p for p in projections if not p.replayed]
        names = sorted({t for p in folded for t in self._names(p)})
        upto = _first_records(self.settings.kafka(), names, records)
        if not upto:
            return 0
        assign, starting, ending = between_json({}, upto)
        raw = read_batch(self.spark, self.settings.kafka(), names, starting, ending, assign)
        decoded = self._decoded(raw, folded)
        try:
            _survey(decoded)
            rows = 0
            for p in folded:
                mine = decoded.where(F.col("topic").isin(self._names(p)))
                rows += sum(handed_over(fold(o, mine), o.columns) for o in p.outputs)
            return rows
        finally:
            decoded.unpersist()

    def restore(self, projection: Projection, kept: keeping.Kept, verify: bool = False) -> Report:
        """Build `projection` from its `kept` copy (its version, at the copy's position) and
        the events since, instead of the whole log, then swap it in as `run` does."""
        started = time.monotonic()
        with psycopg.connect(self.url) as conn:
            self.live_versions = {projection.name: live_version(conn, projection.name)}
            # Another version is live (the kept one is never): nothing of this one is parked.
            self.excluded = {projection.name: ([], excluded(conn, projection.name)[1])}
        self._create_shadows([projection], keyed=True)
        with psycopg.connect(self.url) as conn:
            for table, copy in kept.tables.items():
                columns = ", ".join(common_columns(conn, table + SHADOW, copy))
                conn.execute(
                    f"INSERT INTO {table}{SHADOW} ({columns}) SELECT {columns} FROM {copy}"
                )
            if projection.streams:
                keeping.copy_stream_ids(
                    conn,
                    keeping.stream_fold(projection.name, kept.version),
                    projection.name + SHADOW,
                )
        t0 = time.monotonic()
        report = self._keeping(
            projection,
            lambda: self._swap(
                projection, self._catch_up(projection, kept.offsets), verify, (0, 0)
            ),
        )
        done = time.monotonic()
        report.restored, report.seconds = kept.version, done - started
        report.steps = {"load": t0 - started, "swap": done - t0}
        return report

    def _keeping(self, projection: Projection, swap: Callable[[], Report]) -> Report:
        """`swap`, keeping the live version first when another one is swapped in (and what
        `keep_versions` says to keep after it, swapped or not)."""
        if not self._changing(projection) or not self.settings.keep_versions:
            return swap()
        keeping.keep(
            self.url, projection.name, shadowed_tables(projection), bool(projection.streams)
        )
        try:
            return swap()
        finally:
            with psycopg.connect(self.url) as conn:
                keeping.prune(conn, projection.name, self.settings.keep_versions)

    def _changing(self, projection: Projection) -> bool:
        """Whether this rebuild brings in another version than the live tables'."""
        live = self.live_versions.get(projection.name)
        return live is not None and live != versions.of(projection)

    def _names(self, projection: Projection) -> list[str]:
        return projection.topic_names(self.topics)

    def _share(self, projection: Projection, counts: dict[str, int]) -> int:
        return sum(counts.get(n, 0) for n in self._names(projection))

    def _load(
        self, p: Projection, events: DataFrame, seen: dict[str, int], share: int, bar: tqdm
    ) -> tuple[dict[str, int], tuple[int, int]]:
        """Fill `p`'s shadows from the whole log's `events`; returns the offsets they cover
        and the events applied and late, as the live projector counts them."""
        mine = self._without_excluded(p, events.where(F.col("topic").isin(self._names(p))))
        if p.replayed:
            with psycopg.connect(self.url) as conn:
                # Secondary indexes are built once after the whole log, not row by row
                # during it (the merges of so large a batch join by hashing, not by them).
                indexes = drop_indexes(conn, [f"{t}{SHADOW}" for t in shadowed_tables(p)])
                conn.commit()
                with conn.transaction():
                    # The shadows are new: their keys are built after the first merge.
                    conn.execute(f"SET LOCAL maintenance_work_mem = '{WORK_MEM}'")
                    covered, applied, late = self._apply(conn, p, mine, {}, SHADOW, empty=True)
                with conn.transaction():
                    conn.execute(f"SET LOCAL maintenance_work_mem = '{WORK_MEM}'")
                    for statement in indexes:
                        conn.execute(statement)
            bar.update(share * len(p.outputs))
            return covered, (applied, late)
        for output in p.outputs:
            self._bulk_load(output, mine, bar, share)
        reads = set(p.reads(self.topics, self.settings.partitions))
        return {k: v for k, v in seen.items() if k in reads}, (share, self._late_rows(p))

    def _create_shadows(self, projections: list[Projection], keyed: bool = False) -> None:
        with psycopg.connect(self.url, autocommit=True) as conn:
            for p in projections:
                # Scratch tables: unlogged (no WAL to write, nor for CDC to decode and skip; a
                # database crash empties them, and a rebuild starts them anew). Bulk-loaded ones
                # get their key after the load, and need no other index.
                like = "INCLUDING ALL" if p.replayed or keyed else "INCLUDING DEFAULTS"
                for table in shadowed_tables(p):
                    conn.execute(f"DROP TABLE IF EXISTS {table}{SHADOW}")
                    conn.execute(f"CREATE UNLOGGED TABLE {table}{SHADOW} (LIKE {table} {like})")
                conn.execute("DELETE FROM stream_ids WHERE fold = %s", (p.name + SHADOW,))

    def _bulk_load(self, output: Output, events: DataFrame, bar: tqdm, share: float) -> None:
        watcher = _TaskProgress(self.spark, bar, share)
        watcher.start()
        try:
            bulk_load(
                self.url,
                fold(output, events),
                output.name + SHADOW,
                output.columns,
                output.personal,
            )
        finally:
            watcher.stop()
        shadow = output.name + SHADOW
        with psycopg.connect(self.url) as conn:
            for statement in output.load_statements(shadow):
                conn.execute(statement)
            conn.execute(f"ALTER TABLE {shadow} ADD PRIMARY KEY ({', '.join(output.key)})")

    def _catch_up(self, projection: Projection, covered: dict[str, int]) -> dict[str, int]:
        """Apply to the shadow what the live projector applied since the snapshot was read,
        until little is left for the final step (which holds the live projector's lock)."""
        for _ in range(CATCH_UP_ROUNDS):
            with psycopg.connect(self.url) as conn:
                live = read_progress(conn, projection.name)
            ahead = {k: v for k, v in live.items() if v > covered.get(k, -1)}
            if sum(v - covered.get(k, -1) for k, v in ahead.items()) <= CATCH_UP_ENOUGH:
                return covered
            with psycopg.connect(self.url) as conn, conn.transaction():
                batch = self._between(projection, covered, {**covered, **ahead})
                covered, _, _ = self._apply(conn, projection, batch, covered, SHADOW)
        return covered

    def _late_rows(self, projection: Projection) -> int:
        """The late events in `projection`'s shadows (each is one row of a late output)."""
        with psycopg.connect(self.url) as conn:
            return sum(count_rows(conn, o.name + SHADOW) for o in projection.outputs if o.late)

    def _swap(
        self,
        projection: Projection,
        covered: dict[str, int],
        verify: bool,
        snapshot: tuple[int, int],
    ) -> Report:
        """Make the live view equal to the shadow, which took `snapshot` (events applied,
        late ones) from the read of the whole log, the rest in catch-up batches."""
        report = Report(projection.name, 0, 0.0)
        with psycopg.connect(self.url) as conn, conn.transaction():
            conn.execute(f"SET LOCAL work_mem = '{WORK_MEM}'")
            conn.execute(f"SET LOCAL maintenance_work_mem = '{WORK_MEM}'")
            live = lock_progress(conn, projection.name)  # live batches wait from here
            if live_version(conn, projection.name) != self.live_versions.get(projection.name):
                raise RuntimeError(
                    f"{projection.name}: another version was swapped in during the rebuild "
                    "(a newer projector's); this one is superseded"
                )
            if self.building is not None:
                row = conn.execute(
                    "SELECT building_version FROM projection_progress WHERE projection = %s",
                    (projection.name,),
                ).fetchone()
                if row is None or row[0] != self.building:
                    raise RuntimeError(
                        f"{projection.name}: version {row[0] if row else None} is being built "
                        f"by a later projector; this build of {self.building} is superseded"
                    )
            changing = self._changing(projection)
            left_out = excluded(conn, projection.name)
            if changing:
                left_out = ([], left_out[1])
            if left_out != self.excluded.get(projection.name, ([], [])):
                raise RuntimeError(
                    f"{projection.name}: its parked or skipped events changed during the rebuild "
                    "(a retry or a skip ran); run the rebuild again"
                )
            report.parked_aggregates, report.skipped_events = len(left_out[0]), len(left_out[1])
            # Bring both to the same position: the shadow to what the live view has applied,
            # the live view to what the snapshot read (as its next batches would have).
            behind_live = {k: v for k, v in live.items() if v > covered.get(k, -1)}
            if behind_live:
                batch = self._between(projection, covered, {**covered, **behind_live})
                covered, _, _ = self._apply(conn, projection, batch, covered, SHADOW)
            behind_shadow = {k: v for k, v in covered.items() if v > live.get(k, -1)}
            applied = late = 0
            if behind_shadow and not live and not verify:
                # The live view has applied nothing (no projector has run): the shadow replaces
                # it whole, so applying the log to it first would be work thrown away. It takes
                # the shadow's counts, which are then all the snapshot's (there was no catch-up).
                live, (applied, late) = covered, snapshot
            elif behind_shadow:
                batch = self._between(projection, live, {**live, **behind_shadow})
                live, applied, late = self._apply(conn, projection, batch, live)
            if verify:
                report.differences = {o.name: _differences(conn, o) for o in projection.outputs}
            for output in projection.outputs:
                t = output.name
                replace_contents(conn, t, t + SHADOW, output.key, output.columns)
                conn.execute(f"DROP TABLE {t}{SHADOW}")
                report.rows[t] = count_rows(conn, t)
                for state in output.state:
                    key = tuple(str(c.name) for c in state.primary_key.columns)
                    columns = tuple(str(c.name) for c in state.columns)
                    replace_contents(
                        conn, state.name, state.name + SHADOW, key, columns, private=True
                    )
                    conn.execute(f"DROP TABLE {state.name}{SHADOW}")
            if projection.streams:
                move_stream_ids(conn, projection.name + SHADOW, projection.name)
            if changing:  # the new version folded them: nothing of the old one stays parked
                conn.execute("DELETE FROM parked_events WHERE projection = %s", (projection.name,))
            conn.execute(
                "UPDATE projection_progress SET offsets = %s, generation = generation + 1, "
                "events_applied = events_applied + %s, late_events = late_events + %s, "
                "updated_at = now(), version = %s, building_version = NULL, build_error = NULL "
                "WHERE projection = %s",
                (Jsonb(live), applied, late, versions.of(projection), projection.name),
            )
        return report


def _first_records(bootstrap: str, topics: list[str], n: int) -> dict[str, int]:
    """The last offset of about `n` committed records of `topics`, the first of each of their
    non-empty partitions in equal shares ("topic:partition" -> offset, as `between_json`
    takes them)."""
    consumer = committed_reader(bootstrap)
    try:
        tps = [
            TopicPartition(t, p)
            for t in topics
            for p in sorted(consumer.partitions_for_topic(t) or ())
        ]
        first, end = consumer.beginning_offsets(tps), consumer.end_offsets(tps)
    finally:
        consumer.close()
    held = [tp for tp in tps if end[tp] > first[tp]]
    each = -(-n // max(len(held), 1))
    return {f"{tp.topic}:{tp.partition}": min(first[tp] + each, end[tp]) - 1 for tp in held}


def _survey(records: DataFrame) -> tuple[dict[str, int], dict[str, int], int]:
    """Of a read's decoded `records`: the last offset of each topic-partition, the records of
    each topic, and how many are not at their type's current version."""
    rows = (
        records.groupBy("topic", "partition")
        .agg(
            F.max("offset").alias("last"),
            F.count("*").alias("n"),
            F.count_if(~F.col("current")).alias("old"),
        )
        .collect()
    )
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["topic"]] = counts.get(r["topic"], 0) + int(r["n"])
    seen = {f"{r['topic']}:{r['partition']}": int(r["last"]) for r in rows}
    return seen, counts, sum(int(r["old"]) for r in rows)


def _differences(conn: psycopg.Connection[Any], output: Output) -> list[Any]:
    return differences(conn, output.name, output.name + SHADOW, ", ".join(output.columns))


class ProgressWriter:
    """While a rebuild run in the projector (a changed version's build, a rebuild asked of it)
    works, hands its progress (events folded, of the log's; both None until the log's size is
    known) to `write` every `every_s` seconds, from a thread of its own. The job's bar only
    counts: nothing is drawn. A write Postgres refuses is logged and tried again at the next."""

    def __init__(
        self,
        url: str,
        job: Rebuild,
        write: Callable[[psycopg.Connection[Any], int | None, int | None], None],
        every_s: float = 1.0,
    ) -> None:
        self.url, self.job, self.write, self.every_s = url, job, write, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rebuild-progress", daemon=True)

    def __enter__(self) -> ProgressWriter:
        self.job.bar_out = open(os.devnull, "w")
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()
        if self.job.bar_out is not None:
            self.job.bar_out.close()

    def _run(self) -> None:
        conn: psycopg.Connection[Any] | None = None
        while not self._stop.wait(self.every_s):
            bar = self.job.bar
            done, total = (int(bar.n), int(bar.total)) if bar and bar.total else (None, None)
            try:
                if conn is None or conn.closed:
                    conn = psycopg.connect(self.url, autocommit=True)
                self.write(conn, done, total)
            except psycopg.Error as e:
                log.warning("a rebuild's progress is not recorded: %s", e)
                conn = None
        if conn is not None:
            conn.close()


class _TaskProgress:
    """Moves a progress bar by `share` as Spark completes the tasks of the jobs this thread
    starts (a job group of its own: other loads run their jobs at the same time)."""

    def __init__(self, spark: SparkSession, bar: tqdm, share: float) -> None:
        self.context = spark.sparkContext
        self.tracker = self.context.statusTracker()
        self.group = f"rebuild-load-{threading.get_ident()}-{time.monotonic_ns()}"
        self.bar, self.share = bar, share
        self.moved = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        # Spark's job properties are the calling thread's own (PySpark pins threads).
        self.context.setJobGroup(self.group, "rebuild: load a shadow table")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.context.setLocalProperty("spark.jobGroup.id", None)  # type: ignore[arg-type]

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            done = total = 0
            for job_id in self.tracker.getJobIdsForGroup(self.group):
                job = self.tracker.getJobInfo(job_id)
                for stage_id in job.stageIds if job is not None else ():
                    info = self.tracker.getStageInfo(stage_id)
                    if info is not None:
                        done, total = done + info.numCompletedTasks, total + info.numTasks
            if total:
                moved = int(self.share * done / total)
                if moved > self.moved:
                    self.bar.update(moved - self.moved)
                    self.moved = moved
