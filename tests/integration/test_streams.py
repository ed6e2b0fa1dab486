"""`POST /streams/<stream>/records` (guarantee 19): a `202` means every record of the request is
committed in Kafka; a rejected request writes nothing. Real Kafka, the app in process."""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from flask.testing import FlaskClient
from kafka import KafkaConsumer, TopicPartition
from kafka.errors import KafkaTimeoutError

from app import close_app, create_app
from config.settings import Settings
from config.topics import Topics
from events.partitioning import partition_for
from events.serialization import loads
from events.store import drain, read_to_end
from stack.local_kafka import LocalKafka
from stack.procs import wait_until
from stack.topics import create_topics
from streams.ingest import Ingestion
from tests.support import token

pytestmark = pytest.mark.integration

AUTH = {"Authorization": f"Bearer {token()}"}


@pytest.fixture(scope="module")
def streams_client(deployment: Settings) -> Iterator[FlaskClient]:
    app = create_app(deployment)
    yield app.test_client()
    close_app(app)


def view(customer: str, book: str = "book-1", at: datetime | None = None) -> dict[str, Any]:
    when = at or datetime.now(UTC) - timedelta(minutes=1)
    return {
        "id": f"pv-{uuid.uuid4().hex}",
        "occurred_at": when.isoformat(),
        "data": {"customer_id": customer, "book_id": book},
    }


def post(client: FlaskClient, records: list[dict[str, Any]], **headers: str) -> Any:
    return client.post(
        "/streams/page_views/records", json={"records": records}, headers={**AUTH, **headers}
    )


def page_views(settings: Settings) -> list[Any]:
    return list(read_to_end(settings.kafka(), Topics(settings.topic_prefix).stream("page_views")))


def every_page_view_record(settings: Settings) -> list[Any]:
    """The stream's records as they are in the log, those of open and aborted transactions too
    (`read_uncommitted`)."""
    consumer = KafkaConsumer(
        bootstrap_servers=settings.kafka(),
        isolation_level="read_uncommitted",
        enable_auto_commit=False,
        metrics_enabled=False,
    )
    try:
        topic = Topics(settings.topic_prefix).stream("page_views")
        tps = [TopicPartition(topic, p) for p in range(settings.partitions)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        return list(drain(consumer, tps, 30))
    finally:
        consumer.close()


def test_a_request_is_committed_whole_and_answered_202(
    streams_client: FlaskClient, deployment: Settings
) -> None:
    customer = f"cust-{uuid.uuid4().hex[:8]}"
    at = datetime(2026, 11, 23, 10, 0, 0, 123456, tzinfo=timezone(timedelta(hours=1)))
    records = [view(customer, at=at), view(customer, "book-2"), view(customer, "book-3")]
    before = time.time()
    r = post(streams_client, records)
    assert r.status_code == 202, r.json
    assert r.json == {"accepted": 3}

    found = {rec.key.decode(): rec for rec in page_views(deployment)}
    assert set(found) >= {rec["id"] for rec in records}
    first = loads(found[records[0]["id"]].value)
    assert first["occurred_at"] == "2026-11-23T09:00:00.123Z"  # UTC, milliseconds
    received = datetime.fromisoformat(first["received_at"]).timestamp()
    assert before - 1 <= received <= time.time() + 1
    assert first["data"] == {"customer_id": customer, "book_id": "book-1"}
    partition = partition_for(customer, deployment.partitions)
    assert {found[rec["id"]].partition for rec in records} == {partition}


def test_an_invalid_record_rejects_the_whole_request_naming_each_problem(
    streams_client: FlaskClient, deployment: Settings
) -> None:
    customer = f"cust-{uuid.uuid4().hex[:8]}"
    ok = view(customer)
    no_book = view(customer)
    del no_book["data"]["book_id"]
    bad_time = {**view(customer), "occurred_at": "yesterday"}
    naive_time = {**view(customer), "occurred_at": "2026-11-23T10:00:00"}
    extra = view(customer)
    extra["data"]["colour"] = "red"
    future = view(customer, at=datetime.now(UTC) + timedelta(minutes=5))
    number_time = {**view(customer), "occurred_at": 1763888400}
    before = len(page_views(deployment))

    r = post(streams_client, [ok, no_book, bad_time, naive_time, extra, future, number_time])
    assert r.status_code == 422, r.json
    error = r.json["error"]
    assert error["code"] == "validation_failed"
    fields = [d["field"] for d in error["details"]]
    assert fields == [
        "records.1.data.book_id",
        "records.2.occurred_at",
        "records.3.occurred_at",
        "records.4.data.colour",
        "records.5.occurred_at",
        "records.6.occurred_at",
    ], error["details"]
    assert "future" in error["details"][4]["problem"]
    assert len(page_views(deployment)) == before  # not even the valid one


def test_a_record_within_the_clock_skew_is_accepted(streams_client: FlaskClient) -> None:
    ahead = view("cust-skew", at=datetime.now(UTC) + timedelta(milliseconds=300))
    assert post(streams_client, [ahead]).status_code == 202


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"records": []}, "records"),
        ({"records": [view("c")] * 1001}, "records"),
        ({"records": [view("c")], "more": 1}, "more"),
        ({}, "records"),
        ([view("c")], ""),
    ],
)
def test_the_request_shape_is_checked(
    streams_client: FlaskClient, deployment: Settings, body: Any, field: str
) -> None:
    before = len(page_views(deployment))
    r = streams_client.post("/streams/page_views/records", json=body, headers=AUTH)
    assert r.status_code == 422, r.json
    assert field in [d["field"] for d in r.json["error"]["details"]], r.json
    assert len(page_views(deployment)) == before


