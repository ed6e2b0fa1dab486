"""Records removed from the log before a fold applied them.

Spark's Kafka source reads with `failOnDataLoss=false`: transaction markers and compaction leave
offsets without records, which Spark cannot tell from lost ones, and a projector that stops at
every such offset would stop for nothing. So a fold checks for itself. Between one batch and
the next, a partition's offsets advance by the records applied plus at most one transaction
marker (every processor transaction ends with one). A longer jump is normal for an aborted
transaction or a compacted changelog, and is a loss when the partition's log now starts after
the fold's progress: those records were deleted (retention, `kafka-delete-records`, a topic
recreated) before the fold saw them. Only then is the broker asked, and its answer is cached
for a second, so a healthy batch costs nothing.

Changelogs (`cdc.<table>`) are written without transactions, one offset per record, so there any
jump past a fold's progress means records it never read were removed: compacted (a reader
further behind than `min.compaction.lag.ms`), or deleted. A join then rebuilds (`skipped`)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import psycopg
from kafka import KafkaConsumer
from kafka.errors import KafkaError

from config.settings import kafka_consumer_options
from config.topics import partition_of
from projections.base import Offsets
from spark.sink import record_loss

log = logging.getLogger(__name__)

Lost = dict[str, tuple[int, int]]  # "topic:partition" -> [first, end) offsets never applied

CACHE_S = 1.0


class Gaps:
    def __init__(self, bootstrap: str, timeout_s: float = 5.0) -> None:
        self.bootstrap, self.timeout_s = bootstrap, timeout_s
        self._consumer: KafkaConsumer | None = None
        self._starts: dict[str, tuple[float, int]] = {}
        self._lock = threading.Lock()

    def lost(self, applied: Offsets, first: Offsets) -> Lost:
        """The offsets between `applied` (a fold's progress) and `first` (the first offset of
        each partition in the batch after it) that were removed from the log unapplied."""
        jumps = [k for k, offset in first.items() if offset > applied.get(k, -1) + 2]
        if not jumps:
            return {}
        starts = self._log_starts(jumps)
        return {
            k: (applied.get(k, -1) + 1, starts[k])
            for k in jumps
            if starts[k] > applied.get(k, -1) + 1
        }

    def _log_starts(self, keys: list[str]) -> Offsets:
        now = time.monotonic()
        with self._lock:
            stale = [k for k in keys if now - self._starts.get(k, (-CACHE_S, 0))[0] >= CACHE_S]
            if stale:
                if self._consumer is None:
                    self._consumer = KafkaConsumer(
                        bootstrap_servers=self.bootstrap,
                        request_timeout_ms=int(self.timeout_s * 1000),
                        client_id="logfold-gaps",
                        **kafka_consumer_options(),
                    )
                found = self._consumer.beginning_offsets([partition_of(k) for k in stale])
                for tp, offset in found.items():
                    self._starts[f"{tp.topic}:{tp.partition}"] = (now, int(offset))
            return {k: self._starts[k][1] for k in keys}

    def close(self) -> None:
        with self._lock:
            if self._consumer is not None:
                self._consumer.close()
                self._consumer = None


def skipped(applied: Offsets, first: Offsets) -> Lost:
    """The offsets of changelogs (one offset per record) between `applied` (a fold's progress)
    and `first` (the first offset of each partition in the batch after it) that hold no record
    any more: removed before the fold read them. Partitions it has no progress on never count
    (it reads them from their start, as a rebuild would)."""
    return {
        k: (applied[k] + 1, offset)
        for k, offset in first.items()
        if k in applied and offset > applied[k] + 1
    }


def check_gaps(
    gaps: Gaps, conn: psycopg.Connection[Any], name: str, applied: Offsets, first: Offsets
) -> Lost:
    """Record in `name`'s progress (and log) the records removed from the log before it
    applied them, given its progress and the first offsets of the batch after it; return
    them."""
    try:
        lost = gaps.lost(applied, first)
    except KafkaError as e:  # the batch was just read, so this is rare; say so, go on
        log.error("%s: could not check the log for lost records: %s", name, e)
        return {}
    if lost:
        log.error(
            "%s: records removed from the log before it applied them: %s",
            name,
            ", ".join(f"{k} offsets {a}..{b - 1}" for k, (a, b) in lost.items()),
        )
        record_loss(conn, name, lost)
    return lost
