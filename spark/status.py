"""The projector's status, written by its driver every BEAT_S seconds to `projector_status` (one
row): its Spark master, the executors registered now and their task slots, the slots its
real-time queries need, and each query's mode (real-time, or micro-batches and why).

`/health` reads it (component `projector`, app/health.py): a projector whose executors are all
gone (a cluster's workers lost), or that stopped writing (hung, killed), is reported within
seconds, not after its views' lag has grown; one that folds in micro-batches for want of task
slots says so. A projector that stops cleanly removes its row."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from typing import Any

import psycopg
from pyspark.sql import SparkSession

from config.settings import PROJECTOR_BEAT_S, Settings
from spark.event_pipeline import available_slots
from spark.session import executors

log = logging.getLogger(__name__)

BEAT_S = PROJECTOR_BEAT_S
NAME = "projector"  # one projector per deployment (its database)


class StatusBeat:
    """Writes the row every BEAT_S seconds from a thread of the driver, until stop()."""

    def __init__(
        self,
        settings: Settings,
        spark: SparkSession,
        queries: Callable[[], dict[str, dict[str, Any]]],
        slots_needed: int,
    ) -> None:
        self.settings, self.spark, self.queries = settings, spark, queries
        self.slots_needed = slots_needed
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="projector-status", daemon=True)
        self._thread.start()

    def stop(self, remove: bool) -> None:
        """Stop writing; `remove` the row when the projector was stopped on purpose (it is not
        a failed one: /health shows none). Left, the row goes stale and /health says so."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if not remove:
            return
        try:
            with psycopg.connect(self.settings.database(), autocommit=True) as conn:
                conn.execute("DELETE FROM projector_status WHERE name = %s", (NAME,))
        except psycopg.Error:
            log.warning("could not remove the projector's status row", exc_info=True)

    def status(self) -> dict[str, Any]:
        context = self.spark.sparkContext
        local = (context.master or "").startswith("local")
        return {
            "master": context.master or "",
            "executors": 1 if local else executors(self.spark),  # (local: the driver's own)
            "slots": available_slots(self.spark),
            "slots_needed": self.slots_needed,
            "queries": self.queries(),
        }

    def write(self) -> None:
        s = self.status()
        with psycopg.connect(self.settings.database(), autocommit=True) as conn:
            conn.execute(
                """
                INSERT INTO projector_status
                    (name, master, executors, slots, slots_needed, queries, beat_at)
                VALUES (%s, %s, %s, %s, %s, %s, now())
                ON CONFLICT (name) DO UPDATE SET master = EXCLUDED.master,
                    executors = EXCLUDED.executors, slots = EXCLUDED.slots,
                    slots_needed = EXCLUDED.slots_needed, queries = EXCLUDED.queries,
                    beat_at = EXCLUDED.beat_at
                """,
                (
                    NAME,
                    s["master"],
                    s["executors"],
                    s["slots"],
                    s["slots_needed"],
                    json.dumps(s["queries"]),
                ),
            )

    def _run(self) -> None:
        while True:
            try:
                self.write()
            except Exception:  # Postgres away a moment, the JVM stopping: written next time
                log.debug("writing the projector's status failed", exc_info=True)
            if self._stopping.wait(BEAT_S):
                return
