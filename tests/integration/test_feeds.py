"""Server-sent events (`/views/<view>/events`) and long-polling (`/views/<view>/changes`) on a real
server (werkzeug, threaded), real Kafka, Postgres and CDC: the websocket's promise over plain
HTTP (guarantee 22) — a snapshot, then every change in order with no gap and no duplicate,
resumable from the last position, with row claims, limits and the slow-consumer policy.

As in test_live.py, changes are plain SQL updates of `customers` bumping a version by one."""

from __future__ import annotations

import socket
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import requests
from flask import Flask

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
from tests.sse import SseClient
from tests.support import servers, token
from tests.wsclient import fold

pytestmark = pytest.mark.integration

Serve = Callable[..., tuple[str, Flask]]


@pytest.fixture(scope="module")
def serve(deployment: Settings, capture: Capture) -> Iterator[Serve]:
    """Start an API (with its own settings overrides) on a free port; returns its base URL."""
    # Heartbeats often: a stream whose client went is seen (and let go) at its next write.
    with servers(deployment.model_copy(update={"ws_heartbeat_s": 0.5})) as start:

        def serve_one(**overrides: Any) -> tuple[str, Flask]:
            ws_url, app = start(**overrides)
            return ws_url.removesuffix("/ws").replace("ws://", "http://", 1), app

        yield serve_one


def _keys(n: int) -> tuple[list[str], str]:
    tag = uuid.uuid4().hex[:8]
    return [f"{tag}-{i}" for i in range(n)], f"group-{tag}"


def _holds(client: SseClient, final: dict[str, int]) -> Callable[[], bool]:
    def check() -> bool:
        rows = fold(_messages(client), "customer_id")
        return {k: r["version"] for k, r in rows.items()} == final

    return check


def _messages(client: SseClient) -> list[dict[str, Any]]:
    """The stream's events as websocket messages (`type` is the event's name)."""
    return [{**m, "type": m["_event"]} for m in client.of() if m["_event"] != "message"]


def _get(base: str, path: str, tok: str | None = None, **params: Any) -> requests.Response:
    headers = {"Authorization": f"Bearer {tok or token('views:read')}"}
    return requests.get(f"{base}{path}", params=params, headers=headers, timeout=60)


# -- server-sent events ---------------------------------------------------------------------


def test_sse_snapshot_then_every_change_in_order_under_concurrent_writes(
    serve: Serve, deployment: Settings
) -> None:
    base, _ = serve()
    keys, group = _keys(4)
    insert_customers(deployment, keys, group)
    clients = []
    with Writer(deployment, keys) as writer:
        for i in range(4):  # one stream after another while every key keeps changing
            client = SseClient(base, "customers", token("views:read"), {"name": group})
            assert client.status == 200
            client.wait_for(lambda c=client: bool(c.of("snapshot")), f"snapshot {i}")
            clients.append(client)
            start = writer.done
            wait_until(lambda s=start: writer.done > s + 20, 60, "more writes")
    final = table_versions(deployment, keys)
    for client in clients:
        client.wait_for(_holds(client, final), "the stream to hold the final rows")
        assert_consecutive(versions_seen(_messages(client)), final)
        snapshot = client.of("snapshot")[0]
        assert snapshot["_id"] == snapshot["position"]  # every event's id is its position
        assert all(m["_id"] == m["position"] for m in client.of("change"))
        client.close()


