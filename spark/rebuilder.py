"""The projector's rebuilds asked for by `logfold rebuild` (the requests:
`projections/base/rebuilds.py`).

A rebuild in the projector's driver runs in a JVM that has already loaded and compiled most of
Spark, and on the executors the projector already holds; a new driver for each rebuild spends
more of its time starting and compiling than folding (`docs/benchmarks.md`, rebuild). The
rebuild itself is the command's (`spark/rebuild.py`, then `spark/join.py`'s), in a scheduler
pool of its own beside the live queries. Builds of changed versions (`spark/deploy.py`) go
first: both swap live tables.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

import psycopg
from pyspark.sql import SparkSession

from config.settings import Settings
from projections.base import Join, Projection, rebuilds
from spark.deploy import Deployer
from spark.event_rows import first_line
from spark.join import JoinRebuild
from spark.poller import Poller
from spark.rebuild import ProgressWriter, Rebuild
from spark.session import batch_session
from spark.shadows import Report

log = logging.getLogger(__name__)

POLL_S = 0.5  # how often the projector looks for requests
BEAT_S = 1.0  # how often it beats (with its progress) while it rebuilds


class Rebuilder(Poller):
    """The projector's thread that carries out the rebuilds asked of it, one at a time."""

    def __init__(
        self,
        spark: SparkSession,
        settings: Settings,
        projections: Sequence[Projection],
        joins: Sequence[Join],
        deployer: Deployer,
    ) -> None:
        super().__init__(
            spark,
            settings.database(),
            name="rebuilds",
            pool="rebuild",
            every_s=POLL_S,
            failed="rebuilds: looking for requests failed",
        )
        self.settings, self.deployer = settings, deployer
        self.projections = {p.name: p for p in projections}
        self.joins = {j.name: j for j in joins}
        self.mine = rebuilds.versions_of(projections, joins)
        self.who = f"{socket.gethostname()}:{os.getpid()}"
        self.carried_out = 0  # requests finished (tests, logs)

    def first(self) -> None:
        self.deployer.join()  # a changed version's build first: both swap the live tables
        records = self.settings.projector_rebuild_rehearsal_records
        if records and self.projections and not self.stopping:
            # Beside the looks for requests, not before them: a rebuild asked meanwhile is
            # claimed at once (it then compiles what the rehearsal has not yet).
            threading.Thread(
                target=self.rehearse, args=(records,), name="rebuild-rehearsal", daemon=True
            ).start()

    def rehearse(self, records: int) -> None:
        """A rebuild rehearsed on about `records` of the log, writing nothing
        (`Rebuild.rehearse`): the first rebuild asked of this projector then runs in code
        already generated and compiled. A failed rehearsal costs only that."""
        self.spark.sparkContext.setLocalProperty("spark.scheduler.pool", self.pool)
        started = time.monotonic()
        try:
            job = Rebuild(self.settings, batch_session(self.spark))
            rows = job.rehearse(list(self.projections.values()), records)
        except Exception as e:
            if not self.stopping:  # a stop ends it with Spark: nothing to say then
                log.warning("rebuild rehearsal failed (the first rebuild compiles instead): %s", e)
            return
        log.info("rebuild rehearsed: %d rows in %.1f s", rows, time.monotonic() - started)

    def run_once(self) -> bool:
        """Claim and carry out one request; whether there was one."""
        with self.looking:
            request = rebuilds.claim(self.db.get(), self.mine, self.who)
        if request is None:
            return False
        log.warning("rebuilding %s, as asked (request %d)", ", ".join(request.versions), request.id)
        spark = batch_session(self.spark)
        job, joins = Rebuild(self.settings, spark), JoinRebuild(self.settings, spark)

        def beat(conn: psycopg.Connection[Any], done: int | None, total: int | None) -> None:
            rebuilds.beat(conn, request.id, done, total)

        reports: list[Report] = []
        error = None
        try:
            with ProgressWriter(self.settings.database(), job, beat, BEAT_S):
                chosen = list(request.versions)
                reports = job.run_many(
                    [self.projections[n] for n in chosen if n in self.projections],
                    verify=request.verify,
                    progress=False,
                )
                reports += [
                    joins.run(self.joins[n], verify=request.verify)
                    for n in chosen
                    if n in self.joins
                ]
        except Exception as e:
            error = first_line(e)
            log.exception("rebuild request %d failed", request.id)
        with psycopg.connect(self.settings.database(), autocommit=True) as conn:
            rebuilds.finish(conn, request.id, [dataclasses.asdict(r) for r in reports], error)
        self.carried_out += 1
        return True
