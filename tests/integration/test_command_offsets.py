"""Where command processing resumes (guarantees 1 and 3): the next command offset of each partition
is a record of the transaction that processed the commands before it (the `command-offsets`
topic). The consumer group's offsets are only a copy, for tools and `/health`; a deployment from
before the topic existed resumes from them."""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import uuid
from collections.abc import Iterator

import pytest
from flask.testing import FlaskClient
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import KafkaAdminClient
from kafka.structs import OffsetAndMetadata

from app import close_app, create_app
from commands.processor import CommandProcessor
from config.settings import Settings
from config.topics import Topics
from events.partitioning import partition_for
from events.serialization import loads
from events.store import committed_reader, read_to_end
from stack.procs import wait_until
from tests.support import log_of, new_deployment, token

pytestmark = pytest.mark.integration

AUTH = {"Authorization": f"Bearer {token()}"}
CLAIMED = re.compile(r"claimed partition (\d+) at offset (\S+)")


@contextlib.contextmanager
def running_processor(settings: Settings) -> Iterator[CommandProcessor]:
    proc = CommandProcessor(settings)
    thread = threading.Thread(target=proc.run, name="processor", daemon=True)
    thread.start()
    try:
        yield proc
    finally:
        proc.stop()
        thread.join(timeout=30)
        assert not thread.is_alive()


@contextlib.contextmanager
def api(settings: Settings) -> Iterator[FlaskClient]:
    app = create_app(settings)
    try:
        yield app.test_client()
    finally:
        close_app(app)


def claims(caplog: pytest.LogCaptureFixture) -> dict[int, str]:
    found = (CLAIMED.search(r.getMessage()) for r in caplog.records)
    return {int(m[1]): m[2] for m in found if m}


def command_ends(settings: Settings) -> dict[TopicPartition, int]:
    topic = Topics(settings.topic_prefix).commands
    consumer = committed_reader(settings.kafka())
    try:
        tps = [TopicPartition(topic, p) for p in range(settings.partitions)]
        return {tp: int(end) for tp, end in consumer.end_offsets(tps).items()}
    finally:
        consumer.close()


def group_offsets(settings: Settings) -> dict[TopicPartition, int]:
    admin = KafkaAdminClient(bootstrap_servers=settings.kafka())
    try:
        group = Topics(settings.topic_prefix).processor_group
        found = admin.list_consumer_group_offsets(group)
        return {tp: meta.offset for tp, meta in found.items()}
    finally:
        admin.close()


def set_group_offsets(settings: Settings, offsets: dict[TopicPartition, int]) -> None:
    """What `kafka-consumer-groups --reset-offsets` does, on the stopped group."""
    consumer = KafkaConsumer(
        bootstrap_servers=settings.kafka(),
        group_id=Topics(settings.topic_prefix).processor_group,
        enable_auto_commit=False,
    )
    try:
        consumer.assign(list(offsets))
        consumer.commit({tp: OffsetAndMetadata(o, "", -1) for tp, o in offsets.items()})
    finally:
        consumer.close(autocommit=False)


def every_partition(partitions: int, each: int = 2) -> list[str]:
    """Customer ids, `each` in every partition."""
    found: dict[int, list[str]] = {p: [] for p in range(partitions)}
    while any(len(ids) < each for ids in found.values()):
        candidate = f"cust-{uuid.uuid4().hex[:8]}"
        ids = found[partition_for(candidate, partitions)]
        if len(ids) < each:
            ids.append(candidate)
    return [c for ids in found.values() for c in ids]


def rename(client: FlaskClient, customer: str, name: str) -> None:
    r = client.post(
        "/commands/rename-customer",
        json={"aggregate_id": customer, "data": {"name": name}},
        headers=AUTH,
    )
    assert r.status_code == 201, r.json


def test_processing_resumes_from_the_offsets_its_transactions_wrote_not_the_groups(
    base_settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    settings = new_deployment(base_settings)
    topics = Topics(settings.topic_prefix)
    customers = every_partition(settings.partitions)
    with running_processor(settings), api(settings) as client:
        for c in customers:
            r = client.post(
                "/commands/register-customer",
                json={"aggregate_id": c, "data": {"name": "Ann", "email": "ann@example.com"}},
                headers=AUTH,
            )
            assert r.status_code == 201, r.json
            rename(client, c, "Bea")  # no expected version: processed twice, it would apply twice
        ends = command_ends(settings)
        # The group's offsets catch up with what is processed (the lag `/health` shows).
        wait_until(lambda: group_offsets(settings) == ends, 30, "the group's copy of the offsets")

    records = list(read_to_end(settings.kafka(), topics.command_offsets))
    last = {r.partition: loads(r.value)["next_offset"] for r in records}
    assert {TopicPartition(topics.commands, p): o for p, o in last.items()} == ends
    assert all(r.key == str(r.partition).encode() for r in records)

    # As if an operator had reset the group, or its copy lagged behind a crash.
    set_group_offsets(settings, dict.fromkeys(ends, 0))
    caplog.clear()
    with (
        caplog.at_level(logging.INFO, logger="commands.processor"),
        running_processor(settings),
        api(settings) as client,
    ):
        rename(client, customers[0], "Cy")
        claimed = claims(caplog)
    assert claimed == {tp.partition: str(o) for tp, o in ends.items()}
    events = [e for e in log_of(settings, "customer") if e.aggregate_id in customers]
    assert len(events) == 2 * len(customers) + 1  # nothing processed twice


def test_a_deployment_without_command_offsets_records_resumes_from_the_groups_offsets(
    base_settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    settings = new_deployment(base_settings)
    topics = Topics(settings.topic_prefix)
    customer = f"cust-{uuid.uuid4().hex[:8]}"
    partition = partition_for(customer, settings.partitions)
    tp = TopicPartition(topics.commands, partition)
    # Two unreadable commands the older version processed and committed, as group offsets.
    producer = KafkaProducer(bootstrap_servers=settings.kafka())
    for _ in range(2):
        producer.send(topics.commands, b"not a command", partition=partition)
    producer.flush()
    producer.close()
    set_group_offsets(settings, {tp: 2})

    with (
        caplog.at_level(logging.INFO, logger="commands.processor"),
        running_processor(settings),
        api(settings) as client,
    ):
        r = client.post(
            "/commands/register-customer",
            json={"aggregate_id": customer, "data": {"name": "D", "email": "d@example.com"}},
            headers=AUTH,
        )
        assert r.status_code == 201, r.json
    assert claims(caplog)[partition] == "2"
    assert not [r for r in caplog.records if "skipping unreadable command" in r.getMessage()]
