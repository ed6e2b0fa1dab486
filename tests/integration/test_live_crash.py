"""kill -9 of the CDC process, and separately of the websocket server, while changes flow:
clients that reconnect with `since` get every change exactly once, in order, checked against
the table's final state and against the changelog."""

from __future__ import annotations

import os
import signal
import uuid
from pathlib import Path

import pytest

from config.settings import Settings
from stack.procs import wait_until
from tests.changes import (
    Writer,
    check_once,
    check_resumed,
    insert_customers,
    slot_ready,
    table_versions,
)
from tests.support import Processes, kill_tree, token
from tests.wsclient import WsClient, fold

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _ws(api_url: str) -> str:
    return api_url.replace("http://", "ws://") + "/ws"


def _subscribe(url: str, group: str, since: str | None = None) -> WsClient:
    client = WsClient(url, token("views:read"))
    client.subscribe("s", "customers", {"name": group}, since=since)
    return client


def _wait_changes(client: WsClient, n: int) -> None:
    client.wait_for(
        lambda: len(client.of("s", "change")) > n, f"{n} changes ({client.messages[:3]})"
    )


def test_kill_9_of_cdc_while_clients_listen(fresh: Settings, tmp_path: Path) -> None:
    tag = uuid.uuid4().hex[:8]
    keys, group = [f"{tag}-{i}" for i in range(4)], f"group-{tag}"
    procs = Processes(fresh, tmp_path)
    try:
        cdc = procs.cdc()
        wait_until(lambda: slot_ready(fresh), 60, "the CDC slot")
        _, api = procs.api()
        insert_customers(fresh, keys, group)
        client = _subscribe(_ws(api), group)
        client.wait_for(lambda: len(client.of("s", "snapshot")) == 1, "snapshot")
        with Writer(fresh, keys, total=2000, rate=250) as writer:
            for kill_at in (500, 1200):
                wait_until(lambda k=kill_at: writer.done >= k, 120, f"{kill_at} updates")
                os.kill(cdc.pid, signal.SIGKILL)
                cdc.wait()
                cdc = procs.cdc()
            writer.wait()
        final = table_versions(fresh, keys)

        def caught_up() -> bool:
            rows = fold(client.of("s"), "customer_id")
            return {k: r["version"] for k, r in rows.items()} == final

        client.wait_for(caught_up, "the client to see every change", 120)
        assert client.close_code is None  # the websocket server never noticed
        check_once(fresh, keys, client.of("s"))
        client.close()
    finally:
        procs.stop()


def test_kill_9_of_the_websocket_server_then_resume_with_since(
    fresh: Settings, tmp_path: Path
) -> None:
    tag = uuid.uuid4().hex[:8]
    keys, group = [f"{tag}-{i}" for i in range(4)], f"group-{tag}"
    procs = Processes(fresh, tmp_path)
    try:
        procs.cdc()
        wait_until(lambda: slot_ready(fresh), 60, "the CDC slot")
        server, api = procs.api()
        insert_customers(fresh, keys, group)
        messages: list[dict[str, object]] = []
        client = _subscribe(_ws(api), group)
        client.wait_for(lambda: len(client.of("s", "snapshot")) == 1, "snapshot")
        with Writer(fresh, keys, total=2000, rate=250) as writer:
            for kill_at in (500, 1200):
                wait_until(lambda k=kill_at: writer.done >= k, 120, f"{kill_at} updates")
                _wait_changes(client, 10)
                kill_tree(server.pid)  # gunicorn's master and the worker holding the sockets
                server.wait()
                client.wait_closed()
                messages += client.of("s")
                since = client.last_position("s")
                server, api = procs.api()  # a new server on a new port
                client = _subscribe(_ws(api), group, since=str(since))
            writer.wait()
        check_resumed(fresh, keys, client, messages)
        client.close()
    finally:
        procs.stop()
