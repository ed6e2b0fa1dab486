"""CDC on real Postgres and Kafka: the changelog records, resuming after kill -9, confirming the
slot only after Kafka acknowledged, the first snapshot, and the slot's health."""

from __future__ import annotations

import os
import signal
import threading
import uuid
from pathlib import Path

import psycopg
import pytest
from flask.testing import FlaskClient
from kafka.admin import ConfigResource, ConfigResourceType, KafkaAdminClient, NewTopic
from kafka.errors import MessageSizeTooLargeError

from cdc.capture import Capture
from config.settings import Settings, slot_name
from config.topics import Topics
from stack.procs import wait_until
from stack.topics import topic_spec
from tests.changes import (
    Writer,
    changelog,
    distinct,
    insert_customers,
    slot_ready,
    table_versions,
)
from tests.support import Processes, new_deployment

pytestmark = pytest.mark.integration


def _keys(n: int) -> list[str]:
    tag = uuid.uuid4().hex[:8]
    return [f"{tag}-{i}" for i in range(n)]


def _versions_in_log(settings: Settings, keys: list[str]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for change in distinct(changelog(settings, "customers")):
        key = change.key["customer_id"]
        if key in keys and change.row is not None:
            out.setdefault(key, []).append(change.row["version"])
    return out


def _confirmed_lsn(settings: Settings) -> int:
    with psycopg.connect(settings.database()) as conn:
        row = conn.execute(
            "SELECT confirmed_flush_lsn - '0/0'::pg_lsn FROM pg_replication_slots "
            "WHERE slot_name = %s",
            (slot_name(settings),),
        ).fetchone()
    assert row is not None
    return int(row[0])


def _run_capture(settings: Settings) -> tuple[Capture, threading.Thread]:
    capture = Capture(settings)
    thread = threading.Thread(target=capture.run, daemon=True)
    thread.start()
    return capture, thread


def test_inserts_updates_and_deletes_become_records_and_tombstones(fresh: Settings) -> None:
    with psycopg.connect(fresh.database(), autocommit=True) as conn:
        conn.execute(
            "INSERT INTO customers VALUES ('before-cdc', 'Old', 'old@example.com', now(), 1)"
        )
    capture, thread = _run_capture(fresh)
    try:
        wait_until(lambda: len(changelog(fresh, "customers")) >= 1, 60, "the first snapshot")
        with psycopg.connect(fresh.database(), autocommit=True) as conn:
            conn.execute("INSERT INTO customers VALUES ('c1', 'Ada', 'ada@example.com', now(), 1)")
            with conn.transaction():  # two changes in one transaction: one commit position
                conn.execute(
                    "UPDATE customers SET name = 'Ada L', version = 2 WHERE customer_id = 'c1'"
                )
                conn.execute("UPDATE customers SET version = version WHERE customer_id = 'c1'")
                conn.execute("DELETE FROM customers WHERE customer_id = 'before-cdc'")
        wait_until(lambda: len(changelog(fresh, "customers")) >= 4, 60, "four records")
    finally:
        capture.stop()
        thread.join(30)
    snapshot, insert, update, delete = changelog(fresh, "customers")
    assert (snapshot.op, snapshot.key, snapshot.row and snapshot.row["name"]) == (
        "insert",
        {"customer_id": "before-cdc"},
        "Old",
    )
    assert insert.op == "insert" and insert.row is not None and insert.before is None
    assert insert.row["email"] == "ada@example.com" and insert.row["registered_at"].endswith("Z")
    assert update.op == "update" and update.row is not None and update.before is not None
    assert (update.before["name"], update.row["name"]) == ("Ada", "Ada L")
    # The no-op update wrote nothing; the delete is a tombstone with the old row in a header.
    assert delete.op == "delete" and delete.row is None
    assert delete.before is not None and delete.before["name"] == "Old"
    assert snapshot.position < insert.position < update.position < delete.position
    assert update.position.lsn == delete.position.lsn  # same transaction
    # On the wire, the tombstone's value is really empty (compaction removes the key).
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=fresh.kafka(), enable_auto_commit=False)
    tp = TopicPartition(Topics(fresh.topic_prefix).cdc("customers"), 0)
    consumer.assign([tp])
    consumer.seek(tp, 3)
    record = next(r for batch in [consumer.poll(timeout_ms=5000)] for r in batch[tp])
    consumer.close()
    assert record.value is None and record.key == b'{"customer_id":"before-cdc"}'


