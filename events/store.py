"""The Kafka side of the log: reading topics to their end, and the event log itself."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.consumer.fetcher import ConsumerRecord
from kafka.errors import KafkaTimeoutError

from config.settings import KAFKA_REQUEST_TIMEOUT_MS, kafka_fetch_bounds
from events.serialization import Envelope, decode


def commit_within(producer: KafkaProducer, timeout_s: float) -> None:
    """`producer.commit_transaction()`, bounded (kafka-python's waits for the broker without
    limit). Unacknowledged in time, the producer's sender is stopped, so nothing retries the
    commit later (the next producer's `init_transactions` settles it), and KafkaTimeoutError is
    raised: the outcome is unknown, since a broker that got the request completes it."""
    _end_within(producer, producer._transaction_manager.begin_commit(), timeout_s, "commit")


def abort_within(producer: KafkaProducer, timeout_s: float) -> None:
    """`producer.abort_transaction()`, bounded as `commit_within`: a transaction coordinator
    that is gone (its broker killed) would keep kafka-python's waiting for ever. Not aborted in
    time, the transaction is left to the next producer of its transactional id, whose
    `init_transactions` aborts it, or to the coordinator's transaction timeout."""
    _end_within(producer, producer._transaction_manager.begin_abort(), timeout_s, "abort")


def _end_within(producer: KafkaProducer, result: Any, timeout_s: float, what: str) -> None:
    producer._sender.wakeup()
    if not result.wait(timeout_ms=int(timeout_s * 1000)):
        stop_sending(producer, timeout_s)
        raise KafkaTimeoutError(f"the transaction's {what} was not acknowledged in time")


def stop_sending(producer: KafkaProducer, timeout_s: float) -> None:
    """Stop `producer`'s sender thread at once: nothing it holds is sent or retried later."""
    with contextlib.suppress(Exception):
        producer._sender.force_close()
        producer._sender.join(timeout=timeout_s)


def committed_reader(bootstrap: str, **config: Any) -> KafkaConsumer:
    """A group-less consumer that sees only committed transactions."""
    config.setdefault("request_timeout_ms", KAFKA_REQUEST_TIMEOUT_MS)
    return KafkaConsumer(
        bootstrap_servers=bootstrap,
        metrics_enabled=False,  # kafka-python's own metrics, unused: a tenth of its CPU
        enable_auto_commit=False,
        isolation_level="read_committed",
        auto_offset_reset="earliest",
        **kafka_fetch_bounds(),
        **config,
    )


def read_to_end(
    bootstrap: str, topic: str, partitions: list[int] | None = None, timeout: float = 60.0
) -> Iterator[ConsumerRecord]:
    """Every committed record of `topic` (or of some of its partitions) up to the end offsets
    as they were when the call started."""
    consumer = committed_reader(bootstrap)
    try:
        if partitions is None:
            known = consumer.partitions_for_topic(topic)
            if not known:
                raise LookupError(f"topic {topic} does not exist")
            partitions = sorted(known)
        tps = [TopicPartition(topic, p) for p in partitions]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        yield from drain(consumer, tps, timeout)
    finally:
        consumer.close()


def drain(
    consumer: KafkaConsumer, tps: list[TopicPartition], timeout: float
) -> Iterator[ConsumerRecord]:
    """Poll `consumer` until its position on each of `tps` reaches the current end offset
    (the last stable offset under read_committed)."""
    end = consumer.end_offsets(tps)
    deadline = time.monotonic() + timeout
    while any(consumer.position(tp) < end[tp] for tp in tps):
        if time.monotonic() > deadline:
            raise TimeoutError(f"could not read {tps} to its end within {timeout}s")
        for records in consumer.poll(timeout_ms=200).values():
            yield from records


def read_events(bootstrap: str, topic: str) -> list[Envelope]:
    """The whole event log of one topic, decoded (and upcast), in partition order."""
    return [decode(r.value) for r in read_to_end(bootstrap, topic) if r.value is not None]
