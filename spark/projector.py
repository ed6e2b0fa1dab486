"""The streaming projector: one Structured Streaming query per projection, reading its event
topics with Spark's Kafka source (read_committed) and folding each micro-batch into Postgres,
and one per join, reading its tables' changelogs (see spark/join.py).

Postgres holds each projection's progress, so a query always starts from the offsets after the
last applied ones; Spark's own checkpoint is scratch space. A query that fails is restarted
alone; the others keep running.

    spark-submit --master spark://host:7077 --jars <kafka jars> spark/projector.py
"""

from __future__ import annotations

import logging
import tempfile
import threading

import psycopg
from pyspark.sql import SparkSession
from pyspark.sql.streaming.query import StreamingQuery

from projections.base import Join, Projection
from projections.registry import JOINS, PROJECTIONS
from spark import join as joins
from spark.decode import decode_events, kafka_options, offsets_json
from spark.session import session
from spark.sink import LiveSink, ensure_progress, read_progress
from stack.settings import Settings
from stack.topics import Topics

log = logging.getLogger(__name__)


class Projector:
    def __init__(self, settings: Settings, spark: SparkSession | None = None) -> None:
        self.settings = settings
        self.topics = Topics(settings.topic_prefix)
        self.spark = spark or session(settings, "logfold-projector")
        self.queries: dict[str, StreamingQuery] = {}
        self._scratch = tempfile.mkdtemp(prefix="logfold-projector-")
        self._stopping = threading.Event()

    def topic_names(self, projection: Projection) -> list[str]:
        return [self.topics.events(t) for t in projection.topics]

    def start(self, projection: Projection | Join) -> StreamingQuery:
        if isinstance(projection, Join):
            query = joins.stream(
                self.spark, self.settings, projection, tempfile.mkdtemp(dir=self._scratch)
            )
            self.queries[projection.name] = query
            return query
        url = self.settings.database()
        with psycopg.connect(url, autocommit=True) as conn:
            ensure_progress(conn, projection.name)
            offsets = read_progress(conn, projection.name)
        topics = self.topic_names(projection)
        raw = (
            self.spark.readStream.format("kafka")
            .options(**kafka_options(self.settings.kafka()))
            .option("subscribe", ",".join(topics))
            .option("startingOffsets", offsets_json(topics, self.settings.partitions, offsets, 1))
            .option("maxOffsetsPerTrigger", 200_000)
            .load()
        )
        query = (
            decode_events(raw)
            .writeStream.foreachBatch(LiveSink(projection, url))
            .queryName(projection.name)
            # A fresh checkpoint per start: where to resume is Postgres's progress, not Spark's.
            .option("checkpointLocation", tempfile.mkdtemp(dir=self._scratch))
            .trigger(processingTime=f"{self.settings.projector_trigger_s} seconds")
            .start()
        )
        self.queries[projection.name] = query
        return query

    def run(self) -> None:
        """Run every projection and join until stop(); restart any query that fails."""
        views: list[Projection | Join] = [*PROJECTIONS.values(), *JOINS.values()]
        for view in views:
            self.start(view)
        log.info("projector running: %s", ", ".join(self.queries))
        while not self._stopping.wait(1.0):
            for name, query in list(self.queries.items()):
                if not query.isActive:
                    log.error("projection %s stopped (%s); restarting", name, query.exception())
                    self.start(PROJECTIONS.get(name) or JOINS[name])
        for query in self.queries.values():
            query.stop()

    def stop(self) -> None:
        self._stopping.set()


if __name__ == "__main__":  # under spark-submit; `logfold projector` is the usual entry point
    from stack import logs

    logs.configure(Settings().log_level)
    Projector(Settings()).run()
