"""View changes over plain HTTP, for clients that cannot hold a websocket: server-sent events
(`GET /views/<view>/events`) and long-polling (`GET /views/<view>/changes`). Both make the
websocket's promise (guarantee 22): a snapshot or a position, then every later change in order,
with no gap and no duplicate, resumable from the last position (`Last-Event-ID`, `since`), with
the same row claims, limits and slow-consumer policy. The subscribing is shared with `/ws`
(app/subscribing.py); the changes come from the same hub (app/hub.py), encoded once for every
subscriber of every protocol.

Server-sent events: each stream holds a server thread and an admitted websocket's place (the
same `LOGFOLD_WS_MAX_OPEN`-style bound and per-subject limit), and a client outbox bounded as a
websocket's is: a stream that falls behind gets `event: lagging`, then `event: error` (code
`too_slow`) and its end; the client reconnects with `Last-Event-ID` and resumes. A token's
expiry ends the stream with `event: error` (code `unauthorized`).

Long-polling: each waiting request holds a server thread, so waits count among the process's
and the subject's bounded waiters (as reads with `consistent_with` do)."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Generator, Iterator
from typing import Any

from flask import Blueprint, Response, current_app, g, request
from kafka.errors import KafkaError
from sqlalchemy.exc import OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from app.auth import require, scopes
from app.errors import too_many, unavailable
from app.hub import SLOW_CLOSE, Client, Hub, Subscription, Unservable, compact
from app.read_model import ReadModel
from app.subscribing import Reader, Subscriber, http_error, parse_since
from app.views_api import query_number
from app.waiting import TooManyWaiters
from app.ws_admission import Admission
from app.ws_messages import Problem
from cdc.changes import Snapshot, WalPosition
from config.settings import Settings
from projections.registry import VIEWS

bp = Blueprint("feeds", __name__)

MAX_WAIT_S, MAX_LIMIT, DEFAULT_LIMIT = 30.0, 1000, 100
RESERVED = {"token", "since", "consistent_with", "wait", "limit"}  # the rest is the filter
STREAM_ID = "events"  # the subscription id of a stream's messages (one subscription each)
LONG_POLL_ID = "changes"


def _subscriber(client: Client) -> Subscriber:
    ext = current_app.extensions
    reader = Reader(g.subject, scopes(g.claims), g.rows)
    return Subscriber(
        ext["logfold.settings"], ext["logfold.hub"], ext["logfold.read_model"], client, reader
    )


def _filter() -> dict[str, Any]:
    return {k: v for k, v in request.args.items() if k not in RESERVED}


# -- server-sent events ---------------------------------------------------------------------


def sse(kind: str, data: str, event_id: str | None = None) -> str:
    """One event of a `text/event-stream` (`data` is one line of JSON)."""
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {kind}\ndata: {data}\n\n"


def _position_of(change: str) -> str:
    """A `change` message's position (its last field) without decoding it."""
    return change[change.rindex('"position":"') + 12 : -2]


