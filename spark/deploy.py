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

A build that fails leaves the old version serving, with the error in `build_error`
(`/health`, `logfold projections`); the projector's next start tries again. A later projector
that starts building another version while this one builds supersedes it (the last build
asked for is the one swapped in: the others' swaps refuse), as does a version swapped in
meanwhile."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import psycopg
from pyspark.sql import SparkSession

from config.settings import Settings
from projections.base import Projection, versions
from spark.event_rows import first_line
from spark.rebuild import Rebuild
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
                "build_started_at = now() WHERE projection = %s",
                (version, p.name),
            )
        log.warning("projection %s: building version %s beside the live tables", p.name, version)
        try:
            job = Rebuild(self.settings, self.spark)
            job.building = version
            report = job.run(p, progress=False)
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
        log.warning(
            "projection %s: version %s swapped in (%d events, %.1f s)",
            p.name,
            version,
            report.events,
            report.seconds,
        )
        return True
