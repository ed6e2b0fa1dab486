"""Websocket admission before authentication (guarantees 15 and 17): sockets that never send a
token wait in a small pool of their own, bounded per client address, so a flood of them never
takes the places of authenticated clients; and a connection's subscribes are rate-bounded (each
takes a snapshot). A real API (werkzeug, threaded) on real Kafka and Postgres."""

from __future__ import annotations

import base64
import os
import socket
from collections.abc import Iterator

import pytest

from config.settings import Settings
from tests.support import served, token
from tests.wsclient import WsClient

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def settings(deployment: Settings) -> Settings:
    # 24 admitted places (40 threads of a threaded server, 8 reserved for REST, 8 for sockets
    # still to authenticate), and a long wait for the `auth` message, so the flood holds its
    # sockets for the test.
    return deployment.model_copy(
        update={
            "api_worker": "gthread",
            "api_threads": 40,
            "api_reserved_threads": 8,
            "ws_max_pending": 8,
            "ws_max_pending_per_address": 4,
            "ws_auth_timeout_s": 60.0,
            "ws_subscribe_burst": 3,
            "ws_subscribes_per_s": 0.5,
        }
    )


@pytest.fixture(scope="module")
def url(settings: Settings) -> Iterator[str]:
    with served(settings) as (ws_url, _):
        yield ws_url


def handshakes(url: str, n: int) -> tuple[list[socket.socket], list[bytes]]:
    """`n` websocket handshakes without a token, left idle; with each answer's status line."""
    host, port = url.removeprefix("ws://").removesuffix("/ws").split(":")
    sockets, statuses = [], []
    for _ in range(n):
        s = socket.create_connection((host, int(port)), timeout=30)
        key = base64.b64encode(os.urandom(16)).decode()
        s.sendall(
            f"GET /ws HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
            "Sec-WebSocket-Version: 13\r\n\r\n".encode()
        )
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = s.recv(4096)
            assert chunk, f"closed before the handshake's answer: {head!r}"
            head += chunk
        sockets.append(s)
        statuses.append(head.split(b"\r\n", 1)[0])
    return sockets, statuses


def test_a_flood_of_unauthenticated_sockets_does_not_lock_out_an_authenticated_client(
    url: str, settings: Settings
) -> None:
    flood, statuses = handshakes(url, settings.ws_max_open + 16)
    try:
        accepted = sum(s.startswith(b"HTTP/1.1 101") for s in statuses)
        assert accepted == settings.ws_max_pending_per_address, statuses
        assert all(s.startswith((b"HTTP/1.1 101", b"HTTP/1.1 429")) for s in statuses), statuses

        client = WsClient(url, token("views:read", subject="legit"))
        try:
            client.subscribe("s", "books")
            client.wait_for(lambda: bool(client.of("s", "snapshot")), "a snapshot", 30)
            assert client.close_code is None
        finally:
            client.close()
    finally:
        for s in flood:
            s.close()


def test_an_auth_message_socket_is_admitted_once_it_authenticates(url: str) -> None:
    client = WsClient(url)
    try:
        client.send({"op": "auth", "token": token("views:read", subject="late-auth")})
        client.subscribe("s", "books")
        client.wait_for(lambda: bool(client.of("s", "snapshot")), "a snapshot", 30)
    finally:
        client.close()


def test_subscribes_are_rate_bounded_per_connection(url: str, settings: Settings) -> None:
    client = WsClient(url, token("views:read", subject="looper"))
    try:
        n = settings.ws_subscribe_burst + 2
        for i in range(n):
            client.subscribe(f"s{i}", "books")
        client.wait_for(
            lambda: sum(bool(client.of(f"s{i}")) for i in range(n)) == n, "an answer to each"
        )
        answered = [client.of(f"s{i}")[0] for i in range(n)]
        refused = [m for m in answered if m["type"] == "error"]
        assert len(refused) == n - settings.ws_subscribe_burst, answered
        assert {m["code"] for m in refused} == {"too_many_requests"}
        assert all(m["retry_after"] > 0 for m in refused)
        assert client.close_code is None
    finally:
        client.close()