def test_sse_reconnect_with_last_event_id_resumes_without_gap_or_duplicate(
    serve: Serve, deployment: Settings
) -> None:
    base, _ = serve()
    keys, group = _keys(2)
    insert_customers(deployment, keys, group)
    first = SseClient(base, "customers", token("views:read"), {"name": group})
    first.wait_for(lambda: bool(first.of("snapshot")), "snapshot")
    Writer(deployment, keys, total=30).run()
    first.wait_for(_holds(first, table_versions(deployment, keys)), "the first 30 changes")
    first.close()
    last = first.last_id()
    assert last is not None
    Writer(deployment, keys, total=40).run()
    final = table_versions(deployment, keys)

    second = SseClient(base, "customers", token("views:read"), {"name": group}, last)
    second.wait_for(lambda: len(second.of("change")) >= 40, "the 40 changes made while away")
    assert not second.of("snapshot") and not second.of("resync")
    both = _messages(first) + _messages(second)
    assert_consecutive(versions_seen(both), final)

    # From a snapshot's id (nothing received after it): the changes it does not hold.
    third = SseClient(base, "customers", token("views:read"), {"name": group})
    third.wait_for(lambda: bool(third.of("snapshot")), "snapshot")
    third.close()
    Writer(deployment, keys, total=6).run()
    fourth = SseClient(
        base, "customers", token("views:read"), {"name": group}, third.of("snapshot")[0]["_id"]
    )
    fourth.wait_for(lambda: len(fourth.of("change")) >= 6, "the 6 changes after the snapshot")
    final = table_versions(deployment, keys)
    assert_consecutive(versions_seen(_messages(third) + _messages(fourth)), final)
    second.close()
    fourth.close()


def test_sse_last_event_id_older_than_the_history_gets_resync_then_a_snapshot(
    serve: Serve, deployment: Settings
) -> None:
    base, _ = serve(ws_replay=5)
    keys, group = _keys(1)
    insert_customers(deployment, keys, group)
    first = SseClient(base, "customers", token("views:read"), {"name": group})
    first.wait_for(lambda: bool(first.of("snapshot")), "snapshot")
    Writer(deployment, keys, total=2).run()
    first.wait_for(lambda: len(first.of("change")) == 2, "two changes")
    first.close()
    Writer(deployment, keys, total=20).run()  # far more than the 5 changes of history
    final = table_versions(deployment, keys)
    again = SseClient(base, "customers", token("views:read"), {"name": group}, first.last_id())
    again.wait_for(lambda: bool(again.of("snapshot")), "a new snapshot")
    assert [m["type"] for m in _messages(again)][:2] == ["resync", "snapshot"]
    again.wait_for(_holds(again, final), "the final rows")
    again.close()


def test_sse_heartbeats_are_comments_and_tokens_and_claims_apply(
    serve: Serve, deployment: Settings
) -> None:
    base, _ = serve(ws_heartbeat_s=0.2)
    keys, group = _keys(2)
    insert_customers(deployment, keys, group)
    raw = requests.get(
        f"{base}/views/customers/events",
        params={"name": group, "token": token("views:read")},  # as a browser's EventSource
        stream=True,
        timeout=30,
    )
    assert raw.status_code == 200
    assert raw.headers["Content-Type"].startswith("text/event-stream")
    seen = b""
    for chunk in raw.iter_content(chunk_size=None):
        seen += chunk
        if seen.count(b": heartbeat\n\n") >= 2:
            break
    raw.close()
    assert b"event: snapshot\n" in seen

    assert _get(base, "/views/customers/events", "not-a-token").status_code == 401
    assert _get(base, "/views/customers/events", token("commands:write")).status_code == 403
    assert _get(base, "/views/nope/events").status_code == 404
    bad = _get(base, "/views/customers/events", since="not-a-position")
    assert bad.status_code == 422 and bad.json()["error"]["code"] == "validation_failed"
    # A row claim: a token for one customer streams only that row, and may not widen it.
    mine = token("views:read", rows={"customer_id": keys[0]})
    claimed = SseClient(base, "customers", mine)
    claimed.wait_for(lambda: bool(claimed.of("snapshot")), "snapshot")
    assert [r["customer_id"] for r in claimed.of("snapshot")[0]["rows"]] == [keys[0]]
    Writer(deployment, keys, total=4).run()
    claimed.wait_for(lambda: len(claimed.of("change")) == 2, "the two changes of its row")
    assert {m["key"]["customer_id"] for m in claimed.of("change")} == {keys[0]}
    claimed.close()
    wider = _get(base, "/views/customers/events", mine, customer_id=keys[1])
    assert wider.status_code == 403


