"""Two API nodes behind the load balancer (HAProxy, stack/local_lb.py), while changes flow to a
websocket client connected through it: `kill -9` of the node holding the client, then SIGTERM of
the other (a drain). Each time the client reconnects through the balancer, lands on a node that
is up, and resumes with `since`: every change exactly once, in order (guarantee 12). Requests
keep being answered through the balancer once a node is gone."""

from __future__ import annotations

import contextlib
import http.server
import itertools
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from config.settings import Settings
from stack.local_lb import LoadBalancer
from stack.procs import free_port, wait_until
from tests.changes import Writer, check_resumed, insert_customers, slot_ready
from tests.integration.test_live_crash import _subscribe, _wait_changes
from tests.support import Processes, kill_tree, token

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _routable(lb: LoadBalancer) -> set[str]:
    """The nodes the balancer sends connections to: ready ones, or live ones when none is."""
    return {n.removesuffix("-live") for n, s in lb.servers().items() if s["status"] == "UP"}


def _holding(lb: LoadBalancer) -> str:
    """The node that holds the (one) websocket open through the balancer."""
    open_on = {n.removesuffix("-live") for n, s in lb.servers().items() if int(s["scur"] or 0)}
    assert len(open_on) == 1, lb.servers()
    return open_on.pop()


def test_a_client_through_the_balancer_outlives_its_node(fresh: Settings, tmp_path: Path) -> None:
    tag = uuid.uuid4().hex[:8]
    keys, group = [f"{tag}-{i}" for i in range(4)], f"group-{tag}"
    procs = Processes(fresh, tmp_path)
    lb: LoadBalancer | None = None
    try:
        procs.cdc()
        wait_until(lambda: slot_ready(fresh), 60, "the CDC slot")
        ports = {"api1": free_port(), "api2": free_port()}
        nodes = {name: procs.api(port)[0] for name, port in ports.items()}
        lb = LoadBalancer(tmp_path / "lb", free_port(), list(ports.values()))
        lb.start()
        both = set(ports)
        wait_until(lambda: _routable(lb) == both, 30, "both nodes up behind the balancer")
        ws_url = lb.url.replace("http://", "ws://") + "/ws"
        headers = {"Authorization": f"Bearer {token('views:read')}"}
        insert_customers(fresh, keys, group)
        messages: list[dict[str, object]] = []
        client = _subscribe(ws_url, group)
        client.wait_for(lambda: len(client.of("s", "snapshot")) == 1, "snapshot")
        with Writer(fresh, keys, total=1500, rate=250) as writer:
            for at, how in ((400, "kill -9"), (900, "SIGTERM")):
                wait_until(lambda a=at: writer.done >= a, 120, f"{at} updates")
                _wait_changes(client, 10)
                node = _holding(lb)
                if how == "kill -9":
                    kill_tree(nodes[node].pid)  # gunicorn's master and its worker
                else:
                    nodes[node].terminate()  # a drain: the client is told `going_away`
                code = client.wait_closed()
                nodes[node].wait(30)
                if how == "SIGTERM":
                    assert code == 1001, code
                    told = [m for m in client.messages if m.get("type") == "error"]
                    assert [m["code"] for m in told] == ["going_away"], told
                messages += client.of("s")
                # Straight away, through the balancer, which may not have seen the node go
                # yet: a connection the node refuses is tried on the other one.
                client = _subscribe(ws_url, group, since=str(client.last_position("s")))
                client.wait_for(lambda c=client: c.of("s", "subscribed") != [], "resubscribed")
                assert _holding(lb) != node
                for key in keys * 5:
                    answer = requests.get(f"{lb.url}/views/customers/{key}", headers=headers)
                    assert answer.status_code == 200, (answer.status_code, answer.text[:200])
                nodes[node] = procs.api(ports[node])[0]  # back, on its port
                wait_until(lambda: _routable(lb) == both, 30, f"{node} back behind the balancer")
            writer.wait()
        check_resumed(fresh, keys, client, messages)
        client.close()
    finally:
        if lb is not None:
            lb.stop()
        procs.stop()


def test_with_no_node_up_the_balancer_answers_in_the_api_s_error_shape(tmp_path: Path) -> None:
    lb = LoadBalancer(tmp_path / "lb", free_port(), [free_port(), free_port()])  # nothing there
    lb.start()
    try:
        wait_until(lambda: not _routable(lb), 30, "the balancer to find no node")
        answer = requests.get(f"{lb.url}/views/customers", timeout=10)
        assert answer.status_code == 503
        assert answer.headers["Content-Type"] == "application/json"
        assert answer.headers["Retry-After"] == "2"
        assert answer.json()["error"]["code"] == "unavailable"
    finally:
        lb.stop()


@contextlib.contextmanager
def _behind_the_balancer(
    handler: type[http.server.BaseHTTPRequestHandler], tmp_path: Path
) -> Iterator[LoadBalancer]:
    """One stand-in node served by `handler`, behind a balancer that has found it up."""
    node = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=node.serve_forever, daemon=True).start()
    lb = LoadBalancer(tmp_path / "lb", free_port(), [node.server_address[1]])
    lb.start()
    try:
        wait_until(lambda: _routable(lb) == {"api1"}, 30, "the balancer to find the node up")
        yield lb
    finally:
        lb.stop()
        node.shutdown()
        node.server_close()


class _DropsRequests(http.server.BaseHTTPRequestHandler):
    """A node that passes the balancer's health checks and stops before answering anything
    else, as a node killed in the middle of a request does."""

    def do_GET(self) -> None:
        if self.path.startswith("/health"):
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()
        else:
            self.close_connection = True  # closed without a byte of an answer

    do_POST = do_GET

    def log_message(self, *_: object) -> None:
        pass


def test_a_node_lost_mid_request_gets_the_api_s_error_shape_not_the_balancer_s_page(
    tmp_path: Path,
) -> None:
    with _behind_the_balancer(_DropsRequests, tmp_path) as lb:
        answer = requests.post(f"{lb.url}/commands/register-customer", json={}, timeout=30)
        assert answer.status_code == 502, answer.text
        assert answer.headers["Content-Type"] == "application/json"
        error = answer.json()["error"]
        assert error["code"] == "node_lost"
        assert "Idempotency-Key" in error["message"]


class _KeepsAlive(http.server.BaseHTTPRequestHandler):
    """A node that keeps connections alive (HTTP/1.1), and says on how many connections (one
    handler each) its `POST`s came."""

    protocol_version = "HTTP/1.1"
    opened = itertools.count()
    posted_on: set[int] = set()

    def setup(self) -> None:
        self.number = next(self.opened)
        super().setup()

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.posted_on.add(self.number)
        self.do_GET()

    def log_message(self, *_: object) -> None:
        pass


def test_the_balancer_keeps_no_idle_connection_to_a_node_for_a_later_request(
    tmp_path: Path,
) -> None:
    """A node closes an idle kept-alive connection after its `keepalive`; a balancer reusing one
    as it closes has no answer for a `POST` and drops the client's connection (seen once in
    the cluster's tests). So each request gets a connection of its own to the node, while the
    client's own connection to the balancer stays alive."""
    with _behind_the_balancer(_KeepsAlive, tmp_path) as lb, requests.Session() as client:
        for _ in range(5):
            answer = client.post(f"{lb.url}/commands/register-customer", json={}, timeout=30)
            assert answer.status_code == 200, answer.text
            assert answer.headers.get("Connection", "").lower() != "close"
    assert len(_KeepsAlive.posted_on) == 5
