"""Old events stay in Kafka as they were written and are upcast each time they are read."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from flask.testing import FlaskClient
from kafka import KafkaProducer

from config.settings import Settings
from config.topics import Topics
from events.customer import CustomerRegistered
from events.partitioning import partition_for
from events.store import read_events, read_to_end
from events.upcasting import UnknownSchemaVersion
from tests.support import log_of, new_deployment, token


def v1_customer_registered(aggregate_id: str, schema_version: int = 1) -> dict[str, Any]:
    """A `CustomerRegistered` envelope as schema version 1 wrote it (`full_name`, not `name`)."""
    command_id = str(uuid.uuid4())
    return {
        "event_id": str(uuid.uuid4()),
        "type": "CustomerRegistered",
        "schema_version": schema_version,
        "aggregate_type": "customer",
        "aggregate_id": aggregate_id,
        "version": 1,
        "occurred_at": "2021-03-04T05:06:07.000008Z",
        "command_id": command_id,
        "correlation_id": "legacy-import",
        "causation_id": command_id,
        "data": {"full_name": "Grace Hopper", "email": "grace@example.com"},
    }


def produce_raw(settings: Settings, aggregate_id: str, value: bytes) -> None:
    """Write one record straight into the customer events topic, as an old writer did."""
    producer = KafkaProducer(bootstrap_servers=settings.kafka(), acks="all")
    try:
        producer.send(
            Topics(settings.topic_prefix).events("customer"),
            key=f"{aggregate_id}:1".encode(),
            value=value,
            partition=partition_for(aggregate_id, settings.partitions),
        ).get(timeout=30)
    finally:
        producer.close(timeout=10)


def test_a_v1_customer_registered_is_read_as_v2_and_stored_unchanged(
    deployment: Settings,
) -> None:
    aggregate_id = f"legacy-{uuid.uuid4().hex[:10]}"
    old = v1_customer_registered(aggregate_id)
    raw = json.dumps(old).encode()
    produce_raw(deployment, aggregate_id, raw)

    topic = Topics(deployment.topic_prefix).events("customer")
    [event] = [e for e in read_events(deployment.kafka(), topic) if e.aggregate_id == aggregate_id]
    assert event.schema_version == 2
    assert event.data == {"name": "Grace Hopper", "email": "grace@example.com"}
    assert event.event() == CustomerRegistered(name="Grace Hopper", email="grace@example.com")
    # Everything but the data's shape and its version number is as written.
    for meta in ("event_id", "type", "aggregate_id", "version", "occurred_at", "command_id"):
        assert getattr(event, meta) == old[meta]

    [stored] = [
        r for r in read_to_end(deployment.kafka(), topic) if r.key == f"{aggregate_id}:1".encode()
    ]
    assert stored.value == raw
    assert json.loads(stored.value)["schema_version"] == 1


def test_old_and_new_records_read_back_in_one_shape(
    client: FlaskClient, deployment: Settings
) -> None:
    legacy = f"legacy-{uuid.uuid4().hex[:10]}"
    produce_raw(deployment, legacy, json.dumps(v1_customer_registered(legacy)).encode())
    r = client.post(
        "/commands/register-customer",
        json={"data": {"name": "Ada Lovelace", "email": "ada@example.com"}},
        headers={"Authorization": f"Bearer {token()}"},
    )
    assert r.status_code == 201, r.json
    current = r.json["aggregate_id"]

    topic = Topics(deployment.topic_prefix).events("customer")
    events = {e.aggregate_id: e for e in log_of(deployment, "customer")}  # opened
    assert (events[legacy].schema_version, events[current].schema_version) == (2, 2)
    assert set(events[legacy].data) == set(events[current].data) == {"name", "email"}
    assert events[current].data["name"] == "Ada Lovelace"
    stored = {
        json.loads(r.value)["aggregate_id"]: json.loads(r.value)["schema_version"]
        for r in read_to_end(deployment.kafka(), topic)
    }
    assert (stored[legacy], stored[current]) == (1, 2)


def test_a_record_newer_than_the_code_is_refused_not_misread(base_settings: Settings) -> None:
    # Its own deployment: this record would make every later read of the topic fail.
    settings = new_deployment(base_settings)
    aggregate_id = f"future-{uuid.uuid4().hex[:10]}"
    produce_raw(
        settings, aggregate_id, json.dumps(v1_customer_registered(aggregate_id, 3)).encode()
    )
    topic = Topics(settings.topic_prefix).events("customer")
    with pytest.raises(UnknownSchemaVersion, match=r"CustomerRegistered v3 is newer .* upgrade"):
        read_events(settings.kafka(), topic)