def test_sse_streams_count_against_the_websocket_limits(serve: Serve, deployment: Settings) -> None:
    base, app = serve(ws_max_per_subject=2)
    keys, group = _keys(1)
    insert_customers(deployment, keys, group)
    tok = token("views:read", subject=f"limited-{group}")
    held = [SseClient(base, "customers", tok, {"name": group}) for _ in range(2)]
    assert [c.status for c in held] == [200, 200]
    third = _get(base, "/views/customers/events", tok, name=group)
    assert third.status_code == 429 and third.headers.get("Retry-After")
    admission = app.extensions["logfold.ws_admission"]
    for c in held:
        c.wait_for(lambda c=c: bool(c.of("snapshot")), "snapshot")
        c.close()
    # A stream that ends gives its places back (seen on its next write: a heartbeat at most).
    wait_until(lambda: admission.open == 0, 60, "the streams' places to be given back")


def test_a_slow_sse_reader_is_warned_then_ended_while_others_get_everything(
    serve: Serve, deployment: Settings
) -> None:
    buffer = 500
    base, app = serve(ws_buffer=buffer, ws_socket_buffer_bytes=4096)
    keys, group = _keys(5)
    insert_customers(deployment, keys, group)
    slow = StalledReader(base, f"/views/customers/events?name={group}", token("views:read"))
    normal = SseClient(base, "customers", token("views:read"), {"name": group})
    normal.wait_for(lambda: bool(normal.of("snapshot")), "snapshot")
    hub = app.extensions["logfold.hub"]
    with Writer(deployment, keys, total=3000) as writer:
        # Closed for being slow, it reads at once what the server kept for it: the warning,
        # then the end (a socket that stays blocked is cut off after a grace period).
        wait_until(lambda: hub.stats()["closing_slow"] == 1, 120, "the slow stream's close")
        peak = hub.stats()["outbox_peak"]  # the slow one's, while it is still attached
        slow.release()
        writer.wait()
    wait_until(lambda: slow.ended, 60, "the slow stream to be ended")
    final = table_versions(deployment, keys)
    normal.wait_for(_holds(normal, final), "the normal stream to get every change", 120)
    assert_consecutive(versions_seen(_messages(normal)), final)
    events = slow.events()
    assert "lagging" in events, events[:20]
    assert events[-1] == "error" and b'"code":"too_slow"' in slow.data
    assert peak <= buffer + 1
    normal.close()


class StalledReader:
    """A raw HTTP client with a small receive buffer that reads nothing until `release()`d.

    While it is stalled the socket's buffers fill, then its outbox: however fast or slow this
    machine delivers the changes, every one the normal stream gets is also one this reader does
    not take, so its outbox fills (a reader pacing itself could keep up on a slow machine)."""

    def __init__(self, base: str, path: str, tok: str) -> None:
        host, port = base.removeprefix("http://").split(":")
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.connect((host, int(port)))
        request = f"GET {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {tok}\r\n"
        request += "Connection: close\r\n\r\n"  # the stream's end ends the connection
        self.sock.sendall(request.encode())
        self.data = b""
        self.ended = False
        self._released = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def release(self) -> None:
        self._released.set()

    def _read(self) -> None:
        self._released.wait()
        try:
            while chunk := self.sock.recv(65536):
                self.data += chunk
        except OSError:
            pass
        self.ended = True
        self.sock.close()

    def events(self) -> list[str]:
        return [
            line.removeprefix(b"event: ").decode()
            for line in self.data.split(b"\n")
            if line.startswith(b"event: ")
        ]


# -- long-polling ---------------------------------------------------------------------------


