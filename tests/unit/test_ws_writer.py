"""The process's websocket writer on real sockets (a socketpair), with wsproto on both ends:
frames in order, the library's own frames in line with them, and a reader that does not read
costing its own outbox (lagging, then close 4008), never the writer's memory."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from wsproto.connection import Connection, ConnectionType
from wsproto.events import CloseConnection, Ping, TextMessage

from app.hub import SLOW_CLOSE, Client
from app.ws_writer import HEARTBEAT, Writer
from stack.procs import wait_until

CHANGE = '{"type":"change","id":"s","op":"upsert","key":{},"row":{"x":"%s"},"position":"%d.1"}'


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
    for i in range(2000):
        client.offer(CHANGE % ("x" * 300, i), "s")
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
    sent = 0
    while client.offer(CHANGE % ("x" * 400, sent), "s"):
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


def test_a_heartbeat_in_flight_keeps_the_writer_off_its_socket_and_its_rest_goes_first(
    pair: tuple[Writer, socket.socket, socket.socket],
) -> None:
    """The Beater's thread has the socket while a heartbeat is in flight: a message queued
    meanwhile waits, and what of the heartbeat the socket did not take goes before it."""
    writer, server, other = pair
    ws, client, peer = FakeWs(server), Client(100), Peer(other)
    outlet = writer.attach(ws, client, lambda _: None)
    assert outlet.take_for_beat()
    assert not outlet.take_for_beat()  # (one at a time)
    client.offer({"type": "subscribed", "id": "s"})
    wait_until(lambda: outlet.woken_while_beating, 10, "the writer to keep off")
    assert not outlet.pending and not outlet.done
    server.send(HEARTBEAT[:3])  # as the Beater's send, cut short by a full socket
    assert writer._beater is not None
    writer._beater._done.put((outlet, 3))
    writer._signal()
    wait_until(lambda: peer.read() or len(peer.texts()) >= 2, 10, "both messages")
    assert peer.texts() == [{"type": "heartbeat"}, {"type": "subscribed", "id": "s"}]
    assert not outlet.beating


def test_heartbeats_from_their_own_thread_never_cut_into_messages() -> None:
    """Many sockets, heartbeats due at every look, messages offered all the while to sockets
    read now and then (so some are mid-frame): every frame whole, every message once and in
    order, heartbeats among them."""
    writer = Writer(heartbeat_s=0.05)
    pairs = [socket.socketpair() for _ in range(40)]
    try:
        clients, peers = [], []
        for server, other in pairs:
            server.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            clients.append(Client(5000))
            peers.append(Peer(other))
            writer.attach(FakeWs(server), clients[-1], lambda _: None)
            deadline = time.monotonic() + 2
        sent = 0
        while time.monotonic() < deadline or sent < 50:
            for client in clients[sent % 4 :: 4]:  # a quarter of them at a time: others idle
                assert client.offer(CHANGE % ("x" * 2000, sent), "s")
            sent += 1
            if sent % 8:
                continue  # (peers read now and then: sockets fill, and writes wait)
            for peer in peers:
                peer.sock.settimeout(0.001)
                with contextlib.suppress(TimeoutError, BlockingIOError):
                    peer.ws.receive_data(peer.sock.recv(1 << 20))
                    peer.events += list(peer.ws.events())
        beats = 0
        for i, peer in enumerate(peers):
            mine = [n for n in range(sent) if n % 4 == i % 4]

            def arrived(peer: Peer = peer, mine: list[int] = mine) -> bool:
                peer.read()
                return len([m for m in peer.texts() if m["type"] == "change"]) >= len(mine)

            wait_until(arrived, 30, f"peer {i}'s changes")
            texts = peer.texts()
            got = [int(m["position"].split(".")[0]) for m in texts if m["type"] == "change"]
            assert got == mine
            beats += texts.count({"type": "heartbeat"})
        assert beats > 0
    finally:
        writer.stop()
        for a, b in pairs:
            a.close()
            b.close()
