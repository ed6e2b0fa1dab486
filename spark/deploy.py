"""A changed projection deploys itself beside the live one (guarantee 25).

Each projection has a version (`projections/base/versions.py`); `projection_progress.version`
says which one its live tables were built by. A projector that folds another version leaves
those tables to whatever keeps them (the previous projector, while it runs) and, in this
thread, builds its own version from the log into shadow tables (`spark/rebuild.py`: the whole
log read once, then caught up to the live position), then swaps it in: in one transaction
holding the projection's progress, the live tables become equal to the shadows and the version
is recorded. Readers see the old rows until that commit and the new ones after it, never a
gap, an empty view or a mix; CDC sees each row that changed, so joined views and subscribers
follow. From the next batch this projector folds the projection live, and an older projector
still running leaves it alone (its version is no longer the live one).

Rolling back is deploying the previous code again: while that version is kept
(`spark/keeping.py`, `LOGFOLD_KEEP_VERSIONS`), its build starts from the copy of its tables and
folds only the events since it was swapped out; otherwise from the whole log, as any build.

The build's progress (events folded of the log's) is in `projection_progress.build_done` and
`build_total` (`logfold projections --watch` draws it). With `LOGFOLD_DEPLOY_VERIFY` it also
compares the new version with the live one at the same position before the swap, and records
what differs (`build_report`: per table, rows only in the old version, only in the new).

A build that fails leaves the old version serving, with the error in `build_error`
(`/health`, `logfold projections`); the projector's next start tries again. A later projector
that starts building another version while this one builds supersedes it (the last build
asked for is the one swapped in: the others' swaps refuse), as does a version swapped in
meanwhile."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import psycopg
from psycopg.types.json import Jsonb
from pyspark.sql import SparkSession

from config.settings import Settings
from projections.base import Projection, versions
from spark import keeping
from spark.event_rows import first_line
from spark.rebuild import ProgressWriter, Rebuild
from spark.session import batch_session
from spark.shadows import Report
from spark.sink import ensure_progress, live_version

log = logging.getLogger(__name__)


class Deployer:
    """The projector's thread that builds the projections whose live tables are at another
    version, one after another."""

    def __init__(
        self, spark: SparkSession, settings: Settings, projections: Sequence[Projection]
    ) -> None:
        self.spark, self.settings = spark, settings
        self.projections = list(projections)
        self._thread: threading.Thread | None = None
        self.built: list[str] = []  # swapped in (tests, logs)
        self.failed: dict[str, str] = {}
        self.reports: dict[str, Report] = {}

    def pending(self) -> list[Projection]:
        """The projections whose live tables are at another version than this projector's."""
        with psycopg.connect(self.settings.database(), autocommit=True) as conn:
            found = []
            for p in self.projections:
                ensure_progress(conn, p.name)
                live = live_version(conn, p.name)
                if live is not None and live != versions.of(p):
                    found.append(p)
        return found

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="deploy", daemon=True)
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def run(self) -> None:
        self.spark.sparkContext.setLocalProperty("spark.scheduler.pool", "deploy")
        try:
            for p in self.pending():
                self.build(p)
        except Exception:  # Postgres away: the next start tries again
            log.exception("deploying the projections' versions failed")

    def build(self, p: Projection) -> bool:
        """Build `p`'s version beside its live tables and swap it in; whether it was."""
        version = versions.of(p)
        with psycopg.connect(self.settings.database(), autocommit=True) as conn:
            conn.execute(
                "UPDATE projection_progress SET building_version = %s, build_error = NULL, "
                "build_started_at = now(), build_done = NULL, build_total = NULL, "
                "build_report = NULL WHERE projection = %s",
                (version, p.name),
            )
        log.warning("projection %s: building version %s beside the live tables", p.name, version)
        job = Rebuild(self.settings, batch_session(self.spark))
        job.building = version
        try:
            with psycopg.connect(self.settings.database()) as conn:
                kept = keeping.usable(conn, p.name, version)
            if kept is not None:
                log.warning(
                    "projection %s: starting from version %s kept at %s, with the events since",
                    p.name,
                    version,
                    kept.kept_at,
                )
                report = job.restore(p, kept, verify=self.settings.deploy_verify)
            else:
                with ProgressWriter(self.settings.database(), job, build_progress(p.name)):
                    report = job.run(p, verify=self.settings.deploy_verify, progress=False)
        except Exception as e:
            error = first_line(e)
            self.failed[p.name] = error
            log.error("projection %s: building version %s failed: %s", p.name, version, error)
            with psycopg.connect(self.settings.database(), autocommit=True) as conn:
                conn.execute(
                    "UPDATE projection_progress SET building_version = NULL, build_error = %s "
                    "WHERE projection = %s",
                    (f"version {version}: {error}", p.name),
                )
            return False
        self.built.append(p.name)
        self.reports[p.name] = report
        if report.differences is not None:
            with psycopg.connect(self.settings.database(), autocommit=True) as conn:
                conn.execute(
                    "UPDATE projection_progress SET build_report = %s WHERE projection = %s",
                    (Jsonb(_changes(version, report)), p.name),
                )
        log.warning(
            "projection %s: version %s swapped in (%d events, %.1f s)",
            p.name,
            version,
            report.events,
            report.seconds,
        )
        return True


def _changes(version: str, report: Report) -> dict[str, Any]:
    """What a verified build's new version changed, per table: rows only in the old version,
    only in the new (counted, of at most the first 1000 differences)."""
    tables = {
        table: {
            "only_in_old": sum(1 for r in rows if r[0] == "only_in_live"),
            "only_in_new": sum(1 for r in rows if r[0] == "only_in_rebuild"),
        }
        for table, rows in (report.differences or {}).items()
    }
    return {"version": version, "restored_from_kept": report.restored is not None, "tables": tables}


def build_progress(
    projection: str,
) -> Callable[[psycopg.Connection[Any], int | None, int | None], None]:
    """How a build's progress is recorded: in its projection's progress row, once the log's
    size is known (`logfold projections --watch` draws it)."""

    def record(conn: psycopg.Connection[Any], done: int | None, total: int | None) -> None:
        if total is not None:
            conn.execute(
                "UPDATE projection_progress SET build_done = %s, build_total = %s "
                "WHERE projection = %s",
                (done, total, projection),
            )

    return record
