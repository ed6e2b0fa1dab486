"""`/ws` on a real server (werkzeug, threaded), real Kafka, Postgres and CDC: snapshots and their
hand-off to the stream, `since`, `resync`, slow clients, auth and limits.

Changes are written with plain SQL into `customers`: CDC does not care who writes a table, and
a version bumped by one per update shows every gap and duplicate a client would see."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
import websocket

from app.hub import Hub
from cdc.capture import Capture
from config.settings import Settings
from stack.procs import wait_until
from tests.changes import (
    Writer,
    assert_consecutive,
    insert_customers,
    table_versions,
    versions_seen,
)
from tests.support import servers, token
from tests.wsclient import WsClient, fold

pytestmark = pytest.mark.integration

Serve = Callable[..., tuple[str, Hub]]


@pytest.fixture(scope="module")
def serve(deployment: Settings, capture: Capture) -> Iterator[Serve]:
    """Start an API (with its own settings overrides) on a free port; returns its ws URL."""
    with servers(deployment) as start:

        def serve_one(**overrides: Any) -> tuple[str, Hub]:
            ws_url, app = start(**overrides)
            return ws_url, app.extensions["logfold.hub"]

        yield serve_one


def _keys(n: int) -> tuple[list[str], str]:
    tag = uuid.uuid4().hex[:8]
    return [f"{tag}-{i}" for i in range(n)], f"group-{tag}"


def _has_snapshot(client: WsClient, sub: str) -> Callable[[], bool]:
    return lambda: bool(client.of(sub, "snapshot"))


def _holds(client: WsClient, sub: str, final: dict[str, int]) -> Callable[[], bool]:
    def check() -> bool:
        rows = fold(client.of(sub), "customer_id")
        return {k: r["version"] for k, r in rows.items()} == final

    return check


def test_snapshot_then_every_change_in_order_under_concurrent_writes(
    serve: Serve, deployment: Settings
) -> None:
    url, _ = serve()
    keys, group = _keys(4)
    insert_customers(deployment, keys, group)
    clients = []
    with Writer(deployment, keys) as writer:
        # Subscribe one client after another while every key keeps changing.
        for i in range(6):
            client = WsClient(url, token("views:read"))
            client.subscribe("s", "customers", {"name": group})
            client.wait_for(_has_snapshot(client, "s"), f"snapshot {i}")
            clients.append(client)
            start = writer.done
            client.wait_for(lambda s=start: writer.done > s + 20, "more writes")
    final = table_versions(deployment, keys)
    assert sum(final.values()) == writer.done > 100
    for client in clients:
        client.wait_for(_holds(client, "s", final), "the client to hold the final rows")
        assert_consecutive(versions_seen(client.of("s")), final)
        client.close()


def test_a_snapshot_read_before_the_cdc_slot_existed_is_taken_again(fresh: Settings) -> None:
    """A deployment's first start: a client subscribes before CDC has made its slot. The
    changes made after its snapshot and before the slot's own are never streamed (the slot's
    first rows hold them folded), so that snapshot cannot be handed off: the client gets
    `resync` and a new snapshot, then every change in order (guarantee 12)."""
    keys, group = _keys(2)
    insert_customers(fresh, keys, group)
    with servers(fresh) as start:
        url, _ = start()
        client = WsClient(url, token("views:read"))
        client.subscribe("s", "customers", {"name": group})
        client.wait_for(_has_snapshot(client, "s"), "the first snapshot")
        Writer(fresh, keys, total=10).run()  # no slot yet: never streamed
        capture = Capture(fresh)
        thread = threading.Thread(target=capture.run, name="cdc", daemon=True)
        thread.start()
        try:
            Writer(fresh, keys, total=10).run()  # in the slot's first rows, or streamed
            final = table_versions(fresh, keys)
            client.wait_for(_holds(client, "s", final), "the client to hold the final rows")
        finally:
            capture.stop()
            thread.join(timeout=30)
        got = client.of("s")
        assert [m["type"] for m in got if m["type"] != "change"] == [
            "subscribed",
            "snapshot",
            "resync",
            "snapshot",
        ], got
        assert [r["version"] for r in got[1]["rows"]] == [0, 0]
        assert_consecutive(versions_seen(got), final)
        client.close()


def test_resume_with_since_gets_exactly_what_was_missed(serve: Serve, deployment: Settings) -> None:
    url, _ = serve()
    keys, group = _keys(2)
    insert_customers(deployment, keys, group)
    first = WsClient(url, token("views:read"))
    first.subscribe("s", "customers", {"name": group})
    first.wait_for(_has_snapshot(first, "s"), "snapshot")
    Writer(deployment, keys, total=30).run()
    after_30 = table_versions(deployment, keys)
    first.wait_for(_holds(first, "s", after_30), "the first 30 changes")
    first.close()
    since = first.last_position("s")
    Writer(deployment, keys, total=40).run()
    final = table_versions(deployment, keys)

    # A server that has just started (its hub reads the changelog's recent history) serves it.
    second = WsClient(serve()[0], token("views:read"))
    second.subscribe("s", "customers", {"name": group}, since=since)
    second.wait_for(
        lambda: len(second.of("s", "change")) >= 40, "the 40 changes made while away", 60
    )
    assert not second.of("s", "snapshot") and not second.of("s", "resync")
    got = versions_seen(first.of("s") + second.of("s"))
    assert_consecutive(got, final)
    second.close()


def test_since_older_than_the_history_gets_resync_and_a_new_snapshot(
    serve: Serve, deployment: Settings
) -> None:
    keys, group = _keys(1)
    insert_customers(deployment, keys, group)
    early = WsClient(serve()[0], token("views:read"))
    early.subscribe("s", "customers", {"name": group})
    early.wait_for(_has_snapshot(early, "s"), "snapshot")
    Writer(deployment, keys, total=1).run()
    early.wait_for(lambda: bool(early.of("s", "change")), "a change")
    old = early.last_position("s")
    early.close()
    Writer(deployment, keys, total=30).run()

    url, _ = serve(ws_replay=5)  # a server that keeps only the last 5 changes per table
    client = WsClient(url, token("views:read"))
    client.subscribe("s", "customers", {"name": group}, since=old)
    client.wait_for(_has_snapshot(client, "s"), "a new snapshot")
    kinds = [m["type"] for m in client.of("s")]
    assert kinds[:3] == ["subscribed", "resync", "snapshot"], kinds
    assert fold(client.of("s"), "customer_id")[keys[0]]["version"] == 31
    client.close()


def test_a_rebuilt_projection_sends_resync_then_a_new_snapshot(
    serve: Serve, deployment: Settings
) -> None:
    with psycopg.connect(deployment.database(), autocommit=True) as conn:
        conn.execute(
            "INSERT INTO projection_progress (projection) VALUES ('customers') "
            "ON CONFLICT DO NOTHING"
        )
    url, hub = serve()
    keys, group = _keys(1)
    insert_customers(deployment, keys, group)
    client = WsClient(url, token("views:read"))
    client.subscribe("s", "customers", {"name": group})
    client.wait_for(_has_snapshot(client, "s"), "snapshot")
    client.wait_for(lambda: "customers" in hub.generations, "the hub to know the generation")
    with psycopg.connect(deployment.database(), autocommit=True) as conn:
        # What a rebuild's swap does, in the same transaction as its rows.
        conn.execute(
            "UPDATE projection_progress SET generation = generation + 1 "
            "WHERE projection = 'customers'"
        )
    client.wait_for(lambda: len(client.of("s", "snapshot")) == 2, "a second snapshot")
    kinds = [m["type"] for m in client.of("s")]
    assert kinds[-2:] == ["resync", "snapshot"], kinds
    Writer(deployment, keys, total=3).run()
    client.wait_for(_holds(client, "s", {keys[0]: 3}), "changes after the resync")
    client.close()


def test_a_slow_client_is_warned_then_closed_while_others_get_everything(
    serve: Serve, deployment: Settings
) -> None:
    buffer = 500  # bursts of changes must fit; the slow client's socket fills anyway
    url, hub = serve(ws_buffer=buffer, ws_socket_buffer_bytes=4096)
    keys, group = _keys(5)
    insert_customers(deployment, keys, group)
    # The slow one reads nothing while the changes come (a reader pacing itself could keep up
    # on a slow machine), so its socket fills, then its outbox.
    slow = WsClient(url, token("views:read"), rcvbuf=4096, stalled=True)
    slow.subscribe("s", "customers", {"name": group})
    normal = WsClient(url, token("views:read"))
    normal.subscribe("s", "customers", {"name": group})
    normal.wait_for(_has_snapshot(normal, "s"), "snapshot")
    with Writer(deployment, keys, total=3000) as writer:
        # Closed for being slow, it reads at once what the server kept for it: the warning,
        # then the close code (a socket that stays blocked is cut off after a grace period).
        wait_until(lambda: hub.stats()["closing_slow"] == 1, 120, "the slow client's close")
        peak = hub.stats()["outbox_peak"]  # the slow one's, while it is still attached
        slow.release()
        writer.wait()
    assert slow.wait_closed() == 4008
    final = table_versions(deployment, keys)
    normal.wait_for(_holds(normal, "s", final), "the normal client to get every change", 120)
    assert_consecutive(versions_seen(normal.of("s")), final)
    assert normal.close_code is None
    # The server's memory for the slow one never grew past its buffer (+ the lagging notice).
    assert peak <= buffer + 1
    kinds = [m["type"] for m in slow.messages]
    assert "lagging" in kinds, kinds[:20]
    lagging = next(m for m in slow.messages if m["type"] == "lagging")
    assert lagging["id"] == "s" and lagging["behind"] >= buffer // 2
    normal.close()


def test_token_is_required_and_needs_views_read(serve: Serve) -> None:
    url, _ = serve()
    anonymous = WsClient(url)
    anonymous.send({"op": "subscribe", "id": "s", "view": "customers"})
    assert anonymous.wait_closed() == 4401
    assert anonymous.messages[0]["code"] == "unauthorized"

    bad = WsClient(url, "not-a-token")
    assert bad.wait_closed() == 4401

    writer_only = WsClient(url, token("commands:write"))
    assert writer_only.wait_closed() == 4403
    assert writer_only.messages[0]["code"] == "forbidden"

    by_message = WsClient(url)  # browsers cannot set headers: a first auth message works too
    by_message.send({"op": "auth", "token": token("views:read")})
    by_message.subscribe("s", "books")
    by_message.wait_for(_has_snapshot(by_message, "s"), "snapshot")
    by_message.close()


SUBSCRIBE = {"op": "subscribe", "id": "s", "view": "customers"}


@pytest.mark.parametrize(
    ("message", "code"),
    [
        ({"op": "subscribe", "id": "s", "view": "no_such_view"}, "not_found"),
        ({**SUBSCRIBE, "filter": {"x": 1}}, "validation_failed"),
        ({**SUBSCRIBE, "since": "yesterday"}, "validation_failed"),
        ({**SUBSCRIBE, "consistent_with": "yesterday"}, "validation_failed"),
        ({**SUBSCRIBE, "consistent_with": "x", "wait": 31}, "validation_failed"),
        ({**SUBSCRIBE, "filter": {"name": ["a"]}}, "validation_failed"),
        ({"op": "subscribe", "view": "customers"}, "validation_failed"),
        ({"op": "dance"}, "validation_failed"),
        ({"op": "unsubscribe", "id": "nope"}, "not_found"),
    ],
)
def test_bad_messages_get_an_error_and_the_connection_stays(
    serve: Serve, message: dict[str, Any], code: str
) -> None:
    url, _ = serve()
    client = WsClient(url, token("views:read"))
    client.send(message)
    client.wait_for(lambda: any(m["type"] == "error" for m in client.messages), "an error")
    error = next(m for m in client.messages if m["type"] == "error")
    assert error["code"] == code, error
    client.subscribe("ok", "books")  # still usable
    client.wait_for(_has_snapshot(client, "ok"), "snapshot")
    client.close()


def test_limits_on_subscriptions_and_message_size(serve: Serve) -> None:
    url, _ = serve(ws_max_subscriptions=2, ws_max_message_bytes=1024)
    client = WsClient(url, token("views:read"))
    for i in range(3):
        client.subscribe(f"s{i}", "books")
    client.wait_for(lambda: bool(client.of("s2", "error")), "the third to be refused")
    assert client.of("s2", "error")[0]["code"] == "too_many_subscriptions"
    client.send({"op": "subscribe", "id": "big", "view": "books", "filter": {"title": "x" * 4000}})
    assert client.wait_closed() == 1009  # message too big


def test_a_deeply_nested_message_gets_an_error_not_a_traceback(serve: Serve) -> None:
    url, _ = serve()
    client = WsClient(url, token("views:read"))
    client.ws.send("[" * 5000 + "]" * 5000)  # deeper than the JSON parser recurses
    client.wait_for(lambda: any(m["type"] == "error" for m in client.messages), "an error")
    error = next(m for m in client.messages if m["type"] == "error")
    assert error["code"] == "malformed_json" and "deeply" in error["message"]
    client.subscribe("ok", "books")  # the connection is fine
    client.wait_for(_has_snapshot(client, "ok"), "snapshot")
    client.close()


def test_a_token_that_expires_while_the_socket_is_open_closes_it_with_4401(serve: Serve) -> None:
    url, _ = serve()
    client = WsClient(url, token("views:read", ttl=2))
    client.subscribe("s", "books")
    client.wait_for(_has_snapshot(client, "s"), "snapshot")
    assert client.wait_closed(timeout=30) == 4401
    assert client.messages[-1]["code"] == "unauthorized"
    assert "expired" in client.messages[-1]["message"]


def test_a_socket_that_never_authenticates_is_closed_after_a_short_deadline(
    serve: Serve,
) -> None:
    url, _ = serve(ws_auth_timeout_s=0.5)
    silent = WsClient(url)  # no token, no auth message
    assert silent.wait_closed(timeout=15) == 4401


def test_websockets_per_process_and_per_subject_are_limited(serve: Serve) -> None:
    # 3 sockets at most (9 threads of a threaded server, 5 reserved for REST, 1 for a socket
    # still to authenticate), 2 per token subject.
    url, _ = serve(
        api_worker="gthread",
        api_threads=9,
        api_reserved_threads=5,
        ws_max_pending=1,
        ws_max_per_subject=2,
    )
    ann = [WsClient(url, token("views:read", subject="ann")) for _ in range(2)]
    for i, client in enumerate(ann):
        client.subscribe("s", "books")
        client.wait_for(_has_snapshot(client, "s"), f"ann's snapshot {i}")
    third_ann = WsClient(url, token("views:read", subject="ann"))
    assert third_ann.wait_closed() == 4429
    assert third_ann.messages[0]["code"] == "too_many_connections"

    bob = WsClient(url, token("views:read", subject="bob"))
    bob.subscribe("s", "books")
    bob.wait_for(_has_snapshot(bob, "s"), "bob's snapshot")
    with pytest.raises(websocket.WebSocketBadStatusException) as refused:
        WsClient(url, token("views:read", subject="cy"))  # the process holds all it may
    assert refused.value.status_code == 503
    assert refused.value.resp_headers["retry-after"]

    ann[0].close()  # a place frees up
    cy: WsClient | None = None

    def admitted() -> bool:
        nonlocal cy
        cy = WsClient(url, token("views:read", subject="cy"))
        cy.subscribe("s", "books")
        try:
            cy.wait_for(_has_snapshot(cy, "s"), "cy's snapshot", timeout=2)
            return True
        except TimeoutError:
            cy.close()
            return False

    wait_until(admitted, 30, "a socket to be admitted once one closed")
    for client in (ann[1], bob, cy):
        assert client is not None
        client.close()


def test_a_snapshot_heavier_than_the_outbox_may_hold_is_refused(
    serve: Serve, deployment: Settings
) -> None:
    url, _ = serve(ws_buffer_bytes=64 * 1024)
    keys, group = _keys(400)  # ~150 bytes a row: ~60 kB, more than half of 64 kB
    insert_customers(deployment, keys, group)
    client = WsClient(url, token("views:read"))
    client.subscribe("s", "customers", {"name": group})
    client.wait_for(lambda: bool(client.of("s", "error")), "the snapshot to be refused")
    assert client.of("s", "error")[0]["code"] == "too_many_rows"
    client.subscribe("ok", "books")
    client.wait_for(_has_snapshot(client, "ok"), "a small snapshot still works")
    client.close()


def test_a_row_claim_restricts_subscriptions_and_a_row_leaving_it_is_a_delete(
    serve: Serve, deployment: Settings
) -> None:
    url, _ = serve()
    tag = uuid.uuid4().hex[:8]
    mine, theirs = f"mine-{tag}", f"theirs-{tag}"

    def order(order_id: str, customer: str, version: int, status: str = "placed") -> None:
        with psycopg.connect(deployment.database(), autocommit=True) as conn:
            conn.execute(
                "INSERT INTO orders (order_id, customer_id, status, total_cents, line_count, "
                "placed_at, version) VALUES (%s, %s, %s, 100, 1, now(), %s) "
                "ON CONFLICT (order_id) DO UPDATE SET customer_id = excluded.customer_id, "
                "status = excluded.status, version = excluded.version",
                (order_id, customer, status, version),
            )

    order(f"a-{tag}", mine, 1)
    order(f"b-{tag}", theirs, 1)
    client = WsClient(url, token("views:read", rows={"customer_id": mine}))
    client.subscribe("s", "orders")  # no filter: the claim is the filter
    client.wait_for(_has_snapshot(client, "s"), "snapshot")
    assert [r["order_id"] for r in client.of("s", "snapshot")[0]["rows"]] == [f"a-{tag}"]

    order(f"c-{tag}", theirs, 1)  # not theirs to see
    order(f"a-{tag}", mine, 2, "paid")
    order(f"a-{tag}", theirs, 3, "paid")  # the row moves out of the claim: a delete
    client.wait_for(lambda: len(client.of("s", "change")) >= 2, "two changes")
    changes = [(m["op"], m["key"]["order_id"]) for m in client.of("s", "change")]
    assert changes == [("upsert", f"a-{tag}"), ("delete", f"a-{tag}")], changes
    assert all(
        m["row"] is None or m["row"]["customer_id"] == mine for m in client.of("s", "change")
    )

    for sub_id, view, filter in (("w", "orders", {"customer_id": theirs}), ("b", "books", {})):
        client.subscribe(sub_id, view, filter)
        client.wait_for(lambda s=sub_id: bool(client.of(s, "error")), f"{sub_id} refused")
        assert client.of(sub_id, "error")[0]["code"] == "forbidden"
    client.close()


def test_a_snapshot_never_waits_for_writers_and_hands_off_their_changes(
    serve: Serve, deployment: Settings
) -> None:
    """A transaction writing the table is open while a client subscribes: the snapshot comes at
    once, without that write (it did not commit), and the write arrives as a change once it
    commits. Writers are never made to wait by subscribers either: nothing is locked."""
    url, _ = serve()
    keys, group = _keys(2)
    insert_customers(deployment, keys, group)
    with psycopg.connect(deployment.database()) as writer:
        writer.execute(
            "UPDATE customers SET version = version + 1 WHERE customer_id = %s", (keys[0],)
        )  # open, uncommitted: holds its row lock
        client = WsClient(url, token("views:read"))
        client.subscribe("s", "customers", {"name": group})
        client.wait_for(_has_snapshot(client, "s"), "the snapshot, while the writer is open", 10)
        rows = {r["customer_id"]: r["version"] for r in client.of("s", "snapshot")[0]["rows"]}
        assert rows == {keys[0]: 0, keys[1]: 0}
        # Subscribing again and again does not hold the writer up either.
        for i in range(10):
            client.subscribe(f"again{i}", "customers", {"name": group})
        client.wait_for(lambda: bool(client.of("again9", "snapshot")), "ten more snapshots")
        writer.commit()
    client.wait_for(lambda: bool(client.of("s", "change")), "the committed write as a change")
    change = client.of("s", "change")[0]
    assert (change["op"], change["key"]["customer_id"], change["row"]["version"]) == (
        "upsert",
        keys[0],
        1,
    )
    Writer(deployment, keys, total=10).run()
    final = table_versions(deployment, keys)
    client.wait_for(_holds(client, "s", final), "every later change")
    assert_consecutive(versions_seen(client.of("s")), final)
    client.close()
