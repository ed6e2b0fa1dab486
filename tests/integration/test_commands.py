"""Commands become events: the 201 contract, the envelope and keys in Kafka, idempotency."""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
from flask.testing import FlaskClient
from kafka import KafkaProducer

from commands.messages import LogPosition
from config.settings import Settings
from config.topics import Topics
from events.keys import find_keys, is_sealed, open_value, subject
from events.partitioning import partition_for
from events.store import read_to_end
from tests.support import log_of, token

AUTH = {"Authorization": f"Bearer {token()}"}


def post(client: FlaskClient, name: str, body: dict[str, Any], **headers: str) -> Any:
    return client.post(f"/commands/{name}", json=body, headers={**AUTH, **headers})


def test_register_customer_commits_an_event_with_the_full_envelope(
    client: FlaskClient, deployment: Settings
) -> None:
    r = post(
        client,
        "register-customer",
        {"data": {"name": "Ada", "email": "ada@example.com"}},
        **{"X-Correlation-Id": "corr-1"},
    )
    assert r.status_code == 201, r.json
    body = r.json
    assert body["aggregate_type"] == "customer" and body["version"] == 1
    assert [e["type"] for e in body["events"]] == ["CustomerRegistered"]
    stored = log_of(deployment, "customer", opened=False)
    [event] = [e for e in stored if e.aggregate_id == body["aggregate_id"]]
    assert event.event_id == body["events"][0]["event_id"]
    assert event.version == 1 and event.schema_version == 2
    # Stored sealed with the customer's key (guarantee 27), which opens them.
    assert all(is_sealed(v) for v in event.data.values())
    who = subject("customer", event.aggregate_id)
    with psycopg.connect(deployment.database()) as conn:
        key = find_keys(conn, [who]).get(who)
    opened = {k: open_value(key, who, v) for k, v in event.data.items()}
    assert opened == {"name": "Ada", "email": "ada@example.com"}
    assert event.correlation_id == "corr-1"
    assert event.causation_id == event.command_id
    assert event.occurred_at.endswith("Z")


def test_keys_are_id_and_version_and_the_partition_follows_the_aggregate_id(
    client: FlaskClient, deployment: Settings
) -> None:
    book_id = f"book-{uuid.uuid4().hex[:8]}"
    add = {"title": "Dune", "author": "Herbert", "price_cents": 1999, "royalty_rate": 0.1}
    assert post(client, "add-book", {"aggregate_id": book_id, "data": add}).status_code == 201
    r = post(client, "reprice-book", {"aggregate_id": book_id, "data": {"price_cents": 2499}})
    assert r.status_code == 201 and r.json["version"] == 2
    topic = Topics(deployment.topic_prefix).events("book")
    records = [
        r for r in read_to_end(deployment.kafka(), topic) if r.key.startswith(book_id.encode())
    ]
    assert [r.key for r in records] == [f"{book_id}:1".encode(), f"{book_id}:2".encode()]
    assert {r.partition for r in records} == {partition_for(book_id, deployment.partitions)}
    position = LogPosition.parse(r.json["position"])
    assert (position.topic, position.partition) == (topic, records[1].partition)
    assert position.offset == records[1].offset


def test_place_order_freezes_price_author_and_royalty_rate(
    client: FlaskClient, deployment: Settings
) -> None:
    customer = post(
        client, "register-customer", {"data": {"name": "Bo", "email": "bo@example.com"}}
    ).json["aggregate_id"]
    book = f"b-{uuid.uuid4().hex[:8]}"
    add = {"title": "Emma", "author": "Austen", "price_cents": 1000, "royalty_rate": 0.25}
    assert post(client, "add-book", {"aggregate_id": book, "data": add}).status_code == 201
    lines = [{"book_id": book, "quantity": 3}]
    r = post(client, "place-order", {"data": {"customer_id": customer, "lines": lines}})
    assert r.status_code == 201, r.json
    order_id = r.json["aggregate_id"]
    assert (
        post(
            client, "reprice-book", {"aggregate_id": book, "data": {"price_cents": 5000}}
        ).status_code
        == 201
    )
    [placed] = [e for e in log_of(deployment, "order") if e.aggregate_id == order_id]
    assert placed.data["total_cents"] == 3000
    assert placed.data["lines"] == [
        {
            "book_id": book,
            "quantity": 3,
            "unit_price_cents": 1000,
            "author": "Austen",
            "royalty_rate": 0.25,
        }
    ]
    pay = post(client, "pay-order", {"aggregate_id": order_id, "data": {"amount_cents": 3000}})
    assert pay.status_code == 201 and pay.json["version"] == 2
    ship = post(client, "ship-order", {"aggregate_id": order_id, "data": {}})
    assert ship.status_code == 201 and ship.json["events"][0]["type"] == "OrderShipped"