@bp.get("/views/<view>/events")
@require("views:read", query_token=True)
def events(view: str) -> Response:
    settings: Settings = current_app.extensions["logfold.settings"]
    admission: Admission = current_app.extensions["logfold.ws_admission"]
    hub: Hub = current_app.extensions["logfold.hub"]
    client = Client(settings.ws_buffer, settings.ws_buffer_bytes)
    subscriber = _subscriber(client)
    raw_since = request.headers.get("Last-Event-ID") or request.args.get("since")
    try:
        sub = subscriber.subscription(STREAM_ID, view, _filter())
        since = parse_since(raw_since, STREAM_ID) if raw_since else None
    except Problem as p:
        raise http_error(p) from p
    wait = query_number("wait", 5.0, 0.0, MAX_WAIT_S)
    if not admission.enter():
        raise unavailable("this API process holds as many streams as it may; try again")
    if not admission.enter_subject(g.subject):
        admission.leave()
        raise too_many(
            f"at most {settings.ws_max_per_subject} streams and websockets per token subject; "
            "close one",
            settings.retry_after_s,
        )
    try:
        if consistent_with := request.args.get("consistent_with"):
            subscriber.wait_for(sub, consistent_with, wait)
        client.subscriptions[sub.id] = sub
        hub.attach(client)
        subscriber.start(sub, since)
    except Problem as p:
        _leave(hub, admission, client, g.subject)
        raise http_error(p) from p
    except BaseException:
        _leave(hub, admission, client, g.subject)
        raise
    sock = request.environ.get("gunicorn.socket") or request.environ.get("werkzeug.socket")
    if sock is not None:  # as a websocket's: a reader that falls behind is seen soon
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, settings.ws_socket_buffer_bytes)
    client.abort = lambda: _shutdown(sock)  # type: ignore[attr-defined]
    stream = Stream(settings, hub, admission, subscriber, sub, g.subject, float(g.claims["exp"]))
    return Response(
        stream,
        mimetype="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def _leave(hub: Hub, admission: Admission, client: Client, subject: str) -> None:
    client.close(1000, "bye")
    hub.detach(client)
    admission.leave()
    admission.leave_subject(subject)


def _shutdown(sock: Any) -> None:
    """Cut a stream whose socket stays blocked after it was told to end."""
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


class Stream:
    """One server-sent events stream: drains its client's outbox as events. The server closes
    it (WSGI's `close`) when the response ends, even one never started: its places are given
    back either way."""

    def __init__(
        self,
        settings: Settings,
        hub: Hub,
        admission: Admission,
        subscriber: Subscriber,
        sub: Subscription,
        subject: str,
        expires_at: float,
    ) -> None:
        self.settings, self.hub, self.admission = settings, hub, admission
        self.subscriber, self.sub, self.subject = subscriber, sub, subject
        self.client, self.expires_at = subscriber.client, expires_at
        self._left = False
        self._events: Generator[str] | None = None

    def __iter__(self) -> Iterator[str]:
        self._events = self._run()
        return self._events

    def close(self) -> None:
        if self._events is not None:
            self._events.close()
        if not self._left:
            self._left = True
            _leave(self.hub, self.admission, self.client, self.subject)

    def _run(self) -> Generator[str]:
        try:
            yield f"retry: {int(self.settings.retry_after_s * 1000)}\n\n"
            while True:
                left = self.expires_at - time.time()
                if left <= 0:
                    yield self._error(
                        "unauthorized", "the token has expired; reconnect with a new one"
                    )
                    return
                batch = self.client.take(min(self.settings.ws_heartbeat_s, left))
                if batch is None:  # closed: too slow
                    if self.client.close_code == SLOW_CLOSE:
                        yield self._error(
                            "too_slow",
                            "too far behind: read faster, then reconnect with Last-Event-ID",
                        )
                    return
                if not batch:
                    yield ": heartbeat\n\n"
                    continue
                out: list[str] = []
                for message in batch:
                    if isinstance(message, str):  # a change, encoded once for its subscribers
                        out.append(sse("change", message, _position_of(message)))
                    elif message["type"] == "_resubscribe":
                        yield "".join(out)
                        out = []
                        try:
                            self.subscriber.snapshot(self.sub)
                        except Problem as p:
                            yield self._error(p.code, p.message)
                            return
                    else:
                        kind = str(message["type"])
                        event_id = message.get("position") if kind == "snapshot" else None
                        out.append(sse(kind, compact(message), event_id))
                yield "".join(out)
        finally:
            self.client.close(1000, "bye")

    def _error(self, code: str, message: str) -> str:
        return sse(
            "error", compact({"type": "error", "id": STREAM_ID, "code": code, "message": message})
        )


# -- long-polling ---------------------------------------------------------------------------


@bp.get("/views/<view>/changes")
@require("views:read")
def changes(view: str) -> Response:
    """Without `since`: a snapshot of the rows and its position. With `since`: the changes
    after it (at most `limit`), waiting up to `wait` seconds for the first; `next` is where to
    ask from next; `{"resync": true}` when `since` can no longer be served (ask for a new
    snapshot)."""
    settings: Settings = current_app.extensions["logfold.settings"]
    hub: Hub = current_app.extensions["logfold.hub"]
    model: ReadModel = current_app.extensions["logfold.read_model"]
    subscriber = _subscriber(Client(1))
    raw_since = request.args.get("since")
    try:
        sub = subscriber.subscription(LONG_POLL_ID, view, _filter())
        since = parse_since(raw_since, LONG_POLL_ID) if raw_since is not None else None
    except Problem as p:
        raise http_error(p) from p
    wait = query_number("wait", 0.0, 0.0, MAX_WAIT_S)
    limit = int(query_number("limit", DEFAULT_LIMIT, 1, MAX_LIMIT))
    try:
        if since is None:
            return _snapshot(subscriber, sub, query_number("wait", 5.0, 0.0, MAX_WAIT_S))
        subscriber.ready(sub.id)
        if wait > 0:
            with model.waiters.held(g.subject):
                return _page(hub, sub, since, limit, wait)
        return _page(hub, sub, since, limit, 0.0)
    except Problem as p:
        raise http_error(p) from p
    except TooManyWaiters as e:
        raise too_many(f"{e}; try again when one has answered", settings.retry_after_s) from e
    except (OperationalError, PoolTimeout, KafkaError) as e:
        which = "Kafka" if isinstance(e, KafkaError) else "Postgres"
        raise unavailable(f"{which} is unavailable; try again", e) from e


def _snapshot(subscriber: Subscriber, sub: Subscription, wait: float) -> Response:
    if consistent_with := request.args.get("consistent_with"):
        subscriber.wait_for(sub, consistent_with, wait)
    output = VIEWS[sub.view][1]
    rows, snapshot, _ = subscriber.rows(sub, output, subscriber.settings.ws_snapshot_rows)
    return _json({"snapshot": rows, "changes": [], "next": str(snapshot)})


def _page(
    hub: Hub, sub: Subscription, since: WalPosition | Snapshot, limit: int, wait: float
) -> Response:
    try:
        found, next_position = hub.page(sub, since, limit, wait)
    except Unservable:
        return _json({"resync": True, "changes": [], "next": None})
    # The changes as they were encoded once for every subscriber, spliced in as they are.
    body = '{"changes":[' + ",".join(found) + '],"next":' + json.dumps(str(next_position)) + "}"
    return Response(body, mimetype="application/json")


def _json(body: dict[str, Any]) -> Response:
    return Response(compact(body), mimetype="application/json")
