"""`/ws`: subscribe to views and receive their changes (protocol in docs/api.md, design in
app/hub.py).

Each connection has two threads: this handler, which reads the client's messages, and a sender
that drains the client's outbox into the socket (and sends heartbeats when idle)."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time
from typing import Any

from flask import Blueprint, current_app, g, request
from flask_sock import Sock
from kafka.errors import KafkaError
from simple_websocket import ConnectionClosed  # type: ignore[import-untyped]
from sqlalchemy.exc import OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from app.auth import narrowed, row_scope, scopes, verify
from app.errors import ApiError, too_many, unavailable
from app.health import public_lag
from app.hub import Client, Hub, Subscription, Unservable
from app.read_model import BadValue, BeyondTheLog, ReadModel
from app.waiting import TooManyWaiters
from app.ws_admission import Admission, Ticket, TokenBucket
from app.ws_messages import Problem, Subscribe, Unsubscribe, parse
from cdc.changes import Snapshot, WalPosition
from commands.messages import LogPosition
from config.settings import Settings
from projections.base import Fold
from projections.registry import VIEWS

log = logging.getLogger(__name__)

bp = Blueprint("live", __name__)
sock = Sock()

UNAUTHORIZED, FORBIDDEN, TOO_MANY_FOR_SUBJECT = 4401, 4403, 4429
TRY_AGAIN_LATER = 1013  # RFC 6455's registry: the server is overloaded
HUB_WAIT_S = 15.0


@bp.before_request
def admit() -> None:
    """Before any handshake: a socket with a valid `?token=` takes an admitted place (`503`
    with Retry-After when the process holds all it may: the client tries again later, or
    another API process); any other waits for its `auth` message in the pending pool (`503`
    when it is full, `429` when its address holds its share of it)."""
    admission: Admission = current_app.extensions["logfold.ws_admission"]
    address = request.remote_addr or "-"
    claims = None
    if token := request.args.get("token"):
        with contextlib.suppress(ApiError):  # refused after the handshake, with its reason
            claims = verify(token, current_app.config["JWT_SECRET"])
    if claims is not None:
        if not admission.enter():
            raise unavailable("this API process holds as many websockets as it may; try again")
        g.ws_ticket, g.ws_claims = Ticket("open", address), claims
        return
    refused = admission.enter_pending(address)
    if refused == "full":
        raise unavailable(
            "too many websockets are waiting to authenticate; try again later, or send the "
            "token in the handshake (?token=)"
        )
    if refused == "address":
        raise too_many(
            f"at most {admission.max_pending_per_address} websockets per client address may "
            "wait to authenticate; send the token in the handshake (?token=), or wait",
            current_app.extensions["logfold.settings"].ws_auth_timeout_s,
        )
    g.ws_ticket = Ticket("pending", address)


@bp.teardown_request
def leave(_: BaseException | None) -> None:
    ticket = g.pop("ws_ticket", None)
    if ticket is not None:
        current_app.extensions["logfold.ws_admission"].release(ticket)


@sock.route("/ws", bp=bp)  # type: ignore[untyped-decorator]
def websocket(ws: Any) -> None:
    app = current_app._get_current_object()  # type: ignore[attr-defined]
    try:
        Connection(
            ws,
            app.extensions["logfold.settings"],
            app.extensions["logfold.hub"],
            app.extensions["logfold.read_model"],
            app.config["JWT_SECRET"],
            app.extensions["logfold.ws_admission"],
            g.ws_ticket,
        ).serve(request.args.get("token"), g.get("ws_claims"))
    finally:
        release(ws)


def release(ws: Any, linger: float = 1.0) -> None:
    """End the connection in this handler's thread, waiting at most `linger` for the client
    to answer the close. Under gunicorn the socket is otherwise closed by the worker's one
    event-loop thread, which waits up to 2 s for each peer that does not close: a few silent
    clients would stall every other connection of the process."""
    if ws.mode != "gunicorn":
        return  # other servers close it themselves, off their accept loop
    if ws.connected:
        with contextlib.suppress(ConnectionClosed, OSError):
            ws.close()
    ws.thread.join(timeout=linger)  # its reader ends when the client answers or hangs up
    with contextlib.suppress(OSError):
        ws.sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        ws.sock.close()


class Connection:
    def __init__(
        self,
        ws: Any,
        settings: Settings,
        hub: Hub,
        model: ReadModel,
        secret: str,
        admission: Admission,
        ticket: Ticket,
    ) -> None:
        self.ws, self.settings, self.hub, self.model, self.secret = ws, settings, hub, model, secret
        self.admission, self.ticket = admission, ticket
        self.subscribes = TokenBucket(settings.ws_subscribe_burst, settings.ws_subscribes_per_s)
        self.client = Client(settings.ws_buffer, settings.ws_buffer_bytes)
        self.client.abort = self._abort  # type: ignore[attr-defined]
        self._send_lock = threading.Lock()
        self.subject: str | None = None
        self.scopes: set[str] = set()
        self.rows: dict[str, str] = {}  # the token's row claim (guarantee 18)
        self.expires_at = float("inf")  # the token's `exp`: the connection closes then (4401)

    # -- the connection's life --------------------------------------------------------------

    def serve(self, token: str | None, claims: dict[str, Any] | None = None) -> None:
        """`claims`: the handshake's token, verified at admission (the socket holds an admitted
        place); without them it holds a pending one until its `auth` message is verified."""
        self.hub.start()
        with contextlib.suppress(AttributeError, OSError):
            self.ws.sock.setsockopt(
                socket.SOL_SOCKET, socket.SO_SNDBUF, self.settings.ws_socket_buffer_bytes
            )
        if not self._authenticate(token, claims):
            return
        assert self.subject is not None
        if self.ticket.pool == "pending" and not self.admission.promote(self.ticket):
            self._refuse(
                TRY_AGAIN_LATER,
                "unavailable",
                "this API process holds as many websockets as it may; try again later",
            )
            return
        if not self.admission.enter_subject(self.subject):
            self._refuse(
                TOO_MANY_FOR_SUBJECT,
                "too_many_connections",
                f"at most {self.settings.ws_max_per_subject} websockets per token subject; "
                "close one, or share one connection between subscriptions",
            )
            return
        try:
            self._serve_authenticated()
        finally:
            self.admission.leave_subject(self.subject)

    def _serve_authenticated(self) -> None:
        self.hub.attach(self.client)
        sender = threading.Thread(target=self._send_loop, name="ws-sender", daemon=True)
        sender.start()
        try:
            while self.client.close_code is None:
                raw = self.ws.receive()
                if raw is None or self.client.close_code is not None:
                    continue
                self._handle(raw)
        except ConnectionClosed:
            pass
        finally:
            self.client.close(1000, "bye")
            self.hub.detach(self.client)
            sender.join(timeout=15)

    def _authenticate(self, token: str | None, claims: dict[str, Any] | None = None) -> bool:
        """`?token=` (`claims`, when it was verified at admission) or a first `{"op": "auth",
        "token": …}` message; needs `views:read`."""
        if claims is not None:
            return self._accept(claims)
        if token is None:
            try:
                raw = self.ws.receive(timeout=self.settings.ws_auth_timeout_s)
            except ConnectionClosed:
                return False
            try:
                first = json.loads(raw) if raw is not None else {}
            except (ValueError, RecursionError):
                first = {}
            if isinstance(first, dict) and first.get("op") == "auth":
                token = first.get("token") if isinstance(first.get("token"), str) else None
        if not token:
            return self._refuse(UNAUTHORIZED, "unauthorized", "send ?token=… or an auth message")
        try:
            claims = verify(token, self.secret)
        except ApiError as e:
            return self._refuse(UNAUTHORIZED, "unauthorized", e.message)
        return self._accept(claims)

    def _accept(self, claims: dict[str, Any]) -> bool:
        if "views:read" not in scopes(claims):
            return self._refuse(FORBIDDEN, "forbidden", "subscribing needs the 'views:read' scope")
        self.subject, self.expires_at = str(claims["sub"]), float(claims["exp"])
        self.scopes = scopes(claims)
        self.rows = claims.get("rows") or {}
        return True

    def _refuse(self, close_code: int, code: str, message: str) -> bool:
        with contextlib.suppress(ConnectionClosed, OSError):
            self._send({"type": "error", "id": None, "code": code, "message": message})
            self.ws.close(reason=close_code, message=message)
        return False

    def _abort(self) -> None:
        """Cut a connection whose socket stays blocked after it was told to close."""
        with contextlib.suppress(OSError):
            self.ws.sock.shutdown(socket.SHUT_RDWR)

    def _send(self, message: dict[str, Any]) -> None:
        with self._send_lock:
            self.ws.send(json.dumps(message, separators=(",", ":")))

    def _send_loop(self) -> None:
        try:
            while True:
                left = self.expires_at - time.time()
                if left <= 0 and self.client.close_code is None:  # expired while open
                    self._send(
                        {
                            "type": "error",
                            "id": None,
                            "code": "unauthorized",
                            "message": "the token has expired; connect again with a new one",
                        }
                    )
                    self.client.close(UNAUTHORIZED, "the token has expired")
                batch = self.client.take(min(self.settings.ws_heartbeat_s, max(left, 0.0)))
                if batch is None:
                    break
                if not batch:
                    self._send({"type": "heartbeat"})
                for message in batch:
                    if message["type"] == "_resubscribe":
                        self._resubscribe(message["id"])
                    else:
                        self._send(message)
        except (ConnectionClosed, OSError):
            self.client.close(1006, "connection lost")
        finally:
            if self.client.close_code not in (None, 1000, 1006):
                with contextlib.suppress(ConnectionClosed, OSError):
                    self.ws.close(reason=self.client.close_code, message=self.client.close_reason)

    # -- client messages --------------------------------------------------------------------

    def _handle(self, raw: str | bytes) -> None:
        sub_id = None
        try:
            try:
                message = json.loads(raw)
            except ValueError as e:
                raise Problem("malformed_json", "messages must be JSON objects") from e
            except RecursionError as e:  # "[[[[…": nested deeper than the parser recurses
                raise Problem("malformed_json", "the message is nested too deeply") from e
            if not isinstance(message, dict):
                raise Problem("malformed_json", "messages must be JSON objects")
            sub_id = message.get("id") if isinstance(message.get("id"), str) else None
            op = message.get("op")
            if op == "subscribe":
                self._subscribe(parse(Subscribe, message))
            elif op == "unsubscribe":
                self._unsubscribe(parse(Unsubscribe, message))
            elif op == "auth":
                pass  # already authenticated
            else:
                raise Problem("validation_failed", "op must be subscribe or unsubscribe")
        except Problem as p:
            self.client.offer(
                {
                    "type": "error",
                    "id": p.sub_id or sub_id,
                    "code": p.code,
                    "message": p.message,
                    **p.details,
                }
            )
        except Exception:  # a bug, not the client's doing: said, logged, and the socket stays
            log.exception("websocket message failed")
            self.client.offer(
                {
                    "type": "error",
                    "id": sub_id,
                    "code": "internal",
                    "message": "unexpected server error; it has been logged",
                }
            )

    def _subscribe(self, m: Subscribe) -> None:
        wait = self.subscribes.take()
        if wait:
            raise Problem(
                "too_many_requests",
                f"at most {self.settings.ws_subscribes_per_s:g} subscribes a second per "
                f"connection (after a burst of {self.settings.ws_subscribe_burst}); "
                f"try again in {wait:.1f} s",
                m.id,
                retry_after=round(wait, 3),
            )
        found = VIEWS.get(m.view)
        if found is None:
            raise Problem("not_found", f"unknown view {m.view!r}; GET /views lists them", m.id)
        projection, output = found
        if m.id in self.client.subscriptions:
            raise Problem("validation_failed", f"subscription id {m.id!r} is in use", m.id)
        if len(self.client.subscriptions) >= self.settings.ws_max_subscriptions:
            raise Problem(
                "too_many_subscriptions",
                f"at most {self.settings.ws_max_subscriptions} subscriptions per connection",
                m.id,
            )
        allowed = set(output.filterable) | set(output.key)
        unknown = sorted(set(m.filter) - allowed)
        if unknown:
            raise Problem(
                "validation_failed",
                f"cannot filter {m.view} on {unknown}; filterable: {sorted(allowed)}",
                m.id,
            )
        try:  # the token's row claim: the filter may narrow it, never widen it
            claimed = narrowed(m.filter, row_scope(self.rows, m.view, output.columns))
        except ApiError as e:
            raise Problem(e.code, e.message, m.id) from e
        try:
            wanted = self.model.filter_values(output, claimed)
        except BadValue as e:
            raise Problem("validation_failed", str(e), m.id) from e
        since: WalPosition | Snapshot | None = None
        if m.since is not None:  # a change's position, or a snapshot's (nothing received after)
            try:
                since = Snapshot.parse(m.since) if ":" in m.since else WalPosition.parse(m.since)
            except ValueError as e:
                raise Problem("validation_failed", str(e), m.id) from e
        if m.consistent_with is not None:
            self._wait_for(projection, m)
        sub = Subscription(m.id, m.view, output.name, projection.name, wanted, self.client)
        self.client.subscriptions[m.id] = sub
        self.client.offer({"type": "subscribed", "id": m.id})
        try:
            self._start(sub, since)
        except Problem:
            self.client.subscriptions.pop(m.id, None)
            self.hub.unsubscribe(sub)
            raise

    def _wait_for(self, fold: Fold, m: Subscribe) -> None:
        """Wait until the view includes the command position `consistent_with` (the bound of
        REST's `?consistent_with=&wait=`); an error `timeout` with the lag if it does not."""
        assert m.consistent_with is not None
        try:
            written = LogPosition.parse(m.consistent_with)
        except ValueError as e:
            raise Problem("validation_failed", f"consistent_with: {e}", m.id) from e
        try:
            if self.model.wait_for(fold, written, m.wait, self.subject or "-"):
                return
            lag = self.model.lag().get(fold.name, {})
            if "admin" not in self.scopes:  # failure texts and lost ranges: admin only
                lag = public_lag(lag)
        except (OperationalError, PoolTimeout) as e:
            raise Problem("unavailable", "the database is unavailable; retry", m.id) from e
        except BeyondTheLog as e:
            raise Problem("validation_failed", f"consistent_with: {e}", m.id) from e
        except TooManyWaiters as e:
            raise Problem("too_many_requests", f"{e}; try again when one has answered", m.id) from e
        except KafkaError as e:  # the log's end offsets, for a view fed by changelogs
            log.warning("consistent_with on %s: Kafka did not answer (%s)", m.view, e)
            raise Problem("unavailable", "Kafka is unavailable; retry", m.id) from e
        raise Problem(
            "timeout",
            f"{m.view} did not reach the position within {m.wait:g}s",
            m.id,
            lag=lag,
        )

    def _start(self, sub: Subscription, since: WalPosition | Snapshot | None) -> None:
        if not self.hub.ready.wait(HUB_WAIT_S):
            raise Problem("unavailable", "the changelogs are not readable yet; retry", sub.id)
        if since is not None:
            try:
                self.hub.subscribe(sub, since)
                return
            except Unservable:
                self.client.offer({"type": "resync", "id": sub.id})
        self._snapshot(sub)

    def _snapshot(self, sub: Subscription) -> None:
        _, output = VIEWS[sub.view]
        limit = self.settings.ws_snapshot_rows
        for _ in range(3):
            try:
                rows, snapshot = self.model.snapshot(output, sub.filter, limit)
            except (OperationalError, PoolTimeout) as e:
                raise Problem("unavailable", "the database is unavailable; retry", sub.id) from e
            if len(rows) > limit:
                raise Problem(
                    "too_many_rows",
                    f"the snapshot would exceed {limit} rows; narrow the filter",
                    sub.id,
                )
            weight = len(json.dumps(rows, separators=(",", ":")))
            if weight > self.settings.ws_buffer_bytes // 2:
                raise Problem(
                    "too_many_rows",
                    f"the snapshot would be {weight} bytes, more than a connection may queue "
                    "(LOGFOLD_WS_BUFFER_BYTES / 2); narrow the filter",
                    sub.id,
                )
            first = {"type": "snapshot", "id": sub.id, "rows": rows, "position": str(snapshot)}
            try:
                self.hub.subscribe(sub, snapshot, first, weight)
                return
            except Unservable:
                continue  # the hub's history moved past the snapshot meanwhile: take another
        raise Problem("unavailable", "could not take a consistent snapshot; retry", sub.id)

    def _resubscribe(self, sub_id: str) -> None:
        sub = self.client.subscriptions.get(sub_id)
        if sub is None:
            return
        try:
            self._snapshot(sub)
        except Problem as p:
            self.client.subscriptions.pop(sub_id, None)
            self._send({"type": "error", "id": sub_id, "code": p.code, "message": p.message})

    def _unsubscribe(self, m: Unsubscribe) -> None:
        sub = self.client.subscriptions.pop(m.id, None)
        if sub is None:
            raise Problem("not_found", f"no subscription {m.id!r}", m.id)
        self.hub.unsubscribe(sub)
        self.client.offer({"type": "unsubscribed", "id": m.id})
