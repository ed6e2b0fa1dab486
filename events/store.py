"""The Kafka side of the log: reading topics to their end, and the event log itself."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

import kafka
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.consumer.fetcher import ConsumerRecord
from kafka.errors import KafkaTimeoutError
from kafka.producer.record_accumulator import RecordAccumulator

from config.settings import KAFKA_REQUEST_TIMEOUT_MS, kafka_consumer_options
from events.serialization import Envelope, decode

log = logging.getLogger(__name__)


def _abort_only_queued_batches() -> None:
    """kafka-python 2.x aborts a transaction's batches by removing each unfinished one from its
    partition's queue, including batches already sent and awaiting the broker's answer, which
    are in no queue: `ValueError`. The sender thread then fails on every turn, so the abort
    never completes, and stopping the sender fails the same way, leaving every future of the
    producer unresolved (a processor woken after a freeze, its batches in flight, hit it).
    kafka-python 3 skips batches in flight; this does the same for 2.x: a batch in flight is
    left to the broker's answer, or failed with the rest when the sender is stopped."""
    if int(kafka.__version__.split(".")[0]) >= 3:
        return

    def abort_undrained_batches(self: Any, error: Exception) -> None:
        for batch in self._incomplete.all():
            with self._tp_lock(batch.topic_partition):
                queue = self._batches[batch.topic_partition]
                aborted = not batch.is_done and batch in queue
                if aborted:
                    batch.records.close()
                    queue.remove(batch)
            if aborted:
                batch.abort(error)
                self.deallocate(batch)

    def abort_batches(self: Any, error: Exception) -> None:
        for batch in self._incomplete.all():
            with self._tp_lock(batch.topic_partition):
                batch.records.close()
                queue = self._batches[batch.topic_partition]
                if batch in queue:
                    queue.remove(batch)
            batch.abort(error)
            self.deallocate(batch)

    RecordAccumulator.abort_undrained_batches = abort_undrained_batches
    RecordAccumulator._abort_batches = abort_batches


_abort_only_queued_batches()


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


def close_within(producer: KafkaProducer, timeout_s: float) -> None:
    """`producer.close()`, bounded, and never raising: closing is what a failure's clean-up
    does on its way to releasing the rest (a processor's place in its group above all), so a
    producer whose sends are not acknowledged in time is stopped, its unsent records dropped."""
    try:
        producer.close(timeout=timeout_s)
    except Exception as e:
        log.warning("a producer did not close within %ss (%s); stopping its sender", timeout_s, e)
        stop_sending(producer, timeout_s)
        with contextlib.suppress(Exception):
            producer.close(timeout=0)


def committed_reader(bootstrap: str, **config: Any) -> KafkaConsumer:
    """A group-less consumer that sees only committed transactions."""
    config.setdefault("request_timeout_ms", KAFKA_REQUEST_TIMEOUT_MS)
    return KafkaConsumer(
        bootstrap_servers=bootstrap,
        metrics_enabled=False,  # kafka-python's own metrics, unused: a tenth of its CPU
        enable_auto_commit=False,
        isolation_level="read_committed",
        auto_offset_reset="earliest",
        **kafka_consumer_options(),
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
