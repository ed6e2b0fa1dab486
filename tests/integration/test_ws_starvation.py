"""Websockets cannot starve the API: an API process (gunicorn, as deployed, under either worker)
with 1,000 idle websockets open, or 600 that never authenticate, still answers REST as it did
before they came. Each websocket holds a connection of the process (a greenlet under gevent, a
server thread under gthread); the process admits at most its connections (threads) less those
reserved for REST and for sockets still to authenticate, and refuses the rest at once (`503`),
so the reserved ones always serve plain requests."""

from __future__ import annotations

import base64
import os
import socket
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from config.settings import Settings
from stack.procs import wait_until
from tests.support import HttpApi, Processes, drop_cdc_slot, new_deployment, token
from tests.wsclient import WsClient

pytestmark = pytest.mark.integration

# Fewer places than the test opens sockets, so that it also sees the rest refused.
WORKERS = {
    "gevent": {"LOGFOLD_API_WORKER": "gevent", "LOGFOLD_API_CONNECTIONS": "600"},
    "gthread": {"LOGFOLD_API_WORKER": "gthread"},
}


@pytest.fixture(scope="module", params=sorted(WORKERS))
def api(
    request: pytest.FixtureRequest, base_settings: Settings, workdir: Path
) -> Iterator[tuple[str, Settings]]:
    """An API process of the worker `request.param`; with the settings it runs with."""
    deployment = new_deployment(base_settings)
    logs = workdir / f"ws-starvation-{request.param}"
    logs.mkdir(exist_ok=True)
    env = WORKERS[request.param]
    procs = Processes(deployment, logs, env)
    try:
        procs.processor()
        procs.cdc()
        _, url = procs.api()
        procs.wait_processing(url, 1)
        yield url, Settings(**{k.removeprefix("LOGFOLD_").lower(): v for k, v in env.items()})
    finally:
        procs.stop()
        drop_cdc_slot(deployment)


def open_sockets(url: str, n: int, authenticated: bool) -> tuple[list[socket.socket], int]:
    """`n` websocket handshakes to `/ws`, each with a token of its own subject (as many
    browsers would) or none at all, left idle: they never send a frame nor read one. Returns
    once the server answered every handshake, with how many it accepted (`101`; the others got
    `503` or `429`: the process, or the address, holds all it may)."""
    host, port = url.removeprefix("http://").split(":")
    sockets = []
    for i in range(n):
        bearer = token("views:read", subject=f"browser-{i}") if authenticated else None
        path = f"/ws?token={bearer}" if bearer else "/ws"
        s = socket.create_connection((host, int(port)), timeout=60)
        key = base64.b64encode(os.urandom(16)).decode()
        s.sendall(
            f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
            "Sec-WebSocket-Version: 13\r\n\r\n".encode()
        )
        sockets.append(s)
    accepted = 0
    for s in sockets:  # every handshake answered: admitted, or refused
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = s.recv(4096)
            assert chunk, f"closed before the handshake's answer: {head!r}"
            head += chunk
        # 503: the process holds all it may; 429: the address has its share of the sockets
        # still to authenticate.
        assert head.startswith((b"HTTP/1.1 101", b"HTTP/1.1 503", b"HTTP/1.1 429")), head[:200]
        accepted += head.startswith(b"HTTP/1.1 101")
    return sockets, accepted


def rest_latencies(url: str, n: int = 20) -> list[float]:
    """Seconds per REST call: a command (through Kafka and the processor) and a view read."""
    api = HttpApi(url, token())
    taken = []
    for i in range(n):
        started = time.perf_counter()
        r = api.command("register-customer", {"name": f"r{i}", "email": f"r{i}@example.com"})
        assert r.status == 201, r.body
        taken.append(time.perf_counter() - started)
        started = time.perf_counter()
        v = api.session.get(
            f"{url}/views/books", headers={"Authorization": f"Bearer {api.bearer}"}, timeout=30
        )
        assert v.status_code == 200, v.text
        taken.append(time.perf_counter() - started)
    return taken


def close_all(sockets: list[socket.socket]) -> None:
    for s in sockets:
        s.close()


@pytest.mark.parametrize(("count", "authenticated"), [(1000, True), (600, False)])
def test_rest_answers_as_usual_with_many_websockets_open(
    api: tuple[str, Settings], count: int, authenticated: bool
) -> None:
    url, settings = api
    before = rest_latencies(url)
    sockets: list[socket.socket] = []
    try:
        sockets, accepted = open_sockets(url, count, authenticated)
        during = rest_latencies(url)
    finally:
        close_all(sockets)
    assert 0 < accepted <= settings.ws_max_open < count  # the rest were refused at once
    if not authenticated:  # they wait apart, a few per address, never in the admitted places
        assert accepted <= settings.ws_max_pending_per_address
    usual, now = statistics.median(before), statistics.median(during)
    print(f"{count} websockets: REST p50 {usual * 1e3:.0f} ms before, {now * 1e3:.0f} ms with")
    # Normal latency: on a shared 2-core machine, within a few times the usual median, never
    # the seconds of a request waiting for a thread that a websocket holds.
    assert now < 3 * usual + 0.1, (before, during)
    assert max(during) < 2.0, during

    # Once they are gone, their places are free again.
    ws_url = url.replace("http://", "ws://") + "/ws"

    def admitted() -> bool:
        client = WsClient(ws_url, token("views:read"))
        try:
            client.subscribe("s", "books")
            client.wait_for(lambda: bool(client.of("s", "snapshot")), "a snapshot", timeout=5)
            return True
        except TimeoutError:
            return False
        finally:
            client.close()

    wait_until(admitted, 60, "a new websocket to be admitted")
