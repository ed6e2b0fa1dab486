"""The process's websocket writer on real sockets (a socketpair), with wsproto on both ends:
frames in order, the library's own frames in line with them, and a reader that does not read
costing its own outbox (lagging, then close 4008), never the writer's memory."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from wsproto.connection import Connection, ConnectionType
from wsproto.events import CloseConnection, Ping, TextMessage

from app.hub import SLOW_CLOSE, Client
from app.ws_writer import Writer
from stack.procs import wait_until


@dataclass
class FakeWs:
    """What the writer uses of simple-websocket's connection: its socket and wsproto state."""

    sock: Any
    ws: Connection = field(default_factory=lambda: Connection(ConnectionType.SERVER))
    connected: bool = True


class Peer:
    """The client's end: reads frames as they come."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.ws = sock, Connection(ConnectionType.CLIENT)
        self.events: list[Any] = []

    def read(self) -> None:
        self.sock.settimeout(5)
        try:
            data = self.sock.recv(1 << 20)
        except TimeoutError:
            return
        self.ws.receive_data(data or None)
        self.events += list(self.ws.events())

    def texts(self) -> list[dict[str, Any]]:
        """The text messages received, each put together from its parts (as read)."""
        found, part = [], ""
        for e in self.events:
            if isinstance(e, TextMessage):
                part += e.data
                if e.message_finished:
                    found.append(json.loads(part))
                    part = ""
        return found


@pytest.fixture
def pair() -> Iterator[tuple[Writer, socket.socket, socket.socket]]:
    writer = Writer(heartbeat_s=3600)
    server, client = socket.socketpair()
    yield writer, server, client
    writer.stop()
    server.close()
    client.close()


def test_messages_go_out_in_order_and_the_librarys_frames_never_cut_into_them(
    pair: tuple[Writer, socket.socket, socket.socket],
) -> None:
    """The library's own frames (pongs, from its reader thread) go through the same outlet:
    between messages, never inside one, whatever the timing."""
    writer, server, other = pair
    ws, client, peer = FakeWs(server), Client(5000), Peer(other)
    outlet = writer.attach(ws, client, lambda _: None)
    client.offer({"type": "subscribed", "id": "s"})
    change = '{"type":"change","id":"s","op":"upsert","key":{},"row":{"x":"%s"},"position":"%d.1"}'
    for i in range(2000):
        client.offer(change % ("x" * 300, i), "s")
        if i % 100 == 0:  # as the library's reader thread answers a ping, via the proxy
            ws.sock.send(ws.ws.send(Ping(b"%d" % i)))
    wait_until(lambda: (peer.read(), len(peer.texts()) >= 2001)[1], 30, "every message")
    texts = peer.texts()
    assert texts[0]["type"] == "subscribed"
    changes = [m for m in texts if m["type"] == "change"]
    assert [int(m["position"].split(".")[0]) for m in changes] == list(range(2000))
    assert len([e for e in peer.events if isinstance(e, Ping)]) == 20
    writer.detach(outlet, linger=5)
    assert outlet.finished.is_set()


def test_a_reader_that_does_not_read_fills_its_outbox_not_the_writer(
    pair: tuple[Writer, socket.socket, socket.socket],
) -> None:
    writer, server, other = pair
    server.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    other.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    ws, client, peer = FakeWs(server), Client(50), Peer(other)
    outlet = writer.attach(ws, client, lambda _: None)
    change = '{"type":"change","id":"s","op":"upsert","key":{},"row":{"x":"%s"},"position":"%d.1"}'
    sent = 0
    while client.offer(change % ("x" * 400, sent), "s"):
        sent += 1
        assert sent < 100_000, "the outbox never filled: the writer took everything"
    assert client.close_code == SLOW_CLOSE
    assert len(outlet.pending) < 64 * 1024  # what one pass framed, not the backlog
    wait_until(lambda: (peer.read(), peer.ws.state.name != "OPEN")[1], 30, "the close frame")
    closes = [e for e in peer.events if isinstance(e, CloseConnection)]
    assert closes and closes[0].code == SLOW_CLOSE
    kinds = [m["type"] for m in peer.texts()]
    assert kinds[-1] == "lagging" and kinds.count("lagging") == 1
    positions = [int(m["position"].split(".")[0]) for m in peer.texts() if m["type"] == "change"]
    assert positions == list(range(len(positions)))  # in order, none twice


def test_an_idle_socket_gets_heartbeats_then_its_messages() -> None:
    writer = Writer(heartbeat_s=0.2)
    server, other = socket.socketpair()
    try:
        client, peer = Client(100), Peer(other)
        writer.attach(FakeWs(server), client, lambda _: None)
        wait_until(lambda: peer.read() or len(peer.texts()) >= 2, 10, "two heartbeats", interval=0)
        assert peer.texts()[:2] == [{"type": "heartbeat"}] * 2
        client.offer({"type": "subscribed", "id": "s"})
        subscribed = {"type": "subscribed", "id": "s"}
        wait_until(lambda: peer.read() or subscribed in peer.texts(), 10, "the message")
    finally:
        writer.stop()
        server.close()
        other.close()