def test_kill_9_mid_stream_loses_nothing_and_resends_are_recognisable(
    fresh: Settings, tmp_path: Path
) -> None:
    keys = _keys(8)
    insert_customers(fresh, keys, "crash")
    procs = Processes(fresh, tmp_path)
    try:
        cdc = procs.cdc()
        # Changes made before the slot exists are in its first snapshot, not one by one.
        wait_until(lambda: slot_ready(fresh), 60, "the slot and its first snapshot")
        with Writer(fresh, keys, total=3000) as writer:
            for kill_at in (600, 1500, 2400):
                wait_until(lambda k=kill_at: writer.done >= k, 120, f"{kill_at} updates")
                # Wait until records are flowing, then kill without warning.
                wait_until(lambda: _confirmed_lsn(fresh) > 0, 60, "a confirmed position")
                os.kill(cdc.pid, signal.SIGKILL)
                cdc.wait()
                cdc = procs.cdc()
            writer.wait()
        final = table_versions(fresh, keys)
        assert sum(final.values()) == 3000

        def complete() -> bool:
            seen = _versions_in_log(fresh, keys)
            return all(seen.get(k, [None])[-1] == v for k, v in final.items())

        wait_until(complete, 120, "every update in the changelog")
    finally:
        procs.stop()
    # Without resends, each key's versions are 0, 1, 2, … final: nothing lost, nothing twice.
    seen = _versions_in_log(fresh, keys)
    for key, version in final.items():
        assert seen[key] == list(range(version + 1)), key


def test_the_slot_is_confirmed_only_after_kafka_acknowledged(fresh: Settings) -> None:
    keys = _keys(1)
    insert_customers(fresh, keys, "ack")
    capture, thread = _run_capture(fresh)
    topic = Topics(fresh.topic_prefix).cdc("customers")
    admin = KafkaAdminClient(bootstrap_servers=fresh.kafka())
    try:
        wait_until(lambda: len(changelog(fresh, "customers")) >= 1, 60, "the first records")
        wait_until(lambda: _confirmed_lsn(fresh) > 0, 30, "a confirmed position")
        # The changelog topic disappears (and the broker does not create topics on its own):
        # records cannot be acknowledged, so the slot must not move past them.
        admin.delete_topics([topic])
        wait_until(lambda: topic not in admin.list_topics(), 30, "the topic to be deleted")
        with psycopg.connect(fresh.database(), autocommit=True) as conn:
            lsn = int(
                conn.execute("SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn").fetchone()[0]  # type: ignore[index]
            )
        Writer(fresh, keys, total=5).run()
        wait_until(lambda: capture.failures >= 1, 60, "CDC to fail to deliver")
        assert _confirmed_lsn(fresh) < lsn + 1
        assert capture.confirmed < lsn + 1
        admin.create_topics([NewTopic(topic, 1, 1, topic_configs={"cleanup.policy": "compact"})])
        # Restored, the unconfirmed changes arrive: the slot kept them.
        wait_until(
            lambda: [c.row and c.row["version"] for c in changelog(fresh, "customers")][-1:] == [5],
            90,
            "the five updates after the topic came back",
        )
        versions = [c.row["version"] for c in distinct(changelog(fresh, "customers")) if c.row]
        assert versions == [1, 2, 3, 4, 5]
    finally:
        admin.close()
        capture.stop()
        thread.join(30)


