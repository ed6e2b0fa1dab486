"""The websocket hub after its own failures (guarantee 12): when following the changelogs
fails it resumes right after the last record it took, however many arrived meanwhile; a record
it cannot decode is reported and skipped, and records removed before it read them break the
table's history. Either way a subscriber gets every change or a `resync` and a new snapshot,
never a silent jump. Real Kafka, Postgres and CDC; a server keeping 5 changes per table."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from flask import Flask
from kafka import KafkaProducer

from app.hub import Hub
from cdc.capture import Capture
from config.settings import Settings
from config.topics import Topics
from stack.procs import wait_until
from tests.changes import (
    Writer,
    assert_consecutive,
    insert_customers,
    table_versions,
    versions_seen,
)
from tests.support import delete_records, end_offset, health_component, servers, token
from tests.wsclient import WsClient, fold

pytestmark = pytest.mark.integration

REPLAY = 5  # changes the hub keeps per table: fewer than each test writes while it is away
ADMIN = {"Authorization": f"Bearer {token('admin')}"}

Serve = Callable[..., tuple[Flask, str, Hub]]


@pytest.fixture(scope="module")
def serve(deployment: Settings, capture: Capture) -> Iterator[Serve]:
    with servers(deployment.model_copy(update={"ws_replay": REPLAY})) as start:

        def serve_one() -> tuple[Flask, str, Hub]:
            url, app = start()
            return app, url, app.extensions["logfold.hub"]

        yield serve_one


class Failing:
    """Makes the hub's changelog loop raise (its next round, then each attempt to start
    again) while on; it then starts again by itself."""

    def __init__(self, hub: Hub) -> None:
        self.on = threading.Event()
        self.attempts = 0
        reap, follow = hub._reap, hub._follow

        def failing_reap(*args: Any) -> None:
            if self.on.is_set():
                raise RuntimeError("injected: following the changelogs fails")
            reap(*args)

        def failing_follow() -> None:
            if self.on.is_set():
                self.attempts += 1
                raise RuntimeError("injected: following the changelogs fails")
            follow()

        hub._reap = failing_reap  # type: ignore[method-assign,assignment]
        hub._follow = failing_follow  # type: ignore[method-assign]

    def __enter__(self) -> Failing:
        self.on.set()
        wait_until(lambda: self.attempts >= 1, 30, "the hub's loop to fail and start again")
        return self

    def __exit__(self, *_: object) -> None:
        self.on.clear()


def _subscribe(url: str, group: str, since: str | None = None) -> WsClient:
    client = WsClient(url, token("views:read"))
    client.subscribe("s", "customers", {"name": group}, since=since)
    return client


def _keys(n: int) -> tuple[list[str], str]:
    tag = uuid.uuid4().hex[:8]
    return [f"{tag}-{i}" for i in range(n)], f"group-{tag}"


def _has_snapshot(client: WsClient) -> Callable[[], bool]:
    return lambda: bool(client.of("s", "snapshot"))


def _holds(client: WsClient, final: dict[str, int]) -> Callable[[], bool]:
    def check() -> bool:
        rows = fold(client.of("s"), "customer_id")
        return {k: r["version"] for k, r in rows.items()} == final

    return check


def _every_change_or_a_resync(messages: list[dict[str, Any]], final: dict[str, int]) -> None:
    """From each snapshot (or the `since` it resumed from) on, every version of every key, in
    order: a later snapshot only after a `resync`. And the last of them reach `final`."""
    kinds = [m["type"] for m in messages]
    stretches: list[list[dict[str, Any]]] = [[]]
    for i, m in enumerate(messages):
        if m["type"] == "snapshot":
            if any(k in ("snapshot", "change") for k in kinds[:i]):
                assert "resync" in kinds[:i], f"a new snapshot without a resync: {kinds}"
            stretches.append([])
        stretches[-1].append(m)
    for stretch in stretches:
        for key, versions in versions_seen(stretch).items():
            start = versions[0]
            assert versions == list(range(start, start + len(versions))), (
                f"{key} jumped without a resync: {versions} ({kinds})"
            )
    assert_consecutive(versions_seen(stretches[-1]), final)


def _written_while_away(settings: Settings, keys: list[str], updates: int) -> dict[str, int]:
    """Make `updates` updates and wait until CDC has put them in the changelog."""
    changelog = Topics(settings.topic_prefix).cdc("customers")
    before = end_offset(settings, changelog)
    Writer(settings, keys, total=updates).run()
    wait_until(
        lambda: end_offset(settings, changelog) >= before + updates, 60, "CDC to write the updates"
    )
    return table_versions(settings, keys)


def test_an_undecodable_record_is_reported_and_skipped_and_subscribers_resync(
    serve: Serve, deployment: Settings
) -> None:
    app, url, hub = serve()
    keys, group = _keys(2)
    insert_customers(deployment, keys, group)
    client = _subscribe(url, group)
    client.wait_for(_has_snapshot(client), "snapshot")
    Writer(deployment, keys, total=4).run()
    client.wait_for(_holds(client, table_versions(deployment, keys)), "the first changes")

    topic = Topics(deployment.topic_prefix).cdc("customers")
    producer = KafkaProducer(bootstrap_servers=deployment.kafka(), acks="all")
    try:  # a record no CDC would write: no headers, a value that is not JSON
        sent = producer.send(topic, key=b"{", value=b"\x00not json", partition=0).get(30)
    finally:
        producer.close(timeout=10)
    final = _written_while_away(deployment, keys, 6 * REPLAY)

    client.wait_for(_holds(client, final), "every change, or a resync and a new snapshot")
    messages = client.of("s")
    _every_change_or_a_resync(messages, final)
    assert "resync" in [m["type"] for m in messages]  # what it held is unknown: resync
    client.close()

    http = app.test_client()
    live = health_component(http, "live", lambda c: c.get("undecodable_records") == 1)
    assert live["status"] == "up" and live["resyncs"] >= 1
    assert live["last_undecodable"]["offset"] == sent.offset
    assert (live["last_undecodable"]["topic"], live["last_undecodable"]["partition"]) == (topic, 0)
    metrics = http.get("/metrics", headers=ADMIN).get_data(as_text=True)
    assert 'logfold_undecodable_records{component="live"} 1.0' in metrics
    assert hub.undecodable == 1  # skipped once, never read again


def test_a_hub_that_failed_resumes_where_it_stopped(serve: Serve, deployment: Settings) -> None:
    _, url, hub = serve()
    keys, group = _keys(2)
    insert_customers(deployment, keys, group)
    listening = _subscribe(url, group)
    away = _subscribe(url, group)
    for client in (listening, away):
        client.wait_for(_has_snapshot(client), "snapshot")
    Writer(deployment, keys, total=3).run()
    before = table_versions(deployment, keys)
    for client in (listening, away):
        client.wait_for(_holds(client, before), "the first changes")
    since = away.last_position("s")
    away.close()

    with Failing(hub):  # more than the hub keeps arrive while it fails
        final = _written_while_away(deployment, keys, 6 * REPLAY)

    listening.wait_for(_holds(listening, final), "every change made while the hub failed")
    messages = listening.of("s")
    assert [m["type"] for m in messages].count("snapshot") == 1, "resumed, not resynced"
    _every_change_or_a_resync(messages, final)
    assert hub.failures >= 1
    listening.close()

    # One that was away since before: more changed than the hub keeps, so it resyncs.
    back = _subscribe(url, group, since=since)
    back.wait_for(_holds(back, final), "the resumed client to catch up")
    _every_change_or_a_resync(back.of("s"), final)
    back.close()


def test_records_deleted_before_the_hub_read_them_resync_its_subscribers(
    serve: Serve, deployment: Settings
) -> None:
    _, url, hub = serve()
    keys, group = _keys(2)
    insert_customers(deployment, keys, group)
    client = _subscribe(url, group)
    client.wait_for(_has_snapshot(client), "snapshot")
    topic = Topics(deployment.topic_prefix).cdc("customers")
    with Failing(hub):
        final = _written_while_away(deployment, keys, 10)
        delete_records(deployment, topic, end_offset(deployment, topic))

    client.wait_for(_holds(client, final), "a resync and a new snapshot", 60)
    messages = client.of("s")
    assert [m["type"] for m in messages].count("resync") == 1
    _every_change_or_a_resync(messages, final)
    client.close()
