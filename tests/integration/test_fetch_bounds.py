"""Fetch responses never exceed a consumer's frame bound: kafka-python closes the connection on
one that does (`InvalidReceiveError: Invalid frame length`), failing what was in flight on it.
Records as large as the topics take, in several partitions, are read whole and quietly."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterator

import pytest
from kafka import KafkaConsumer, KafkaProducer
from kafka.consumer.fetcher import ConsumerRecord

from config.settings import KAFKA_MAX_BATCH_BYTES, Settings, kafka_fetch_bounds
from config.topics import Topics
from events.store import read_to_end
from stack.topics import admin_client, topic_configs

pytestmark = pytest.mark.integration

PER_PARTITION = 5  # more than one fetch can carry, in each partition


def largest_record(settings: Settings, topic: str) -> int:
    """The value size of the largest record the broker takes on `topic` (its
    `max.message.bytes` less a one-record batch's overhead)."""
    admin = admin_client(settings)
    try:
        limit = int(topic_configs(admin, [topic])[topic]["max.message.bytes"] or 0)
    finally:
        admin.close()
    assert limit <= KAFKA_MAX_BATCH_BYTES, "a topic takes larger batches than consumers expect"
    return limit - 256


@pytest.fixture(scope="module")
def full_topic(deployment: Settings) -> tuple[str, int, int]:
    """A Logfold topic with PER_PARTITION records of the largest size in every partition: its
    name, the record count and the value size."""
    topic = Topics(deployment.topic_prefix).snapshots
    size = largest_record(deployment, topic)
    producer = KafkaProducer(
        bootstrap_servers=deployment.kafka(), acks="all", max_request_size=2 * size
    )
    try:
        for partition in range(deployment.partitions):
            for n in range(PER_PARTITION):
                key = f"{partition}:{n}:".encode()  # the topic is compacted: keys differ
                value = key.ljust(size, b"x")
                producer.send(topic, key=key, value=value, partition=partition).get(30)
    finally:
        producer.close(timeout=10)
    return topic, deployment.partitions * PER_PARTITION, size


def read_with_committed_reader(settings: Settings, topic: str, count: int) -> list[bytes]:
    """As the API's reply reader and the processors' state readers do (`committed_reader`)."""
    return [r.value for r in read_to_end(settings.kafka(), topic, timeout=60)]


def read_in_a_group(settings: Settings, topic: str, count: int) -> list[bytes]:
    """As the command processors do: subscribed in a consumer group, from the earliest."""
    consumer = KafkaConsumer(
        bootstrap_servers=settings.kafka(),
        group_id=f"fetch-bounds-{uuid.uuid4().hex[:8]}",
        enable_auto_commit=False,
        isolation_level="read_committed",
        auto_offset_reset="earliest",
        **kafka_fetch_bounds(),
    )
    try:
        consumer.subscribe([topic])
        return [r.value for r in _poll(consumer, count)]
    finally:
        consumer.close()


def _poll(consumer: KafkaConsumer, count: int) -> Iterator[ConsumerRecord]:
    seen = 0
    for _ in range(120):
        for records in consumer.poll(timeout_ms=500).values():
            seen += len(records)
            yield from records
        if seen >= count:
            return


@pytest.mark.parametrize("read", [read_with_committed_reader, read_in_a_group])
def test_records_of_the_largest_size_are_read_without_closing_the_connection(
    deployment: Settings,
    full_topic: tuple[str, int, int],
    read: Callable[[Settings, str, int], list[bytes]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    topic, count, size = full_topic
    caplog.set_level(logging.INFO, logger="kafka")
    values = read(deployment, topic, count)
    closed = [r.getMessage() for r in caplog.records if "Invalid frame length" in r.getMessage()]
    assert closed == []
    expected = {
        f"{p}:{n}:".encode() for p in range(deployment.partitions) for n in range(PER_PARTITION)
    }
    assert {v[: v.index(b"x")] for v in values} == expected
    assert len(values) == count and all(len(v) == size for v in values)