def test_a_change_kafka_does_not_take_has_nothing_after_it_in_its_changelog(
    fresh: Settings,
) -> None:
    """A row larger than CDC may send, committed with a small one after it: while CDC cannot
    send the large one, nothing after it reaches the changelog (its readers take a record
    older than one they hold for a resend: the large one, sent later, would be dropped);
    with the limit raised, both arrive in order, and a reader that drops resends gets both."""
    big, small = _keys(2)
    limited = fresh.model_copy(update={"cdc_max_record_bytes": 4096})
    capture, thread = _run_capture(limited)
    try:
        wait_until(lambda: slot_ready(fresh), 60, "the first snapshot")
        with psycopg.connect(fresh.database()) as conn, conn.transaction():
            sql = "INSERT INTO customers VALUES (%s, %s, %s, now(), 1)"
            conn.execute(sql, (big, "B" * 10_000, "big@example.com"))
            conn.execute(sql, (small, "Small", "small@example.com"))
        wait_until(lambda: capture.failures >= 2, 60, "CDC to stop at the large row twice")
        assert isinstance(capture.send_failed, MessageSizeTooLargeError), capture.send_failed
    finally:
        capture.stop()
        thread.join(30)
    keys = {c.key["customer_id"] for c in changelog(fresh, "customers")}
    assert small not in keys and big not in keys, "a change after the one Kafka did not take"

    capture, thread = _run_capture(fresh)  # the default limit: the row fits
    try:
        wait_until(
            lambda: small in {c.key["customer_id"] for c in changelog(fresh, "customers")},
            60,
            "both rows once the limit is raised",
        )
    finally:
        capture.stop()
        thread.join(30)
    read = [c.key["customer_id"] for c in distinct(changelog(fresh, "customers"))]
    assert read[-2:] == [big, small], read


def _snapshot_done(settings: Settings) -> bool:
    with psycopg.connect(settings.database()) as conn:
        sql = "SELECT 1 FROM cdc_slots WHERE slot = %s"
        return conn.execute(sql, (slot_name(settings),)).fetchone() is not None


def test_the_first_snapshot_is_done_only_once_kafka_took_every_row(fresh: Settings) -> None:
    """Rows the broker refuses (here: bigger than the topic allows) keep the first snapshot
    from being marked done; it is taken again, and no row is lost."""
    keys = _keys(3)
    insert_customers(fresh, keys, "snapshot")
    topic = Topics(fresh.topic_prefix).cdc("customers")
    admin = KafkaAdminClient(bootstrap_servers=fresh.kafka())
    spec = topic_spec(Topics(fresh.topic_prefix), topic)

    def limit(size: int) -> None:  # AlterConfigs resets what it is not given: give it all
        configs = {**spec.configs, "max.message.bytes": str(size)}
        admin.alter_configs([ConfigResource(ConfigResourceType.TOPIC, topic, configs)])

    limit(64)  # smaller than any record
    capture, thread = _run_capture(fresh)
    try:
        wait_until(lambda: capture.failures >= 1, 60, "the snapshot's sends to fail")
        assert not _snapshot_done(fresh)
        limit(1024 * 1024)
        wait_until(lambda: _snapshot_done(fresh), 90, "the snapshot to be taken again")
        snapshot = {c.key["customer_id"] for c in changelog(fresh, "customers") if c.row}
        assert set(keys) <= snapshot
    finally:
        admin.close()
        capture.stop()
        thread.join(30)


def test_server_limits_the_wal_a_dead_consumer_can_hold(base_settings: Settings) -> None:
    with psycopg.connect(base_settings.database()) as conn:
        setting = conn.execute("SHOW max_slot_wal_keep_size").fetchone()
    assert setting is not None and setting[0] != "-1"


def test_health_shows_the_slot_lag_and_retained_wal(client: FlaskClient) -> None:
    def cdc() -> dict[str, object]:
        component: dict[str, object] = client.get("/health").json["components"]["cdc"]
        return component

    wait_until(lambda: cdc()["status"] == "up", 60, "the cdc component to be up")
    status = cdc()
    assert status["active"] is True and status["wal_status"] in ("reserved", "extended")
    assert isinstance(status["lag_bytes"], int) and status["lag_bytes"] >= 0
    assert isinstance(status["retained_wal_bytes"], int) and status["retained_wal_bytes"] >= 0
    assert isinstance(status["lag_seconds"], float)


def test_health_shows_cdc_down_without_a_slot(base_settings: Settings) -> None:
    from app.health import HealthChecks

    settings = new_deployment(base_settings)
    status = HealthChecks(settings).cdc()
    assert status["status"] == "down" and "no replication slot" in str(status["error"])
