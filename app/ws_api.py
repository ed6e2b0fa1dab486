"""`/ws`: subscribe to views and receive their changes (protocol in docs/api.md, design in
app/hub.py).

Each connection's handler reads the client's messages from its socket itself (`receive`); what
the server sends goes through the process's one websocket writer (app/ws_writer.py), which
drains every client's outbox into its socket and sends heartbeats when idle. So an open socket
costs one thread (a greenlet, under gevent) and no more: the websocket library would start a
reader thread of its own per connection (`Unthreaded` keeps it from doing so)."""

from __future__ import annotations

import _socket
import contextlib
import json
import logging
import select
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

from flask import Blueprint, current_app, g, request
from flask_sock import Sock
from simple_websocket import ConnectionClosed  # type: ignore[import-untyped]
from wsproto.connection import ConnectionState
from wsproto.utilities import LocalProtocolError

from app.auth import scopes, verify
from app.errors import ApiError, too_many, unavailable
from app.hub import Client, Hub, compact
from app.read_model import ReadModel
from app.subscribing import Reader, Subscriber, parse_since
from app.ws_admission import Admission, Ticket, TokenBucket
from app.ws_messages import Problem, Subscribe, Unsubscribe, parse
from app.ws_writer import SocketProxy, Writer
from config.settings import Settings

log = logging.getLogger(__name__)

bp = Blueprint("live", __name__)
sock = Sock()

UNAUTHORIZED, FORBIDDEN, TOO_MANY_FOR_SUBJECT = 4401, 4403, 4429
TRY_AGAIN_LATER = 1013  # RFC 6455's registry: the server is overloaded
EXPIRED = {
    "type": "error",
    "id": None,
    "code": "unauthorized",
    "message": "the token has expired; connect again with a new one",
}


@bp.before_request
def admit() -> None:
    """Before any handshake: a socket with a valid `?token=` takes an admitted place (`503`
    with Retry-After when the process holds all it may: the client tries again later, or
    another API process); any other waits for its `auth` message in the pending pool (`503`
    when it is full, `429` when its address holds its share of it)."""
    # No permessage-deflate (browsers always offer it): compressing costs ~90 KiB of zlib state
    # per socket and a compression per message per subscriber, for JSON that is mostly small.
    request.environ.pop("HTTP_SEC_WEBSOCKET_EXTENSIONS", None)
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
            app.extensions["logfold.ws_writer"],
        ).serve(request.args.get("token"), g.pop("ws_claims", None))
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
    deadline = time.monotonic() + linger
    while ws.ws.state != ConnectionState.CLOSED and _read(ws, deadline):
        pass  # until the client answers the close, hangs up, or `linger` is over
    with contextlib.suppress(OSError):
        ws.sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        ws.sock.close()


class _HandshakeDone:
    """Stands for wsproto's handshake once it is over: the connection asks it only for events,
    and it has none left."""

    def events(self) -> Iterator[Any]:
        return iter(())


def _forget_handshake(ws: Any) -> None:
    """Let go of the HTTP/1.1 handshake once it is done: wsproto keeps it (an h11 connection,
    its buffers and event queue: ~3 KiB) for the connection's life, for every idle socket."""
    if ws.ws.connection is not None:
        ws.ws.handshake = _HandshakeDone()


class Unthreaded:
    """The websocket library's `thread_class`: the reader it would start for each connection
    is never started; the connection's handler reads instead (`receive`)."""

    def __init__(self, target: Callable[[], None]) -> None:
        self.name = "websocket"

    def start(self) -> None:
        pass

    def join(self, timeout: float | None = None) -> None:
        pass


class Unsignalled:
    """The library's `event_class`: its event told a waiting `receive` of the reader's news;
    with no reader nothing waits on it (and an event costs ~1 KiB for every idle socket)."""

    def set(self) -> None:
        pass

    def clear(self) -> None:
        pass