def _poll_all(base: str, group: str, since: str, until: Callable[[list[Any]], bool]) -> list[Any]:
    """Every change from `since` on, page after page (waiting up to 5 s each), until `until`."""
    got: list[Any] = []
    while not until(got):
        page = _get(base, "/views/customers/changes", name=group, since=since, wait=5, limit=7)
        assert page.status_code == 200, page.text
        body = page.json()
        assert not body.get("resync"), body
        assert len(body["changes"]) <= 7
        got += body["changes"]
        since = body["next"]
    return got


def test_long_poll_snapshot_then_every_change_page_by_page(
    serve: Serve, deployment: Settings
) -> None:
    base, _ = serve()
    keys, group = _keys(3)
    insert_customers(deployment, keys, group)
    with Writer(deployment, keys, rate=200) as writer:
        wait_until(lambda: writer.done > 10, 60, "some writes")
        first = _get(base, "/views/customers/changes", name=group)
        assert first.status_code == 200
        body = first.json()
        snapshot = {"type": "snapshot", "rows": body["snapshot"]}
        wait_until(lambda: writer.done > 80, 60, "more writes")
    final = table_versions(deployment, keys)

    def complete(changes: list[Any]) -> bool:
        rows = fold([snapshot, *changes], "customer_id")
        return {k: r["version"] for k, r in rows.items()} == final

    changes = _poll_all(base, group, body["next"], complete)
    assert_consecutive(versions_seen([snapshot, *changes]), final)


def test_long_poll_waits_for_the_first_change_and_resyncs_when_too_old(
    serve: Serve, deployment: Settings
) -> None:
    base, _ = serve(ws_replay=5)
    keys, group = _keys(1)
    insert_customers(deployment, keys, group)
    start = _get(base, "/views/customers/changes", name=group).json()["next"]
    empty = _get(base, "/views/customers/changes", name=group, since=start).json()
    assert empty["changes"] == [] and empty["next"] == start  # at once, with nothing

    answered: list[requests.Response] = []
    waiter = threading.Thread(
        target=lambda: answered.append(
            _get(base, "/views/customers/changes", name=group, since=start, wait=30)
        )
    )
    waiter.start()
    Writer(deployment, keys, total=1).run()
    waiter.join(timeout=60)
    (page,) = answered
    assert [c["row"]["version"] for c in page.json()["changes"]] == [1]

    Writer(deployment, keys, total=20).run()  # far more than the 5 changes of history
    old = _get(base, "/views/customers/changes", name=group, since=page.json()["next"])
    assert old.status_code == 200 and old.json()["resync"] is True


def test_long_poll_waiters_are_bounded_and_bad_input_is_a_4xx(
    serve: Serve, deployment: Settings
) -> None:
    base, app = serve(max_waiters_per_subject=1)
    keys, group = _keys(1)
    insert_customers(deployment, keys, group)
    subject = f"waiter-{group}"
    tok = token("views:read", subject=subject)
    start = _get(base, "/views/customers/changes", tok, name=group).json()["next"]
    holding: list[requests.Response] = []
    waiter = threading.Thread(
        target=lambda: holding.append(
            _get(base, "/views/customers/changes", tok, name=group, since=start, wait=30)
        )
    )
    waiter.start()
    waiters = app.extensions["logfold.read_model"].waiters
    wait_until(lambda: waiters.subjects.get(subject) == 1, 30, "the first request to wait")
    again = _get(base, "/views/customers/changes", tok, name=group, since=start, wait=1)
    assert again.status_code == 429 and again.headers.get("Retry-After")
    assert again.json()["error"]["code"] == "too_many_requests"
    Writer(deployment, keys, total=1).run()
    waiter.join(timeout=60)
    assert holding[0].status_code == 200
    for params, status in [
        ({"since": "nope"}, 422),
        ({"since": start, "wait": "31"}, 422),
        ({"since": start, "limit": "0"}, 422),
        ({"since": start, "colour": "red"}, 422),
    ]:
        r = _get(base, "/views/customers/changes", tok, name=group, **params)
        assert r.status_code == status, (params, r.text)
        assert r.json()["error"]["code"] == "validation_failed"
    assert _get(base, "/views/nope/changes").status_code == 404
