"""Appending a request's records to their stream's topic: one Kafka transaction per request, so
a request is committed whole or not at all (guarantee 19)."""

from __future__ import annotations

import contextlib
import logging
import threading
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from kafka import KafkaProducer

from config.settings import Settings, kafka_client_options
from config.topics import Topics
from events.partitioning import partition_for
from events.serialization import dumps
from events.store import commit_within
from streams.registry import Stream

log = logging.getLogger(__name__)


class Unavailable(Exception):
    """Kafka did not commit the request's records, and will not: the transaction failed before
    its commit was asked for, so the next producer's `init_transactions` aborts it."""


class Unknown(Exception):
    """The commit was asked for but not acknowledged in time: the records may be committed or
    not (a broker that got the request completes it). A retry with the same ids is harmless."""


@dataclass(frozen=True)
class FactRecord:
    """A record as it lands in `streams.<name>`: keyed by `id`."""

    id: str
    occurred_at: str  # ISO-8601, UTC: the device's clock (event time)
    received_at: str  # ISO-8601, UTC: when the API accepted it
    data: dict[str, Any]


class Ingestion:
    """One transactional producer per API process, one transaction at a time. A producer that
    failed is thrown away: the next request starts a new one, whose `init_transactions` aborts
    whatever the old one left open."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.topics = Topics(settings.topic_prefix)
        self.transactional_id = f"{settings.topic_prefix}logfold-ingest-{uuid.uuid4()}"
        self._producer: KafkaProducer | None = None
        self._lock = threading.Lock()

    def _get_producer(self) -> KafkaProducer:
        if self._producer is None:
            timeout_ms = int(self.settings.kafka_timeout_s * 1000)
            producer = KafkaProducer(
                bootstrap_servers=self.settings.kafka(),
                **kafka_client_options(),
                metrics_enabled=False,
                transactional_id=self.transactional_id,
                acks="all",
                enable_idempotence=True,
                linger_ms=5,
                batch_size=256 * 1024,
                max_request_size=2 * 1024 * 1024,
                max_block_ms=timeout_ms,
                request_timeout_ms=timeout_ms,
                retry_backoff_ms=10,
            )
            try:
                producer.init_transactions()
            except BaseException:
                producer.close(timeout=0)
                raise
            self._producer = producer
        return self._producer

    def append(self, stream: Stream, records: list[FactRecord]) -> None:
        """Commit every record, or raise Unavailable (none is, or will be, visible to
        readers) or Unknown (the commit's outcome is not known yet)."""
        topic = self.topics.stream(stream.name)
        n = self.settings.partitions
        with self._lock:
            try:
                producer = self._get_producer()
            except Exception as e:
                raise Unavailable(str(e)) from e
            try:
                producer.begin_transaction()
                for r in records:
                    producer.send(
                        topic,
                        key=r.id.encode(),
                        value=dumps(r),
                        partition=partition_for(str(r.data[stream.key]), n),
                        # The record's log time is when the API received it: views measure
                        # lateness against it (see projections.base.Projection).
                        timestamp_ms=round(datetime.fromisoformat(r.received_at).timestamp() * 1e3),
                    )
                producer.flush(timeout=self.settings.kafka_timeout_s)
            except Exception as e:
                self._discard()
                raise Unavailable(str(e)) from e
            try:
                self._commit(producer)
            except Exception as e:
                self._discard()
                raise Unknown(str(e)) from e

    def _commit(self, producer: KafkaProducer) -> None:
        commit_within(producer, self.settings.kafka_timeout_s)

    def _discard(self) -> None:
        """Drop a failed producer at once: its pending records fail (their transaction is
        aborted by the next producer's `init_transactions`), so `close()` need not wait."""
        producer, self._producer = self._producer, None
        if producer is not None:
            with contextlib.suppress(Exception):
                producer._sender.force_close()
                producer._sender.join(timeout=self.settings.kafka_timeout_s)
            with contextlib.suppress(Exception):
                producer.close(timeout=0)

    def close(self) -> None:
        with self._lock:
            if self._producer is not None:
                with contextlib.suppress(Exception):
                    self._producer.close(timeout=5)
                self._producer = None