def receive(ws: Any, timeout: float | None) -> str | bytes | None:
    """The client's next message, or None once `timeout` seconds have passed without one; the
    library answers pings and closes meanwhile. Raises ConnectionClosed once the connection is
    closed (by the client, the server, or the network)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while not ws.input_buffer:
        if not ws.connected:
            raise ConnectionClosed(ws.close_reason, ws.close_message)
        if not _read(ws, deadline):
            return None
    message: str | bytes = ws.input_buffer.pop(0)
    return message


def _recv(sock: Any, size: int, timeout: float | None) -> bytes | None:
    """What `sock` has (up to `size` bytes; b"" once the peer closed), or None when nothing
    came within `timeout` seconds. A gevent socket waits with its own timeout (the writer sends
    through its C-level socket, which has none); a plain socket is polled first, as a timeout of
    its own would also hold up the writer's sends (CPython waits for room before each send on a
    socket with a timeout, MSG_DONTWAIT or not)."""
    if isinstance(sock, SocketProxy):
        sock = sock.wrapped
    if isinstance(sock, _socket.socket):  # a plain socket (gevent's is not one)
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN)
        if not poller.poll(None if timeout is None else timeout * 1000):
            return None
        return sock.recv(size)
    sock.settimeout(timeout)
    try:
        data: bytes = sock.recv(size)
    except TimeoutError:
        return None
    return data


def _read(ws: Any, deadline: float | None) -> bool:
    """Read the socket once and let the library handle what came (messages to its input
    buffer; pongs, close answers and too-large messages sent back through the socket). False
    when `deadline` passed first or the socket is gone."""
    left = None if deadline is None else deadline - time.monotonic()
    if left is not None and left <= 0:
        return False
    try:
        data = _recv(ws.sock, ws.receive_bytes, left)
    except OSError:
        data = b""
    if data is None:
        return False
    if not data:
        ws.connected = False
        return False
    try:
        ws.ws.receive_data(data)
        ws.connected = ws._handle_events() and ws.connected
    except LocalProtocolError:
        ws.connected = False
    return True


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
        writer: Writer,
    ) -> None:
        self.ws, self.settings, self.hub, self.model, self.secret = ws, settings, hub, model, secret
        self.admission, self.ticket, self.writer = admission, ticket, writer
        self.subscribes = TokenBucket(settings.ws_subscribe_burst, settings.ws_subscribes_per_s)
        self.client = Client(settings.ws_buffer, settings.ws_buffer_bytes)
        self.client.abort = self._abort  # type: ignore[attr-defined]
        self.subject: str | None = None
        self.scopes: set[str] = set()
        self.rows: dict[str, str] = {}  # the token's row claim (guarantee 18)
        self.expires_at = float("inf")  # the token's `exp`: the connection closes then (4401)

    # -- the connection's life --------------------------------------------------------------

    def serve(self, token: str | None, claims: dict[str, Any] | None = None) -> None:
        """`claims`: the handshake's token, verified at admission (the socket holds an admitted
        place); without them it holds a pending one until its `auth` message is verified."""
        self.hub.start()
        _forget_handshake(self.ws)
        with contextlib.suppress(AttributeError, OSError):
            self.ws.sock.setsockopt(
                socket.SOL_SOCKET, socket.SO_SNDBUF, self.settings.ws_socket_buffer_bytes
            )
        if not self._authenticate(token, claims):
            return
        del token, claims  # what the connection keeps of them is its own (this frame lives on)
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
        """Read the client's messages until it goes (the writer sends: app/ws_writer.py)."""
        self.hub.attach(self.client)
        outlet = self.writer.attach(self.ws, self.client, self._resubscribe)
        try:
            while self.client.close_code is None:
                left = self.expires_at - time.time()
                if left <= 0:  # expired while open
                    self.client.close(UNAUTHORIZED, "the token has expired", EXPIRED)
                    break
                raw = receive(self.ws, left)
                if raw is None or self.client.close_code is not None:
                    continue
                self._handle(raw)
        except ConnectionClosed:
            pass
        finally:
            self.client.close(1000, "bye")
            self.hub.detach(self.client)
            self.writer.detach(outlet, linger=2.0)

    def _authenticate(self, token: str | None, claims: dict[str, Any] | None = None) -> bool:
        """`?token=` (`claims`, when it was verified at admission) or a first `{"op": "auth",
        "token": …}` message; needs `views:read`."""
        if claims is not None:
            return self._accept(claims)
        if token is None:
            try:
                raw = receive(self.ws, self.settings.ws_auth_timeout_s)
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
        self.subscriber = Subscriber(
            self.settings,
            self.hub,
            self.model,
            self.client,
            Reader(self.subject, self.scopes, self.rows),
        )
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
        """Send at once, before the connection is registered with the writer (refusals)."""
        self.ws.send(compact(message))

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
        if m.id in self.client.subscriptions:
            raise Problem("validation_failed", f"subscription id {m.id!r} is in use", m.id)
        if len(self.client.subscriptions) >= self.settings.ws_max_subscriptions:
            raise Problem(
                "too_many_subscriptions",
                f"at most {self.settings.ws_max_subscriptions} subscriptions per connection",
                m.id,
            )
        sub = self.subscriber.subscription(m.id, m.view, m.filter)
        since = parse_since(m.since, m.id) if m.since is not None else None
        if m.consistent_with is not None:
            self.subscriber.wait_for(sub, m.consistent_with, m.wait)
        self.client.subscriptions[m.id] = sub
        self.client.offer({"type": "subscribed", "id": m.id})
        try:
            self.subscriber.start(sub, since)
        except Problem:
            self.client.subscriptions.pop(m.id, None)
            self.hub.unsubscribe(sub)
            raise

    def _resubscribe(self, sub_id: str) -> None:
        sub = self.client.subscriptions.get(sub_id)
        if sub is None:
            return
        try:
            self.subscriber.snapshot(sub)
        except Problem as p:
            self.client.subscriptions.pop(sub_id, None)
            self.client.offer({"type": "error", "id": sub_id, "code": p.code, "message": p.message})

    def _unsubscribe(self, m: Unsubscribe) -> None:
        sub = self.client.subscriptions.pop(m.id, None)
        if sub is None:
            raise Problem("not_found", f"no subscription {m.id!r}", m.id)
        self.hub.unsubscribe(sub)
        self.client.offer({"type": "unsubscribed", "id": m.id})
