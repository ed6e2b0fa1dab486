"""A projector's thread that looks in Postgres, every so often, for work asked of it (rebuilds:
`spark/rebuilder.py`; retries and skips of parked events: `spark/retrier.py`)."""

from __future__ import annotations

import logging
import threading
from typing import Any

from pyspark.sql import SparkSession

from spark.sink import Reconnecting

log = logging.getLogger(__name__)


class Poller:
    """Calls `run_once` every `every_s` seconds from a thread of its own, in Spark's scheduler
    pool `pool`, until stopped. It looks on one connection (`db`), not one per look, opened
    again once it is lost, and one look at a time on it (`looking`), were `run_once` called from
    another thread too. A look that fails is logged (`failed`) and made again at the next."""

    def __init__(
        self, spark: SparkSession, url: str, name: str, pool: str, every_s: float, failed: str
    ) -> None:
        self.spark, self.name, self.pool, self.every_s, self.failed = (
            spark,
            name,
            pool,
            every_s,
            failed,
        )
        self.db = Reconnecting(url, autocommit=True)
        self.looking = threading.Lock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def stop(self, wait_s: float = 0) -> None:
        """Stop looking; wait up to `wait_s` for the work in hand to end."""
        self._stopping.set()
        if wait_s and self._thread is not None:
            self._thread.join(timeout=wait_s)

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def first(self) -> None:
        """What the thread does before its first look."""

    def run_once(self) -> Any:
        raise NotImplementedError

    def _run(self) -> None:
        self.first()
        self.spark.sparkContext.setLocalProperty("spark.scheduler.pool", self.pool)
        try:
            while not self._stopping.wait(self.every_s):
                try:
                    self.run_once()
                except Exception:  # Postgres away (a new connection next time), or the work
                    log.exception(self.failed)
        finally:
            self.db.close()