def test_every_command_of_every_aggregate_is_accepted(client: FlaskClient) -> None:
    c = post(client, "register-customer", {"data": {"name": "Cy", "email": "cy@example.com"}})
    cid = c.json["aggregate_id"]
    assert (
        post(client, "rename-customer", {"aggregate_id": cid, "data": {"name": "Cyd"}}).json[
            "version"
        ]
        == 2
    )
    r = post(
        client, "change-customer-email", {"aggregate_id": cid, "data": {"email": "c@example.org"}}
    )
    assert r.status_code == 201 and r.json["version"] == 3
    b = post(
        client,
        "add-book",
        {"data": {"title": "T", "author": "A", "price_cents": 5, "royalty_rate": 0}},
    )
    bid = b.json["aggregate_id"]
    o = post(
        client,
        "place-order",
        {"data": {"customer_id": cid, "lines": [{"book_id": bid, "quantity": 1}]}},
    )
    assert o.status_code == 201
    r = post(
        client,
        "cancel-order",
        {"aggregate_id": o.json["aggregate_id"], "data": {"reason": "changed mind"}},
    )
    assert r.status_code == 201 and r.json["events"][0]["type"] == "OrderCancelled"


def test_a_retry_with_the_same_idempotency_key_returns_the_first_response(
    client: FlaskClient, deployment: Settings
) -> None:
    key = f"key-{uuid.uuid4()}"
    body = {"data": {"name": "Di", "email": "di@example.com"}}
    first = post(client, "register-customer", body, **{"Idempotency-Key": key})
    again = post(client, "register-customer", body, **{"Idempotency-Key": key})
    assert first.status_code == 201 and again.status_code == 200
    assert again.headers["Idempotent-Replay"] == "true"
    assert again.json == first.json
    agg = first.json["aggregate_id"]
    assert len([e for e in log_of(deployment, "customer") if e.aggregate_id == agg]) == 1


def test_a_reply_position_stays_exact_when_another_producer_writes_to_the_partition(
    client: FlaskClient, deployment: Settings
) -> None:
    """Replies announce their events' offsets before Kafka acknowledges them (one writer per
    partition). A record from elsewhere (say, an erasure tombstone) shifts the offsets: the
    processor must notice before committing, start over, and still answer with the truth."""
    r = post(client, "register-customer", {"data": {"name": "Eve", "email": "eve@example.com"}})
    assert r.status_code == 201, r.json
    customer = r.json["aggregate_id"]
    topic = Topics(deployment.topic_prefix).events("customer")
    partition = partition_for(customer, deployment.partitions)
    outsider = KafkaProducer(bootstrap_servers=deployment.kafka())
    for _ in range(3):
        outsider.send(topic, key=b"someone-else:1", value=None, partition=partition)
    outsider.flush()
    outsider.close()

    r = post(client, "rename-customer", {"aggregate_id": customer, "data": {"name": "Eva"}})
    assert r.status_code == 201, r.json
    records = [
        x for x in read_to_end(deployment.kafka(), topic) if x.key == f"{customer}:2".encode()
    ]
    assert len(records) == 1  # committed once: the attempt with the wrong offsets aborted
    position = LogPosition.parse(r.json["position"])
    assert (position.topic, position.partition, position.offset) == (
        topic,
        partition,
        records[0].offset,
    )
