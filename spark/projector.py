"""The streaming projector: two Structured Streaming queries in one Spark driver.

- `events` (spark/event_pipeline.py) folds the event log into every projection's views;
- `joins` (spark/join.py) folds the changelogs of the joined tables into the joined views;

and threads apply the parked events whose retry was asked for (spark/parking.py), build,
beside the live tables, the projections whose version changed (spark/deploy.py), and carry out
the rebuilds `logfold rebuild` asks of it (spark/rebuilder.py);

each in Spark's real-time mode where it can (spark/realtime.py), else in micro-batches.

Each fold keeps its own progress in Postgres, so a query always starts from the offsets after
the last applied ones; Spark's own checkpoint is scratch space. A query that stops is started
again (after a pause that grows while it keeps failing); the other keeps running.

    spark-submit --master spark://host:7077 --jars <kafka jars> spark/projector.py
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from pyspark.sql import SparkSession

from config.settings import Settings
from projections.base import Join, Projection
from projections.registry import JOINS, PROJECTIONS
from spark.deploy import Deployer
from spark.event_pipeline import EventPipeline, Running, realtime_partitions, realtime_slots
from spark.event_rows import keep_ids
from spark.join import JoinPipeline
from spark.realtime import RealTimeEvents, RealTimeJoins
from spark.rebuilder import Rebuilder
from spark.retrier import Retrier
from spark.session import quiet_stop, session
from spark.status import StatusBeat

log = logging.getLogger(__name__)

MAX_PAUSE_S = 30.0
# How often a query folding in micro-batches for want of task slots looks whether Spark has
# them again (a worker came back), to start again in real-time mode.
SLOTS_LOOK_S = 5.0


class Pipeline(Protocol):
    micro_batches_why: str | None  # why it folds in micro-batches; None: in real-time mode

    def start(self) -> Running: ...

    def realtime_again(self) -> bool: ...  # in micro-batches, though real-time mode may run now


SCRATCH_PREFIX = "logfold-projector-"


def scratch_dir(settings: Settings) -> str:
    """Where the queries' checkpoints go: memory (/dev/shm) when the machine has it, since
    Spark writes two small files per micro-batch and nothing there needs to survive. The
    scratch of projectors that died without cleaning up (kill -9) is removed first."""
    base = settings.spark_scratch_dir
    if base is None and os.access("/dev/shm", os.W_OK):
        base = "/dev/shm"
    base = base or tempfile.gettempdir()
    for old in Path(base).glob(f"{SCRATCH_PREFIX}*-*"):
        pid = old.name.removeprefix(SCRATCH_PREFIX).split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-", dir=base)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


class Projector:
    def __init__(
        self,
        settings: Settings,
        spark: SparkSession | None = None,
        projections: Sequence[Projection] | None = None,
        joins: Sequence[Join] | None = None,
    ) -> None:
        self.settings = settings
        self._own_spark = spark is None  # a session it was given is not its to quiet
        chosen = list(PROJECTIONS.values()) if projections is None else list(projections)
        joined = list(JOINS.values()) if joins is None else list(joins)
        self.spark = spark or session(
            settings,
            "logfold-projector",
            settings.projector_jvm_options(),
            slots=realtime_slots(settings, chosen, joined) if settings.spark_realtime else 0,
        )
        self.scratch = scratch_dir(settings)
        self.pipelines: dict[str, Pipeline] = {}
        # The one place the live paths' mode is chosen: Spark's real-time mode where wanted
        # (each pipeline still falls back to micro-batches without the task slots it needs).
        realtime = settings.spark_realtime
        if chosen:
            self.pipelines["events"] = EventPipeline(
                self.spark, settings, chosen, self.scratch, RealTimeEvents if realtime else None
            )
        if joined:
            beside = realtime_partitions(settings, chosen)
            self.pipelines["joins"] = JoinPipeline(
                self.spark,
                settings,
                joined,
                self.scratch,
                beside=beside,
                realtime_mode=RealTimeJoins if realtime else None,
            )
        self.queries: dict[str, Running] = {}
        # Builds the projections whose live tables are at another version (spark/deploy.py).
        self.deployer = Deployer(self.spark, settings, chosen)
        # Carries out the rebuilds `logfold rebuild` asks of it, after the deployer's builds.
        self.rebuilder = Rebuilder(self.spark, settings, chosen, joined, self.deployer)
        # Applies parked events whose retry was asked for (`logfold dead-letters retry`).
        self.retrier = (
            Retrier(self.spark, settings, chosen, lambda p: keep_ids(p, settings))
            if chosen
            else None
        )
        self._stopping = threading.Event()
        needed = realtime_slots(settings, chosen, joined) if realtime else 0
        self.status = StatusBeat(settings, self.spark, self.query_status, needed)

    def query_status(self) -> dict[str, dict[str, object]]:
        """Each query's mode as the projector's status shows it (spark/status.py)."""
        shown: dict[str, dict[str, object]] = {}
        for name, pipeline in self.pipelines.items():
            query = self.queries.get(name)
            why = pipeline.micro_batches_why
            shown[name] = {
                "mode": "real-time" if why is None else "micro-batch",
                "active": bool(query is not None and query.isActive),
                **({"why": why} if why is not None else {}),
            }
        return shown

    def start(self, name: str) -> Running:
        # Each query's jobs run in a scheduler pool of its own, so neither waits behind the other.
        self.spark.sparkContext.setLocalProperty("spark.scheduler.pool", name)
        query = self.pipelines[name].start()
        self.queries[name] = query
        return query

    def run(self) -> None:
        """Run every pipeline until stop(); start again any query that stops."""
        for name in self.pipelines:
            self.start(name)
        log.info("projector running: %s", ", ".join(self.queries))
        self.status.start()
        if self.retrier is not None:
            self.retrier.start()
        self.deployer.start()
        self.rebuilder.start()
        failures: dict[str, int] = {}
        restart_at: dict[str, float] = {}
        slots_look_at = time.monotonic() + SLOTS_LOOK_S
        try:
            while not self._stopping.wait(0.5):
                if time.monotonic() >= slots_look_at:
                    slots_look_at = time.monotonic() + SLOTS_LOOK_S
                    self.back_to_realtime()
                for name, query in list(self.queries.items()):
                    if query.isActive:
                        continue
                    if name not in restart_at:
                        failures[name] = failures.get(name, 0) + 1
                        pause = min(2.0 ** (failures[name] - 1), MAX_PAUSE_S)
                        log.error(
                            "query %s stopped (%s); restarting in %.0fs",
                            name,
                            query.exception(),
                            pause,
                        )
                        restart_at[name] = time.monotonic() + pause
                    elif time.monotonic() >= restart_at[name]:
                        del restart_at[name]
                        self.start(name)
        finally:
            self.rebuilder.stop()
            if self.retrier is not None:
                self.retrier.stop()
            self.status.stop(remove=self._stopping.is_set())
            if self._stopping.is_set() and self._own_spark:
                quiet_stop(self.spark, self.settings)
            for query in self.queries.values():
                query.stop()
            shutil.rmtree(self.scratch, ignore_errors=True)

    def back_to_realtime(self) -> None:
        """Start again, in real-time mode, each query that folds in micro-batches only for
        want of task slots Spark has now. It resumes from the projections' progress, as any
        restart does, so nothing is lost or applied twice."""
        for name, pipeline in self.pipelines.items():
            query = self.queries.get(name)
            if query is None or not query.isActive or not pipeline.realtime_again():
                continue
            log.warning("Spark has the task slots again: %s goes back to real-time mode", name)
            query.stop()
            self.start(name)

    def stop(self) -> None:
        self._stopping.set()


if __name__ == "__main__":  # under spark-submit; `logfold projector` is the usual entry point
    from config import logs

    logs.configure(Settings().log_level, Settings().log_format)
    Projector(Settings()).run()
