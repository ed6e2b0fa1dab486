"""The API from each of gunicorn's workers, started by the real CLI: `gevent` (the default: the
CLI starts itself again patched, so Kafka and psycopg wait cooperatively) and `gthread`. REST
reads, websocket snapshots and changes, server-sent events and long-polling all work; a hundred
open websockets cost a gevent process no OS thread, and a gthread process one each (the
connection's handler reads its socket itself; one writer thread sends to all of them)."""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import requests

from config.settings import Settings
from stack.procs import wait_until
from tests.changes import insert_customers
from tests.sse import SseClient
from tests.support import Processes, drop_cdc_slot, new_deployment, token
from tests.wsclient import WsClient

pytestmark = pytest.mark.integration

SOCKETS = 100
THREADS_PER_SOCKET = {"gevent": 0, "gthread": 1}


@pytest.fixture(scope="module", params=sorted(THREADS_PER_SOCKET))
def api(
    request: pytest.FixtureRequest, base_settings: Settings, workdir: Path
) -> Iterator[tuple[str, int, Settings, str]]:
    deployment = new_deployment(base_settings)
    logs = workdir / f"api-{request.param}"
    logs.mkdir(exist_ok=True)
    # Heartbeats often: a stream whose client went is let go soon (and the API stops soon).
    env = {"LOGFOLD_API_WORKER": request.param, "LOGFOLD_WS_HEARTBEAT_S": "1"}
    procs = Processes(deployment, logs, env)
    try:
        procs.cdc()
        proc, url = procs.api()
        yield url, proc.pid, deployment, request.param
    finally:
        procs.stop()
        drop_cdc_slot(deployment)


def _os_threads(pid: int) -> int:
    """OS threads of the API's process tree (gunicorn's master and its worker)."""
    total = 0
    for p in [pid, *_children(pid)]:
        total += len(list(Path(f"/proc/{p}/task").iterdir()))
    return total


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(c) for c in path.read_text().split()] if path.exists() else []


def test_rest_websockets_sse_and_long_polling(api: tuple[str, int, Settings, str]) -> None:
    url, pid, deployment, worker = api
    group = f"group-{uuid.uuid4().hex[:8]}"
    keys = [f"{group}-{i}" for i in range(2)]
    insert_customers(deployment, keys, group)
    auth = {"Authorization": f"Bearer {token('views:read')}"}
    row = requests.get(f"{url}/views/customers/{keys[0]}", headers=auth, timeout=30)
    assert row.status_code == 200 and row.json()["name"] == group

    ws_url = url.replace("http://", "ws://") + "/ws"
    threads_before = _os_threads(pid)
    clients = [WsClient(ws_url, token("views:read", subject=f"g-{i}")) for i in range(SOCKETS)]
    for client in clients:
        client.subscribe("s", "customers", {"name": group})
    for client in clients:
        client.wait_for(lambda c=client: bool(c.of("s", "snapshot")), "every snapshot")
    # (give or take the hub's and the writer's threads, and pool threads that were idle)
    grown = _os_threads(pid) - threads_before
    assert abs(grown - SOCKETS * THREADS_PER_SOCKET[worker]) <= 4, grown
    stream = SseClient(url, "customers", token("views:read"), {"name": group})
    assert stream.status == 200
    stream.wait_for(lambda: bool(stream.of("snapshot")), "the stream's snapshot")
    start = requests.get(
        f"{url}/views/customers/changes", params={"name": group}, headers=auth, timeout=30
    ).json()["next"]

    with psycopg.connect(deployment.database(), autocommit=True) as conn:
        conn.execute("UPDATE customers SET version = 1 WHERE customer_id = %s", (keys[0],))
    for client in clients:
        client.wait_for(lambda c=client: bool(c.of("s", "change")), "the change on every socket")
        assert client.of("s", "change")[0]["row"]["version"] == 1
    stream.wait_for(lambda: bool(stream.of("change")), "the change on the stream")
    page = requests.get(
        f"{url}/views/customers/changes",
        params={"name": group, "since": start, "wait": 10},
        headers=auth,
        timeout=30,
    ).json()
    assert [c["row"]["version"] for c in page["changes"]] == [1]
    for client in clients:
        client.close()
    stream.close()
    health = requests.get(f"{url}/health/live", timeout=10)
    assert health.status_code == 200
    if worker == "gevent":  # (gthread keeps its pool's threads, idle, for the next ones)
        wait_until(lambda: _os_threads(pid) <= threads_before + 2, 30, "no thread left behind")


def test_stopping_tells_sockets_and_streams_to_go_elsewhere(
    api: tuple[str, int, Settings, str],
) -> None:
    """SIGTERM (a drain, as before a deploy): each websocket gets `error` `going_away` and close
    code 1001, each event stream the same `error` and its end; their clients reconnect (through
    a load balancer, to another node) and resume. (The module's last test: it stops the API.)"""
    url, pid, deployment, _ = api
    group = f"group-{uuid.uuid4().hex[:8]}"
    insert_customers(deployment, [f"{group}-0"], group)
    client = WsClient(url.replace("http://", "ws://") + "/ws", token("views:read"))
    client.subscribe("s", "customers", {"name": group})
    stream = SseClient(url, "customers", token("views:read"), {"name": group})
    client.wait_for(lambda: bool(client.of("s", "snapshot")), "the socket's snapshot")
    stream.wait_for(lambda: bool(stream.of("snapshot")), "the stream's snapshot")

    os.kill(pid, signal.SIGTERM)
    assert client.wait_closed() == 1001
    told = [m for m in client.messages if m["type"] == "error"]
    assert [m["code"] for m in told] == ["going_away"], told
    stream.wait_for(lambda: stream.ended, "the stream's end")
    assert [m["code"] for m in stream.of("error")] == ["going_away"]
