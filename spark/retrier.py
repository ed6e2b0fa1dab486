"""The projector's retries of parked events (guarantee 26; what parks: `spark/parking.py`).

`logfold dead-letters retry` (or `POST /dead-letters/<projection>/retry`) marks an aggregate's
parked events; the projector's `Retrier` applies them in log order, in chunks of `CHUNK` read
from Kafka by offset, each chunk's rows and the removal of its letters in one transaction
holding the projection's progress: a crash mid-retry loses and doubles nothing. An event that
fails again stops its aggregate's retry there, with its new error. Skips asked for
(`logfold dead-letters skip`) are carried out first.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

import psycopg
from kafka import KafkaConsumer, TopicPartition
from pyspark.sql import SparkSession

from config.settings import Settings, kafka_consumer_options
from config.topics import Topics
from projections.base import Projection, versions
from projections.base import dead_letters as store
from projections.base.dead_letters import Key, Letter
from spark.decode import every_event, parse_events
from spark.event_rows import KAFKA_RECORD_SCHEMA, OFFSET, PARTITION, POSITION, TOPIC, rows_json
from spark.parking import Poison, isolate, isolate_upcast, merge_parking
from spark.poller import Poller
from spark.sink import live_version

log = logging.getLogger(__name__)

CHUNK = 1000  # parked events a retry reads and applies at once
POLL_S = 1.0  # how often the projector looks for retries asked for


class Retrier(Poller):
    """The projector's thread that applies parked events whose retry was asked for."""

    def __init__(
        self,
        spark: SparkSession,
        settings: Settings,
        projections: Sequence[Projection],
        keep: Callable[[Projection], Any],
    ) -> None:
        super().__init__(
            spark,
            settings.database(),
            name="dead-letters",
            pool="dead-letters",
            every_s=POLL_S,
            failed="dead letters: a retry failed; it is tried again",
        )
        self.settings = settings
        self.projections = {p.name: p for p in projections}
        self.topics = Topics(settings.topic_prefix)
        self.keep = keep
        self.columns = {p.name: [rows_json(o) for o in p.outputs] for p in projections}
        self.retried = 0  # events applied by retries (tests, logs)

    def stop(self, wait_s: float = 30) -> None:
        """Stop, letting the chunk in hand commit (or not) first."""
        super().stop(wait_s)

    def run_once(self) -> int:
        """Carry out the skips asked for, then apply the retries asked for; returns the events
        applied."""
        with self.looking:
            conn = self.db.get()
            for name in store.skip_requests(conn, self.projections):
                with conn.transaction():
                    skipped = store.carry_out_skips(conn, name)
                log.warning("dead letters: %s skipped %d parked events", name, len(skipped))
            asked = store.retry_requests(conn, self.projections)
        applied = 0
        for name, key in asked:
            applied += self.retry(self.projections[name], key)
        return applied

    def retry(self, p: Projection, key: Key) -> int:
        """Apply the parked events of one aggregate in order, a chunk at a time, until none is
        left or one fails again."""
        applied = 0
        with psycopg.connect(self.settings.database()) as conn:
            while not self.stopping:
                with conn.transaction():
                    chunk = store.first_parked(conn, p.name, key, CHUNK)
                if not chunk or chunk[0].retry_requested_at is None:
                    break
                rows, poisons = self._rows(p, chunk)
                done, stopped = self._apply(conn, p, key, chunk, rows, poisons)
                applied += done
                self.retried += done
                if stopped:
                    break
        if applied:
            log.info("dead letters: %s applied %d parked events of %s", p.name, applied, key)
        return applied

    def _rows(self, p: Projection, chunk: list[Letter]) -> tuple[list[Any], dict[Key, Poison]]:
        """The rows of the chunk's events (read from Kafka by offset) that Spark computes, and
        the first that raises."""
        records = read_records(self.settings, [(c.topic, c.partition, c.offset) for c in chunk])
        streams = {self.topics.stream(s): s for s in p.streams}
        frame = every_event(
            parse_events(self.spark.createDataFrame(records, KAFKA_RECORD_SCHEMA), streams)
        )
        columns = self.columns[p.name]
        rows, poisons = isolate(frame, columns, set())
        return isolate_upcast(frame, rows, columns, set(), poisons)

    def _apply(
        self,
        conn: psycopg.Connection[Any],
        p: Projection,
        key: Key,
        chunk: list[Letter],
        rows: list[Any],
        poisons: dict[Key, Poison],
    ) -> tuple[int, bool]:
        """Merge the chunk's rows up to its first failing event, and unpark them, in one
        transaction holding the projection's progress; (events applied, whether it stopped)."""
        spark_poison = poisons.get(key)
        with conn.transaction():
            if not store.lock(conn, p.name):
                return 0, True
            if live_version(conn, p.name) not in (None, versions.of(p)):
                log.warning("dead letters: %s is at another version; not retried here", p.name)
                return 0, True
            still = {
                (c.topic, c.partition, c.offset)
                for c in store.first_parked(conn, p.name, key, CHUNK, lock_rows=True)
            }
            chosen = [c for c in chunk if (c.topic, c.partition, c.offset) in still]
            if spark_poison is not None:
                at = (spark_poison.partition, spark_poison.offset)
                chosen = [c for c in chosen if (c.partition, c.offset) < at]
            wanted = {(c.topic, c.partition, c.offset) for c in chosen}
            mine = [r for r in rows if (r[TOPIC], r[PARTITION], r[OFFSET]) in wanted]
            reads = frozenset(f"{c.topic}:{c.partition}" for c in chosen)
            streams = frozenset(self.topics.stream(s) for s in p.streams)
            _, late, refused = merge_parking(
                conn, p, reads, streams, mine, POSITION, {}, self.keep(p)
            )
            failed: tuple[Letter, str] | None = None
            if refused:
                at = (refused[0].partition, refused[0].offset)
                failed_letter = next(c for c in chosen if (c.partition, c.offset) == at)
                failed = (failed_letter, refused[0].error)
                chosen = [c for c in chosen if (c.partition, c.offset) < at]
            elif spark_poison is not None:
                at = (spark_poison.partition, spark_poison.offset)
                failed_letter = next(c for c in chunk if (c.partition, c.offset) == at)
                failed = (failed_letter, spark_poison.error)
            store.unpark(conn, chosen)
            conn.execute(
                "UPDATE projection_progress SET events_applied = events_applied + %s, "
                "late_events = late_events + %s, updated_at = now() WHERE projection = %s",
                (len(chosen), late, p.name),
            )
            if failed is not None:
                store.retry_failed(conn, p.name, key, failed[0], failed[1])
        return len(chosen), failed is not None


