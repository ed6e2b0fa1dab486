"""kill -9 of the CDC process, and separately of the websocket server, while changes flow:
clients that reconnect with `since` get every change exactly once, in order, checked against
the table's final state and against the changelog."""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from config.settings import Settings
from stack.procs import wait_until
from tests.changes import (
    Writer,
    assert_consecutive,
    changelog,
    distinct,
    insert_customers,
    slot_ready,
    table_versions,
    versions_seen,
)
from tests.support import Processes, drop_cdc_slot, kill_tree, new_deployment, token
from tests.wsclient import WsClient, fold

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture
def fresh(base_settings: Settings) -> Iterator[Settings]:
    settings = new_deployment(base_settings)
    yield settings
    drop_cdc_slot(settings)


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


def _check(settings: Settings, keys: list[str], messages: list[dict[str, object]]) -> None:
    final = table_versions(settings, keys)
    rows = fold(messages, "customer_id")  # type: ignore[arg-type]
    assert {k: r["version"] for k, r in rows.items()} == final
    assert_consecutive(versions_seen(messages), final)  # type: ignore[arg-type]
    # The same sequence as the changelog (without CDC's resends) after the first snapshot.
    logged: dict[str, list[int]] = {}
    for change in distinct(changelog(settings, "customers")):
        if change.row is not None and change.key["customer_id"] in final:
            logged.setdefault(change.key["customer_id"], []).append(change.row["version"])
    seen = versions_seen(messages)  # type: ignore[arg-type]
    for key, versions in seen.items():
        assert logged[key][-len(versions) :] == versions, key


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
        _check(fresh, keys, client.of("s"))
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
        final = table_versions(fresh, keys)

        def caught_up() -> bool:
            rows = fold(messages + client.of("s"), "customer_id")  # type: ignore[arg-type]
            return {k: r["version"] for k, r in rows.items()} == final

        client.wait_for(caught_up, "the resumed client to see every change", 120)
        resumed = client.of("s")
        assert not [m for m in resumed if m["type"] in ("snapshot", "resync")], "not resumed"
        _check(fresh, keys, messages + resumed)
        client.close()
    finally:
        procs.stop()