def test_a_body_over_one_mebibyte_is_413_and_one_under_it_is_accepted(
    streams_client: FlaskClient,
) -> None:
    records = [view(f"cust-{i}", f"book-{i}") for i in range(1000)]
    body = json.dumps({"records": records})
    assert len(body) < 1024 * 1024 / 4
    padded = body[:-1] + " " * (1024 * 1024 + 1 - len(body)) + "}"  # still valid JSON
    assert len(padded) > 1024 * 1024
    headers = {**AUTH, "Content-Type": "application/json"}
    r = streams_client.post("/streams/page_views/records", data=padded, headers=headers)
    assert r.status_code == 413, r.json
    assert r.json["error"]["code"] == "payload_too_large"
    assert "1048576" in r.json["error"]["message"]
    r = streams_client.post("/streams/page_views/records", data=body, headers=headers)
    assert r.status_code == 202, r.json
    assert r.json == {"accepted": 1000}


def test_auth_unknown_streams_and_bodies_that_are_not_json(streams_client: FlaskClient) -> None:
    url = "/streams/page_views/records"
    body = {"records": [view("c")]}
    assert streams_client.post(url, json=body).status_code == 401
    reader = {"Authorization": f"Bearer {token('views:read', 'commands:write')}"}
    r = streams_client.post(url, json=body, headers=reader)
    assert r.status_code == 403 and "streams:write" in r.json["error"]["message"]
    r = streams_client.post("/streams/clicks/records", json=body, headers=AUTH)
    assert r.status_code == 404 and r.json["error"]["code"] == "not_found"
    r = streams_client.post(url, data="{", headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 400 and r.json["error"]["code"] == "malformed_json"
    r = streams_client.post(url, data="x", headers={**AUTH, "Content-Type": "text/plain"})
    assert r.status_code == 415


def test_the_stream_is_in_openapi(streams_client: FlaskClient) -> None:
    spec = streams_client.get("/openapi.json").json
    op = spec["paths"]["/streams/page_views/records"]["post"]
    assert op["security"] == [{"bearer": ["streams:write"]}]
    assert {"202", "413", "422", "503"} <= set(op["responses"])
    record = op["requestBody"]["content"]["application/json"]["schema"]["properties"]["records"]
    assert record["maxItems"] == 1000
    data_ref = record["items"]["properties"]["data"]["$ref"].rsplit("/", 1)[-1]
    assert set(spec["components"]["schemas"][data_ref]["required"]) == {"customer_id", "book_id"}


def test_kafka_down_gives_503_writes_nothing_and_recovers(
    own_broker: LocalKafka, base_settings: Settings
) -> None:
    settings = base_settings.model_copy(
        update={"kafka_bootstrap_servers": own_broker.bootstrap, "kafka_timeout_s": 2.0}
    )
    create_topics(settings)
    app = create_app(settings)
    client = app.test_client()
    try:
        assert post(client, [view("cust-before")]).status_code == 202

        own_broker.proc.kill()  # type: ignore[union-attr]
        own_broker.proc.wait()  # type: ignore[union-attr]
        during = view("cust-during")
        started = time.monotonic()
        r = post(client, [during])
        assert r.status_code == 503, r.json
        assert time.monotonic() - started < 30  # bounded by the Kafka timeout, never a hang
        assert r.json["error"]["code"] == "unavailable"
        assert int(r.headers["Retry-After"]) > 0

        own_broker.start()
        answers: list[int] = []
        after = view("cust-after")

        def accepted() -> bool:
            answers.append(post(client, [after]).status_code)
            return answers[-1] == 202

        wait_until(accepted, 120, "ingestion to accept records again", interval=0.5)
        assert set(answers) <= {202, 503}, answers
        ids = [r.key.decode() for r in page_views(settings)]
        assert during["id"] not in ids
        assert ids.count(after["id"]) == 1
    finally:
        close_app(app)


def test_a_request_that_fails_part_way_leaves_none_of_its_records_visible(
    deployment: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = create_app(deployment)
    client = app.test_client()
    ingestion: Ingestion = app.extensions["logfold.ingestion"]
    try:
        assert post(client, [view("cust-first")]).status_code == 202
        producer = ingestion._get_producer()
        real_send, sent = producer.send, []

        def send_two_then_fail(*args: Any, **kwargs: Any) -> Any:
            if len(sent) == 2:
                producer.flush()  # the first two are in the log, in the open transaction
                raise KafkaTimeoutError("injected: the third record could not be sent")
            sent.append(real_send(*args, **kwargs))
            return sent[-1]

        monkeypatch.setattr(producer, "send", send_two_then_fail)
        customer = f"cust-{uuid.uuid4().hex[:8]}"
        records = [view(customer, f"book-{i}") for i in range(3)]
        r = post(client, records)
        assert r.status_code == 503, r.json
        assert r.json["error"]["code"] == "unavailable"

        after = view(customer)  # a new producer, which aborts the failed one's transaction
        assert post(client, [after]).status_code == 202
        ids = {rec["id"] for rec in records}
        in_log = [rec.key.decode() for rec in every_page_view_record(deployment)]
        assert len(ids & set(in_log)) == 2  # the first two did reach Kafka...
        visible = [rec.key.decode() for rec in page_views(deployment)]
        assert not ids & set(visible)  # ...and no reader of committed records sees them
        assert after["id"] in visible
    finally:
        close_app(app)


def every_thread_stopped(pid: int) -> bool:
    """Whether each thread of `pid` is stopped (state `T` in its `/proc` stat line)."""
    states = []
    for task in os.scandir(f"/proc/{pid}/task"):
        try:
            with open(f"{task.path}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        except FileNotFoundError:  # a thread that just ended
            continue
    return bool(states) and all(state in "Tt" for state in states)


def test_a_commit_kafka_does_not_acknowledge_is_504_not_503(
    own_broker: LocalKafka, base_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once the commit is asked for, the client cannot tell whether it happened: the answer
    says so (`504`), where `503` would promise that nothing was written."""
    settings = base_settings.model_copy(
        update={"kafka_bootstrap_servers": own_broker.bootstrap, "kafka_timeout_s": 2.0}
    )
    create_topics(settings)
    app = create_app(settings)
    client = app.test_client()
    broker = own_broker.proc
    assert broker is not None
    real_commit = Ingestion._commit

    def commit_to_a_paused_broker(self: Ingestion, producer: Any) -> None:
        os.kill(broker.pid, signal.SIGSTOP)
        # A stop reaches each of the JVM's threads in its own time: one still running would
        # answer the commit, as a broker that got it before pausing rightly does.
        wait_until(lambda: every_thread_stopped(broker.pid), 10, "the broker to stop")
        real_commit(self, producer)

    try:
        assert post(client, [view("cust-before")]).status_code == 202
        monkeypatch.setattr(Ingestion, "_commit", commit_to_a_paused_broker)
        record = view("cust-unknown")
        started = time.monotonic()
        r = post(client, [record])
        assert r.status_code == 504, r.json
        assert r.json["error"]["code"] == "timeout"
        assert "may or may not" in r.json["error"]["message"]
        assert time.monotonic() - started < 30
        os.kill(broker.pid, signal.SIGCONT)
        monkeypatch.setattr(Ingestion, "_commit", real_commit)

        answers: list[int] = []

        def retried() -> bool:
            answers.append(post(client, [record]).status_code)
            return answers[-1] == 202

        wait_until(retried, 120, "the retry to be accepted", interval=0.5)
        assert set(answers) <= {202, 503, 504}, answers
        ids = [r.key.decode() for r in page_views(settings)]
        assert 1 <= ids.count(record["id"]) <= 2  # views count an id once either way
    finally:
        os.kill(broker.pid, signal.SIGCONT)
        close_app(app)