def read_records(
    settings: Settings, wanted: list[tuple[str, int, int]]
) -> list[tuple[str, int, int, datetime, bytes]]:
    """The Kafka records at `wanted` ((topic, partition, offset)), as Spark's Kafka source
    gives them (`KAFKA_RECORD_SCHEMA`): read by offset, committed ones only."""
    consumer = KafkaConsumer(
        bootstrap_servers=settings.kafka(),
        enable_auto_commit=False,
        isolation_level="read_committed",
        consumer_timeout_ms=int(settings.kafka_timeout_s * 1000),
        **kafka_consumer_options(),
    )
    found: dict[tuple[str, int, int], tuple[str, int, int, datetime, bytes]] = {}
    try:
        by_partition: dict[TopicPartition, set[int]] = {}
        for t, p, o in wanted:
            by_partition.setdefault(TopicPartition(t, p), set()).add(o)
        for tp, offsets in by_partition.items():
            consumer.assign([tp])
            for offset in sorted(offsets):
                if (tp.topic, tp.partition, offset) in found:
                    continue
                consumer.seek(tp, offset)
                deadline = time.monotonic() + settings.kafka_timeout_s
                while (tp.topic, tp.partition, offset) not in found:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"could not read {tp.topic}:{tp.partition} at {offset}")
                    for records in consumer.poll(timeout_ms=500).values():
                        for r in records:
                            if r.offset in offsets:
                                when = datetime.fromtimestamp(r.timestamp / 1000, UTC)
                                found[(r.topic, r.partition, r.offset)] = (
                                    r.topic,
                                    r.partition,
                                    r.offset,
                                    when,
                                    r.value,
                                )
                    gone = consumer.position(tp) > offset
                    if gone and (tp.topic, tp.partition, offset) not in found:
                        log.warning("%s:%s: no record at %s", tp.topic, tp.partition, offset)
                        break  # gone from the log: nothing to apply for it
    finally:
        consumer.close()
    return [found[w] for w in wanted if w in found]
